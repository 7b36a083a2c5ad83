"""The planner prices MoE blocks (issue 51 item 3, ``plan/moe_blocks.py``): from ``describe.moe``
as ``sim`` does (same events, ranks, bytes and milliseconds; the same saved bytes and model states
beyond the dense twin), above the dense twin, and only what the trainer runs for MoE (the uniform
degree T, Megatron's modules, the default executor at TP > 1), with the trainer's refusals."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_oases.describe.moe import MoEShape
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.plan.cost_model import build_cost_model
from megatron_oases.plan.graph import PlanModel
from megatron_oases.plan.ilp import evaluate
from megatron_oases.plan.pricing import DevicePricer
from megatron_oases.pricing.device_model import device_model
from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import load_topology

TOPO = "dgx-a100"  # 8 ranks: TP 2 x DP 4, EP 2 (expert-DP 2)
BASE = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128, micro_batch_size=2, tp=2,
            sequence_parallel=True, sub_batches=1, padded_vocab_size=1024)


def _model(moe: MoEShape | None = None, *, ep: int = 1, **kw) -> PlanModel:
    from megatron_oases.describe.shapes import variant_from_flags

    return PlanModel(**{**BASE, **kw}, variant=variant_from_flags(add_bias_linear=False), moe=moe, ep=ep)


def _moe(**kw) -> MoEShape:
    return MoEShape(**{"num_experts": 8, "ffn": 1024, "topk": 2, **kw})


def _cost(m: PlanModel, **kw):
    topo = load_topology(TOPO)
    pricer = DevicePricer(topology=topo, model=m)
    return build_cost_model(m, topology=topo, global_batch_size=16, pricer=pricer, **kw), pricer


def _sim_inputs(m: PlanModel, **kw) -> tuple[GPTShape, Strategy]:
    shape = GPTShape(**{f.name: getattr(m, f.name) for f in dataclasses.fields(GPTShape)})
    return shape, Strategy(tp=m.tp, dp=8 // m.tp, ep=m.ep, num_microbatches=16 // (8 // m.tp * m.micro_batch_size),
                           sequence_parallel=m.sequence_parallel, **kw)


def test_eight_experts_are_priced_above_the_dense_twin_and_every_other_layer_between():
    times = {}
    for name, moe in (("dense", None), ("half", _moe(layer_freq=2)), ("moe", _moe())):
        cm, _ = _cost(_model(moe, ep=2 if moe else 1))
        assert [b.kind for b in cm.blocks] == {"dense": ["attention", "mlp"] * 2, "half": [
            "attention", "moe", "attention", "mlp"], "moe": ["attention", "moe"] * 2}[name]
        assert [s.label for s in cm.strategies] == ["tp2"]  # the trainer runs MoE at the uniform degree T only
        times[name] = evaluate(cm.problem, cm.uniform(2))
    assert times["dense"][0] < times["half"][0] < times["moe"][0]  # top-2 experts, the dispatcher's gathers
    assert times["dense"][1] < times["half"][1] < times["moe"][1]  # 4 experts a rank, each the twin's MLP


@pytest.mark.parametrize("dispatcher, tp, ep, oases", [("alltoall", 2, 2, False), ("allgather", 2, 2, False),
                                                      ("allgather", 1, 4, False), ("alltoall", 2, 2, True),
                                                      ("alltoall", 1, 4, True)])
def test_moe_block_prices_the_simulators_events(dispatcher, tp, ep, oases):
    """Every MoE event the planner prices is one the simulator builds (key, dims, bytes, ranks:
    the EP and TP x EP groups placed alike), and the MoE block's time is the sum of the
    simulator's prices of that block's events (stock executor: run one after another; under the
    Oases executor its tape's steps, one sub-batch's)."""
    m = _model(_moe(dispatcher=dispatcher), ep=ep, num_layers=1, tp=tp, sequence_parallel=tp > 1,
               sub_batches=2 if oases else 1)
    cm, pricer = _cost(m)
    shape, st = _sim_inputs(m, schedule="oases" if oases else "default")
    topo = load_topology(TOPO)
    stage = build_stage_events(shape, st, topo)[0]
    sim = {e.key: e for ch in stage.chunks for seg in (*ch.forward_segments, *ch.backward_segments)
           for e in seg[0]}
    ours = [k for k in pricer.events if "moe." in k]
    assert any(k.startswith("all_to_all:moe.dispatch[" if dispatcher == "alltoall" else "all_gather:moe.ag[")
               for k in ours), ours
    assert any(k.startswith("compute:moe.permute[") for k in ours) == oases
    for k in ours:
        assert k in sim, (k, sorted(s for s in sim if "moe." in s))
        got, want = pricer.events[k], sim[k]
        assert (got.dims, got.nbytes, got.ranks) == (want.dims, want.nbytes, want.ranks), k
    dm = device_model(topo, bytes_per_element=m.bytes_per_element)
    want_ms = sum(dm.price(k, e.op, kind=e.kind, nbytes=e.nbytes, ranks=e.ranks) for k, e in sim.items() if "moe." in k)
    c = cm.costs[("moe", 0)]
    assert c.c_fwd + c.m_fwd + c.c_bwd + c.m_bwd == pytest.approx(want_ms)


@pytest.mark.parametrize("recompute, tp", [(False, 2), (True, 2), ("oases", 2)],
                         ids=["no-recompute", "full-recompute", "oases-fine-grained"])
def test_moe_memory_beyond_the_dense_twin_is_the_simulators(recompute, tp):
    """The MoE model's model states (experts over EP, their Adam states over expert-DP under the
    distributed optimizer) and saved bytes per micro-batch exceed the dense twin's by what the
    simulator counts (``sim.core.memory.stage_memory``); under the Oases executor's fine-grained
    recompute a recomputed MoE layer keeps its forward collectives' outputs."""
    oases = recompute == "oases"
    kw = dict(distributed_optimizer=True, recompute=bool(recompute))
    plan, sim = {}, {}
    for name, moe in (("dense", None), ("moe", _moe(layer_freq=2, dispatcher="alltoall"))):
        m = _model(moe, ep=2 if moe else 1, tp=tp, sequence_parallel=tp > 1, sub_batches=2 if oases else 1, **kw)
        cm, _ = _cost(m)
        rows = cm.breakdown(cm.uniform(tp))
        plan[name] = (sum(r["state_bytes"] for r in rows), sum(r["saved_bytes"] for r in rows))
        shape, st = _sim_inputs(m, schedule="oases" if oases else "default", **kw)
        mem = simulate(shape, st, device_model(load_topology(TOPO)), timeline=False).memory[0]
        from megatron_oases.sim.core.memory import chunk_activation_bytes

        stage = build_stage_events(shape, st, load_topology(TOPO))[0]
        sim[name] = (mem.weights + mem.grads + mem.optimizer, chunk_activation_bytes(shape, st, stage.chunks[0])[0])
    for i in (0, 1):
        assert plan["moe"][i] - plan["dense"][i] == pytest.approx(sim["moe"][i] - sim["dense"][i]), i
    assert plan["moe"][0] > plan["dense"][0]


