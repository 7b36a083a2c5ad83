"""Simulator: device-model formulas, profile override, event dedup, timeline invariants, scale."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from megatron_oases.pricing.device_model import GPUS, ProfileDB, SimError, device_model, gemm_efficiency
from megatron_oases.pricing.stack import LOCAL
from megatron_oases.describe.megatron_1d import OUTPUT_ASYNC_DGRAD, STOCK_ASYNC_DGRAD
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.events import build_stage_events, overlapped_keys, unique_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import run_segments, run_template, simulate
from megatron_oases.sim.core.trace import chrome_trace, timeline_events, write_chrome_trace
from megatron_oases.topology import Level, Topology, load_topology
from megatron_oases.describe.atp_2d import atp_layout
from tests.script_modules import load_script

EPS = 1e-9
SMALL = GPTShape(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, padded_vocab_size=4096,
                 micro_batch_size=2)


def topo(nodes: int = 2, per_node: int = 8, lat: float = 2.0) -> Topology:
    lv = [Level(name="nvlink", size=per_node, scope="intra_node", p2p_bandwidth_GBps=300,
                group_bandwidth_GBps=300, latency_us=lat)]
    if nodes > 1:
        lv.append(Level(name="ib", size=nodes, scope="inter_node", p2p_bandwidth_GBps=25,
                        group_bandwidth_GBps=25, latency_us=2 * lat))
    return Topology(name="t", levels=tuple(lv), device="a100-80gb")


def test_gpu_table_and_gemm_curve():
    assert GPUS["a100-80gb"].tensor_tflops == 312 and GPUS["h100-sxm"].hbm_GBps == 3350
    effs = [gemm_efficiency(t, max_efficiency=0.75, half_ms=0.01) for t in (1e-4, 1e-2, 1, 100)]
    assert effs == sorted(effs) and effs[1] == pytest.approx(0.375) and effs[-1] < 0.75


def test_ring_collectives_use_bottleneck_link():
    dm = device_model(topo())
    s, n = 64e6, 4
    intra = dm.collective_ms("all_reduce", s, (0, 1, 2, 3))
    assert intra == pytest.approx(2 * (n - 1) / n * s / 300e6 + 2 * (n - 1) * 2e-3)
    # The ring crosses IB with 2 of a node's 8 GPUs: 4 such rings share the node's 25 GB/s.
    cross = dm.collective_ms("all_reduce", s, (0, 1, 8, 9))
    assert cross == pytest.approx(2 * (n - 1) / n * s / (25e6 * 2 / 8) + 2 * (n - 1) * 4e-3)
    ag = dm.collective_ms("all_gather", s, (0, 1, 2, 3))
    assert ag == pytest.approx((n - 1) / n * s / 300e6 + (n - 1) * 2e-3)
    assert dm.collective_ms("all_reduce", s, (5,)) == 0.0


def test_concurrent_rings_share_a_nodes_network_cards():
    """One TP 16 ring through both nodes' GPUs gets each node's aggregate inter-node bandwidth
    (NCCL spreads it over all cards); each of TP 8's eight DP rings (one GPU per node, all
    running together) gets an eighth of it."""
    dm, s = device_model(topo()), 64e6
    tp16 = tuple(range(16))
    assert dm.ring_link(tp16)[0] == 25  # min(NVLink 300, the node's 25)
    dp_rings = [(g, 8 + g) for g in range(8)]
    assert {dm.ring_link(r)[0] for r in dp_rings} == {25 / 8}
    assert dm.collective_ms("all_reduce", s, dp_rings[0]) == pytest.approx(s / (25e6 / 8) + 2 * 4e-3)
    assert dm.ring_link((0, 1, 2, 3))[0] == 300  # intra-node links are per GPU: no sharing


def test_events_dedup_and_layer_description_shared():
    st = build_stage_events(SMALL, Strategy(tp=4, pp=2, dp=2), topo())
    assert len(st[0].forward) == 2 + 4 * 2  # embedding + its all-reduce, 2 layers x 4 ops
    keys = unique_events(st)
    assert len(keys) < sum(len(s.forward) + len(s.backward) for s in st)
    assert sum(k.startswith("compute:attention[") for k in keys) == 1


def test_profile_overrides_and_names_missing(tmp_path: Path):
    t, strat = topo(nodes=1, per_node=2), Strategy(tp=2, pp=1, dp=1, num_microbatches=2)
    keys = list(unique_events(build_stage_events(SMALL, strat, t)))
    prof = ProfileDB(device="a100-80gb", events_ms={k: 1.0 for k in keys})
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    r = simulate(SMALL, strat, device_model(t, profile=ProfileDB.load(path)))
    n_fwd = len(build_stage_events(SMALL, strat, t)[0].forward)
    assert r.templates[0][0][0].duration == pytest.approx(n_fwd)
    partial = ProfileDB(device="x", events_ms={k: 1.0 for k in keys[1:]})
    with pytest.raises(SimError, match="lacks 1 event.*" + keys[0].split("[")[0]):
        simulate(SMALL, strat, device_model(t, profile=partial))
    lenient = device_model(t, profile=partial, strict_profile=False)
    assert simulate(SMALL, strat, lenient).iteration_ms > 0


CONFIGS = [Strategy(tp=2, pp=4, dp=2, num_microbatches=8, pipeline_schedule=sch, schedule=ov, recompute=rc, virtual_stages=vp)
           for sch, vp in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2)) for ov in ("default", "oases") for rc in (False, True)
           if sch == "1f1b" or vp == 1]
CONFIGS += [Strategy(tp=4, pp=2, dp=2, num_microbatches=4, backend="atp", layout=atp_layout(2, 2), recompute=True, virtual_stages=2),
            Strategy(tp=2, pp=2, dp=4, num_microbatches=3, distributed_optimizer=True)]
MODEL8 = GPTShape(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=256, padded_vocab_size=4096,
                  micro_batch_size=2)


def _label(s: Strategy) -> str:
    return f"{s.pipeline_schedule}-vp{s.virtual_stages}-{s.schedule}-rc{int(s.recompute)}-{s.backend}"


@pytest.mark.parametrize("strat", CONFIGS, ids=_label)
def test_timeline_invariants(strat: Strategy):
    """Streams never overlap, every dependency holds, iteration = end of the last event."""
    r = simulate(MODEL8, strat, device_model(topo()))
    evs = timeline_events(r)
    for st in range(strat.pp):
        for stream in ("compute", "comm"):
            on = sorted((e for e in evs if e["stage"] == st and e["stream"] == stream), key=lambda e: e["start"])
            assert all(a["end"] <= b["start"] + EPS for a, b in zip(on, on[1:])), f"{stream} overlap"
    # inside a template each sub-batch's ops run in order (compute waits on its collectives); stock
    # Megatron's input-gradient all-reduce starts beside its compute's weight gradient instead
    chain_end, chain_start = {}, {}
    beside = strat.schedule == "default" and strat.backend == "megatron"
    for e in evs:
        if e["phase"] in ("F", "B") and e["stream"] != "p2p":
            k = (e["stage"], e["chunk"], e["phase"], e["micro_batch"], e["chain"])
            # (under oases the output layer's all-reduce runs per sub-batch, in its chain's order)
            if (e["name"] in OUTPUT_ASYNC_DGRAD and strat.schedule != "oases") or (
                    beside and e["name"] in STOCK_ASYNC_DGRAD):
                assert e["start"] >= chain_start[k] - EPS
                chain_end[k] = max(chain_end[k], e["end"])
                continue
            assert e["start"] >= chain_end.get(k, 0.0) - EPS
            chain_start[k], chain_end[k] = e["start"], e["end"]
    span = {}
    for e in evs:
        if e["phase"] in ("F", "B") and e["stream"] != "p2p":
            k = (e["chunk"] * strat.pp + e["stage"], e["phase"], e["micro_batch"])
            lo, hi = span.get(k, (float("inf"), 0.0))
            span[k] = (min(lo, e["start"]), max(hi, e["end"]))
    pp, last = strat.pp, strat.pp * strat.virtual_stages - 1
    send = lambda g, i: r.p2p_ms[g % pp][g // pp][i]  # noqa: E731
    assert len(span) == 2 * strat.num_microbatches * (last + 1)
    for m in range(strat.num_microbatches):
        for g in range(1, last + 1):
            assert span[(g, "F", m)][0] >= span[(g - 1, "F", m)][1] + send(g - 1, 0) - EPS
        for g in range(last):
            assert span[(g, "B", m)][0] >= span[(g + 1, "B", m)][1] + send(g + 1, 1) - EPS
        assert span[(last, "B", m)][0] >= span[(last, "F", m)][1] - EPS
    step = [e for e in evs if e["phase"] == "STEP"]
    for st in range(strat.pp):  # the step's tail follows the stage's last backward
        last_b = max(e["end"] for e in evs if e["stage"] == st and e["phase"] == "B")
        assert all(e["start"] >= last_b - EPS for e in step if e["stage"] == st)
    assert {e["name"] for e in step} >= {"grad_norm", "optimizer"}
    assert r.iteration_ms == pytest.approx(max(e["end"] for e in evs))
    for x in r.stages:
        assert x.compute_ms + x.exposed_comm_ms + x.bubble_ms == pytest.approx(r.iteration_ms)
        assert x.bubble_ms >= -EPS
    assert 0 < r.mfu < 1 and 0 <= r.bubble_fraction < 1


no_host = dataclasses.replace(LOCAL, dispatch_us=0.0, layer_framework_us=0.0)


@pytest.mark.parametrize("tp,pp,mb", [(2, 1, 2), (4, 2, 4), (8, 2, 2), (8, 1, 8)])
def test_oases_never_slower_with_linear_costs(tp: int, pp: int, mb: int):
    """With costs linear in batch (no GEMM overhead, no dispatch floor, no latency) halving is free, so overlap only helps."""
    dm = device_model(topo(lat=0.0), gemm_half_ms=0.0, stack=no_host)  # no host floor either
    model = GPTShape(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=8192,
                     micro_batch_size=mb)
    times = {ov: simulate(model, Strategy(tp=tp, pp=pp, dp=16 // (tp * pp), num_microbatches=4, schedule=ov),
                          dm).iteration_ms for ov in ("default", "oases")}
    assert times["oases"] <= times["default"] + EPS


def test_oases_meets_max_bound_for_one_layer_comm_equal_compute():
    model = GPTShape(num_layers=1, hidden_size=512, num_attention_heads=8, seq_length=256, padded_vocab_size=4096,
                     micro_batch_size=2)
    layer = ("attention", "attention.g", "mlp", "mlp.g")
    for ov, unit in (("default", 2.0), ("oases", 1.0)):  # a sub-batch op costs half a micro-batch op
        st = build_stage_events(model, Strategy(tp=2, schedule=ov), topo(nodes=1, per_node=2))[0]
        ops = tuple(e for e in st.forward if e.name in layer)
        tm = run_template(ops, st.chains, {e.key: unit for e in ops})
        c = m = 2 * 2.0  # total compute = total comm = 4 (two segments of 2 per micro-batch)
        if ov == "default":
            assert tm.duration == pytest.approx(c + m)
        else:  # max(C, M) + the one sub-batch segment that cannot overlap (pipeline fill)
            assert tm.duration == pytest.approx(max(c, m) + unit)


def test_stock_input_gradient_all_reduce_runs_beside_the_weight_gradient():
    """Stock Megatron's dgrad all-reduce starts when the weight-gradient GEMM does: hidden while
    shorter than it, else only the rest is exposed; shared-core slow-downs stretch both."""
    model = GPTShape(num_layers=1, hidden_size=512, num_attention_heads=8, seq_length=256, padded_vocab_size=4096,
                     micro_batch_size=2)
    st = build_stage_events(model, Strategy(tp=2), topo(nodes=1, per_node=2))[0]
    ops = tuple(e for e in st.backward if e.name in ("attention.bwd", "attention.f.bwd"))
    ar = ops[1]
    assert ar.beside is not None and ar.beside.name == "attention.wgrad"
    for comm, want in ((2.0, 10.0), (5.0, 12.0)):  # compute 10 ms of which the wgrad is the last 3
        price = {ops[0].key: 10.0, ar.key: comm, ar.beside.key: 3.0}
        tm = run_template(ops, 1, price)
        assert tm.duration == pytest.approx(want)
        assert tm.slots[1].start == pytest.approx(7.0)
    price = {ops[0].key: 10.0, ar.key: 5.0, ar.beside.key: 3.0}
    # both twice as slow together: the wgrad ends at 7 + 6, the all-reduce did 6/10 by then, 2 ms alone
    tm = run_template(ops, 1, price, {ar.key: 10.0, ar.beside.key: 6.0})
    assert tm.slots[0].dur == pytest.approx(13.0) and tm.duration == pytest.approx(15.0)
    oases = build_stage_events(model, Strategy(tp=2, schedule="oases"), topo(nodes=1, per_node=2))[0]
    # the executor launches its own collectives, the output layer's too (per sub-batch)
    assert [e.name for e in oases.backward if e.beside is not None] == []


def test_oases_splits_the_layers_and_the_head_collectives():
    """The decoder layers and the head's TP collectives (the embedding's all-reduce, the output
    layer's input-gradient all-reduce) run per sub-batch, two chains; the embedding's and the
    logits' compute and the loss run before and after them on the whole micro-batch, one chain."""
    model = GPTShape(num_layers=2, hidden_size=512, num_attention_heads=8, seq_length=256, padded_vocab_size=4096,
                     micro_batch_size=4)
    st = build_stage_events(model, Strategy(tp=2, schedule="oases"), topo(nodes=1, per_node=2))[0]
    ch = st.chunks[0]
    assert [c for _, c in ch.forward_segments] == [1, 2, 1] == [c for _, c in ch.backward_segments]
    assert [e.name for e in ch.forward_segments[0][0]] == ["embedding"]
    assert [e.name for e in ch.forward_segments[2][0]] == ["logits", "loss.ar"]
    assert [e.name for e in ch.backward_segments[0][0]] == ["logits.bwd"]
    assert ch.forward_segments[1][0][0].name == "embedding.ar"
    assert ch.backward_segments[1][0][0].name == "logits.f.bwd"
    head = [e for evs, c in (*ch.forward_segments, *ch.backward_segments) if c == 1 for e in evs]
    split = [e for evs, c in (*ch.forward_segments, *ch.backward_segments) if c == 2 for e in evs]
    assert all("[b4s256" in e.key for e in head)
    assert all("[b2s256" in e.key for e in split if e.name != "main_grad.add")  # keyed by its bytes
    ov = overlapped_keys([st])
    # the whole micro-batch's head overlaps nothing; the sub-batch chains overlap each other
    assert {e.key for e in split} <= ov and not ov & {e.key for e in head}
    price = {k: 1.0 for k in unique_events([st])}
    tm = run_segments(ch.forward_segments, price)
    parts = [run_template(evs, c, price).duration for evs, c in ch.forward_segments]
    assert parts[0] == 1.0 and parts[2] == 2.0 and tm.duration == pytest.approx(sum(parts))
    n0 = len(ch.forward_segments[0][0])
    assert max(sl.start + sl.dur for sl in tm.slots[:n0]) <= min(sl.start for sl in tm.slots[n0:])
    stock = build_stage_events(model, Strategy(tp=2), topo(nodes=1, per_node=2))[0]
    assert [c for _, c in stock.chunks[0].forward_segments] == [1]


