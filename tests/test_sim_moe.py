"""MoE through describe, sim and sim --search (issue 51 item 3; the planner's MoE blocks:
tests/test_plan_moe.py): the description's bytes and FLOPs, the all-to-all priced on the topology, the dense twin priced differently, EP searched and
launched, the flags refused where they cannot take effect. Quick: the models are small."""
from __future__ import annotations

import dataclasses
import shlex

import pytest

from megatron_oases.describe.moe import ROUTING_ASSUMPTION, MoEShape, moe_block, moe_block_param_tensors
from megatron_oases.describe.ops import GPT2, LayerVariant, ring_factor
from megatron_oases.describe.registry import layer_description
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.pricing.device_model import SimError, device_model
from megatron_oases.sim.calibrate.profiler import resolve_topology
from megatron_oases.sim.core.events import build_stage_events, unique_events
from megatron_oases.sim.core.search import SearchSpace, candidates
from megatron_oases.sim.core.strategy import Strategy, check
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.sim.frontends.cli import sim_main

B, S, H, E, K, F = 2, 64, 128, 8, 2, 256
BASE = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024, micro_batch_size=1,
            ffn_hidden_size=2048, variant=LayerVariant(bias=False))  # MoE at TP > 1: no linear biases


def _ops(pass_ops, kind=None):
    return {op.name: op for op in pass_ops if kind is None or getattr(op, "kind", None) == kind}


@pytest.mark.parametrize("t,ep", [(1, 4), (2, 4), (4, 2)])
def test_alltoall_bytes_are_tokens_topk_hidden(t, ep):
    """The dispatch and combine all-to-alls carry this rank's s/t tokens x topk x h elements, of
    which (EP-1)/EP leave the rank; the experts' TP all-gathers TP times that."""
    moe = MoEShape(num_experts=E, ffn=F, topk=K, dispatcher="alltoall")
    fwd, bwd = moe_block(micro_batch=B, seq=S, hidden=H, moe=moe, tp=t, ep=ep, bytes_per_element=2, variant=GPT2)
    a2a = _ops(fwd, "all_to_all")
    copies = B * S // t * K
    assert a2a["moe.dispatch"].payload_bytes == a2a["moe.combine"].payload_bytes == copies * H * 2
    assert a2a["moe.dispatch"].wire_bytes_per_rank == pytest.approx(copies * H * 2 * (ep - 1) / ep)
    assert a2a["moe.dispatch.probs"].payload_bytes == copies * 2
    gathers = _ops(fwd, "all_gather")
    assert (gathers["moe.ag"].payload_bytes == copies * t * H * 2) if t > 1 else "moe.ag" not in gathers
    # the backward has each forward collective's adjoint (the same bytes), but for the routing
    # bookkeeping's, which has no gradient: the token counts per expert, int64, over TP x EP
    counts = _ops(fwd, "all_gather")["moe.ag.counts"]
    assert counts.payload_bytes == t * ep * E * 8 and counts.group_size == t * ep
    assert sorted(op.payload_bytes for op in _ops(bwd).values() if hasattr(op, "kind")) == \
        sorted(op.payload_bytes for n, op in _ops(fwd).items() if hasattr(op, "kind") and n != "moe.ag.counts")


def test_allgather_dispatcher_gathers_the_tp_ep_group():
    moe = MoEShape(num_experts=E, ffn=F, topk=K, dispatcher="allgather")
    fwd, _ = moe_block(micro_batch=B, seq=S, hidden=H, moe=moe, tp=2, ep=2, bytes_per_element=2, variant=GPT2)
    colls = _ops(fwd, "all_gather") | _ops(fwd, "reduce_scatter")
    assert {c.axis for c in colls.values()} == {"tp_ep"} and all(c.group_size == 4 for c in colls.values())
    assert colls["moe.ag"].payload_bytes == colls["moe.rs"].payload_bytes == B * S * 2 * H * 2  # tokens x EP
    assert ring_factor("all_to_all", 4) == ring_factor("all_gather", 4)
    assert not _ops(moe_block(micro_batch=B, seq=S, hidden=H, moe=moe, tp=1, ep=1, bytes_per_element=2,
                              variant=GPT2)[0], "all_gather")


