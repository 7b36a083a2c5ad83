"""sim prices the Oases executor over MoE layers (issue 51 item 3) from ``describe.moe``'s MoE
block as the executor's tape runs it (``schedules/oases/moe_tape.py``): route and permute as two
steps with the blocking token-count gather between them, the sub-batches joined after routing when
the load-balancing loss is on, the dispatch and combine all-to-alls of one sub-batch overlapping
the other's compute, fine-grained recompute keeping every forward collective's output and issuing
none. Analytical prices only; each test well under a second."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks.harness import topology_yaml, write_topology
from megatron_oases.describe.moe import MoEShape, moe_block, moe_layer
from megatron_oases.describe.moe_oases import oases_moe_layer_kept_bytes
from megatron_oases.describe.ops import GPT2, Collective, LayerVariant
from megatron_oases.describe.registry import layer_description
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.pricing.device_model import device_model
from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.core.memory import chunk_activation_bytes
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import run_template, simulate
from megatron_oases.topology import load_topology

B, S, H, E, K, F = 4, 2048, 4096, 8, 2, 8192
MODEL = dict(num_layers=4, hidden_size=H, num_attention_heads=32, seq_length=S, micro_batch_size=B,
             ffn_hidden_size=F, variant=LayerVariant(bias=False), dtype="bf16")


def _moe(aux_loss=True) -> MoEShape:
    return MoEShape(num_experts=E, ffn=F, topk=K, dispatcher="alltoall", aux_loss=aux_loss)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """2 nodes x 4 H100s; the nodes' link at ``GB/s`` (EP 8 at TP 1, EP 4 at TP 2: across them)."""
    tmp = str(tmp_path_factory.mktemp("topo"))

    def at(gbps: float):
        return load_topology(write_topology(tmp, f"two{gbps:g}", topology_yaml(
            f"two{gbps:g}", "2 x 4", [("nv", 4, "intra_node", 450, 2), ("ib", 2, "inter_node", gbps, 5)], "h100-sxm")))
    return at


