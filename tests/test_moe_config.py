"""MoE flags in the trainer (issue 51 item 1): each combination that cannot run is refused at parse
time in one line naming the flag, before any process group; what runs is mapped onto Megatron-Core's
config, layer pattern and FLOPs count as Megatron-LM does."""
from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from megatron_oases.moe import (flops_ffn_hidden_size, moe_config_kwargs, moe_layer_pattern,
                                normalized_moe)
from megatron_oases.run_config import RunConfig, run_config
from megatron_oases.train import main
from megatron_oases.train_args import build_parser, validate_config

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
MOE = ["--num-experts", "4", "--disable-bias-linear"]


@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "2", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size takes effect with MoE layers only; add --num-experts N"),
    (["--nproc-per-node", "1", "--moe-router-topk", "1"], "--moe-router-topk takes effect with MoE"),
    (["--nproc-per-node", "2", *MOE, "--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size 3 must divide --num-experts 4"),
    (["--nproc-per-node", "2", *MOE, "--expert-model-parallel-size", "4"],
     "--expert-model-parallel-size 4 must divide the data-parallel size 2"),
    (["--nproc-per-node", "1", *MOE, "--moe-router-topk", "5"], "--moe-router-topk must be in [1, --num-experts 4]"),
    (["--nproc-per-node", "1", *MOE, "--moe-token-dispatcher-type", "flex"],
     "--moe-token-dispatcher-type flex needs DeepEP or HybridEP"),
    (["--nproc-per-node", "1", *MOE, "--moe-grouped-gemm"], "--moe-grouped-gemm: this megatron-core"),
    (["--nproc-per-node", "2", *MOE, "--tensor-model-parallel-size", "2"],
     "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--nproc-per-node", "2", "--num-experts", "4", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], "needs --disable-bias-linear"),
    (["--nproc-per-node", "1", "--num-experts", "4"], "with biases at --tensor-model-parallel-size 1 and"),
    (["--nproc-per-node", "2", *MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--schedule", "oases"], "--schedule oases overlaps MoE layers' all-to-alls; use --moe-token-dispatcher-type"),
    (["--nproc-per-node", "2", *MOE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
      "alltoall", "--moe-expert-capacity-factor", "1.0", "--schedule", "oases"],
     "--moe-expert-capacity-factor: with --schedule oases"),
    (["--nproc-per-node", "2", *MOE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
      "alltoall", "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0", "--schedule",
      "oases"], "--moe-router-load-balancing-type sinkhorn is not split by sub-batch"),
    (["--nproc-per-node", "2", *MOE, "--tensor-model-parallel-size", "2", "--tp-backend", "atp",
      "--atp-mesh", "2,1"], "--tp-backend atp does not"),
    (["--nproc-per-node", "1", *MOE, "--moe-aux-loss-coeff", "0.1", "0.2"],
     "--moe-aux-loss-coeff takes one coefficient per --moe-router-load-balancing-type (1 given, 2"),
    (["--nproc-per-node", "1", *MOE, "--moe-expert-capacity-factor", "1.0",
      "--moe-router-load-balancing-type", "sinkhorn"], "--moe-expert-capacity-factor works with aux_loss"),
    (["--nproc-per-node", "1", *MOE, "--moe-layer-freq", "0"], "--moe-layer-freq must be >= 1"),
    (["--nproc-per-node", "1", *MOE, "--moe-router-topk", "1"], "--moe-router-topk 1 needs Megatron's"),
])
def test_moe_refusals_one_line_before_any_process_group(argv, needle, capsys):
    assert main(BASE + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err
    assert not dist.is_initialized()


def _validated(argv: list[str], world: int) -> RunConfig:
    return validate_config(run_config(build_parser().parse_args(BASE + argv)), world, cuda=False)


def test_megatron_lm_list_flags_fill_as_megatron_lm():
    """``--moe-router-load-balancing-type`` / ``--moe-aux-loss-coeff`` take lists as Megatron-LM's
    parser does; one element is the scalar, several a tuple handed to Megatron as a list."""
    cfg = _validated(MOE + ["--moe-aux-loss-coeff", "0.01"], 1)
    assert (cfg.moe_aux_loss_coeff, cfg.moe_router_load_balancing_type) == (0.01, "aux_loss")
    assert cfg.moe_ffn_hidden_size == cfg.ffn_hidden_size == 128  # Megatron-LM's filling
    two = _validated(MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                            "--moe-aux-loss-coeff", "0.01", "0.001"], 1)
    kw = moe_config_kwargs(two)
    assert kw["moe_router_load_balancing_type"] == ["aux_loss", "seq_aux_loss"]
    assert kw["moe_aux_loss_coeff"] == [0.01, 0.001]
    assert _validated(MOE, 1) == validate_config(_validated(MOE, 1), 1, cuda=False)  # idempotent
    assert normalized_moe(RunConfig(num_experts=0)).num_experts is None


