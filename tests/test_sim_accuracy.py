"""The pure logic behind the accuracy study (scripts/bench_sim_accuracy.py): compute contention
(interpolation, fluid pipeline placement), the emulated profiler's plan (concurrent sibling
groups, busy levels, merging ranks' results), the profile format's contention section, and the
bench's error table. No timing asserts, no emulator."""
from __future__ import annotations

import math
import os

import pytest

from megatron_oases.sim.core.contention import block_duration, interpolate, level_prices
from megatron_oases.pricing.device_model import ProfileDB, SimError, device_model
from megatron_oases.sim.calibrate.emulated_profile import build_plan, busy_levels, merge_rank_results, sibling_groups
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.events import build_stage_events, overlapped_keys, unique_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.calibrate.profiler import local_topology
from megatron_oases.sim.core.schedules import schedule_order
from megatron_oases.sim.core.placement import place_pipeline
from megatron_oases.sim.core.timeline import run_template, simulate
from megatron_oases.describe.atp_2d import atp_layout
from tests.script_modules import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = GPTShape(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=128,
                micro_batch_size=2, dtype="fp32")


def test_interpolate_and_block_duration():
    lv = {2: 10.0, 4: 20.0}
    assert interpolate(lv, 1) == 10.0 and interpolate(lv, 3) == 15.0 and interpolate(lv, 8) == 20.0
    assert interpolate({4: 7.0}, 2) == 7.0
    with pytest.raises(SimError):
        interpolate({}, 1)
    assert level_prices({"a": 1.0, "b": 5.0}, {"a": lv}, 3) == {"a": 15.0, "b": 5.0}
    assert block_duration([1.0, 2.0], 1.0) == 1.0 and block_duration([1.0, 2.0], 1.5) == 1.5
    assert block_duration([1.0, 2.0], 0.2) == 1.0 and block_duration([1.0, 2.0, 4.0], 9) == 4.0


@pytest.mark.parametrize("pp,m,vp", [(2, 4, 1), (4, 8, 1), (2, 4, 2)])
def test_shared_placement_without_contention_is_algorithm_1(pp, m, vp):
    orders = [schedule_order("1f1b", s, pp, m, vp) for s in range(pp)]
    fixed = [[(1.0 + 0.1 * s + c, 2.0 + 0.2 * s) for c in range(vp)] for s in range(pp)]
    p2p = [[(0.3, 0.2) for _ in range(vp)] for _ in range(pp)]
    ref, ref_end = place_pipeline(orders, fixed, p2p)
    dur = [[([f] * pp, [b] * pp) for f, b in row] for row in fixed]
    frac = [[(1.0, 1.0) for _ in range(vp)] for _ in range(pp)]
    got, end = place_pipeline(orders, dur, p2p, compute_fractions=frac)
    key = lambda p: (p.stage, p.chunk, p.phase, p.micro_batch)  # noqa: E731
    assert len(got) == len(ref)
    for a, b in zip(sorted(got, key=key), sorted(ref, key=key)):
        assert key(a) == key(b) and a.start == pytest.approx(b.start) and a.end == pytest.approx(b.end)
    assert end == pytest.approx(ref_end)


def test_shared_placement_slows_overlapping_blocks():
    # two stages, one micro-batch of F each way: stage 1's F waits for stage 0's, so they never
    # overlap and run at the one-stage speed; a second micro-batch overlaps and slows down
    orders = [schedule_order("gpipe", s, 2, 2, 1) for s in range(2)]
    dur = [[([1.0, 2.0], [1.0, 2.0])] for _ in range(2)]
    p2p = [[(0.0, 0.0)], [(0.0, 0.0)]]
    full = [[(1.0, 1.0)], [(1.0, 1.0)]]
    place, end = place_pipeline(orders, dur, p2p, compute_fractions=full)
    f = {(p.stage, p.phase, p.micro_batch): p for p in place}
    assert f[(0, "F", 0)].end == pytest.approx(1.0)  # alone
    # stage 0's F1 and stage 1's F0 overlap from t=1: both at half speed (D = 2) -> end at 3
    assert f[(0, "F", 1)].end == pytest.approx(3.0) and f[(1, "F", 0)].end == pytest.approx(3.0)
    # a neighbour that computes half the time slows a block by half as much
    half = [[(0.5, 0.5)], [(0.5, 0.5)]]
    place, _ = place_pipeline(orders, dur, p2p, compute_fractions=half)
    f = {(p.stage, p.phase, p.micro_batch): p for p in place}
    assert f[(0, "F", 1)].end == pytest.approx(1.0 + 1.5)
    assert max(end) > 0 and all(math.isfinite(x) for x in end)


