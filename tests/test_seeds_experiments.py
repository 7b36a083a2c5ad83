"""scripts/seeds_experiments.py: the seed papers' rows load, three of them (an absolute row, a
ratio row and a planner row) simulate and the script writes its table, CSV and JSON; ATP IC1's
calibrated bandwidths are priced as the paper's Eq. 2 prices them. No row's accuracy is asserted
here (docs/sim_seeds.md reports the errors)."""
from __future__ import annotations

import csv
import json
import os
from tests.script_modules import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    return load_script("scripts/seeds_experiments.py")


def test_rows_cite_a_table_and_cover_the_four_papers():
    mod = _script()
    sources, runs, rows = mod.load()
    assert {mod.source_of(r, runs) for r in rows} == {"oases", "atp", "tp3d", "distsim"}
    for r in rows:
        assert r["where"] and ("published" in r or "published_range" in r)
    for s in sources.values():
        assert s["where"] and s["assumptions"]


def test_script_runs_three_rows_and_writes_outputs(tmp_path, capsys):
    out = str(tmp_path / "seeds")
    ids = ["oases-t6-pcie-h8192-plan", "atp-t3-ic3-m2", "tp3d-t2-64-1d-over-3d"]   # file order
    assert _script().main(["--rows", *ids, "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "median |error|" in printed and all(i in printed for i in ids)
    with open(out + ".csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["id"] for r in rows] == ids and all(float(r["predicted"]) > 0 for r in rows)
    assert rows[0]["published_pick"] and rows[0]["our_pick"].startswith("[[")
    with open(out + ".json", encoding="utf-8") as f:
        data = json.load(f)
    assert data["summary"]["all"]["rows"] == 3 and set(data["sources"]) == {"atp", "tp3d", "oases"}


def test_every_plan_row_runs_the_recompute_its_source_states():
    """The Oases runs are stated with full recompute (the YAML's assumption); the planner, which
    prices the saved bytes, refuses Table 6's 24 GB budgets without it. Every plan row passes it
    and the planner returns a speedup for each (a few ms a row)."""
    mod = _script()
    _, _, rows = mod.load()
    plans = [r for r in rows if "plan" in r]
    assert len(plans) == 6
    for r in plans:
        assert r["plan"]["recompute-granularity"] == "full"
        speedup, pick, _ = mod.run_plan(r["plan"])
        assert speedup >= 1.0 and pick.startswith("[[")


def test_megatron_based_runs_carry_megatron_lms_dropout_and_it_is_priced():
    """Oases and DistSim ran Megatron-LM's model code, whose dropout defaults are 0.1 (the papers
    set none; ours is 0): their runs and the Oases plan rows carry it, and it reaches the simulator
    (the same Oases run without it is faster). A few ms."""
    mod = _script()
    _, runs, rows = mod.load()
    for run in runs.values():
        if run["source"] in ("oases", "distsim"):
            assert run["flags"]["attention-dropout"] == run["flags"]["hidden-dropout"] == 0.1, run["name"]
    for r in rows:
        if "plan" in r:
            assert r["plan"]["attention-dropout"] == r["plan"]["hidden-dropout"] == 0.1, r["id"]
    from megatron_oases.sim.frontends.published import simulate_run
    run = runs["oases-pcie-h2048-megatron"]
    without = {**run["flags"], "attention-dropout": 0.0, "hidden-dropout": 0.0}
    assert simulate_run(run["topology"], None, run["flags"]).iteration_ms > \
        simulate_run(run["topology"], None, without).iteration_ms


def test_layers_only_times_the_layers_alone():
    """3-D TP times only its transformer layers: a layers_only run's time is linear in the layer
    count (what is outside the layers drops out) and below the whole step, which holds the
    embedding's activation-sized all-reduce and the cube's entry and exit. A few tens of ms."""
    mod = _script()
    _, runs, _ = mod.load()
    run = runs["tp3d-weak-3d-8"]
    assert run["layers_only"]
    four = mod.layers_only(run)
    eight = mod.layers_only({**run, "flags": {**run["flags"], "num-layers": 8}})
    assert abs(eight.iteration_ms / four.iteration_ms - 2.0) < 0.02
    assert four.iteration_ms < mod.Simulator.simulate(run).iteration_ms


def test_batch_between_interpolates_a_batch_the_cube_cannot_split():
    """Table 2's 3-D run at 64 GPUs has batch 24, which the 4 x 4 x 4 cube cannot split: its time is
    the midpoint of batches 16 and 32, and a batch outside the pair is refused. Tens of ms."""
    import pytest

    mod = _script()
    _, runs, _ = mod.load()
    run = runs["tp3d-strong-3d-64"]
    assert run["batch_between"] == [16, 32] and run["flags"]["micro-batch-size"] == 24
    got = mod.between_batches(run)
    ends = [mod.Simulator.timed({**run, "flags": {**run["flags"], "micro-batch-size": b}}).iteration_ms
            for b in (16, 32)]
    assert got.model.micro_batch_size == 24 and abs(got.iteration_ms - sum(ends) / 2) < 1e-6 * got.iteration_ms
    with pytest.raises(ValueError, match="batch_between"):
        mod.between_batches({**run, "flags": {**run["flags"], "micro-batch-size": 48}})


def test_a_calibrated_all_reduce_costs_its_bytes_over_atps_b():
    """ATP IC1's calibrated numbers are Eq. 2's algorithm bandwidths B (ATP §5.3): an all-reduce of
    S bytes over a calibrated group takes S / B, so the calibrated ATP-4 (DeviceMesh(2,4)) prices
    its per-layer all-reduces 46% below ATP-1's, as the paper's Eq. 2 gives (it was 59% when the
    simulator used B as the ring's link). Eq. 2's volumes: 2bs x 7h/d1 on the axis-2 groups and
    2bs x 2h/d2 on the axis-1 groups."""
    from megatron_oases.pricing.device_model import device_model
    from megatron_oases.topology import load_topology

    dm = device_model(load_topology("pcie-ic1"), gpu="a100-80gb")
    s = 64e6
    ring_latency_ms = 2 * 7 * 0.015  # the cpu-socket level's 15 us, 2(n - 1) steps
    assert abs(dm.collective_ms("all_reduce", s, tuple(range(8))) - (s / 0.97e6 + ring_latency_ms)) < 1e-6
    h = 4096
    atp4 = 7 * h / 2 * dm.collective_ms("all_reduce", s, (0, 1, 2, 3)) + 2 * h / 4 * dm.collective_ms(
        "all_reduce", s, (0, 4))
    atp1 = 2 * h * dm.collective_ms("all_reduce", s, tuple(range(8)))
    assert abs(1 - atp4 / atp1 - 0.46) < 0.01
