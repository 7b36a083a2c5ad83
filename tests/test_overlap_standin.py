"""The one-GPU overlap benchmark (benchmarks/standin/, scripts/bench_gpu_overlap.py) on
CPU: stand-ins run synchronously there, so the mechanics are tested (pricing, handles, counts,
the whole script end to end), not the overlap. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.standin.standins import (Link, StandIns, calibrate, calibrate_nccl, link_matching,
                                                   nccl_channels)
from megatron_oases.parallel.collectives import WatchedCall
from megatron_oases.runtime.device import detect_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, B, S, H, HEADS = 2, 2, 16, 32, 4  # layers, micro-batch, sequence, hidden, heads (fp32)
TP = 2


def test_link_prices_with_the_ring_formula_and_matches_a_target():
    link = Link(GBps=100.0, latency_us=5.0)
    # all-reduce of 1 GB on 2 ranks: 2 (n-1)/n S / B = 10 ms, + 2 (n-1) steps of 5 us
    assert link.collective_ms("all_reduce", 1e9, 2) == pytest.approx(10.01)
    assert link.collective_ms("all_gather", 1e9, 4) == pytest.approx(7.5 + 0.015)
    calls = [("all_reduce", 2, 64 << 20)] * 6 + [("all_reduce", 2, 128)] * 3
    found = link_matching(12.0, calls, latency_us=5.0)
    assert sum(found.collective_ms(k, b, n) for k, n, b in calls) == pytest.approx(12.0, rel=1e-6)
    with pytest.raises(ValueError, match="latency"):
        link_matching(0.01, calls, latency_us=5.0)  # 9 x 10 us of latency alone exceed it


@pytest.mark.parametrize("kind", ["sleep", "copy"])
def test_stand_ins_follow_the_call_and_return_handles(kind):
    """A sync call returns None (waited at once), an async one a handle that keeps the call's
    tensors until ``wait()``; each is priced and listed; the replay runs them again."""
    import torch

    rt = detect_runtime("cpu")
    cal, *scratch = calibrate(rt, 1 << 16, reps=1)
    stand = StandIns(rt, kind, Link(GBps=1.0, latency_us=0.0), cal, tuple(scratch))
    x = torch.ones(256)
    assert stand(WatchedCall("all_reduce", None, 2, 1024, (x,), False)) is None
    work = stand(WatchedCall("all_gather", None, 2, 2048, (x,), True))
    assert work._keep == (x,) and work.wait() is True and work._keep == ()
    assert [(i.kind, i.payload_bytes, i.async_op) for i in stand.issued] == [
        ("all_reduce", 1024, False), ("all_gather", 2048, True)]
    assert [i.ms for i in stand.issued] == pytest.approx([1024e-6, 1024e-6])  # (n-1)/n factors
    stand.replay(stand.issued)
    assert torch.equal(x, torch.ones(256))  # a stand-in moves no data of the call


def test_nccl_stand_ins_run_on_nccl_s_channels_for_the_link():
    """Two blocks per 25 GB/s, at most NCCL's 32: a PCIe ring's duplicated channel, A100 and H100
    NVLink's 24 and 32."""
    assert [nccl_channels(g) for g in (1, 24, 24.1, 50, 150, 300, 450, 900)] == [2, 2, 2, 4, 12, 24, 32, 32]


@pytest.mark.parametrize("kind, n, payload, wire", [("all_reduce", 2, 4096, 4096), ("all_gather", 4, 4096, 3072),
                                                    ("reduce_scatter", 8, 8192, 7168)])
def test_nccl_stand_in_moves_the_bytes_the_rank_sends(kind, n, payload, wire):
    """The CPU twin of the ``nccl`` kind copies the ring's wire bytes (2(n-1)/n or (n-1)/n of the
    payload) between the scratch buffers, no more; without ``calibrate_nccl`` it is refused."""
    rt = detect_runtime("cpu")
    cal, src, dst = calibrate(rt, 1 << 16, reps=1)
    with pytest.raises(ValueError, match="calibrate_nccl"):
        StandIns(rt, "nccl", Link(GBps=1.0, latency_us=0.0), cal, (src, dst))
    cal = calibrate_nccl(rt, cal, src, dst, blocks=4)
    assert (cal.nccl_blocks, cal.nccl_GBps) == (4, None)  # CPU: no rate to measure
    dst.zero_()
    stand = StandIns(rt, "nccl", Link(GBps=100.0, latency_us=0.0), cal, (src, dst))
    assert stand(WatchedCall(kind, None, n, payload, (), False)) is None
    assert int(dst[:wire].sum()) == wire and int(dst[wire:].sum()) == 0  # src is all ones
    assert stand.issued[0].wire_bytes == wire