def test_sibling_groups_and_levels():
    s = Strategy(tp=2, pp=2, dp=2)  # ranks: tp fastest, then dp, then pp
    assert sibling_groups((0, 1), s) == ((0, 1), (2, 3))             # TP groups of both DP replicas
    assert sibling_groups((0, 2), s) == ((0, 2), (1, 3))             # DP groups of both TP ranks
    assert sibling_groups((4, 6), s) == ((4, 6), (5, 7))             # stage 1 stays on stage 1
    assert set(sibling_groups((0, 4), s)) == {(0, 4), (1, 5), (2, 6), (3, 7)}  # p2p / tie pairs
    assert sibling_groups((0, 1, 4, 5), s) == ((0, 1, 4, 5), (2, 3, 6, 7))     # grad-norm (TP x PP)
    assert busy_levels(s) == [4, 8] and busy_levels(Strategy(tp=2)) == [2]


def test_sibling_groups_inside_the_tp_group():
    """A 3-D cube line or an ATP mesh row / column is one of a partition of the TP group: the
    trainer runs the collective on every line at once, so the profiler must too."""
    from megatron_oases.describe.registry import axis_ranks

    cube = Strategy(tp=8, backend="3d")
    tp_ranks = tuple(range(8))
    for axis, lines in (("cube_z", {(0, 1), (2, 3), (4, 5), (6, 7)}), ("cube_x", {(0, 2), (1, 3), (4, 6), (5, 7)}),
                        ("cube_y", {(0, 4), (1, 5), (2, 6), (3, 7)})):
        assert set(sibling_groups(axis_ranks(axis, tp_ranks, None), cube)) == lines
    assert sibling_groups(tp_ranks, cube) == (tp_ranks,)
    mesh = Strategy(tp=4, dp=2, backend="atp", layout=atp_layout(2, 2))  # two replicas of a 2 x 2 mesh
    for axis in ("mesh1", "mesh2"):
        groups = sibling_groups(axis_ranks(axis, (0, 1, 2, 3), atp_layout(2, 2)), mesh)
        assert len(groups) == 4 and sorted(r for g in groups for r in g) == list(range(8))


def test_plan_and_merge():
    s = Strategy(tp=2, pp=2, num_microbatches=2)
    topo = local_topology(4)
    events = unique_events(build_stage_events(TINY, s, topo))
    plan = build_plan(events, s, warmup=1, reps=2)
    assert plan["levels"] == [2, 4] and plan["world"] == 4
    comm_keys = [k for j in plan["comm"] for k in j["keys"]]
    assert sorted(comm_keys + [c["key"] for c in plan["compute"]]) == sorted(events)
    # one job per distinct (kind, groups, bytes): same-size TP all-reduces share it
    assert len(plan["comm"]) < len(comm_keys)
    ranks = []
    for r in range(4):
        ranks.append({"comm": [1.0 + r if r in {x for g in j["groups"] for x in g} else None for j in plan["comm"]],
                      "compute": [[1.0 + r if r < 2 else None, 2.0 + r] for _ in plan["compute"]]})
    ev, cont, src, ovl = merge_rank_results(plan, ranks)
    assert ovl == {}  # nothing was marked overlapped
    c0 = plan["compute"][0]["key"]
    assert cont[c0] == {2: 2.0, 4: 5.0} and ev[c0] == 5.0  # slowest busy rank; all-busy in events_ms
    p2p = next(j for j in plan["comm"] if j["kind"] == "p2p")
    assert ev[p2p["keys"][0]] == 1.0 + max(x for g in p2p["groups"] for x in g)  # p2p: the receiver
    assert set(ev) == set(events) and all(src.values())


