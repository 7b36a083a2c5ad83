"""Strategy search (DistSim §6): ranking, infeasible reasons, table + CSV, CLI."""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from megatron_oases.pricing.device_model import SimError, device_model
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.search import COLUMNS, SearchSpace, candidates, search, search_table, write_csv
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import load_topology

MODEL = GPTShape(num_layers=12, hidden_size=1536, num_attention_heads=12, seq_length=1024, padded_vocab_size=51200,
                 micro_batch_size=2)


def _run(memory=None, **kw):
    space = SearchSpace(gpus=16, global_batch=64, **kw)
    return search(MODEL, space, device_model(load_topology("2node-ib")), memory_limit_GB=memory)


def test_ranked_with_reasons():
    cands = _run(memory=6.0)
    ok = [c for c in cands if c.feasible]
    assert ok and [c.result.iteration_ms for c in ok] == sorted(c.result.iteration_ms for c in ok)
    assert cands[: len(ok)] == ok  # feasible first
    reasons = " | ".join(c.reason for c in cands)
    assert "memory" in reasons  # DP-only replicas do not fit in 6 GB
    assert "not divisible by PP 8" in reasons  # 12 layers
    assert "must be divisible by TP 8" in reasons  # 12 heads
    # every point of the space appears, Megatron and ATP meshes, Oases on and off
    labels = {c.label for c in cands}
    assert {"tp4.pp1.dp4", "tp4.pp1.dp4.oases", "tp4.pp1.dp4.atp2x2", "tp4.pp1.dp4.rc"} <= labels
    best = ok[0]
    again = simulate(MODEL, best.strategy, device_model(load_topology("2node-ib")), memory_limit_GB=6.0)
    assert again.iteration_ms == pytest.approx(best.result.iteration_ms)
    table = search_table(cands, top=5)
    assert f"best {best.label}" in table and "memory" in table


def test_global_batch_divisibility_and_space():
    cands = candidates(MODEL, SearchSpace(gpus=16, global_batch=24, tp_sizes=(1, 2), pp_sizes=(1,)))
    assert any("global batch 24 is not divisible by micro-batch 2 x DP 16" in c.reason for c in cands)
    with pytest.raises(SimError, match="--gpus 8 but topology '2node-ib' describes 16 GPUs"):
        search(MODEL, SearchSpace(gpus=8, global_batch=16), device_model(load_topology("2node-ib")))


def test_csv(tmp_path: Path):
    cands = _run(tp_sizes=(2, 4), pp_sizes=(1, 2), backends=("megatron",))
    path = tmp_path / "s.csv"
    write_csv(cands, path)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(cands) and tuple(rows[0]) == COLUMNS
    assert rows[0]["feasible"] == "1" and float(rows[0]["iteration_ms"]) > 0


def test_cli_search(tmp_path: Path, capsys):
    from megatron_oases.sim.frontends.cli import sim_main

    out = tmp_path / "s.csv"
    argv = ["--search", "--topology", "2node-ib", "--gpus", "16", "--memory-gb", "6", "--global-batch-size", "64",
            "--num-layers", "12", "--hidden-size", "1536", "--num-attention-heads", "12", "--seq-length", "1024",
            "--micro-batch-size", "2", "--csv", str(out), "--top", "3"]
    assert sim_main(argv) == 0
    text = capsys.readouterr().out
    assert "feasible; best" in text and "memory" in text and out.is_file()
    assert sim_main(argv[:4] + ["32"] + argv[5:]) == 2
    assert "error: --gpus 32 but topology '2node-ib' describes 16 GPUs" in capsys.readouterr().err


def test_worker_processes_give_the_serial_ranking():
    """The search spreads its simulations over processes; the table must not depend on that."""
    space = SearchSpace(gpus=16, global_batch=64)
    dm = device_model(load_topology("2node-ib"))
    serial = search(MODEL, space, dm, memory_limit_GB=6.0, jobs=1)
    forked = search(MODEL, space, dm, memory_limit_GB=6.0, jobs=2)
    assert len([c for c in serial if c.strategy is not None]) >= 16  # enough to use the workers
    assert write_csv(forked) == write_csv(serial)