def test_comm_disabled_stand_ins_take_no_time_and_move_nothing():
    """The comm-disabled step's stand-ins are priced at zero and run no kernel, but are issued
    (and waited) like the others."""
    import torch

    rt = detect_runtime("cpu")
    cal, src, dst = calibrate(rt, 1 << 16, reps=1)
    dst.zero_()
    off = StandIns(rt, "copy", Link(GBps=1e-3, latency_us=5.0), cal, (src, dst), comm_disabled=True)
    assert off(WatchedCall("all_reduce", None, 2, 4096, (), False)) is None
    assert off(WatchedCall("all_gather", None, 2, 4096, (torch.ones(2),), True)).wait() is True
    assert [i.ms for i in off.issued] == [0.0, 0.0] and int(dst.sum()) == 0


def _described(schedule: str, passes=("forward", "backward")) -> list[tuple[str, int]]:
    """(kind, payload bytes) of one step's TP collectives in ``passes`` by the descriptions: the
    layers' (per sub-batch under Oases) and the head's; Megatron's vocab-parallel cross-entropy
    issues the described per-token fp32 reductions (``loss.ar``) as three all-reduces of equal
    size; the head's other collectives run per sub-batch under Oases (``split_*``)."""
    from megatron_oases.describe.head import head_ops
    from megatron_oases.describe.registry import layer_description
    from megatron_oases.schedules.oases.options import OasesOptions

    subs = OasesOptions(recompute=False).sub_batches if schedule == "oases" else 1
    layer = layer_description(backend="megatron", layout=None, micro_batch=B // subs, seq=S, hidden=H,
                              heads=HEADS, ffn=4 * H, tp=TP, bytes_per_element=4, schedule=schedule)
    out = [(c.kind, c.payload_bytes) for p in passes for c in layer.collectives(p)] * L * subs
    head = head_ops(b=B, s=S, h=H, v=1024, t=TP, e=4, first=True, last=True, sub_batches=subs)
    for c in (c for p in passes for c in (*getattr(head, f"pre_{p}"), *getattr(head, f"post_{p}"))):
        if hasattr(c, "payload_bytes"):
            out += [(c.kind, c.payload_bytes // 3)] * 3 if c.name == "loss.ar" else [(c.kind, c.payload_bytes)]
    for p in passes:  # under Oases the embedding's and output layer's collectives, per sub-batch
        out += [(c.kind, c.payload_bytes) for c in (*getattr(head, f"split_pre_{p}"),
                                                    *getattr(head, f"split_post_{p}"))] * subs
    return sorted(out)


def test_script_runs_stock_and_oases_with_both_stand_ins(tmp_path, capsys):
    from benchmarks.standin import summary

    out = tmp_path / "overlap.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_gpu_overlap.py"), "--tp", str(TP),
           "--steps", "1", "--warmup", "1", "--kinds", "sleep,copy,nccl", "--label", "tiny", "--out", str(out), "--",
           "--device", "cpu", "--num-layers", str(L), "--hidden-size", str(H),
           "--num-attention-heads", str(HEADS), "--seq-length", str(S), "--micro-batch-size", str(B)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stock / Oases with copy stand-ins" in proc.stdout and "meaningless" in proc.stdout
    res = json.loads(out.read_text())
    assert res["link"]["chosen_by"] == "--match-compute" and res["link"]["GBps"] > 0
    assert res["calibration"]["nccl_blocks"] == nccl_channels(res["link"]["GBps"])
    for schedule in ("default", "oases"):
        r = res["schedules"][schedule]
        assert r["recompute"] == "none"
        # comm-disabled: the same stand-ins issued, each of zero duration
        assert r["comm_disabled"]["standins_per_step"] == r["collectives_per_step"] and r["comm_disabled"]["ms"] > 0
        for kind in ("sleep", "copy", "nccl"):
            issued = r[kind]["issued"]
            # one stand-in per TP collective, as the layer and head descriptions name them
            assert r[kind]["standins_per_step"] == r["collectives_per_step"] == len(issued)
            assert sorted((k, b) for k, n, b, _ in issued) == _described(schedule)
            assert {n for _, n, _, _ in issued} == {TP}
            # async: Megatron's input-gradient all-reduces of the column linears (QKV, fc1 and
            # the output layer) in stock; under the Oases executor every collective but the
            # loss's three (the layers' and the head's, per sub-batch)
            n_async = sum(a for *_, a in issued)
            assert n_async == (2 * L + 1 if schedule == "default" else len(issued) - 3)
            assert r[kind]["with_standins"]["ms"] > 0 and r[kind]["standins_only"]["ms"] > 0
            # the forward pass alone: its stand-ins are the described forward collectives, the
            # first the step issued; the pass bound is made of the four measured times
            fwd = r[kind]["forward"]
            assert sorted((k, b) for k, _, b, _ in issued[:fwd["standins"]]) == _described(schedule, ("forward",))
            assert fwd["standins_only"]["ms"] > 0 and fwd["with_standins"]["ms"] > 0
            c, cf = r["compute"]["ms"], r["compute_forward"]["ms"]
            s, sf = r[kind]["standins_only"]["ms"], fwd["standins_only"]["ms"]
            assert r[kind]["pass_bound_ms"] == pytest.approx(max(cf, sf) + max(c - cf, s - sf))
            assert r[kind]["pass_bound_ms"] >= max(c, s) * (1 - 1e-9)
            assert r[kind]["max_compute_standins_ms"] == max(c, s)
    # the bound table: per kind, stock and Oases beside comm-disabled and max(compute, comm)
    sch = res["schedules"]
    assert [(b["model"], b["kind"], b["recompute"]) for b in res["bounds"]] == [
        ("tiny", k, "none") for k in ("sleep", "copy", "nccl")]
    for b in res["bounds"]:
        assert list(b) == list(summary.FIELDS) and b["link_GBps"] == res["link"]["GBps"]
        assert (b["stock_ms"], b["oases_ms"]) == (sch["default"][b["kind"]]["with_standins"]["ms"],
                                                  sch["oases"][b["kind"]]["with_standins"]["ms"])
        assert (b["comm_disabled_ms"], b["oases_comm_disabled_ms"]) == (sch["default"]["comm_disabled"]["ms"],
                                                                        sch["oases"]["comm_disabled"]["ms"])
        assert b["max_compute_comm_ms"] == max(sch["oases"]["comm_disabled"]["ms"],
                                               sch["oases"][b["kind"]]["standins_only"]["ms"])
    assert "comm-disabled ms" in proc.stdout and "max(compute, comm) ms" in proc.stdout
    # gpu_check's overlap-summary step: the runs' records in one list
    assert summary.main([str(out), str(out), "--out", str(tmp_path / "summary.json")]) == 0
    assert json.loads((tmp_path / "summary.json").read_text()) == res["bounds"] * 2
    assert "Oases / comm-disabled" in capsys.readouterr().out


def test_trainer_flags_pass_through_unabbreviated():
    """The trainer's ``--optimizer`` is not taken for the benchmark's ``--optimizer-step``, and
    the trainer's parser gets every flag the benchmark does not know."""
    from benchmarks.standin.measure import build_parser, trainer_config

    a, rest = build_parser().parse_known_args(
        ["--optimizer", "sgd", "--tp", "4", "--out", "x.json", "--micro-batch-size", "4", "--schedule", "oases"])
    assert (a.tp, a.optimizer_step, a.out) == (4, False, "x.json")
    cfg = trainer_config(rest, a.tp, "default")
    assert (cfg.optimizer, cfg.tensor_model_parallel_size, cfg.schedule) == ("sgd", 4, "default")
    assert (cfg.global_batch_size, cfg.tp_invariant_init) == (4, False)  # one micro-batch a step


MODEL = ["--device", "cpu", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("flags, message", [
    (["--kinds", "foo"], "--kinds: 'foo' is not one of sleep, copy, channels, nccl"),
    (["--kinds", "sleep,sleep"], "--kinds sleep,sleep names one twice"),
    (["--schedules", "foo"], "--schedules: 'foo' is not one of default, oases"),
    (["--steps", "0"], r"--steps must be >= 1 \(got 0\)"),
    (["--warmup", "-1"], r"--warmup must be >= 0 \(got -1\)"),
    (["--link-gbps", "0"], r"--link-gbps must be > 0 \(got 0.0\)"),
    (["--link-gbps", "-2"], r"--link-gbps must be > 0 \(got -2.0\)"),
    (["--latency-us", "-1"], r"--latency-us must be >= 0 \(got -1.0\)"),
    (["--scratch-mb", "0"], r"--scratch-mb must be > 0 \(got 0.0\)"),
    (["--tp", "1"], "--tp must be >= 2 .*no collective.*unless --ep >= 2"),
    (["--ep", "0"], r"--ep must be >= 1 \(got 0\)"),
    (["--tp", "1", "--ep", "2"], "--ep 2 splits an MoE model's experts; add --num-experts"),
    (["--", "--expert-model-parallel-size", "2"], "give it to the benchmark as --ep"),
    (["--", "--tensor-model-parallel-size=2"], "give it to the benchmark as --tp"),
    (["--tp", "1", "--ep", "2", "--num-experts", "3"], "--ep 2 must divide --num-experts 3"),
    (["--tp", "3"], "--hidden-size 64 is not divisible by --tp 3"),
    (["--tp", "8"], "--num-attention-heads 4 is not divisible by --tp 8"),
    (["--channels", "8"], "--channels sizes the channels and nccl stand-ins, neither of which --kinds sleep,copy runs"),
    (["--kinds", "channels", "--channels", "0"], r"--channels must be >= 1 \(got 0\)"),
    (["--out", "/proc/x/o.json"], "--out /proc/x/o.json: /proc is not a writable directory"),
    (["--out", "/"], "--out / is a directory; give a file name"),
    (["--trace", "/proc/x"], "--trace /proc/x: /proc is not a writable directory"),
    (["--", "--train-iters", "6"], "--train-iters has no effect here"),
    (["--", "--log-json=x.json"], "--log-json has no effect here"),
    (["--", "--save", "ck"], "--save has no effect here"),
])
def test_bad_flags_are_refused_before_the_model_is_built(flags, message):
    """Each bad benchmark flag is one ``ConfigError`` naming it, from the checks ``main`` runs
    right after parsing (no model is built here); the trainer's sizes are checked at --tp."""
    from benchmarks.standin.measure import build_parser, validate_args
    from megatron_oases.errors import ConfigError

    a, rest = build_parser().parse_known_args(flags + MODEL)
    with pytest.raises(ConfigError, match=message):
        validate_args(a, rest)


def test_good_flags_pass_validation(tmp_path):
    from benchmarks.standin.measure import build_parser, validate_args

    a, rest = build_parser().parse_known_args(
        ["--tp", "4", "--kinds", "nccl,sleep", "--channels", "8", "--schedules", "oases", "--steps", "1",
         "--warmup", "0", "--link-gbps", "10", "--latency-us", "0", "--scratch-mb", "1",
         "--trace", str(tmp_path / "traces"), "--out", str(tmp_path / "new" / "o.json")] + MODEL)
    validate_args(a, rest)


def test_moe_flags_pass_validation_and_size_the_world():
    """--tp 1 --ep 2 with an MoE model: a fake world of 2 ranks, DP 2, one micro-batch a rank.
    Any MoE model runs in an expert world (its count gather sizes the experts' GEMMs at EP 1
    too), a dense one does not."""
    from benchmarks.standin.measure import Bench, build_parser, trainer_config, validate_args

    a, rest = build_parser().parse_known_args(["--tp", "1", "--ep", "2"] + MODEL + MOE)
    validate_args(a, rest)
    cfg = trainer_config(rest, a.tp, "oases", a.ep)
    assert (cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.global_batch_size) == (1, 2, 4)
    assert Bench(a, rest).world.world_size == 2
    assert Bench(*build_parser().parse_known_args(["--tp", "2"] + MODEL + ["--num-experts=4"])).world.world_size == 2
    assert Bench(*build_parser().parse_known_args(["--tp", "2"] + MODEL)).world is None


def test_integer_all_gathers_are_filled_as_rank_0_s_replicas():
    """The dispatcher's token counts (int64) come back as if every fake rank routed as rank 0, in
    both of Megatron's all-gather forms; a float all-gather (tokens) is left to the stand-in."""
    import torch

    from benchmarks.standin.moe import fill_routing_metadata

    counts = torch.tensor([3, 1, 0, 4])
    out = torch.full((3 * 4,), -1, dtype=torch.long)
    assert fill_routing_metadata(WatchedCall("all_gather", None, 3, out.numel() * 8, (out, counts), False))
    assert out.tolist() == counts.tolist() * 3
    outs = [torch.full((4,), -1, dtype=torch.long) for _ in range(2)]
    assert fill_routing_metadata(WatchedCall("all_gather", None, 2, 64, (*outs, counts), False))
    assert [o.tolist() for o in outs] == [counts.tolist()] * 2
    tokens, gathered = torch.ones(2, 3), torch.zeros(4, 3)
    assert not fill_routing_metadata(WatchedCall("all_gather", None, 2, 96, (gathered, tokens), True))
    assert not fill_routing_metadata(WatchedCall("all_reduce", None, 2, 32, (counts,), False))
    assert int(gathered.abs().sum()) == 0


def test_moe_script_prices_the_all_to_alls_as_described_and_not_dp(tmp_path):
    """TP 1 x EP 2 (rank 0 of a fake world of 2): every all-to-all is a stand-in priced on the
    link; the forward's dispatch collectives are ``describe.moe``'s (the count gather, the tokens'
    and probabilities' all-to-alls: kind, group, bytes), per sub-batch under Oases, async there
    and blocking in stock; DP's gradient all-reduce is issued but lasts zero; the JSON has the
    dense runs' schema (the bound records included)."""
    from collections import Counter

    from benchmarks.standin.summary import FIELDS
    from megatron_oases.describe.moe import MoEShape, dispatch_collectives

    out = tmp_path / "moe.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_gpu_overlap.py"), "--tp", "1", "--ep", "2",
           "--steps", "1", "--warmup", "0", "--kinds", "sleep", "--link-gbps", "0.01", "--out", str(out), "--",
           "--device", "cpu", "--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
           "--seq-length", str(S), "--micro-batch-size", str(B), *MOE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TP 1 x EP 2" in proc.stdout and "not priced" in proc.stdout
    res = json.loads(out.read_text())
    assert (res["tp"], res["ep"], res["moe"]["moe_layers"], res["moe"]["local_experts"]) == (1, 2, L, 2)
    assert [(b["model"], b["kind"]) for b in res["bounds"]] == [("tp1ep2", "sleep")]
    assert all(list(b) == list(FIELDS) and b["stock_ms"] > 0 and b["oases_ms"] > 0 for b in res["bounds"])
    link = Link(GBps=res["link"]["GBps"], latency_us=res["link"]["latency_us"])
    moe = MoEShape(num_experts=4, ffn=4 * H, topk=2, dispatcher="alltoall")
    for schedule, subs in (("default", 1), ("oases", 2)):
        r = res["schedules"][schedule]
        issued = r["sleep"]["issued"]
        # DP's gradient all-reduce (the only all-reduce at TP 1): issued, zero duration
        assert r["unpriced"]["collectives_per_step"] == 1 == sum(k == "all_reduce" for k, *_ in issued)
        assert r["comm_disabled"]["standins_per_step"] == r["collectives_per_step"] + 1 == len(issued)
        assert r["sleep"]["priced_ms"] == pytest.approx(
            sum(link.collective_ms(k, b, n) for k, n, b, _ in issued if k != "all_reduce"))
        a2a = [(n, a) for k, n, _, a in issued if k == "all_to_all"]
        assert a2a and all(n == 2 and a == (schedule == "oases") for n, a in a2a)
        dispatch, _ = dispatch_collectives(b=B // subs, s=S, h=H, t=1, ep=2, e=4, moe=moe)
        described = Counter((c.kind, c.group_size, c.payload_bytes) for c, _ in dispatch)
        fwd = [(k, n, b) for k, n, b, _ in issued[:r["sleep"]["forward"]["standins"]]]
        # per layer and sub-batch: the count gather, the dispatch's two all-to-alls, the combine's
        # (its bytes are the rows routed to rank 0's experts, about the dispatch's: not described)
        assert Counter(k for k, *_ in fwd) == {"all_gather": subs * L, "all_to_all": 3 * subs * L}
        assert all(Counter(fwd)[c] >= m * subs * L for c, m in described.items())
        if schedule == "default":
            assert [fwd[4 * i:4 * i + 3] for i in range(L)] == [list(described)] * L


def test_script_refuses_bad_flags_in_one_line_with_status_2():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_gpu_overlap.py"), "--tp", "2",
           "--schedules", "foo", "--", *MODEL]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("bench_gpu_overlap.py: error: --schedules: 'foo' is not one of default, oases; "
                           "give a comma-separated list of them (e.g. --schedules default,oases)\n")


def test_summary_refuses_a_missing_run_and_an_unwritable_out_in_one_line(tmp_path, capsys):
    from benchmarks.standin import summary

    for argv, message in (([str(tmp_path / "none.json"), "--out", str(tmp_path / "s.json")],
                           f"OVERLAP_JSON {tmp_path / 'none.json'} is not a file"),
                          ([__file__, "--out", str(tmp_path / "no" / "s.json")], "--out ")):
        with pytest.raises(SystemExit) as exc:
            summary.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "no").exists()