def _strategy(tp: int, schedule: str) -> Strategy:
    return Strategy(tp=tp, dp=8 // tp, ep=8 // tp, sequence_parallel=tp > 1, schedule=schedule, recompute=True)


@pytest.mark.parametrize("t,ep", [(1, 2), (2, 4)])
def test_the_oases_block_is_stocks_work_in_the_tapes_steps(t, ep):
    """Under Oases the router is route + permute (the same work), the counts' gather between them
    and blocking; every collective as stock's."""
    kw = dict(micro_batch=B, seq=S, hidden=H, moe=_moe(), tp=t, ep=ep, bytes_per_element=2, variant=GPT2)
    (stock_f, stock_b), (oases_f, oases_b) = moe_block(**kw), moe_block(**kw, oases=True)
    names = [op.name for op in oases_f]
    assert names[:3] == ["moe.route", "moe.ag.counts", "moe.permute"] and oases_f[1].blocking
    colls = lambda ops: [op for op in ops if isinstance(op, Collective)]  # noqa: E731
    assert colls(oases_f) == colls(stock_f) and colls(oases_b) == colls(stock_b)
    for p_stock, p_oases in ((stock_f, oases_f), (stock_b, oases_b)):
        for what in ("gemm_flops", "elementwise_bytes", "kernels"):
            assert sum(getattr(op, what, 0) for op in p_oases) == sum(getattr(op, what, 0) for op in p_stock)


def test_the_sub_batches_join_after_routing_only_with_the_aux_loss():
    dense = layer_description(backend="megatron", layout=None, micro_batch=B // 2, seq=S, hidden=H, heads=32, ffn=F,
                              tp=2, bytes_per_element=2, sequence_parallel=True, schedule="oases")
    kw = dict(micro_batch=B // 2, seq=S, hidden=H, tp=2, ep=4, bytes_per_element=2, variant=GPT2, oases=True)
    with_aux, without = moe_layer(dense, moe=_moe(), **kw), moe_layer(dense, moe=_moe(False), **kw)
    assert [with_aux.forward[j].name for j in with_aux.joins] == ["moe.route"] and without.joins == ()
    assert moe_layer(dense, moe=_moe(), **{**kw, "oases": False}).joins == ()


@pytest.mark.parametrize("tp", [1, 2])
def test_sims_collectives_under_oases_are_the_descriptions(tp, two_nodes):
    """Per MoE layer and sub-batch, sim's forward and backward collectives (name, kind, group size,
    bytes) are the Oases description's; fine-grained recompute issues none; with the aux loss the
    forward is cut after each layer's routing."""
    m, s = GPTShape(**MODEL, moe=_moe()), _strategy(tp, "oases")
    desc = layer_description(backend="megatron", layout=None, micro_batch=B // 2, seq=S, hidden=H, heads=32, ffn=F,
                             tp=tp, bytes_per_element=2, variant=m.variant, sequence_parallel=tp > 1,
                             schedule="oases", moe=m.moe, ep=s.ep)
    chunk = build_stage_events(m, s, two_nodes(50))[0].chunks[0]
    sig = lambda ops: [(c.name, c.kind, c.group_size, c.payload_bytes) for c in ops]  # noqa: E731
    fwd = [ev.op for ev in chunk.forward if ev.name.startswith(("moe.", "attention."))]
    bwd = [ev.op for ev in chunk.backward if ev.name.startswith(("moe.", "attention."))]
    for got, pass_ in ((fwd, "forward"), (bwd, "backward")):
        mine = sig(op for op in got if isinstance(op, Collective))
        assert mine == sig(desc.collectives(pass_)) * m.num_layers
    assert {c.kind for c in desc.collectives("forward")} >= {"all_to_all"}
    assert [evs[-1].name for evs, chains in chunk.forward_segments if chains == 2][:-1] == ["moe.route"] * 4


def test_the_blocking_gather_holds_the_compute_stream(two_nodes):
    """The token counts' gather runs on the compute stream (the host waits for it); the dispatch
    all-to-all on the comm stream, beside the other sub-batch's compute."""
    chunk = build_stage_events(GPTShape(**MODEL, moe=_moe()), _strategy(1, "oases"), two_nodes(50))[0].chunks[0]
    evs = next(evs for evs, chains in chunk.forward_segments if chains == 2 and evs[0].name == "moe.ag.counts")
    price = {ev.key: 1.0 for ev in evs}
    slots = run_template(evs, 2, price).slots
    streams = {sl.name: sl.stream for sl in slots}
    assert streams["moe.ag.counts"] == "compute" and streams["moe.dispatch"] == "comm"


@pytest.mark.parametrize("tp", [1, 2])
def test_oases_over_moe_is_priced_faster_when_the_all_to_all_is_comparable_to_compute(tp, two_nodes):
    """EP across the nodes' link: on a fast link the all-to-alls are small and the two schedules
    are within a few percent; where they take about as long as the compute, Oases hides part of
    them (forward, and backward where stock's recompute repeats them) and is priced faster."""
    m = GPTShape(**MODEL, moe=_moe())
    step = {gbps: {sch: simulate(m, _strategy(tp, sch), device_model(two_nodes(gbps)), timeline=False)
                   for sch in ("default", "oases")} for gbps in (1000, 25)}
    fast, slow = step[1000], step[25]
    assert fast["oases"].iteration_ms == pytest.approx(fast["default"].iteration_ms, rel=0.05)
    assert slow["default"].exposed_comm_ms > fast["default"].iteration_ms / 2  # comm ~ compute
    assert slow["oases"].iteration_ms < 0.95 * slow["default"].iteration_ms
    assert slow["oases"].exposed_comm_ms < slow["default"].exposed_comm_ms


def test_fine_grained_recompute_keeps_the_forward_collectives_outputs(two_nodes):
    """At TP 1 a recomputed MoE layer keeps, per sub-batch, its input (a one-rank group's all-reduce
    keeps nothing), the dispatched tokens, their probabilities and the combined
    tokens (this rank's tokens x top-k each) and the dispatcher's routing metadata (the map, the
    probabilities over the experts, the inverse permutation; the counts, int64), and per layer the
    dispatcher's two index maps and the micro-batch's counts; stock full recompute keeps its input
    (``describe.moe_oases``, as the trainer measures it: ``tests/test_moe_description.py``)."""
    m = GPTShape(**MODEL, moe=_moe())
    topo = two_nodes(50)
    kept = {}
    for sch in ("default", "oases"):
        s = _strategy(1, sch)
        kept[sch] = chunk_activation_bytes(m, s, build_stage_events(m, s, topo)[0].chunks[0])[0]
    e, ep, tokens = 2, 8, B // 2 * S
    collectives = tokens * K * H * e + tokens * K * e + tokens * K * H * e
    metadata = tokens * E * (1 + e) + 8 * tokens * K + 8 * (ep * (E // ep) + E // ep) + 8 * E
    per_layer = 2 * (tokens * H * e + collectives + metadata) + 2 * 8 * E + 8 * E
    assert kept["oases"] - kept["default"] == pytest.approx(m.num_layers * (per_layer - B * S * H * e))


def _kept_per_layer(m: GPTShape, s: Strategy, topo) -> float:
    """What one more layer (of the pattern's next two, an MoE and a dense one at ``--moe-layer-freq
    2``; one MoE layer at 1) keeps per micro-batch in sim: the chunk's bytes at 2 layers minus at 1
    (or at 4 minus at 2), the head's alike."""
    per = {}
    for n in (m.moe.layer_freq, 2 * m.moe.layer_freq):
        mn = dataclasses.replace(m, num_layers=n)
        per[n] = chunk_activation_bytes(mn, s, build_stage_events(mn, s, topo)[0].chunks[0])[0]
    return per[2 * m.moe.layer_freq] - per[m.moe.layer_freq]


@pytest.mark.parametrize("freq", [1, 2])
def test_sims_kept_bytes_at_tp1_ep2_are_the_descriptions(freq, two_nodes):
    """At TP 1 x EP 2 under fine-grained recompute sim keeps, per MoE layer, ``describe.moe_oases``'s
    figure (which ``tests/test_moe_description.py`` pins to the trainer), and per dense layer of the
    same run (``--moe-layer-freq 2``) only its input: its all-reduces are one-rank, whose outputs the
    executor does not keep."""
    m = GPTShape(**MODEL, moe=dataclasses.replace(_moe(), layer_freq=freq))
    s = Strategy(tp=1, dp=8, ep=2, schedule="oases", recompute=True)
    assert s.oases_runs and s.fine_grained_recompute
    figure = oases_moe_layer_kept_bytes(micro_batch=B, seq=S, hidden=H, heads=32, ffn=F, moe=m.moe, tp=1, ep=2,
                                        bytes_per_element=m.bytes_per_element, variant=m.variant,
                                        sequence_parallel=False)
    dense_input = B * S * H * m.bytes_per_element
    assert _kept_per_layer(m, s, two_nodes(50)) == pytest.approx(figure + (freq - 1) * dense_input)


@pytest.mark.parametrize("types,coeffs,joins", [("none", "0.01", False), ("aux_loss", "0.01", True),
                                                ("aux_loss", "0", False)])
def test_the_join_is_priced_as_the_router_reads_the_load_balancing_flags(types, coeffs, joins, two_nodes):
    """``--moe-aux-loss-coeff`` counts only for an ``aux_loss`` type (Megatron's router,
    ``describe.moe.aux_loss_coeff``): with ``none`` no aux loss exists, so the sub-batches do not
    join after routing."""
    from megatron_oases.sim.frontends.cli import build_parser, model_from_args

    m = model_from_args(build_parser().parse_args([
        "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "256",
        "--micro-batch-size", "2", "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall",
        "--disable-bias-linear", "--moe-router-load-balancing-type", types, "--moe-aux-loss-coeff", coeffs]))
    assert m.moe.aux_loss == joins
    chunk = build_stage_events(m, Strategy(tp=1, dp=8, ep=2, schedule="oases"), two_nodes(50))[0].chunks[0]
    cuts = [evs[-1].name for evs, chains in chunk.forward_segments if chains == 2][:-1]
    assert cuts == (["moe.route"] * m.num_layers if joins else [])
