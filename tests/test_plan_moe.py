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


@pytest.mark.parametrize("tp, ep", [(1, 4), (2, 2)])
def test_the_blocking_count_gather_is_compute_in_plan_as_in_sim(tp, ep):
    """Under the Oases executor the MoE block's gather of the token counts is blocking
    (``describe.moe.moe_block(oases=True)``: the host reads the counts): the simulator runs it on
    the compute stream, so it overlaps nothing of the other sub-batch, and the planner's lock-step
    counts it in the block's compute C, not in its collectives M (``describe.ops.holds_compute``):
    per pass, C and M are the simulator's prices of that block's events on each stream."""
    from megatron_oases.sim.core.timeline import _stream

    m = _model(_moe(dispatcher="alltoall"), ep=ep, num_layers=1, tp=tp, sequence_parallel=tp > 1, sub_batches=2)
    cm, _ = _cost(m)
    shape, st = _sim_inputs(m, schedule="oases")
    topo = load_topology(TOPO)
    chunk = build_stage_events(shape, st, topo)[0].chunks[0]
    dm = device_model(topo, bytes_per_element=m.bytes_per_element)
    c = cm.costs[("moe", 0)]
    for segments, (want_c, want_m) in ((chunk.forward_segments, (c.c_fwd, c.m_fwd)),
                                       (chunk.backward_segments, (c.c_bwd, c.m_bwd))):
        events = [e for evs, chains in segments if chains == 2 for e in evs if "moe." in e.key]
        assert any(getattr(e.op, "blocking", False) for e in events) == (segments is chunk.forward_segments)
        on = {"compute": 0.0, "comm": 0.0}
        for e in events:
            on[_stream(e)] += dm.price(e.key, e.op, kind=e.kind, nbytes=e.nbytes, ranks=e.ranks)
        assert (on["compute"], on["comm"]) == (pytest.approx(want_c), pytest.approx(want_m))


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


@pytest.fixture(scope="module")
def slow_link(tmp_path_factory):
    """2 nodes x 4 H100s joined at 1 GB/s: EP 8 at TP 1 crosses it, so the all-to-alls outlast the
    compute they overlap and the join's lost overlap shows in the step."""
    from benchmarks.harness import topology_yaml, write_topology

    return load_topology(write_topology(str(tmp_path_factory.mktemp("topo")), "two1", topology_yaml(
        "two1", "2 x 4", [("nv", 4, "intra_node", 450, 2), ("ib", 2, "inter_node", 1, 5)], "h100-sxm")))


@pytest.mark.parametrize("types", ["aux_loss", "none"])
def test_plan_reads_the_aux_loss_flags_as_sim_and_prices_the_join_where_sim_cuts(types, slow_link):
    """``--moe-router-load-balancing-type`` / ``--moe-aux-loss-coeff`` (issue 51 item 3): plan's model
    file reads them into the MoEShape ``sim``'s flags give (and writes them back); under Oases at
    TP 1 x EP 8 with the aux loss the sub-batches join after routing: plan's MoE events are sim's,
    the block's part up to the join is what sim's first forward segment holds of it, and the step
    costs more than with ``none``, where nothing joins."""
    from megatron_oases.plan.model import model_from_mapping
    from megatron_oases.sim.frontends.cli import build_parser, moe_from_args

    flags = {"num_experts": 8, "moe_token_dispatcher_type": "alltoall", "moe_aux_loss_coeff": 0.01}
    base = dict(num_layers=1, hidden_size=1024, num_attention_heads=8, seq_length=512, micro_batch_size=2, tp=1,
                sub_batches=2, vocab_size=1024, add_bias_linear=False, **flags)
    steps = {}
    for t in ("aux_loss", "none"):
        m = model_from_mapping({**base, "moe_router_load_balancing_type": t}, expert_model_parallel_size=8)
        pricer = DevicePricer(topology=slow_link, model=m)
        cm = build_cost_model(m, topology=slow_link, global_batch_size=16, pricer=pricer)
        steps[t] = evaluate(cm.problem, cm.uniform(1))[0]
        if t == types:
            ours, joined = pricer, cm.costs[("moe", 0)].fwd_joined
            mine = m
    sim_args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    assert mine.moe == moe_from_args(build_parser().parse_args(
        ["--hidden-size", "1024", *sim_args, "--moe-router-load-balancing-type", types]))
    assert model_from_mapping(mine.to_dict()).moe == mine.moe
    shape, st = _sim_inputs(mine, schedule="oases")
    st = dataclasses.replace(st, dp=8, ep=8, num_microbatches=1)
    chunk = build_stage_events(shape, st, slow_link)[0].chunks[0]
    segments = [evs for evs, chains in chunk.forward_segments if chains == 2]
    sim = {e.key: e for evs, _ in (*chunk.forward_segments, *chunk.backward_segments) for e in evs}
    for k in (k for k in ours.events if "moe." in k):
        assert (ours.events[k].dims, ours.events[k].nbytes) == (sim[k].dims, sim[k].nbytes), k
    if types == "none":
        assert joined is None and len(segments) == 1
        return
    dm = device_model(slow_link, bytes_per_element=mine.bytes_per_element)
    before = [e for e in segments[0] if "moe." in e.key]
    assert [e.name for e in before] == ["moe.route"]
    assert joined[0] + joined[1] == pytest.approx(sum(dm.price(e.key, e.op, kind=e.kind, nbytes=e.nbytes,
                                                               ranks=e.ranks) for e in before))
    assert steps["aux_loss"] > steps["none"]