def test_transformer_config_takes_the_moe_fields():
    from megatron_oases.specs import transformer_config_from_args

    cfg = _validated(MOE + ["--moe-router-topk", "3", "--moe-ffn-hidden-size", "48",
                            "--moe-expert-capacity-factor", "1.5", "--moe-token-dispatcher-type",
                            "alltoall", "--moe-layer-freq", "2"], 1)
    tc = transformer_config_from_args(cfg, cuda=False)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.moe_layer_freq) == (4, 3, 48, 2)
    assert (tc.moe_expert_capacity_factor, tc.moe_token_dispatcher_type) == (1.5, "alltoall")
    assert transformer_config_from_args(_validated([], 1), cuda=False).num_moe_experts is None


def test_layer_pattern_and_flops_width_follow_megatron():
    """``--moe-layer-freq 2``: layers 0 and 2 of 4 are MoE (Megatron-Core's integer rule); the
    FLOPs count's FFN width averages top-k experts' width and the dense layers'."""
    cfg = dataclasses.replace(_validated(MOE + ["--moe-layer-freq", "2", "--moe-ffn-hidden-size", "16"], 1))
    assert moe_layer_pattern(cfg) == [True, False, True, False]
    assert flops_ffn_hidden_size(cfg) == (2 * 16 * 2 + 2 * 128) / 4
    dense = _validated([], 1)
    assert moe_layer_pattern(dense) == [False] * 4 and flops_ffn_hidden_size(dense) == 128


def test_moe_model_builds_megatron_moe_layers(on_ranks):
    """The decoder's MoE layers are Megatron-Core's ``MoELayer`` with ``SequentialMLP`` experts
    (two local of four at EP 2), the dense ones its ``MLP``, per ``--moe-layer-freq``."""
    from tests.rank_fns_moe import built_mlps

    cfg = _validated(MOE + ["--moe-layer-freq", "2", "--expert-model-parallel-size", "2"], 2)
    for layers in on_ranks(built_mlps, 2, cfg, timeout_s=120):
        assert layers == [("MoELayer", "SequentialMLP", 2), ("MLP", None, 0)] * 2


def test_trainer_logs_the_load_balancing_loss_as_one_rank(on_ranks):
    """Each iteration's record (and log line) carries Megatron-LM's ``load_balancing_loss``, the
    routers' loss gathered by Megatron's tracker, and EP 2 logs one rank's."""
    from tests.rank_fns_moe import logged_moe_losses

    argv = MOE + ["--moe-aux-loss-coeff", "0.01", "--train-iters", "2", "--seq-length", "16"]
    one = on_ranks(logged_moe_losses, 1, _validated(argv, 1), timeout_s=120)[0]
    ep2 = on_ranks(logged_moe_losses, 2, _validated(argv + ["--expert-model-parallel-size", "2"], 2),
                   timeout_s=120)[-1]
    assert len(one) == 2 and all(v is not None and v > 0 for v in one)
    assert ep2 == pytest.approx(one, rel=1e-5)


def test_oases_over_moe_refused_in_one_line_where_megatron_core_lacks_the_router_hooks(monkeypatch, capsys):
    """megatron-core 0.16.1's router has no ``get_moe_metrics_tracker``: Oases over MoE is refused
    at parse time there (stock MoE runs); simulated here by removing the name."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "get_moe_metrics_tracker", raising=False)
    argv = ["--nproc-per-node", "2", *MOE, "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--schedule", "oases"]
    assert main(BASE + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--schedule oases over --num-experts needs megatron-core 0.19 or newer" in err
    assert "moe_utils.get_moe_metrics_tracker" in err
    assert not dist.is_initialized()
