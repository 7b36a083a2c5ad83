"""Profile DB: measuring events (compute on this device, collectives / P2P on gloo ranks), the
comm plan's extrapolation, pricing from the DB, and the trainer-args -> step-time prediction."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_oases.pricing.device_model import ProfileDB, SimError, device_model
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.events import build_stage_events, unique_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.calibrate.profiler import local_topology, needed_events, plan_comm
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import load_topology
from megatron_oases.describe.atp_2d import atp_layout

TINY = GPTShape(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=128,
                micro_batch_size=2, dtype="fp32")
TRAIN = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
         "--num-layers-per-virtual-pipeline-stage", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--recompute-granularity", "full", "--recompute-method", "uniform", "--device", "cpu"]


def test_plan_comm_extrapolates_scales_and_names_unreachable_links():
    topo = load_topology("2node-ib")  # 8 ranks per node
    model = GPTShape(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=512, padded_vocab_size=8192,
                     micro_batch_size=2)
    tp8 = unique_events(build_stage_events(model, Strategy(tp=8, pp=2), topo))
    comm = [e for e in tp8.values() if e.kind == "collective" and e.ranks and len(e.ranks) == 8]
    jobs, plan = plan_comm(comm, topo, nproc=4, max_bytes=1 << 20)
    ar = next(e for e in comm if e.name == "attention.g")
    j, scale, why = plan[ar.key]
    assert jobs[j].ranks == (0, 1, 2, 3) and jobs[j].kind == "all_reduce"
    nbytes = ar.nbytes
    assert scale == pytest.approx(nbytes / (1 << 20) * (2 * 7 / 8) / (2 * 3 / 4))  # bytes, then ring formula
    assert "extrapolated from 4 ranks" in why and "scaled from" in why
    p2p = [e for e in tp8.values() if e.kind == "p2p"]  # stage 0 -> 1 is rank 0 -> 8: crosses ib
    with pytest.raises(SimError, match=r"ranks 0-3 of topology '2node-ib'\) form no group crossing ib.*p2p:"):
        plan_comm(p2p, topo, nproc=4, max_bytes=1 << 20)
    jobs, plan = plan_comm(p2p, topo, nproc=16, max_bytes=1 << 30)  # ranks spanning both nodes
    assert jobs[0].kind == "p2p" and topo.level_between(*jobs[0].ranks) == 1


def test_collectives_on_cuda_refuse_more_ranks_than_visible_gpus(monkeypatch):
    """``--nproc 4`` on 2 GPUs put two NCCL ranks on each device (``LOCAL_RANK mod visible``),
    which NCCL refuses after the ranks have started; now one error naming --nproc, no rank."""
    from megatron_oases.runtime import spawn
    from megatron_oases.sim.calibrate.profiler import ProfileSettings, profile_comm

    topo = local_topology(4)
    comm = [e for e in needed_events(TINY, [Strategy(tp=4)], topo).values() if e.kind != "compute"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    started = []

    def ranks(fn, n, args, **kw):  # every job takes 1 ms on every rank
        started.append(n)
        return [[1.0] * len(args[0])] * n
    monkeypatch.setattr(spawn, "run_on_ranks", ranks)
    with pytest.raises(SimError, match=r"--nproc 4: .*4 visible CUDA devices.*2 are visible.*--device cpu"):
        profile_comm(comm, topo, ProfileSettings(nproc=4, device="cuda"))
    assert not started
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    times, _ = profile_comm(comm, topo, ProfileSettings(nproc=4, device="cuda"))  # one GPU each
    assert started == [4] and times


def test_compute_events_are_timed_on_the_rank_s_gpu_and_its_stream(monkeypatch):
    """With LOCAL_RANK / SLURM_LOCALID 1 of 2 GPUs, a Megatron layer workload's ``init_runtime``
    made cuda:1 current while the profiler put the inputs on a fixed cuda:0 (and recorded its CUDA
    events on the current device's stream, not the one the work ran on)."""
    from megatron_oases.sim.calibrate import profiler

    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert profiler._torch_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert profiler._torch_device("cuda") == torch.device("cuda", 1)
    assert profiler._torch_device(None) == torch.device("cuda", 1)
    assert profiler._torch_device("cpu") == torch.device("cpu")

    from tests.fake_cuda import fake_cuda_events

    recorded = fake_cuda_events(monkeypatch, 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert profiler.time_ms(lambda: None, warmup=0, reps=2, device=torch.device("cuda", 1)) == 1.0
    assert recorded == ["stream of cuda:1"] * 4


def test_every_compute_event_has_a_workload():
    import torch

    from megatron_oases.sim.calibrate.layer_workloads import single_rank_world
    from megatron_oases.sim.calibrate.workloads import compute_workload

    topo = local_topology(4)
    strats = [Strategy(tp=2, pp=2, num_microbatches=2, recompute=True),
              Strategy(tp=2, pp=2, num_microbatches=2, selective_recompute=True),
              Strategy(tp=4, backend="atp", layout=atp_layout(2, 2), num_microbatches=2),
              Strategy(tp=2, dp=2, schedule="oases", distributed_optimizer=True)]
    events = needed_events(TINY, strats, topo)
    names = {e.name for e in events.values() if e.kind == "compute"}
    assert {"attention.bwd", "attention.core", "atp.core.bwd", "logits.bwd", "embedding", "optimizer",
            "grad_norm"} <= names
    with single_rank_world():  # Megatron layer workloads build a real layer
        for e in events.values():
            if e.kind == "compute":
                compute_workload(e.name, dict(e.dims), torch.device("cpu"))()
    with pytest.raises(SimError, match="no profiling workload"):
        compute_workload("nope", dict(next(iter(events.values())).dims), torch.device("cpu"))


def test_optimizer_events_run_on_the_stage_s_own_parameter_tensors():
    """Adam and the gradient norm loop over tensors: their events carry the stage's tensor sizes,
    which match a real Megatron layer's parameters and sum to the stage's parameter count."""
    import torch

    from megatron_oases.describe.registry import layer_param_tensors
    from megatron_oases.sim.calibrate.layer_workloads import _tp1_layer, single_rank_world, variant_of

    h, a, f, t = 32, 4, 128, 2
    qkn = {"groups": a, "gated": 0, "norm": "LayerNorm", "bias": 1, "rope": 1.0, "qkn": 1}  # + replicated q/k norms
    with single_rank_world():
        for extra in ({}, qkn):
            d = {"h": h, "a": a, "f": f, "t": t, **extra}
            layer = _tp1_layer(d, torch.device("cpu"), torch.float32)
            assert sorted(p.numel() for p in layer.parameters()) == sorted(
                layer_param_tensors("megatron", h, f, t, None, heads=a, variant=variant_of(d)))
    st = build_stage_events(TINY, Strategy(tp=2, pp=2), local_topology(4))
    for s in st:
        sizes = dict(s.optimizer.dims)["sizes"]
        assert sum(sizes) == s.params_per_rank == dict(s.grad_norm.dims)["p"]
        assert f"n{len(sizes)}" in s.optimizer.key and f"n{len(sizes)}" in s.grad_norm.key
    assert len(dict(st[0].optimizer.dims)["sizes"]) == 12 * TINY.num_layers // 2 + 2  # + word, position embeddings


def test_profile_search_on_gloo_ranks_then_simulate(tmp_path: Path, capsys):
    """`megatron-oases profile --search` on 2 local ranks, then `sim --search --profile`: every
    strategy priced from measurements (strict: a missing key would be an infeasible reason)."""
    from megatron_oases.sim.frontends.cli import sim_main
    from megatron_oases.sim.frontends.profile_cli import profile_main

    out = tmp_path / "p.json"
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--vocab-size", "128", "--dtype", "fp32"]
    search = ["--search", "--gpus", "2", "--global-batch-size", "4"]
    assert profile_main(["--out", str(out), "--nproc", "2", "--warmup", "0", "--reps", "1", *model, *search]) == 0
    db = ProfileDB.load(out)
    assert db.device.startswith("cpu") and db.meta["nproc"] == 2
    kinds = {k.split(":", 1)[0] for k in db.events_ms}
    assert {"compute", "all_reduce", "all_gather", "p2p"} <= kinds
    assert all(v == "measured" for v in db.sources.values())
    capsys.readouterr()
    assert sim_main(["--topology", "local", "--gpu", "a100-80gb", "--profile", str(out), *model, *search,
                     "--csv", str(tmp_path / "s.csv")]) == 0
    assert "lacks" not in capsys.readouterr().out
    # a strategy the profile never saw: the error names the missing events
    assert sim_main(["--topology", "local", "--gpu", "a100-80gb", "--profile", str(out), *model[:-6],
                     "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "128", "--dtype", "fp32",
                     "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "lacks 20 event(s)" in err and "[b2s32h32a4f128t2_fp32_fusedattn]@tpx2:local" in err  # sim and profile: auto


def test_predict_maps_trainer_flags():
    from megatron_oases.sim.frontends.predict import predict_train_step, sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(TRAIN)
    model, s = sim_inputs_from_train_args(args)
    assert (model.padded_vocab_size, model.dtype, model.tied_embeddings) == (128, "fp32", True)  # padded to 128
    assert (s.tp, s.pp, s.dp, s.virtual_stages, s.num_microbatches, s.recompute) == (1, 2, 1, 2, 4, True)
    oases = build_parser().parse_args([
        "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--schedule", "oases", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--device", "cpu"])
    assert sim_inputs_from_train_args(oases)[1].schedule == "oases"
    topo = local_topology(2)
    keys = unique_events(build_stage_events(model, s, topo))
    db = ProfileDB(device="cpu", events_ms={k: 1.0 for k in keys})
    r = predict_train_step(args, db)
    assert r.iteration_ms > 0 and r.strategy == s
    with pytest.raises(SimError, match="lacks 1 event"):
        predict_train_step(args, ProfileDB(device="cpu", events_ms={k: 1.0 for k in list(keys)[1:]}))
    sel = build_parser().parse_args(TRAIN[:-6] + ["--recompute-granularity", "selective", "--device", "cpu"])
    s_sel = sim_inputs_from_train_args(sel)[1]
    assert s_sel.selective_recompute and not s_sel.recompute
    with pytest.raises(SimError, match="--global-batch-size|micro"):
        sim_inputs_from_train_args(build_parser().parse_args(TRAIN + ["--global-batch-size", "3"]))


def test_predict_prices_the_step_tail_the_optimizer_runs():
    """``--clip-grad 0``: Megatron's optimizer computes no gradient norm and scales nothing, so
    the prediction has no norm events and its optimizer event is keyed (and timed) without the
    scale; ``--optimizer sgd`` is refused (the simulator profiles and prices Adam's step)."""
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.sim.calibrate.workloads import compute_workload
    from megatron_oases.train_args import build_parser

    def tail(*extra):
        model, s = sim_inputs_from_train_args(build_parser().parse_args(TRAIN + list(extra)))
        return s, unique_events(build_stage_events(model, s, local_topology(s.world_size)))
    s, clipped = tail()
    s0, unclipped = tail("--clip-grad", "0")
    assert s.clip_grad and not s0.clip_grad
    assert any(k.startswith("compute:grad_norm") for k in clipped)
    assert not any("grad_norm" in k for k in unclipped)
    opt = [e for k, e in unclipped.items() if k.startswith("compute:optimizer")]
    assert opt and all(e.key.endswith("_noclip]") and dict(e.dims)["clip"] == 0 for e in opt)
    assert not set(k for k in unclipped if "optimizer" in k) & set(clipped)
    compute_workload("optimizer", dict(opt[0].dims), torch.device("cpu"))()
    with pytest.raises(SimError, match="--optimizer sgd is not modeled"):
        tail("--optimizer", "sgd")


def test_profile_train_args_on_gloo_ranks(tmp_path: Path):
    """The accuracy study's path: profile exactly the trainer run's events, then predict it."""
    from megatron_oases.sim.frontends.predict import predict_train_step, profile_train_args
    from megatron_oases.sim.calibrate.profiler import ProfileSettings
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(TRAIN)
    db = profile_train_args(args, settings=ProfileSettings(nproc=2, warmup=0, reps=1, threads=1))
    assert any(k.startswith("p2p:activation") for k in db.events_ms)
    assert any(k.startswith("all_reduce:embedding.tie") for k in db.events_ms)
    db.save(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["format"] == "megatron-oases-profile/2"
    r = predict_train_step(args, ProfileDB.load(tmp_path / "t.json"))
    assert r.iteration_ms > 0 and r.strategy.virtual_stages == 2
    # the trainer's loop overhead, measured at 1 and 2 layers on one rank (calibrate.loop_overhead)
    loop = {k.split("[")[0]: v for k, v in db.events_ms.items() if "loop." in k}
    assert set(loop) == {"compute:loop.microbatch", "compute:loop.layer"} and min(loop.values()) >= 0
    assert set(db.meta["loop_overhead_runs"]) == {"1", "2"}, db.meta
    with_loop = predict_train_step(args, ProfileDB.load(tmp_path / "t.json"), loop_overhead=True)
    assert with_loop.iteration_ms >= r.iteration_ms


def test_loop_events_price_what_a_profile_measured_and_nothing_else():
    """``loop.microbatch`` once and ``loop.layer`` once per layer, per chunk and micro-batch:
    priced as measured, 0 unmeasured (and not required), 0 in the analytical model."""
    import dataclasses

    from megatron_oases.describe.ops import is_loop_event
    from megatron_oases.sim.calibrate.loop_overhead import single_rank_args
    from megatron_oases.sim.frontends.predict import predict_train_step, sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(["--nproc-per-node", "1", "--num-layers", "3", "--hidden-size", "32",
                                      "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "100",
                                      "--micro-batch-size", "2", "--global-batch-size", "8", "--device", "cpu"])
    model, s = sim_inputs_from_train_args(args)
    assert not s.loop_overhead  # the headline prediction
    looped = dataclasses.replace(s, loop_overhead=True)
    topo = local_topology(1)
    keys = unique_events(build_stage_events(model, looped, topo))
    loop = sorted(k for k in keys if is_loop_event(k))
    assert [k.split("[")[0] for k in loop] == ["compute:loop.layer", "compute:loop.microbatch"]
    forward = [e.name for evs, _ in build_stage_events(model, looped, topo)[0].chunks[0].forward_segments
               for e in evs]
    assert forward[:4] == ["loop.microbatch"] + ["loop.layer"] * 3
    base = ProfileDB(device="cpu", events_ms={k: 1.0 for k in keys if k not in loop})
    plain = predict_train_step(args, base).iteration_ms
    assert predict_train_step(args, base, loop_overhead=True).iteration_ms == pytest.approx(plain)
    measured = ProfileDB(device="cpu", events_ms={**base.events_ms, loop[1]: 0.5, loop[0]: 0.25})
    assert predict_train_step(args, measured, loop_overhead=True).iteration_ms == pytest.approx(
        plain + 4 * (0.5 + 3 * 0.25))  # 4 micro-batches of 3 layers
    dm = device_model(topo, gpu="h100-sxm")
    assert simulate(model, looped, dm).iteration_ms == pytest.approx(simulate(model, s, dm).iteration_ms)
    # the measured runs: one rank, TP 1, one micro-batch of 1 and 2 layers, same shapes
    plan_run = build_parser().parse_args(TRAIN + ["--tensor-model-parallel-size", "1"])
    one = single_rank_args(plan_run, 2)
    assert (one.num_layers, one.pipeline_model_parallel_size, one.num_layers_per_virtual_pipeline_stage,
            one.global_batch_size, one.nproc_per_node, one.recompute_num_layers, one.hidden_size) == (
        2, 1, None, 2, None, 1, 32)


def test_a_profile_s_prediction_reports_mfu_against_the_card_it_ran_on():
    """On an H100 (2026-11-27) ``sim --predict`` priced a 465 TFLOP/s step against an A100's peak
    (MFU 152.5%): the card of a profile-priced prediction is the profile's."""
    from megatron_oases.pricing.device_model import gpu_of_device_name
    from megatron_oases.sim.frontends.predict import predict_train_step, sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser

    assert [gpu_of_device_name(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                            "NVIDIA A100-SXM4-40GB", "NVIDIA A10", "cpu")] == [
        "h100-sxm", None, "h200-sxm", "a100-40gb", "a10-24gb", None]
    args = build_parser().parse_args(TRAIN + ["--bf16"])  # the tensor cores' peak
    model, s = sim_inputs_from_train_args(args)
    events = {k: 1.0 for k in unique_events(build_stage_events(model, s, local_topology(s.world_size)))}
    mfu = {dev: predict_train_step(args, ProfileDB(device=dev, events_ms=events)).mfu
           for dev in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "cpu")}
    assert mfu["NVIDIA A100-SXM4-80GB"] == pytest.approx(mfu["NVIDIA H100 80GB HBM3"] * 989 / 312)
    assert mfu["cpu"] == mfu["NVIDIA A100-SXM4-80GB"]  # no card: the default one's peak, as before


def test_loop_overhead_is_the_trainer_beyond_its_events_and_nothing_where_it_ran_below_them():
    from megatron_oases.sim.calibrate.loop_overhead import split

    assert split({1: {"trainer_ms": 11.0, "events_ms": 7.0}, 2: {"trainer_ms": 17.0, "events_ms": 11.0}}) == (
        pytest.approx(2.0), pytest.approx(2.0))  # 4 = m + l, 6 = m + 2 l
    assert split({1: {"trainer_ms": 9.0, "events_ms": 7.0}, 2: {"trainer_ms": 12.0, "events_ms": 11.0}}) == (
        pytest.approx(2.0), 0.0)  # the line falls with the layers: no part per layer
    # one H100, hidden 512 (2026-11-27): the trainer faster than its events, one by one
    assert split({1: {"trainer_ms": 5.5482, "events_ms": 7.8}, 2: {"trainer_ms": 8.4981, "events_ms": 10.3784}}) == (0.0, 0.0)
    assert split({1: {"trainer_ms": 5.5876, "events_ms": 6.2149}, 2: {"trainer_ms": 8.2748, "events_ms": 8.0172}}) == (0.0, 0.0)


def test_one_rank_worlds_take_nccl_for_cuda_tensors(monkeypatch):
    """On an H100 (2026-11-27) every loop-overhead run failed in its one-rank gloo world: the
    trainer's gradient all-reduce on CUDA tensors ("ProcessGroupGloo::allreduce_coalesced:
    unsupported device type cuda"). The one-rank world takes NCCL for CUDA tensors, gloo for CPU
    ones, and the loop-overhead run opens it on the run's device."""
    import contextlib

    from megatron_oases import runtime
    from megatron_oases.run_config import RunConfig
    from megatron_oases.sim.calibrate import layer_workloads, loop_overhead

    assert layer_workloads.single_rank_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert layer_workloads.single_rank_backend("cuda:1") == "cpu:gloo,cuda:nccl"
    assert layer_workloads.single_rank_backend("cpu") == "gloo"
    opened = []

    @contextlib.contextmanager
    def world(device="cpu"):
        opened.append(device)
        raise RuntimeError("stop here")
        yield

    monkeypatch.setattr(layer_workloads, "single_rank_world", world)
    monkeypatch.setattr(runtime, "detect_runtime",
                        lambda device=None: runtime.Runtime(device=torch.device("cuda", 0), backend="nccl"))
    with pytest.raises(RuntimeError, match="stop here"):
        loop_overhead.forward_backward_ms(RunConfig(device="cuda"), warmup=0, reps=1, threads=None)
    assert opened == ["cuda"]


def test_profile_format_errors(tmp_path: Path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "megatron-oases-profile/1", "device": "x", "events": {}}))
    with pytest.raises(SimError, match="measure it again"):
        ProfileDB.load(old)
    with pytest.raises(SimError, match="finite numbers"):
        ProfileDB(device="x", events_ms={"k": -1.0})
    a = ProfileDB(device="x", events_ms={"a": 1.0}, sources={"a": "measured"})
    assert a.merged(ProfileDB(device="x", events_ms={"b": 2.0})).events_ms == {"a": 1.0, "b": 2.0}
    with pytest.raises(SimError, match="different devices"):
        a.merged(ProfileDB(device="y", events_ms={}))


def test_missing_link_named():
    topo = load_topology("fig7b-torus")  # ring links only: rank 0 and 2 are not linked
    model = GPTShape(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=64, padded_vocab_size=512,
                     micro_batch_size=2)
    dm = device_model(topo, gpu="a100-80gb")
    with pytest.raises(SimError, match=r"no link between ranks 0 and 2 \(level 'ring'"):
        simulate(model, Strategy(tp=2, dp=8), dm)  # the DP ring 0-2-4-...
    with pytest.raises(SimError, match=r"no link between ranks 0 and 8 \(level 'ring-of-rings'"):
        simulate(model, Strategy(tp=2, pp=2, dp=4, optimizer_step=False), dm)
    with pytest.raises(SimError, match="no link between ranks 0 and 2"):
        simulate(model, Strategy(tp=4, dp=4, backend="atp", layout=atp_layout(2, 2)), dm)
    assert simulate(model, Strategy(tp=4, dp=4), dm).iteration_ms > 0  # the 4-ring 0-1-2-3 is linked


@pytest.mark.parametrize("tp,pp,launch", [(2, 1, "python -m"), (2, 2, "forkserver")], ids=["2-1", "2-2"])
def test_emulated_profiling_ranks_finish_and_merge(tmp_path, tp, pp, launch):
    """The emulated profiler's ranks (run here on plain loopback, no emulator) measure every event
    of an Oases run, overlapped ones too, without deadlocking: with TP 2 alone the TP group is the
    whole world, the group the start barriers would otherwise share with the helper thread's
    collective; with PP 2 each stage runs its own collective beside the other's. TP 2 launches
    each rank as the emulator does (``python -m``, an interpreter and torch's imports each); the
    4 ranks of PP 2 run the same ``rank_main`` on forkserver ranks (``run_on_ranks``, the
    torchrun variables set alike), ~6 s less on 2 cores."""
    import os
    import subprocess
    import sys

    from megatron_oases.runtime.spawn import free_port, run_on_ranks
    from megatron_oases.sim.calibrate.emulated_profile import build_plan, merge_rank_results, rank_main
    from megatron_oases.sim.core.events import overlapped_keys

    s = Strategy(tp=tp, pp=pp, num_microbatches=2, schedule="oases")
    stages = build_stage_events(TINY, s, local_topology(s.world_size))
    events = unique_events(stages)
    plan = build_plan(events, s, warmup=0, reps=1, overlap=overlapped_keys(stages))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    if launch == "forkserver":
        run_on_ranks(rank_main, s.world_size, args=(str(tmp_path / "plan.json"), str(tmp_path)), timeout_s=240)
    else:
        root = str(Path(__file__).resolve().parents[1])
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-m", "megatron_oases.sim.calibrate.emulated_profile",
                                   str(tmp_path / "plan.json"), str(tmp_path)], cwd=root, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": root, "RANK": str(r), "WORLD_SIZE": str(s.world_size),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
                 for r in range(s.world_size)]
        try:
            outs = [p.communicate(timeout=240)[0].decode()[-2000:] for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert all(p.returncode == 0 for p in procs), outs
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(s.world_size)]
    ev, cont, _, ovl = merge_rank_results(plan, per_rank)
    assert set(ev) == set(events) and all(v > 0 for v in ev.values())
    assert set(ovl) == overlapped_keys(stages) & set(events)
    assert sorted(next(iter(cont.values()))) == [tp * j for j in range(1, pp + 1)]


def test_profile_repeats_must_be_positive_and_profiles_combine_by_median(tmp_path, capsys):
    from megatron_oases.sim.frontends.profile_cli import profile_main

    train = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--device", "cpu"]
    out = tmp_path / "p.json"
    assert profile_main(["--out", str(out), "--emulate", "--repeats", "0", "--topology", "local", "--", *train]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err and not out.exists()
    a = ProfileDB(device="cpu", events_ms={"x": 1.0, "y": 5.0}, contention={"x": {2: 1.0, 4: 2.0}}, overlapped={"x": 3.0})
    b = ProfileDB(device="cpu", events_ms={"x": 9.0, "y": 6.0}, contention={"x": {2: 3.0, 4: 2.0}}, overlapped={"x": 1.0})
    c = ProfileDB(device="cpu", events_ms={"x": 2.0, "y": 7.0}, contention={"x": {2: 2.0, 4: 8.0}})
    m = ProfileDB.median_of([a, b, c])
    assert m.events_ms == {"x": 2.0, "y": 6.0} and m.contention == {"x": {2: 2.0, 4: 2.0}}
    assert m.overlapped == {"x": 2.0} and m.meta["profiles_combined"] == 3
    with pytest.raises(SimError, match="different devices"):
        ProfileDB.median_of([a, ProfileDB(device="cuda", events_ms={})])


@pytest.mark.parametrize("schedule", [[], ["--schedule", "oases"], ["--recompute-granularity", "selective"]],
                         ids=["stock", "oases", "stock-selective-recompute"])
def test_profile_and_predict_a_llama_style_run(tmp_path: Path, schedule):
    """GQA, SwiGLU, RMSNorm, no bias, RoPE and QK-norm: the events carry the variant in their keys
    and dims, the profiler builds that Megatron layer (QK-norm, the rotary table; under selective
    recompute its core attention with grouped keys and values alone), and the prediction prices
    it."""
    from megatron_oases.sim.frontends.predict import predict_train_step, profile_train_args, sim_inputs_from_train_args
    from megatron_oases.sim.calibrate.profiler import ProfileSettings
    from megatron_oases.train_args import build_parser

    argv = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "64", "--normalization", "RMSNorm",
            "--disable-bias-linear", "--position-embedding-type", "rope", "--qk-layernorm", "--seq-length", "16",
            "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu",
            *schedule]
    args = build_parser().parse_args(argv)
    model, _ = sim_inputs_from_train_args(args)
    v = model.variant
    assert v.query_groups == 2 and v.gated and not v.bias and v.rotary and v.qk_norm
    db = profile_train_args(args, settings=ProfileSettings(nproc=2, warmup=0, reps=1, threads=1))
    assert any("_g2_swiglu_rms_nobias_rope_qkn" in k for k in db.events_ms)
    assert any(k.startswith("compute:attention.core[") for k in db.events_ms) == ("selective" in schedule)
    assert predict_train_step(args, db).iteration_ms > 0


def test_host_issue_times_merge_per_event_and_cpu_times_are_their_own_host_part():
    """``meta.host_issue_ms`` (GPU profiles: the host's part of each compute event) merges per
    event as ``events`` does; on CPU an event's host part is its whole time."""
    from megatron_oases.sim.calibrate.profiler import time_ms_and_host

    a = ProfileDB(device="gpu", events_ms={"x": 1.0}, meta={"host_issue_ms": {"x": 0.2}, "reps": 5})
    b = ProfileDB(device="gpu", events_ms={"y": 2.0}, meta={"host_issue_ms": {"y": 1.9}, "reps": 10})
    m = a.merged(b)
    assert m.meta["host_issue_ms"] == {"x": 0.2, "y": 1.9} and m.meta["reps"] == 10
    ms, host = time_ms_and_host(lambda: torch.ones(64).sum(), warmup=1, reps=3, device=torch.device("cpu"))
    assert ms == host > 0


def test_layer_events_name_the_executor_as_the_trainer_and_old_plans_still_run():
    """A layer event's ``exec`` dim is the trainer's ``--schedule`` value (default | oases); profile
    plans written before say ``stock`` for default and still run; anything else is refused."""
    from megatron_oases.sim.calibrate.layer_workloads import single_rank_world
    from megatron_oases.sim.calibrate.workloads import compute_workload

    for schedule in ("default", "oases"):
        events = unique_events(build_stage_events(TINY, Strategy(tp=2, schedule=schedule), local_topology(2)))
        (mlp,) = [e for e in events.values() if e.kind == "compute" and e.name == "mlp"]
        assert dict(mlp.dims)["exec"] == schedule
    dims = dict(mlp.dims)
    with single_rank_world():
        compute_workload("mlp", {**dims, "exec": "stock"}, torch.device("cpu"))()
        with pytest.raises(SimError, match="default, oases"):
            compute_workload("mlp", {**dims, "exec": "none"}, torch.device("cpu"))()
