"""The planner plans for the launch (issue 47 item 4), read from the trainer's own command line:
``plan`` takes the flags it shares with ``megatron-oases train`` as the trainer does, so the plan
it writes records the trainer's data-parallel size, micro-batch and executor, and the trainer
accepts it; a stock-schedule plan runs whatever micro-batch the stock schedule runs.
(The refusals of a plan made for another launch, in the trainer and in the Megatron-LM entry:
``tests/test_planner_cli.py``.)"""
from __future__ import annotations

import json

import pytest

from megatron_oases.plan.plan_cli import build_parser as plan_parser, plan_main
from megatron_oases.run_config import run_config
from megatron_oases.train_args import build_parser as train_parser, parallel_dims, validate_config

MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256"]


def _plan_from_train_argv(tmp_path, capsys, argv: list[str]) -> tuple[str, dict]:
    """``plan`` on the trainer's command line (the flags ``plan`` does not take dropped by its
    parser) plus a topology; the plan file it writes."""
    out = tmp_path / "plan.json"
    takes = plan_parser()._option_string_actions
    shared, i = [], 0
    while i < len(argv):  # each flag with its value, if any
        n = 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
        shared += argv[i:i + n] if argv[i] in takes else []
        i += n
    assert plan_main([*shared, "--topology", "dgx-a100", "--out", str(out), "--quiet"]) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    return str(out), json.loads(out.read_text())


def _trainer(argv: list[str], world: int):
    cfg = validate_config(run_config(train_parser().parse_args(argv)), world, cuda=False)
    return cfg, parallel_dims(cfg, world)


@pytest.mark.parametrize("nproc, tp, pp", [
    (2, 2, 1), (4, 2, 1), (8, 2, 1), (8, 4, 1), (4, 1, 1), (8, 2, 2), (8, 4, 2),
], ids=lambda v: str(v))
def test_plan_reads_the_launch_world_as_the_trainer_does(tmp_path, capsys, nproc, tp, pp):
    argv = [*MODEL, "--micro-batch-size", "4", "--global-batch-size", str(4 * 2 * nproc),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--nproc-per-node", str(nproc)]
    path, data = _plan_from_train_argv(tmp_path, capsys, argv)
    _, dims = _trainer(argv, nproc)
    assert (data["world_size"], data["data_parallel_size"]) == (dims.world_size, dims.dp)
    assert data["pipeline_model_parallel_size"] == dims.pp and len(data["degrees"]) == 2 * 2  # every layer
    assert data["micro_batch_size"] == 4 and data["schedule"] == "default"
    cfg, _ = _trainer([*argv, "--oases-plan", path], nproc)  # the trainer takes the plan it was given
    assert cfg.oases_layer_degrees is not None


@pytest.mark.parametrize("schedule", [[], ["--schedule", "default"]], ids=["no-schedule", "default"])
def test_a_stock_plan_runs_a_micro_batch_of_one(tmp_path, capsys, schedule):
    """The stock schedule runs one sample a micro-batch: its plan prices one sub-batch and names no
    bigger micro-batch (the Oases split's two sub-batches need an even one)."""
    argv = [*MODEL, "--micro-batch-size", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
            "--nproc-per-node", "2", *schedule]
    path, data = _plan_from_train_argv(tmp_path, capsys, argv)
    assert (data["schedule"], data["inputs"]["model"]["sub_batches"], data["micro_batch_size"]) == ("default", 1, 1)
    cfg, _ = _trainer([*argv, "--oases-plan", path], 2)
    assert cfg.oases_layer_degrees is not None


@pytest.mark.parametrize("recompute, want", [
    ([], (False, False, True)),
    (["--recompute-granularity", "selective"], (False, True, True)),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], (True, False, True)),
    (["--schedule", "oases", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--no-oases-fine-grained-recompute"], (True, False, False)),
], ids=["none", "selective", "full", "oases-coarse"])
def test_plan_prices_the_recompute_the_launch_runs(tmp_path, capsys, recompute, want):
    """plan reads the trainer's recompute flags (was: Oases fine-grained recompute unless
    --no-plan-recompute, whatever the launch ran)."""
    argv = [*MODEL, "--micro-batch-size", "4", "--global-batch-size", "16", "--tensor-model-parallel-size", "2",
            "--nproc-per-node", "4", *recompute]
    _, data = _plan_from_train_argv(tmp_path, capsys, argv)
    cfg, _ = _trainer(argv, 4)
    model = data["inputs"]["model"]
    assert (model["recompute"], model["selective_recompute"], model["fine_grained_recompute"]) == want
    assert model["recompute"] == (cfg.recompute_granularity == "full")


@pytest.mark.parametrize("argv, needle", [
    (["--plan-recompute"], "--plan-recompute is now the trainer's --recompute-granularity full|selective"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method uniform|block"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
     "--recompute-method block --recompute-num-layers 1 recomputes 1 of a stage's 2 layers"),
    (["--recompute-method", "uniform"], "--recompute-method / --recompute-num-layers need --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--families", "atp", "--tensor-model-parallel-size", "4"],
     "--recompute-granularity selective checkpoints Megatron's core attention"),
    (["--recompute-granularity", "selective", "--schedule", "oases"],
     "--recompute-granularity selective cannot be combined with --schedule oases"),
])
def test_recompute_the_planner_cannot_price_is_one_line(tmp_path, capsys, argv, needle):
    base = [*MODEL, "--micro-batch-size", "4", "--global-batch-size", "16", "--nproc-per-node", "4",
            "--topology", "dgx-a100", "--out", str(tmp_path / "p.json"), "--quiet"]
    assert plan_main([*base, *(["--tensor-model-parallel-size", "2"] if "--families" not in argv else []),
                      *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