@pytest.mark.parametrize("extra, needle", [
    (["--families", "atp"], "--num-experts: --families atp does not run Megatron-Core's MoE layers"),
    (["--degrees", "1"], "--num-experts: the trainer runs MoE at the uniform degree 2 only"),
    (["--schedule", "oases"], "--schedule oases overlaps MoE layers' all-to-alls"),
    (["--ep", "8"], "--expert-model-parallel-size 8 must divide the data-parallel size 4"),
    (["--ep", "3"], "--expert-model-parallel-size 3 must divide --num-experts 8"),
    (["-" "--disable-bias-linear"], "needs --disable-bias-linear"),
    (["-" "--sequence-parallel"], "needs --sequence-parallel"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type must be one of allgather, alltoall"),
], ids=["atp", "degrees", "oases", "ep-dp", "ep-experts", "bias", "no-sp", "flex"])
def test_plan_refuses_what_the_trainer_does_not_run_for_moe_in_one_line(tmp_path, capsys, extra, needle):
    from megatron_oases.plan.plan_cli import plan_main

    """``extra``: flags added, or with a leading ``-`` left out of the launch that plans."""
    moe = [f for f in ["--num-experts", "8", "--sequence-parallel", "--disable-bias-linear"] if "-" + f not in extra]
    extra = [f for f in extra if not f.startswith("---")]
    assert plan_main([*_CLI, *moe, *extra, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_moe_flags_without_experts_are_one_line(tmp_path, capsys):
    from megatron_oases.plan.plan_cli import plan_main

    for flag in (["--ep", "2"], ["--moe-router-topk", "4"]):
        assert plan_main([*_CLI, *flag, "--out", str(tmp_path / "p.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{flag[0] if flag[0] != '--ep' else '--expert-model-parallel-size'} takes effect with MoE " \
               f"layers only" in err and len(err.splitlines()) == 1


_TRAIN = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
          "--micro-batch-size", "2", "--global-batch-size", "16", "--tensor-model-parallel-size", "2"]
_CLI = [*_TRAIN, "--topology", TOPO, "--quiet"]


def test_an_moe_plan_launches_without_oases_plan_and_the_trainer_takes_it(tmp_path, capsys):
    """The plan file records the MoE flags (read back as the same model) and its launch is uniform
    TP without ``--oases-plan`` (which the trainer refuses with MoE); the trainer accepts that launch."""
    from megatron_oases.plan.model import model_from_mapping
    from megatron_oases.plan.plan_cli import plan_main
    from megatron_oases.plan.plan_file import plan_launch_flags
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    out = tmp_path / "p.json"
    moe = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-layer-freq", "2",
           "--moe-token-dispatcher-type", "alltoall", "--sequence-parallel", "--disable-bias-linear"]
    assert plan_main([*_CLI, *moe, "--out", str(out)]) == 0, capsys.readouterr().err
    assert "without --oases-plan (which refuses MoE)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    m = model_from_mapping(data["inputs"]["model"])
    assert m.moe == MoEShape(num_experts=8, ffn=1024, topk=2, layer_freq=2, dispatcher="alltoall") and m.ep == 2
    assert [b["kind"] for b in data["predicted"]["blocks"]] == ["attention", "moe", "attention", "mlp"]
    flags = plan_launch_flags(data, str(out))
    assert flags == {"--tensor-model-parallel-size": "2", "--oases-plan": None, "--schedule": None}
    validate_config(run_config(build_parser().parse_args([*_TRAIN, *moe, "--nproc-per-node", "8"])), 8, cuda=False)


@pytest.mark.parametrize("dispatcher, tp, ep, freq", [("alltoall", 2, 2, 1), ("allgather", 2, 2, 2),
                                                      ("alltoall", 1, 4, 1)])
def test_moe_step_beyond_the_dense_twin_is_the_simulators(dispatcher, tp, ep, freq):
    """Per micro-batch, what the MoE layers add to the dense twin's step is what ``sim`` adds (its
    forward and backward templates; the embedding and logits, which the planner leaves out, cancel).
    Both run the stock executor's events one after another at the same prices; the simulator's
    templates let the host issue ahead of the GPU (``timeline.host_splits``), hiding part of the
    experts' kernel launches, which the planner charges whole (measured 2026-11-29: the planner
    0.5%, 0.8% and 1.3% above)."""
    plan, sim = {}, {}
    for name, moe in (("dense", None), ("moe", _moe(dispatcher=dispatcher, layer_freq=freq))):
        m = _model(moe, ep=ep if moe else 1, tp=tp, sequence_parallel=tp > 1)
        cm, _ = _cost(m)
        plan[name] = evaluate(cm.problem, cm.uniform(tp))[0] / cm.num_microbatches
        shape, st = _sim_inputs(m)
        r = simulate(shape, st, device_model(load_topology(TOPO)), timeline=False)
        sim[name] = sum(f.duration + b.duration for f, b in r.templates[0])
    added_plan, added_sim = plan["moe"] - plan["dense"], sim["moe"] - sim["dense"]
    assert added_sim > 0 and added_sim <= added_plan <= 1.02 * added_sim, (added_plan, added_sim)