def test_profile_contention_roundtrip_and_simulation(tmp_path):
    s = Strategy(tp=2, pp=2, num_microbatches=4)
    topo = local_topology(4)
    dm = device_model(topo, gpu="a100-80gb")
    from megatron_oases.sim.core.timeline import price_events

    price = price_events(build_stage_events(TINY, s, topo), dm)
    comp = [k for k in price if k.startswith("compute:")]
    # the base: the same prices as a profile without contention (a profile's events hold their
    # host time, so unlike the analytical model it lets no host issue run ahead)
    base = simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=ProfileDB(device="x", events_ms=price)),
                    memory_limit_GB=0)
    # equal levels: contention changes nothing
    same = ProfileDB(device="x", events_ms=price, contention={k: {2: price[k], 4: price[k]} for k in comp})
    p = tmp_path / "p.json"
    same.save(p)
    back = ProfileDB.load(p)
    assert back.contention == same.contention
    r = simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=back), memory_limit_GB=0)
    assert r.iteration_ms == pytest.approx(base.iteration_ms)
    # a stage computing alone is twice as fast: the step gets shorter, but not below the
    # all-alone bound
    fast = ProfileDB(device="x", events_ms=price, contention={k: {2: price[k] / 2, 4: price[k]} for k in comp})
    r2 = simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=fast), memory_limit_GB=0)
    assert r2.iteration_ms < base.iteration_ms
    half = ProfileDB(device="x", events_ms={k: v / 2 if k in comp else v for k, v in price.items()})
    assert r2.iteration_ms >= simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=half),
                                       memory_limit_GB=0).iteration_ms - 1e-9


def test_overlap_plan_and_merge():
    """Oases stages mark their forward / backward events overlapped; the plan measures those
    collectives and compute events also under overlap, and the merge keeps the slowest rank."""
    s = Strategy(tp=2, num_microbatches=2, schedule="oases")
    topo = local_topology(2)
    stages = build_stage_events(TINY, s, topo)
    keys = overlapped_keys(stages)
    assert keys and all(not k.startswith(("compute:optimizer", "compute:grad_norm")) for k in keys)
    stock = overlapped_keys(build_stage_events(TINY, Strategy(tp=2, num_microbatches=2), topo))
    assert {k.split("[")[0] for k in stock} == {  # only the async input-gradient all-reduces and their wgrads
        "all_reduce:attention.f.bwd", "all_reduce:mlp.f.bwd", "compute:attention.wgrad", "compute:mlp.wgrad",
        "all_reduce:logits.f.bwd", "compute:logits.wgrad"}
    assert overlapped_keys(build_stage_events(TINY, Strategy(pp=2, num_microbatches=2), topo)) == set()
    events = unique_events(stages)
    plan = build_plan(events, s, warmup=1, reps=2, overlap=keys)
    marked = [j for j in plan["comm"] if j.get("overlap")]
    assert marked and all(j["kind"] != "p2p" for j in marked)
    assert {c["key"] for c in plan["compute"] if c["overlap"]} == {k for k in keys if k.startswith("compute:")}
    ranks = [{"comm": [None] * len(plan["comm"]), "compute": [[1.0] for _ in plan["compute"]],
              "overlap_comm": [3.0 + r if j.get("overlap") else None for j in plan["comm"]],
              "overlap_compute": [2.0 + r if c["overlap"] else None for c in plan["compute"]]} for r in range(2)]
    for r in ranks:
        r["comm"] = [1.0 for _ in plan["comm"]]
    _, _, _, ovl = merge_rank_results(plan, ranks)
    assert set(ovl) == {k for k in keys if k in events}  # only the keys that overlap, not their jobs' others
    assert all(v in (4.0, 3.0) for v in ovl.values())  # the slowest rank's