def test_plans_kept_bytes_at_tp1_ep2_under_oases_recompute_are_the_descriptions():
    """At TP 1 x EP 2 under the Oases fine-grained recompute, plan keeps per MoE layer
    ``describe.moe_oases``'s figure (pinned to the trainer by ``tests/test_moe_description.py``, and
    sim's by ``tests/test_sim_moe_oases.py``) and per dense layer of the run (``--moe-layer-freq 2``)
    only its input (``describe.split.recompute_boundaries`` at TP 1: one-rank collectives keep
    no output), as sim does."""
    from megatron_oases.describe.moe_oases import oases_moe_layer_kept_bytes

    m = _model(_moe(layer_freq=2, dispatcher="alltoall"), ep=2, tp=1, sequence_parallel=False, sub_batches=2,
               recompute=True)
    assert m.sub_batches == 2 and m.fine_grained
    cm, _ = _cost(m)
    rows = cm.breakdown(cm.uniform(1))
    per_layer = [sum(r["saved_bytes"] for r in rows if r["layer"] == i) for i in (0, 1)]
    figure = oases_moe_layer_kept_bytes(micro_batch=m.micro_batch_size, seq=m.seq_length, hidden=m.hidden_size,
                                        heads=m.num_attention_heads, ffn=m.ffn_hidden_size, moe=m.moe, tp=1, ep=2,
                                        bytes_per_element=m.bytes_per_element, variant=m.variant,
                                        sequence_parallel=False)
    dense_input = m.micro_batch_size * m.seq_length * m.hidden_size * m.bytes_per_element
    assert per_layer == [pytest.approx(figure), pytest.approx(dense_input)]


@pytest.mark.parametrize("recompute, dropout", [(False, 0.0), (True, 0.0), (True, 0.1)],
                         ids=["no-recompute", "fine-grained", "fine-grained-dropout"])
def test_a_dense_layer_of_an_moe_run_at_tp1_keeps_alike_in_plan_sim_and_describe_saved(recompute, dropout):
    """A dense layer of an MoE run at TP 1 x EP 2 (``--moe-layer-freq 2``) runs in the Oases
    executor, split (``describe.split.oases_splits``): without recompute it keeps stock's inventory
    and what each further sub-batch's attention call builds anew (RoPE's tables here), under
    fine-grained recompute its input only, and with dropout a generator state per dropout site
    (``describe.saved.redraw_state_bytes``); plan, sim and ``describe.saved`` agree (the trainer's
    bytes for all three: ``tests/test_moe_description.py``'s ``moe-ep2-oases-dense-layer`` rows)."""
    from megatron_oases.describe.saved import layer_saved_bytes
    from megatron_oases.describe.shapes import variant_from_flags
    from megatron_oases.sim.core.memory import chunk_activation_bytes

    variant = variant_from_flags(add_bias_linear=False, position_embedding_type="rope")
    m = dataclasses.replace(_model(_moe(layer_freq=2, dispatcher="alltoall"), ep=2, tp=1, sequence_parallel=False,
                                   sub_batches=2, recompute=recompute, hidden_dropout=dropout,
                                   attention_dropout=dropout), variant=variant)
    cm, _ = _cost(m)
    plan = sum(r["saved_bytes"] for r in cm.breakdown(cm.uniform(1)) if r["layer"] == 1)
    shape, st = _sim_inputs(m, schedule="oases", recompute=recompute)
    per = {}
    for n in (1, 2):
        sn = dataclasses.replace(shape, num_layers=n)
        per[n] = chunk_activation_bytes(sn, st, build_stage_events(sn, st, load_topology(TOPO))[0].chunks[0])[0]
    described = layer_saved_bytes(schedule="oases", recompute=recompute, b=m.micro_batch_size, s=m.seq_length,
                                  h=m.hidden_size, a=m.num_attention_heads, f=m.ffn_hidden_size, t=1,
                                  e=m.bytes_per_element, hidden_dropout=m.hidden_dropout > 0,
                                  attention_dropout=m.attention_dropout > 0, variant=variant,
                                  core_attention=m.core_attention, expert_parallel=2)
    stock = layer_saved_bytes(recompute=recompute, b=m.micro_batch_size, s=m.seq_length, h=m.hidden_size,
                              a=m.num_attention_heads, f=m.ffn_hidden_size, t=1, e=m.bytes_per_element,
                              hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
                              variant=variant, core_attention=m.core_attention)
    assert plan == pytest.approx(per[2] - per[1]) and described == pytest.approx(plan)
    assert (described > stock) == (not recompute or dropout > 0)  # the redraw's states under recompute
