"""``sim --predict`` for per-block plans (``--oases-plan``) and the 3-D cube: the events each block
runs at its degree, the reshards between degrees (the planner's description), the replica
gradient sums, and profiles measured on this machine."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_oases.describe.planned import degree_reshard
from megatron_oases.describe.registry import block_param_tensors, layer_param_tensors
from megatron_oases.pricing.device_model import ProfileDB, SimError
from megatron_oases.sim.core.events import build_stage_events, unique_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.calibrate.profiler import ProfileSettings, local_topology

TRAIN = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--device", "cpu"]
OASES = ["--schedule", "oases"]
TINY_PROFILE = ProfileSettings(nproc=2, warmup=0, reps=1, threads=1)


def _args(tmp_path: Path, degrees=None, extra=(), layers: int = 2):
    from megatron_oases.train_args import build_parser

    argv = [*TRAIN, "--num-layers", str(layers), *extra]
    if degrees is not None:
        plan = tmp_path / f"plan{''.join(map(str, degrees))}.json"
        plan.write_text(json.dumps({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": 2,
                                    "num_layers": layers, "degrees": list(degrees)}))
        argv += ["--oases-plan", str(plan)]
    return build_parser().parse_args(argv)


def _stages(args):
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args

    model, strategy = sim_inputs_from_train_args(args)
    return model, strategy, build_stage_events(model, strategy, local_topology(strategy.world_size))


def _varied_profile(stages) -> ProfileDB:
    """Every event its own made-up price (no timing), so two runs agree only if their events do."""
    return ProfileDB(device="cpu", events_ms={k: 0.1 + (sum(map(ord, k)) % 97) / 10
                                               for k in unique_events(stages)})


@pytest.mark.parametrize("schedule", [[], OASES], ids=["stock", "oases"])
def test_a_plan_predicts_from_a_profile_measured_here(tmp_path: Path, schedule):
    from megatron_oases.sim.frontends.predict import predict_train_step, profile_train_args

    args = _args(tmp_path, [1, 2, 2, 1], schedule)
    db = profile_train_args(args, settings=TINY_PROFILE)
    assert any(k.startswith("all_gather:reshard.ag") for k in db.events_ms)
    assert any(k.startswith("all_reduce:replica_grad.ar") for k in db.events_ms)
    r = predict_train_step(args, db)
    assert r.iteration_ms > 0 and r.strategy.block_degrees == (1, 2, 2, 1)


def test_a_degree_1_block_runs_a_degree_1_layer_on_its_replica_s_share(tmp_path: Path):
    model, strategy, stages = _stages(_args(tmp_path, [1, 2, 2, 1]))
    # the same layer at TP 1 on b * 1 / T = 2 samples, without a plan
    ref_model = dataclasses.replace(model, micro_batch_size=model.micro_batch_size // 2)
    ref = build_stage_events(ref_model, Strategy(tp=1, num_microbatches=1), local_topology(1))
    want = {e.name: e.key for e in ref[0].forward + ref[0].backward if e.name.startswith(("attention", "mlp"))}
    fwd, bwd = stages[0].forward, stages[0].backward
    layer0_attention = next(e for e in fwd if e.name == "attention")
    layer1_mlp = [e for e in fwd if e.name == "mlp"][-1]
    assert layer0_attention.key == want["attention"] and layer1_mlp.key == want["mlp"]
    assert dict(layer0_attention.dims)["b"] == 2 and dict(layer0_attention.dims)["t"] == 1
    assert [e for e in bwd if e.name == "attention.bwd"][-1].key == want["attention.bwd"]
    assert next(e for e in bwd if e.name == "mlp.bwd").key == want["mlp.bwd"]
    # the degree-2 blocks run the TP-2 layer on the whole micro-batch
    assert dict([e for e in fwd if e.name == "attention"][-1].dims)["b"] == 4
    # the degree-1 blocks' gradients are summed over their 2 replicas, in fp32
    t1 = layer_param_tensors("megatron", 32, 128, 1, None, heads=4)
    (ar,) = stages[0].replica_allreduce
    assert ar.nbytes == 4 * (sum(block_param_tensors("attention", t1)) + sum(block_param_tensors("mlp", t1)))
    assert ar.ranks == (0, 1)


@pytest.mark.parametrize("schedule", [[], OASES], ids=["stock", "oases"])
def test_plan_reshards_carry_the_description_s_bytes(tmp_path: Path, schedule):
    model, strategy, stages = _stages(_args(tmp_path, [1, 2, 2, 1], schedule))
    kw = dict(tp=2, micro_batch=4, seq=16, hidden=32, bytes_per_element=model.bytes_per_element)
    up, down = degree_reshard(1, 2, **kw), degree_reshard(2, 1, **kw)
    assert up.forward is not None and down.backward is not None
    fwd = [e for e in stages[0].forward if e.name == "reshard.ag"]
    bwd = [e for e in stages[0].backward if e.name == "reshard.ag"]
    # forward: layer 0 attention (1) -> mlp (2), layer 1 mlp (1) -> the output layer (T)
    assert [(e.nbytes, e.ranks) for e in fwd] == [(up.forward.payload_bytes, up.ranks)] * 2
    # backward: the input gradients of layer 1's mlp (from 2) and layer 0's attention (from T)
    assert [(e.nbytes, e.ranks) for e in bwd] == [(down.backward.payload_bytes, down.ranks)] * 2
    # outside the Oases executor: one chain each
    for ch in stages[0].chunks:
        for evs, chains in (*ch.forward_segments, *ch.backward_segments):
            assert chains == 1 or all(e.name != "reshard.ag" for e in evs)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("schedule", [[], OASES], ids=["stock", "oases"])
def test_a_uniform_plan_predicts_the_run_without_a_plan(tmp_path: Path, schedule, pp):
    from megatron_oases.sim.frontends.predict import predict_train_step

    extra = [*schedule, "--pipeline-model-parallel-size", str(pp), "--nproc-per-node", str(2 * pp)]
    plain = _args(tmp_path, None, extra)
    uniform = _args(tmp_path, [2] * 4, extra)
    db = _varied_profile(_stages(plain)[2])
    a, b = predict_train_step(plain, db), predict_train_step(uniform, db)  # every event already in db
    assert b.iteration_ms == pytest.approx(a.iteration_ms, rel=1e-6)


def test_plan_flags_the_simulator_does_not_model(tmp_path: Path):
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args

    args = _args(tmp_path, [1, 2, 2, 1], ["--recompute-granularity", "full", "--recompute-method", "uniform"])
    with pytest.raises(SimError, match="--oases-plan with --recompute-granularity full"):
        sim_inputs_from_train_args(args)
    with pytest.raises(SimError, match="--oases-plan: degree 3"):
        Strategy(tp=2, block_degrees=(3, 2))


def test_the_cube_profiles_and_predicts_here():
    """3-D: the cube's compute events run as a cube rank's local blocks; its collectives (lines of
    p = 2 ranks) are measured on the 2 ranks at hand."""
    from megatron_oases.sim.frontends.predict import predict_train_step, profile_train_args
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args([
        "--nproc-per-node", "8", "--tensor-model-parallel-size", "8", "--tp-backend", "3d", "--num-layers", "1",
        "--hidden-size", "32", "--num-attention-heads", "8", "--seq-length", "16", "--vocab-size", "100",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--device", "cpu"])
    db = profile_train_args(args, settings=TINY_PROFILE)
    assert any(k.startswith("compute:3d.qkv.bwd") for k in db.events_ms)
    assert any("@cube_y" in k for k in db.events_ms)
    r = predict_train_step(args, db)
    assert r.iteration_ms > 0 and r.strategy.backend == "3d"