def test_template_with_overlap_prices():
    """Without overlap prices the fluid template equals the list schedule; when overlapped
    collectives and compute slow each other down, the template gets longer but never longer
    than running everything back to back at the overlapped prices."""
    s = Strategy(tp=2, num_microbatches=2, schedule="oases")
    topo = local_topology(2)
    dm = device_model(topo, gpu="a100-80gb")
    st = build_stage_events(TINY, s, topo)[0]
    from megatron_oases.sim.core.timeline import price_events

    price = price_events([st], dm)
    for evs in (st.forward, st.backward):
        plain = run_template(evs, 2, price)
        same = run_template(evs, 2, price, {k: v for k, v in price.items()})
        assert same.duration == pytest.approx(plain.duration)
        assert [x.start for x in same.slots] == pytest.approx([x.start for x in plain.slots])
        slow = {k: 2 * v for k, v in price.items()}
        both = run_template(evs, 2, price, slow)
        assert plain.duration < both.duration <= 2 * sum(price[e.key] for e in evs) * 2 + 1e-9
        assert both.compute_busy >= plain.compute_busy
    db = ProfileDB(device="x", events_ms=price, overlapped={k: 2 * v for k, v in price.items()})
    p = ProfileDB.from_dict(db.to_dict())
    assert p.overlapped == db.overlapped
    full = build_stage_events(TINY, s, topo)
    price = price_events(full, dm)
    base = simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=ProfileDB(device="x", events_ms=price)),
                    memory_limit_GB=0)
    slowed = simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=ProfileDB(
        device="x", events_ms=price, overlapped={k: 1.5 * v for k, v in price.items()})), memory_limit_GB=0)
    assert slowed.iteration_ms > base.iteration_ms


def _bench():
    return load_script("scripts/bench_sim_accuracy.py")


def test_bench_table_and_errors():
    b = _bench()
    rows = [{"config": "a", "strategy": "tp2", "ranks": 2, "predicted_ms": 105.0, "measured_ms": 100.0,
             "error_pct": 5.0},
            {"config": "b", "strategy": "pp2", "ranks": 2, "predicted_ms": 90.0, "measured_ms": 100.0,
             "error_pct": -10.0},
            {"config": "c", "strategy": "dp2", "ranks": 2, "predicted_ms": 101.0, "measured_ms": 100.0,
             "error_pct": 1.0}]
    assert b.error_summary(rows) == {"median_abs_error_pct": 5.0, "max_abs_error_pct": 10.0, "configs": 3}
    t = b.format_table(rows)
    assert "| b | pp2 | 2 | 90.0 | 100.0 | -10.0 |" in t and "median |error| 5.0%" in t
    assert b.world_of(b.CONFIGS["tp2dp2"][0]) == 4 and len(b.DEFAULT_CONFIGS) >= 6
    # profile-only rows (no trainer launch) are shown but not counted
    assert b.error_summary(rows + [{**rows[0], "measured_ms": None, "error_pct": None}])["configs"] == 3
    assert "no configuration measured" in b.format_table([{**rows[0], "measured_ms": None, "error_pct": None}])
    dbs = [ProfileDB(device="x", events_ms={"a": 10.0, "b": 4.0}), ProfileDB(device="x", events_ms={"a": 11.0, "b": 5.0})]
    assert b.profile_spread(dbs) == {"median_pct": 17.5, "max_pct": 25.0, "max_key": "b"}
    for world in (2, 4):
        import argparse

        from megatron_oases.topology import load_topology

        a = argparse.Namespace(intra_GBps=0.1, inter_GBps=0.1)
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"acc_test_topo{os.getpid()}_{world}.yaml")
        with open(path, "w") as f:
            f.write(b.topology_yaml(world, a))
        try:
            assert load_topology(path).world_size == world
        finally:
            os.remove(path)