@pytest.mark.parametrize("gated", [False, True])
def test_flops_are_router_plus_topk_experts(gated):
    """Per rank, forward: the router's 2 (s/t) h E, then the top-k experts on every token at width
    ffn/t, whatever EP (even routing); a capacity factor below 1 drops the rest."""
    v = LayerVariant(gated=gated)
    t, fc1 = 2, (2 if gated else 1) * F
    for ep, cf in ((1, None), (4, None), (2, 0.5)):
        moe = MoEShape(num_experts=E, ffn=F, topk=K, dispatcher="alltoall", capacity_factor=cf)
        fwd, bwd = moe_block(micro_batch=B, seq=S, hidden=H, moe=moe, tp=t, ep=ep, bytes_per_element=2, variant=v)
        router, experts = _ops(fwd)["moe.router"], _ops(fwd)["moe.experts"]
        assert router.flops == 2 * (B * S // t) * H * E
        kept = 1.0 if cf is None else cf
        assert experts.flops == pytest.approx(2 * B * S * K * kept * H * (fc1 + F) / t)
        assert sum(2 * m * n * k for m, n, k in experts.gemms) == pytest.approx(experts.flops)
        assert _ops(bwd)["moe.experts.bwd"].flops == 2 * experts.flops


def test_params_per_rank_split_experts_over_ep_and_tp():
    v = LayerVariant(gated=True, bias=False, normalization="RMSNorm")
    moe = MoEShape(num_experts=E, ffn=F, topk=K)
    tensors = moe_block_param_tensors(h=H, moe=moe, t=2, ep=4, variant=v)
    assert sum(tensors) == H + E * H + (E // 4) * (H * 2 * F // 2 + F // 2 * H)


def test_layer_description_keeps_attention_and_refuses_other_backends():
    moe = MoEShape(num_experts=E, ffn=F, topk=K, dispatcher="alltoall")
    kw = dict(layout=None, micro_batch=B, seq=S, hidden=H, heads=4, ffn=4 * H, tp=2, bytes_per_element=2,
              sequence_parallel=True)
    dense = layer_description(backend="megatron", **kw)
    layer = layer_description(backend="megatron", moe=moe, ep=2, **kw)
    assert [op.name for op in layer.forward[:3]] == [op.name for op in dense.forward[:3]]  # the attention block
    assert "mlp" not in {op.name for op in layer.forward}
    with pytest.raises(ValueError, match="--tp-backend megatron"):
        layer_description(backend="atp", **dict(kw, sequence_parallel=False), moe=moe)


def _topology(nodes=2):
    return resolve_topology("dgx-h100-ndr8", 0).with_nodes(nodes)


def test_eight_experts_priced_differently_from_the_dense_twin():
    topo = _topology()
    dm = device_model(topo)
    dense = GPTShape(**BASE)
    moe = GPTShape(**BASE, moe=MoEShape(num_experts=8, ffn=2048, topk=2, dispatcher="alltoall"))
    st = dict(tp=2, pp=1, dp=8, num_microbatches=2, sequence_parallel=True)
    r_dense = simulate(dense, Strategy(**st), dm, timeline=False)
    r_moe = simulate(moe, Strategy(**st, ep=4), dm, timeline=False)
    assert r_moe.iteration_ms > r_dense.iteration_ms  # twice the MLP FLOPs (top-2), plus the all-to-alls
    assert r_moe.stages[0].memory_GB > r_dense.stages[0].memory_GB  # 2 experts a rank, each the twin's MLP
    keys = unique_events(build_stage_events(moe, Strategy(**st, ep=4), topo))
    assert any(k.startswith("all_to_all:moe.dispatch[") for k in keys)
    # every other layer MoE: between the two
    half = GPTShape(**BASE, moe=MoEShape(num_experts=8, ffn=2048, topk=2, dispatcher="alltoall", layer_freq=2))
    r_half = simulate(half, Strategy(**st, ep=4), dm, timeline=False)
    assert r_dense.iteration_ms < r_half.iteration_ms < r_moe.iteration_ms


def test_all_to_all_across_nodes_costs_more_than_inside():
    """EP inside a node (TP 2: EP ranks 0, 2, 4, 6) vs across nodes (TP 8: ranks 0, 8): the same
    rule as TP's collectives, the group's slowest link."""
    topo = _topology()
    dm = device_model(topo)
    moe = GPTShape(**BASE, moe=MoEShape(num_experts=8, ffn=2048, topk=2, dispatcher="alltoall"))

    def a2a(tp, ep):
        evs = unique_events(build_stage_events(moe, Strategy(tp=tp, dp=16 // tp, sequence_parallel=True, ep=ep), topo))
        ev = next(e for k, e in evs.items() if k.startswith("all_to_all:moe.dispatch["))
        return ev, dm.price(ev.key, ev.op, kind=ev.kind, nbytes=ev.nbytes, ranks=ev.ranks)
    (inside, t_in), (across, t_across) = a2a(2, 2), a2a(8, 2)
    assert inside.ranks == (0, 2) and across.ranks == (0, 8)
    per_byte = (t_across / across.op.payload_bytes) / (t_in / inside.op.payload_bytes)
    assert per_byte > 2


def test_expert_gradients_reduce_over_expert_data_parallel():
    topo = _topology()
    moe = GPTShape(**BASE, moe=MoEShape(num_experts=8, ffn=2048, topk=2))
    st = build_stage_events(moe, Strategy(tp=2, dp=8, sequence_parallel=True, ep=4), topo)[0]
    (expert,) = st.replica_allreduce
    assert expert.ranks == (0, 8)  # DP replicas 0 and 4: expert-DP = DP / EP
    assert st.grad_allreduce.nbytes + expert.nbytes == 4 * st.params_per_rank


@pytest.mark.parametrize("flags,match", [
    (["--tp", "2", "--ep", "4"], "needs --sequence-parallel"),
    (["--tp", "2", "--sequence-parallel", "--ep", "3"], "must divide --num-experts 8"),
    (["--tp", "8", "--sequence-parallel", "--ep", "4"], "must divide the data-parallel size 2"),
    (["--tp", "2", "--sequence-parallel"], "needs --disable-bias-linear"),
    (["--tp", "2", "--sequence-parallel", "--disable-bias-linear", "--schedule", "oases"],
     "--schedule oases overlaps MoE layers' all-to-alls; use --moe-token-dispatcher-type alltoall"),
    (["--tp", "2", "--sequence-parallel", "--disable-bias-linear", "--schedule", "oases", "--micro-batch-size", "2",
      "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "seq_aux_loss",
      "--moe-aux-loss-coeff", "0.01"], "--moe-router-load-balancing-type seq_aux_loss is not split by sub-batch"),
])
def test_sim_refuses_what_megatron_refuses(flags, match, capsys):
    assert sim_main(["--topology", "dgx-h100-ndr8", "--nodes", "2", "--num-layers", "4", "--hidden-size", "512",
                     "--num-attention-heads", "8", "--seq-length", "256", "--num-experts", "8",
                     "--global-batch-size", "16", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_moe_flags_without_experts_and_ep_without_moe_are_one_line(capsys):
    common = ["--topology", "local", "--gpu", "h100-sxm", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--global-batch-size", "2"]
    assert sim_main([*common, "--moe-router-topk", "4"]) == 2
    assert "--moe-router-topk takes effect with MoE layers only" in capsys.readouterr().err
    assert sim_main([*common, "--dp", "2", "--ep", "2", "--micro-batch-size", "1"]) == 2
    assert "--expert-model-parallel-size takes effect with MoE layers only" in capsys.readouterr().err


def test_sim_prints_the_routing_assumption(capsys):
    assert sim_main(["--topology", "dgx-h100-ndr8", "--num-layers", "2", "--hidden-size", "512",
                     "--num-attention-heads", "8", "--seq-length", "256", "--num-experts", "8",
                     "--moe-token-dispatcher-type", "alltoall", "--tp", "2", "--sequence-parallel", "--ep", "4",
                     "--disable-bias-linear",
                     "--global-batch-size", "32"]) == 0
    assert ROUTING_ASSUMPTION in capsys.readouterr().out


def test_search_enumerates_ep_and_launches_with_it(capsys):
    moe = GPTShape(**{**BASE, "micro_batch_size": 2}, moe=MoEShape(num_experts=8, ffn=2048, topk=2,
                                                                  dispatcher="alltoall"))
    cands = candidates(moe, SearchSpace(gpus=16, global_batch=32, tp_sizes=(2,), pp_sizes=(1,),
                                        backends=("megatron", "atp"), recompute=("off",)))
    assert {c.ep for c in cands} == {1, 2, 4, 8}  # powers of two dividing 8 experts and DP 8
    assert {c.backend for c in cands} == {"megatron"} and all(c.sequence_parallel for c in cands)
    # Oases over MoE is priced where the trainer runs it (describe.moe.moe_refusal, the one rule) ...
    oases = [c for c in cands if c.schedule == "oases" and c.strategy is not None]
    assert oases
    for c in oases:
        check(moe, c.strategy, 16)
    # ... and refused where it does not (the allgather dispatcher): the check each simulation runs first
    gathered = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, dispatcher="allgather"))
    oases = [c for c in candidates(gathered, SearchSpace(gpus=16, global_batch=32, tp_sizes=(2,), pp_sizes=(1,),
                                                         recompute=("off",))) if c.schedule == "oases"]
    assert oases
    for c in oases:
        with pytest.raises(SimError, match="use --moe-token-dispatcher-type alltoall"):
            check(gathered, c.strategy, 16)
    assert sim_main(["--search", "--topology", "dgx-h100-ndr8", "--nodes", "2", "--num-layers", "4",
                     "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
                     "--num-experts", "8", "--moe-token-dispatcher-type", "alltoall", "--global-batch-size", "32",
                     "--tp-sizes", "2", "--pp-sizes", "1", "--ep-sizes", "2", "--recompute-options", "off",
                     "--disable-bias-linear",
                     "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("launch (trainer):"))
    argv = shlex.split(line.split(":", 1)[1])
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "2"
    assert argv[argv.index("--num-experts") + 1] == "8" and "--sequence-parallel" in argv
    from megatron_oases.train_args import build_parser
    parsed = build_parser().parse_args(argv[argv.index("megatron_oases.train") + 1:])
    assert parsed.expert_model_parallel_size == 2 and parsed.moe_token_dispatcher_type == "alltoall"


def test_search_launches_oases_over_moe_as_the_trainer_takes_it(capsys):
    """An Oases candidate over MoE at TP 2 with SP is searched, and its printed launch passes the
    trainer's checks (``validate_config``), as the search's other launches do."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    assert sim_main(["--search", "--topology", "dgx-h100-ndr8", "--nodes", "2", "--num-layers", "4",
                     "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
                     "--num-experts", "8", "--moe-token-dispatcher-type", "alltoall", "--global-batch-size", "32",
                     "--tp-sizes", "2", "--pp-sizes", "1", "--ep-sizes", "2", "--recompute-options", "off",
                     "--schedules", "oases", "--disable-bias-linear", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "best tp2.pp1.dp8.ep2.sp.oases:" in out.splitlines()[0]
    line = next(x for x in out.splitlines() if x.startswith("launch (trainer):"))
    argv = shlex.split(line.split(":", 1)[1])
    cfg = validate_config(run_config(build_parser().parse_args(argv[argv.index("megatron_oases.train") + 1:])),
                          16, cuda=False)
    assert (cfg.schedule, cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size) == ("oases", 2, 2)
    assert cfg.sequence_parallel and cfg.num_experts == 8


def test_dense_strategy_has_no_moe_events():
    with pytest.raises(SimError, match="takes effect with MoE layers only"):
        build_stage_events(GPTShape(**BASE), Strategy(dp=16, ep=2), _topology())
