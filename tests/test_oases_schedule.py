"""Oases schedule parity against stock Megatron TP (same TP, full recompute), collective counts,
and its flag validation. Issue acceptance: losses and every gradient over 5 iterations, fp32,
relative difference <= 1e-5, dropout on, TP=2, TP=4, PP=2 x TP=2, each ablation switch."""
from __future__ import annotations

import pytest

from megatron_oases.errors import ConfigError
from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, count_recompute_collectives, run_training

TOL = 1e-5
# SGD: Adam turns float noise in near-zero gradients into lr-sized steps (see test_parity_baseline),
# which would make later iterations' gradients differ for reasons unrelated to the schedule.
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "512", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--seed", "7", "--train-iters", "5", "--optimizer", "sgd",
         "--lr", "0.05", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OASES = ["--schedule", "oases"]


_run = run_training


def _reference(n, layout):
    """Stock schedule, same layout, Megatron's full recompute (one run per layout)."""
    return cached_training(n, MODEL + RECOMPUTE + layout)


def _assert_parity(got, ref):
    assert_same_training(got, ref, tol=TOL, iterations=5)


TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.mark.parametrize("switches", [
    RECOMPUTE,
    RECOMPUTE + ["--no-oases-fine-grained-recompute"],
    RECOMPUTE + ["--no-oases-cross-pass"],
    RECOMPUTE + ["--no-oases-fine-grained-recompute", "--no-oases-cross-pass"],
    [],
], ids=["all-on", "no-fine-grained", "no-cross-pass", "both-off", "no-recompute"])
def test_tp2_matches_stock(switches):
    _assert_parity(_run(2, MODEL + OASES + TP2 + switches), _reference(2, TP2))


@pytest.mark.parametrize("layout,switches", [
    (["--tensor-model-parallel-size", "4"], RECOMPUTE),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], RECOMPUTE),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     RECOMPUTE + ["--no-oases-cross-pass", "--no-oases-fine-grained-recompute"]),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "16"], RECOMPUTE),
    (["--tensor-model-parallel-size", "2", "--overlap-grad-reduce"], RECOMPUTE),
], ids=["tp4", "pp2-tp2", "pp2-tp2-ablations-off", "interleaved-pp2-tp2", "dp2-tp2-overlap-grad"])
def test_four_rank_layouts_match_stock(layout, switches):
    _assert_parity(_run(4, MODEL + OASES + layout + switches), _reference(4, layout))


def test_fine_grained_recompute_issues_no_collective():
    """2 micro-batches x 2 sub-batches: 2 forward + 2 backward all-reduces per layer (4), and
    the head's 2 (the embedding's forward, the output layer's input gradient); the
    Megatron-style recompute repeats the layers' 2 forward ones."""
    base = MODEL + OASES + TP2 + RECOMPUTE
    from megatron_oases.runtime.spawn import run_on_ranks

    fine = run_on_ranks(count_recompute_collectives, 2, args=(base,), timeout_s=120)[0]
    coarse = run_on_ranks(count_recompute_collectives, 2,
                          args=(base + ["--no-oases-fine-grained-recompute"],), timeout_s=120)[0]
    assert fine == {"": 2 * 2 * (4 * 4 + 2)}
    assert coarse == {"": 2 * 2 * (4 * 4 + 2), "recompute": 2 * 4 * 2 * 2}


@pytest.mark.parametrize("argv,needle", [
    (["--micro-batch-size", "1", "--global-batch-size", "4"], "--micro-batch-size >= 2"),
    (["--recompute-granularity", "selective"], "selective"),
    (RECOMPUTE[:2] + ["--recompute-method", "block"], "uniform"),
    (["--tp-backend", "atp", "--atp-mesh", "1,2", "--atp-chunks", "2"], "--atp-chunks"),
])
def test_bad_combinations_fail_before_launch(argv, needle):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(OASES + TP2 + argv)
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+")):
        validate_config(run_config(args), world_size=2, cuda=False)


def test_tape_collectives_match_the_layer_description():
    """The executor's tape and describe/megatron_1d.py name the same collectives per pass."""
    from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
    from megatron_oases.runtime.spawn import run_on_ranks
    from tests.rank_fns_oases import megatron_tape_steps

    steps = run_on_ranks(megatron_tape_steps, 1, timeout_s=60)[0]
    desc = megatron_1d_gpt_layer(micro_batch=2, seq=8, hidden=32, heads=4, ffn=128, tp=2)
    fwd = [name for kind, name in steps if kind == "ForwardAllReduce"]
    bwd = [name for kind, name in reversed(steps) if kind == "BackwardAllReduce"]
    assert fwd == [c.name for c in desc.collectives("forward")]
    assert bwd == [c.name for c in desc.collectives("backward")]