def test_lockstep_and_interleaved_timing():
    """Per repetition the slowest rank, then the median; older rank files (one median per rank)
    still merge; events run in turn within a repetition and skipped ones still get ``before``."""
    from megatron_oases.sim.calibrate.emulated_profile import interleaved_ms, lockstep_ms

    assert lockstep_ms([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == 3.0  # max per rep: 3, 5, 2.5
    assert lockstep_ms([2.0, 4.0]) == 4.0
    calls = []
    out = interleaved_ms([lambda: calls.append("a"), None, lambda: calls.append("b")], warmup=1, reps=2,
                         before=lambda: calls.append("|"))
    assert calls == ["|", "a", "|", "|", "b"] * 3
    assert out[1] is None and len(out[0]) == len(out[2]) == 2 and all(t >= 0 for t in out[0] + out[2])


def test_overlapped_collective_time_from_the_executor_s_pattern():
    """A collective launched beside one compute event, then waited for: the in-flight time the
    fluid model needs is what reproduces that run (and a merge goes through it per repetition)."""
    from megatron_oases.sim.calibrate.emulated_profile import (MAX_OVERLAP_SLOWDOWN, beside_lockstep_ms,
                                                     overlapped_from_beside)

    assert overlapped_from_beside(total=6.0, compute=9.0, plain=10.0) == 6.0  # done during the compute
    ov = overlapped_from_beside(total=15.0, compute=9.0, plain=10.0)  # 40% done in 9 ms, 6 ms alone
    assert ov == pytest.approx(22.5)
    evs = tuple(e for e in build_stage_events(TINY, Strategy(tp=2, schedule="oases"), local_topology(2))[0].forward
                if e.name in ("attention", "attention.g"))[:2]
    price = {evs[0].key: 9.0, evs[1].key: 10.0}
    # sub-batch 0's all-reduce beside sub-batch 1's 9 ms compute ends 6 ms after it, as measured
    tm = run_template(evs, 2, price, {evs[0].key: 9.0, evs[1].key: ov})
    ar0 = next(sl for sl in tm.slots if sl.stream == "comm" and sl.chain == 0)
    assert ar0.start + ar0.dur == pytest.approx(9.0 + 15.0)
    assert overlapped_from_beside(total=30.0, compute=9.0, plain=10.0) == pytest.approx(MAX_OVERLAP_SLOWDOWN * 10.0)
    # per repetition the rank whose collective ended last, then the median
    assert beside_lockstep_ms([[[6.0, 9.0], [15.0, 9.0]], [[15.0, 9.0], [14.0, 9.0]]], 10.0) == pytest.approx(
        (22.5 + overlapped_from_beside(15.0, 9.0, 10.0)) / 2)


def test_stage_collectives_get_loaded_levels():
    """With PP, a stage's collectives are also timed while other stages compute; the merge puts
    those times in ``contention`` beside the plain one (one stage busy), and p2p / cross-stage
    collectives get none."""
    s = Strategy(tp=2, pp=2, num_microbatches=2)
    events = unique_events(build_stage_events(TINY, s, local_topology(4)))
    plan = build_plan(events, s, warmup=1, reps=2)
    assert plan["stages"] == [[0, 1], [2, 3]]
    staged = [j for j, job in enumerate(plan["comm"]) if job["stage"] is not None]
    assert staged and all(plan["comm"][j]["kind"] != "p2p" for j in staged)
    assert all(job["stage"] is None for job in plan["comm"] if job["kind"] == "p2p")
    ranks = [{"comm": [[1.0, 1.0] if r in {x for g in job["groups"] for x in g} else None for job in plan["comm"]],
              "compute": [[[1.0] if r < 2 else None, [2.0]] for _ in plan["compute"]],
              "comm_loaded": [[None, [3.0 + r, 3.0 + r]] if j in staged and r in {x for g in plan["comm"][j]["groups"]
                                                                               for x in g} else
                              ([None, None] if j in staged else None) for j in range(len(plan["comm"]))]}
             for r in range(4)]
    ev, cont, _, _ = merge_rank_results(plan, ranks)
    k = plan["comm"][staged[0]]["keys"][0]
    top = 3.0 + max(x for g in plan["comm"][staged[0]]["groups"] for x in g)
    assert ev[k] == 1.0 and cont[k] == {2: 1.0, 4: top}
    p2p = next(j for j in plan["comm"] if j["kind"] == "p2p")
    assert p2p["keys"][0] not in cont


def test_loaded_collectives_lengthen_a_pipelined_stock_step():
    """A stage's all-reduces priced slower while the other stage computes make the PP step longer;
    levels equal to the plain time change nothing."""
    s = Strategy(tp=2, pp=2, num_microbatches=4)
    topo = local_topology(4)
    dm = device_model(topo, gpu="a100-80gb")
    from megatron_oases.sim.core.timeline import price_events

    price = price_events(build_stage_events(TINY, s, topo), dm)
    comp = {k: {2: price[k], 4: price[k]} for k in price if k.startswith("compute:")}
    ars = [k for k in price if k.startswith("all_reduce:") and "@tp" in k]

    def step(factor):
        cont = {**comp, **{k: {2: price[k], 4: factor * price[k]} for k in ars}}
        return simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=ProfileDB(
            device="x", events_ms=price, contention=cont)), memory_limit_GB=0).iteration_ms
    plain = ProfileDB(device="x", events_ms=price)  # the same prices without contention
    assert step(1.0) == pytest.approx(simulate(TINY, s, device_model(topo, gpu="a100-80gb", profile=plain),
                                               memory_limit_GB=0).iteration_ms)
    assert step(3.0) > step(1.0)
