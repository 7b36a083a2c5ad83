"""``--no-async-tensor-model-parallel-allreduce``: a Megatron-LM older than its async input-gradient
all-reduce (issue 49 item 2).

Megatron-LM overlaps each column-parallel linear's input-gradient all-reduce with its weight-gradient
GEMM since NVIDIA/Megatron-LM cf7efd4 (2021-08-30); v2.6 (the ATP paper's baseline) and every
earlier release do not. Megatron-LM's own flag for the old behaviour existed from 3f65246
(2021-09-02) to core_v0.15; the simulator takes it to describe such a run, the trainer (on
megatron-core 0.16+) does not.
"""
from __future__ import annotations

import pytest

from megatron_oases.describe.megatron_1d import OUTPUT_ASYNC_DGRAD, STOCK_ASYNC_DGRAD
from megatron_oases.flags import option
from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.frontends.cli import build_parser, model_from_args, strategy_from_args
from megatron_oases.topology import load_topology

FLAG = option("async_tensor_model_parallel_allreduce")
MODEL = ["--topology", "dgx-a100", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--micro-batch-size", "2", "--vocab-size", "512", "--tp", "8", "--dp", "1",
         "--num-microbatches", "1"]


def _besides(argv):
    a = build_parser().parse_args(MODEL + argv)
    (stage,) = build_stage_events(model_from_args(a, 8), strategy_from_args(a, 8), load_topology("dgx-a100"))
    return sorted(ev.op.name for ch in stage.chunks for ev in ch.backward if ev.beside is not None)


@pytest.mark.parametrize("sp", [[], ["--sequence-parallel"]])
def test_flag_drops_every_input_gradient_overlap(sp):
    """Stock: each layer's two column linears and the output layer run their input-gradient
    collective beside the weight gradient; with the flag none does (the all-reduce follows)."""
    stock = _besides(sp)
    assert stock and set(stock) <= set(STOCK_ASYNC_DGRAD) | set(OUTPUT_ASYNC_DGRAD)
    assert any(name in OUTPUT_ASYNC_DGRAD for name in stock)
    assert _besides(sp + [FLAG]) == []


def test_trainer_refuses_it(capsys):
    from megatron_oases.train_args import build_parser as train_parser

    with pytest.raises(SystemExit) as e:
        train_parser().parse_args([FLAG])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and FLAG in err[0], err


def test_rows_of_megatron_lm_before_cf7efd4_carry_it():
    """The ATP paper's Megatron-LM v2.6 runs and the 2021 README rows (docs/sim_seeds.md,
    docs/sim_validation.md) price no input-gradient overlap; later Megatron rows keep it."""
    import pathlib

    import yaml

    root = pathlib.Path(__file__).resolve().parents[1] / "examples" / "validation"
    name = FLAG.removeprefix("--")
    seeds = yaml.safe_load((root / "seeds_experiments.yaml").read_text())
    megatron_atp = {k: r for k, r in seeds["runs"].items()
                    if r["source"] == "atp" and r["flags"].get("tp-backend", "megatron") == "megatron"}
    assert megatron_atp and all(r["flags"].get(name) is True for r in megatron_atp.values())
    assert not any(name in r["flags"] for r in seeds["runs"].values() if r["source"] != "atp")
    published = yaml.safe_load((root / "published_megatron.yaml").read_text())["defaults"]
    old = {s for s, d in published.items() if d.get("flags", {}).get(name) is True}
    assert old == {"mlm-readme-2021", "mlm-readme-gpt3-example"}