def test_tp1_runs_stock_layers_and_megatron_recompute():
    """At TP 1 there is no collective to overlap: --schedule oases builds stock layers (Megatron's
    own full recompute included) instead of paying the executor's overhead."""
    from megatron_oases.runtime.spawn import run_on_ranks
    from tests.rank_fns_oases import oases_state_at

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--device", "cpu",
            "--recompute-granularity", "full", "--recompute-method", "uniform"] + OASES
    assert run_on_ranks(oases_state_at, 1, args=(argv,), timeout_s=60) == [(False, "full")]
    tp2 = run_on_ranks(oases_state_at, 2, args=(argv + ["--tensor-model-parallel-size", "2"],), timeout_s=60)
    assert tp2 == [(True, None)] * 2


WHOLE = 16 * 4 * 32 * 4
"""Bytes of one micro-batch's hidden states in MODEL (s x b x h x fp32)."""


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"],
                                   ["--sequence-parallel", "--position-embedding-type", "rope"]],
                         ids=["tp2", "tp2-sp", "tp2-sp-rope"])
def test_no_tp_collective_moves_the_whole_micro_batch(extra):
    """Stock runs the embedding's all-reduce and the output layer's input-gradient all-reduce
    (under SP: the gathers and reduce-scatters of the head and the layers) on the whole
    micro-batch; under Oases every TP collective, Megatron's own included, moves one sub-batch."""
    from megatron_oases.runtime.spawn import run_on_ranks
    from tests.rank_fns_oases import all_collectives_of_one_step

    def whole(argv):
        seen = run_on_ranks(all_collectives_of_one_step, 2, args=(MODEL + TP2 + RECOMPUTE + extra + argv,),
                            timeout_s=180)[0]
        return {kind: calls for (kind, group), (calls, sizes) in seen.items()
                if group == 2 and WHOLE in sizes}

    assert whole([])  # stock
    assert whole(OASES) == {}


@pytest.mark.parametrize("dtype,per_weight", [([], {"addmm_": 2 * 2}), (["--bf16"], {"add_": 2})],
                         ids=["fp32", "bf16"])
def test_one_weight_gradient_accumulation_per_micro_batch(dtype, per_weight):
    """Stock adds each linear weight's gradient into ``main_grad`` once per micro-batch (one
    GEMM, one add). The executor's sub-batches (before: one GEMM and one add each) accumulate
    inside their GEMMs (fp32: ``addmm_`` into ``main_grad``, no add), or, with 16-bit
    activations and an fp32 ``main_grad`` (no Apex), into one 16-bit sum added once."""
    from megatron_oases.runtime.spawn import run_on_ranks
    from tests.rank_fns_oases import main_grad_writes

    argv = MODEL + TP2 + RECOMPUTE + ["--untie-embeddings-and-output-weights"] + dtype
    stock, weights = run_on_ranks(main_grad_writes, 2, args=(argv,), timeout_s=180)[0]
    oases, same = run_on_ranks(main_grad_writes, 2, args=(argv + OASES,), timeout_s=180)[0]
    split, _ = run_on_ranks(main_grad_writes, 2, args=(argv + OASES, False), timeout_s=180)[0]
    assert weights == same == 4 * 4 + 1  # 4 linears a layer, the output layer
    assert stock == {"add_": 2 * weights}  # 2 micro-batches
    assert oases == {op: n * weights for op, n in per_weight.items()}
    # each sub-batch's GEMM result added (the output layer's two summed before its one add)
    assert split == {"add_": 2 * 2 * (weights - 1) + 2}


def test_only_the_first_and_last_pipeline_stage_run_the_head():
    """Interleaved PP 2 x TP 2 (two chunks a stage): the embedding's tape in the first stage's
    first chunk, the output layer's in the last stage's last chunk, none elsewhere."""
    from megatron_oases.runtime.spawn import run_on_ranks
    from tests.rank_fns_oases import oases_heads

    layout = TP2 + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                    "--global-batch-size", "16"]
    got = run_on_ranks(oases_heads, 4, args=(MODEL + OASES + RECOMPUTE + layout,), timeout_s=180)
    assert sorted(got) == [(0, [(True, False), (False, False)])] * 2 + [(1, [(False, False), (False, True)])] * 2