def test_sequence_parallel_is_searched_where_it_runs():
    cands = candidates(MODEL, SearchSpace(gpus=16, global_batch=64, tp_sizes=(1, 4), pp_sizes=(1,)))
    sp = {c.label for c in cands if c.sequence_parallel}
    assert "tp4.pp1.dp4.sp" in sp and "tp4.pp1.dp4.sp.oases" in sp  # SP under Oases too
    assert not any(c.tp == 1 or c.backend != "megatron" for c in cands if c.sequence_parallel)
    off = candidates(MODEL, SearchSpace(gpus=16, global_batch=64, tp_sizes=(4,), pp_sizes=(1,),
                                        sequence_parallel=(False,)))
    assert not any(c.sequence_parallel for c in off)


def test_refused_strategies_are_counted_unless_asked_for():
    cands = _run(memory=6.0)
    short, full = search_table(cands, top=3, show_refused=False), search_table(cands, top=3)
    assert "--show-refused lists them" in short and "over the memory limit" in short
    assert "memory" not in short.split("(")[0] and len(short.splitlines()) < len(full.splitlines())


def test_the_printed_launch_command_is_accepted_by_the_trainer(capsys):
    """The best strategy's trainer command parses and validates as the trainer's own flags, and
    names what was searched (SP, Oases, backend) as the trainer reads it."""
    import shlex

    from megatron_oases.run_config import run_config
    from megatron_oases.sim.frontends.cli import sim_main
    from megatron_oases.train_args import build_parser, validate_config

    argv = ["--search", "--topology", "local", "--gpu", "h100-sxm", "--gpus", "4", "--global-batch-size", "8",
            "--num-layers", "4",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--vocab-size", "1024", "--swiglu", "--dtype", "fp32", "--jobs", "1"]
    for extra in ([], ["--schedules", "oases", "--sequence-parallel", "--tp-sizes", "2"]):
        assert sim_main(argv + extra + ["--show-refused", "--top", "1000"]) == 0
        out = capsys.readouterr().out
        if not extra:  # the default space holds SP and Oases candidates (and both together)
            assert ".sp " in out and ".oases " in out and ".sp.oases " in out
        line = next(l for l in out.splitlines() if l.startswith("launch (trainer): "))
        words = shlex.split(line.split(": ", 1)[1])
        assert words[:4] == ["megatron-oases", "train", "--nproc-per-node", "4"]
        cfg = validate_config(run_config(build_parser().parse_args(words[2:])), 4, cuda=False)
        best = out.splitlines()[0].split("best ")[1].split(":")[0]
        assert cfg.swiglu and cfg.vocab_size == 1024 and cfg.attention_backend == "auto"  # sim's default: the trainer's
        assert f"tp{cfg.tensor_model_parallel_size}.pp{cfg.pipeline_model_parallel_size}" in best
        assert cfg.sequence_parallel == (".sp" in best) and (cfg.schedule == "oases") == (".oases" in best)
        assert "launch (Megatron-LM): torchrun --nnodes 1 --nproc-per-node 4 -m megatron_oases.pretrain_gpt" in out


PLAN_ARGV = ["--search", "--topology", "dgx-a100", "--global-batch-size", "32", "--num-layers", "4", "--hidden-size",
             "1024", "--num-attention-heads", "16", "--seq-length", "512", "--micro-batch-size", "4", "--backends",
             "megatron", "--schedules", "oases", "--tp-sizes", "4", "--pp-sizes", "1", "--recompute-options", "off",
             "--sequence-parallel-options", "off", "--jobs", "1"]
"""A host-bound model on 8 A100s where the planner's per-block degrees beat the uniform Oases TP 4."""


def test_per_block_plans_are_a_search_step_priced_by_the_simulator(tmp_path: Path, capsys):
    """The planner runs on the best uniform strategy, the simulator prices its plan; a plan that
    beats every uniform strategy is written to --plan-out and launched with --oases-plan, which the
    trainer reads and accepts as is."""
    import json
    import shlex

    from megatron_oases.run_config import run_config
    from megatron_oases.sim.core.strategy import Strategy
    from megatron_oases.sim.frontends.cli import build_parser as build_sim_parser, sim_main, simulation_inputs
    from megatron_oases.train_args import build_parser, validate_config

    assert sim_main(PLAN_ARGV) == 0  # without --plan-out: the plan is shown, the uniform one launched
    out = capsys.readouterr().out
    assert "per-block plans" in out and "give --plan-out FILE" in out and "--oases-plan" not in out
    path = tmp_path / "plan.json"
    assert sim_main(PLAN_ARGV + ["--plan-out", str(path)]) == 0
    out = capsys.readouterr().out
    plan = json.loads(path.read_text())
    planned = next(l for l in out.splitlines() if ".plan " in l).split()
    uniform_ms = float(out.splitlines()[0].rsplit(": ", 1)[1].split()[0])
    assert float(planned[1]) < uniform_ms and set(plan["degrees"]) != {4}
    shape, _, dm = simulation_inputs(build_sim_parser().parse_args(PLAN_ARGV))  # the model and device the search priced
    again = simulate(shape, Strategy(tp=4, pp=1, dp=2, num_microbatches=4, schedule="oases",
                                     block_degrees=tuple(plan["degrees"])), dm)
    assert again.iteration_ms == pytest.approx(float(planned[1]), abs=0.01)  # the simulator's number, not the planner's
    line = next(l for l in out.splitlines() if l.startswith("launch (trainer): "))
    words = shlex.split(line.split(": ", 1)[1])
    assert words[words.index("--oases-plan") + 1] == str(path)
    cfg = validate_config(run_config(build_parser().parse_args(words[2:])), 8, cuda=False)
    assert [d for pair in cfg.oases_layer_degrees for d in pair] == plan["degrees"] and cfg.schedule == "oases"


def test_plan_refusals_and_untied_embeddings():
    from megatron_oases.sim.frontends.search_plans import plan_refusal, plan_search

    dm = device_model(load_topology("2node-ib"))
    cands = search(MODEL, SearchSpace(gpus=16, global_batch=64, tp_sizes=(4,), pp_sizes=(1,),
                                      recompute=("off", "full")), dm, jobs=1)
    why = {c.label: plan_refusal(c, MODEL) for c in cands}
    assert "--sequence-parallel" in why["tp4.pp1.dp4.sp"] and "recompute" in why["tp4.pp1.dp4.rc"]
    assert "Megatron 1-D" in why["tp4.pp1.dp4.atp2x2"] and why["tp4.pp1.dp4"] == ""
    untied = dataclasses.replace(MODEL, tied_embeddings=False)  # the planner plans its blocks tied
    rows = plan_search(search(untied, SearchSpace(gpus=16, global_batch=64, tp_sizes=(4,), pp_sizes=(1,),
                                                  backends=("megatron",)), dm, jobs=1),
                       untied, dm, top=2, global_batch=64, memory_limit_GB=None)
    assert len(rows) == 2 and not any(r.reason.startswith("planner") for r in rows)


def test_interleaved_candidates_get_no_plan_in_the_planners_words(capsys):
    """A candidate with virtual stages is refused a per-block plan in the words ``plan`` refuses its
    launch's ``--num-layers-per-virtual-pipeline-stage`` with (the planner prices a stage as
    contiguous layers under non-interleaved 1F1B); its non-interleaved twin is planned (issue 49)."""
    from megatron_oases.plan.plan_cli import plan_main
    from megatron_oases.sim.frontends.launch import strategy_flags
    from megatron_oases.sim.frontends.search_plans import plan_refusal, plan_search

    dm = device_model(load_topology("2node-ib"))
    cands = search(MODEL, SearchSpace(gpus=16, global_batch=64, tp_sizes=(4,), pp_sizes=(2,), virtual_stages=(1, 2),
                                      backends=("megatron",), recompute=("off",), sequence_parallel=(False,)),
                   dm, jobs=1)
    interleaved = next(c for c in cands if c.vp == 2 and c.feasible and c.schedule == "default")
    flags = strategy_flags(interleaved, global_batch=64, num_layers=12)  # the launch the search would print
    per_vstage = flags[flags.index("--num-layers-per-virtual-pipeline-stage") + 1]
    assert plan_main(["--topology", "2node-ib", "--num-layers", "12", "--pipeline-model-parallel-size", "2",
                      "--num-layers-per-virtual-pipeline-stage", per_vstage]) == 2
    said = capsys.readouterr().err.strip().split("error: ", 1)[1]
    assert plan_refusal(interleaved, MODEL) == said
    rows = plan_search(cands, MODEL, dm, top=4, global_batch=64, memory_limit_GB=None)
    assert rows and all(r.uniform.vp == 1 for r in rows)


def test_atp_t_by_1_is_searched_as_atps_layer(capsys):
    """ATP's T x 1 mesh is its own launch (ATP's layers), offered beside Megatron's TP T, as the planner does."""
    from megatron_oases.describe.atp_2d import atp_layout
    from megatron_oases.sim.frontends.launch import strategy_flags

    cands = candidates(MODEL, SearchSpace(gpus=16, global_batch=64, tp_sizes=(1, 4), pp_sizes=(1,)))
    atp = {c.strategy.layout for c in cands if c.backend == "atp" and c.strategy is not None}
    assert atp_layout(4, 1) in atp and not any(c.backend == "atp" and c.tp == 1 for c in cands)
    tx1 = next(c for c in cands if c.label == "tp4.pp1.dp4.atp4x1")
    flags = strategy_flags(tx1, global_batch=64, num_layers=12)
    assert flags[flags.index("--atp-mesh") + 1] == "4,1"


def test_a_launch_the_trainer_refuses_is_not_printed(monkeypatch, capsys):
    from megatron_oases.sim.frontends import launch
    from megatron_oases.sim.frontends.cli import sim_main

    refusal = launch.trainer_refusal("megatron-oases train --num-layers 2 --bf16 --fp16", 1)
    assert refusal == "--bf16 and --fp16 are exclusive; pick one"
    monkeypatch.setattr(launch, "trainer_refusal", lambda command, gpus: refusal)
    assert sim_main(PLAN_ARGV + ["--search-plans", "0"]) == 2
    captured = capsys.readouterr()
    assert "launch (" not in captured.out
    assert captured.err.strip().endswith(f"the trainer refuses the launch of tp4.pp1.dp2.oases: {refusal}")


def test_the_printed_launch_trains_on_cpu(capsys):
    """The acceptance run: the best of a search whose space holds SP and Oases candidates, launched
    as printed (plus one iteration on CPU), trains with two ranks. About 6 s (spawned ranks):
    in tests/slow_tests.txt."""
    import shlex
    import subprocess
    import sys

    from megatron_oases.sim.frontends.cli import sim_main

    argv = ["--search", "--topology", "local", "--gpu", "h100-sxm", "--gpus", "2", "--global-batch-size", "4",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--vocab-size", "1024", "--swiglu", "--dtype", "fp32", "--jobs", "1",
            "--schedules", "oases", "--sequence-parallel", "--tp-sizes", "2"]
    assert sim_main(argv) == 0
    out = capsys.readouterr().out
    assert "best tp2.pp1.dp1.sp.oases:" in out.splitlines()[0]  # the SP + Oases strategy is the one launched
    words = shlex.split(next(l for l in out.splitlines() if l.startswith("launch (trainer): ")).split(": ", 1)[1])
    exe = str(Path(sys.executable).with_name(words[0]))
    run = subprocess.run([exe, *words[1:], "--train-iters", "1", "--device", "cpu"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "iteration        1/       1 | lm loss" in run.stdout