def test_chrome_trace(tmp_path: Path):
    r = simulate(SMALL, Strategy(tp=2, pp=2, dp=4, num_microbatches=3, schedule="oases"), device_model(topo()))
    tr = chrome_trace(r)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert xs and all({"name", "pid", "tid", "ts", "dur", "args"} <= e.keys() for e in xs)
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"compute", "comm", "p2p"}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(r.iteration_ms * 1e3)
    write_chrome_trace(r, tmp_path / "t.json")
    json.loads((tmp_path / "t.json").read_text())


def test_png_timeline(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from megatron_oases.sim.core.trace import plot_timeline
    r = simulate(SMALL, Strategy(tp=2, pp=2, dp=4, num_microbatches=3), device_model(topo()))
    plot_timeline(r, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.parametrize("strat,msg", [
    (Strategy(tp=4, pp=2, dp=3), r"TP 4 x PP 2 x DP 3 = 24 != 16 GPUs"),
    (Strategy(tp=2, pp=8, dp=1), r"4 layers are not divisible by PP 8"),
    (Strategy(tp=16, pp=1, dp=1), r"divisible by TP 16"),
])
def test_bad_input_one_line(strat: Strategy, msg: str):
    with pytest.raises(SimError, match=msg) as e:
        simulate(SMALL, strat, device_model(topo()))
    assert "\n" not in str(e.value)
    with pytest.raises(SimError, match="schedule must be one of"):
        Strategy(schedule="zb")


def _bench():
    return load_script("scripts/bench_sim_scale.py")


def test_3072_gpus_under_one_second(capsys):
    bench = _bench()
    t0 = time.perf_counter()
    r, _ = bench.run()
    n = len(timeline_events(r))  # the expanded timeline too
    assert time.perf_counter() - t0 <= 1.0 and n > 10_000
    assert r.strategy.world_size == 3072 and 0.1 < r.mfu < 0.7
    assert bench.main(["--dp", "47"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: TP 8 x PP 8 x DP 47 = 3008 != 3072 GPUs"


def test_shipped_topology_prices_with_its_device():
    r = simulate(SMALL, Strategy(tp=4, pp=2, dp=2, num_microbatches=4), device_model(load_topology("2node-ib")))
    assert r.iteration_ms > 0 and len(r.stages) == 2


def test_sim_main(tmp_path: Path, capsys):
    from megatron_oases.sim.frontends.cli import sim_main
    base = ["--topology", "2node-ib", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "256", "--micro-batch-size", "2", "--vocab-size", "4096", "--num-microbatches", "4"]
    out = tmp_path / "t.json"
    assert sim_main(base + ["--tp", "4", "--pp", "2", "--dp", "2", "--schedule", "oases", "--trace", str(out)]) == 0
    assert "iteration" in capsys.readouterr().out and out.is_file()
    assert sim_main(base + ["--tp", "4", "--pp", "2", "--dp", "3"]) == 2
    assert capsys.readouterr().err.strip() == "error: TP 4 x PP 2 x DP 3 = 24 != 16 GPUs"


def test_atp_description_matches_megatron_flops_and_eq2_forward_volume():
    from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
    from tests.atp_eq2 import ATP_LAYER_ALLREDUCES
    from megatron_oases.describe.atp_2d import atp_2d_gpt_layer

    b, s, h, a, e = 2, 128, 512, 8, 2
    for d1, d2 in ((4, 2), (2, 4), (1, 8)):
        atp = atp_2d_gpt_layer(micro_batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, d1=d1, d2=d2, bytes_per_element=e)
        meg = megatron_1d_gpt_layer(micro_batch=b, seq=s, hidden=h, heads=a, ffn=4 * h, tp=8, bytes_per_element=e)
        for p in ("forward", "backward"):
            assert atp.flops(p) == pytest.approx(meg.flops(p))
        fwd = {1: 0.0, 2: 0.0}
        for c in atp.collectives("forward"):
            if c.kind == "all_reduce" and not c.name.startswith("ln"):
                fwd[int(c.axis[-1])] += c.payload_bytes
        want = {1: 0.0, 2: 0.0}
        for _, axis, width, shard in ATP_LAYER_ALLREDUCES:  # Eq. 2's forward half
            if (d1, d2)[axis - 1] > 1:
                want[axis] += b * s * width * h / (d1, d2)[shard - 1] * e
        assert fwd == pytest.approx(want)
        # the conjugate backward all-reduces: column-first dX on axis 1, row-first dX on axis 2
        bwd = {c.name: c for c in atp.collectives("backward")}
        if d1 > 1:
            assert bwd["qkv.bwd"].axis == "mesh1" and bwd["qkv.bwd"].payload_bytes == b * s * h // d2 * e
        assert bwd["fc2.bwd"].axis == "mesh2" and bwd["fc2.bwd"].payload_bytes == b * s * 4 * h // d1 * e


def test_shipped_topology_device_spellings_resolve():
    """pcie-3090x4 names its device rtx3090-24gb; the simulator refused it (unknown GPU)."""
    topo = load_topology("pcie-3090x4")
    assert device_model(topo).gpu.name == GPUS["rtx-3090"].name
    with pytest.raises(SimError, match="unknown GPU 'tpu-v5'"):
        device_model(topo, gpu="tpu-v5")
