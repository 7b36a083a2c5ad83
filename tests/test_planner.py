"""Oases planner: model graph, cost model (Eq. 3-4, 6), and optimality of the ILP and the DP (Eq. 5-6)."""
from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest

from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.plan.chain_dp import solve_chain
from megatron_oases.plan.cost_model import build_cost_model
from megatron_oases.plan.memory import block_activation_bytes, state_bytes_per_param
from megatron_oases.plan.graph import (BlockStrategy, PlanError, PlanModel, build_graph, candidate_strategies,
                                       family_of, model_from_mapping, split_blocks)
from megatron_oases.plan.ilp import (MemoryInfeasible, PlanProblem, brute_force, evaluate, min_memory, solve,
                                     solve_ilp)
from megatron_oases.plan.pricing import DevicePricer, resolve_gpu
from megatron_oases.topology import Level, Topology, load_topology
from megatron_oases.describe.atp_2d import atp_layout

GiB = float(1 << 30)


def flat(n: int, name: str = "flat") -> Topology:
    return Topology(name=name, device="a100-80gb", levels=(Level(name="nvlink", size=n, scope="intra_node",
                    p2p_bandwidth_GBps=100, group_bandwidth_GBps=100, latency_us=2),))


def small_model(**kw) -> PlanModel:
    d = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=4, tp=2, dtype="bf16")
    d.update(kw)
    return PlanModel(**d)


class FakePricer:
    """Compute / collective ms from a function of (op name, TP degree in the shape)."""

    def __init__(self, compute, comm):
        self.compute, self.comm = compute, comm

    def compute_ms(self, op, *, shape, dims=()):
        return self.compute(op.name, int(re.search(r"t(\d+)_", shape).group(1)))

    def collective_ms(self, op, *, shape, ranks, dims=()):
        return self.comm(op.name, len(ranks)) if len(ranks) > 1 else 0.0

    def summary(self):
        return {"gpu": "fake", "topology": "fake"}


# ---- model graph -------------------------------------------------------------------------------

def test_a_layer_is_two_blocks_attention_then_mlp():
    for tp in (1, 2):
        blocks = split_blocks(megatron_1d_gpt_layer(micro_batch=2, seq=8, hidden=16, heads=2, ffn=64, tp=tp))
        assert [b.kind for b in blocks] == ["attention", "mlp"]
        assert [c.name for c in blocks[0].fwd_compute] == ["attention"]
        assert [c.name for c in blocks[1].bwd_compute] == ["mlp.bwd"]
        comm = [([c.name for c in b.fwd_comm], [c.name for c in b.bwd_comm]) for b in blocks]
        assert comm == ([(["attention.g"], ["attention.f.bwd"]), (["mlp.g"], ["mlp.f.bwd"])] if tp == 2
                        else [([], []), ([], [])])
    assert [b.name for b in build_graph(small_model(num_layers=2))] == ["0.attention", "0.mlp", "1.attention", "1.mlp"]


def test_candidates_are_feasible_powers_of_two():
    m8 = small_model(tp=8, micro_batch_size=8, num_attention_heads=8)
    assert [s.degree for s in candidate_strategies(m8)] == [1, 2, 4, 8]
    # micro-batch 2 over TP 4: degree 1 and 2 replicas get too few samples for two sub-batches
    assert [s.degree for s in candidate_strategies(small_model(tp=4, micro_batch_size=2))] == [4]
    with pytest.raises(PlanError, match="--degrees 3"):
        candidate_strategies(small_model(tp=4), degrees=(3,))
    # per-block degrees are powers of two dividing T: the megatron family needs T one; ATP does not
    m6 = small_model(tp=6, hidden_size=96, num_attention_heads=6, ffn_hidden_size=384, micro_batch_size=6)
    with pytest.raises(PlanError, match="--tensor-model-parallel-size 6 must be a power of two"):
        candidate_strategies(m6)
    # ATP's meshes, (T, 1) too: its layers there are not Megatron's (plan.graph._atp_layouts)
    assert [s.layout.shape for s in candidate_strategies(m6, families=("atp",))] == [(6, 1), (3, 2), (2, 3), (1, 6)]


def test_reshard_groups_and_payload():
    m = small_model(tp=4, micro_batch_size=8)
    fam = family_of(BlockStrategy(degree=2))
    up = fam.reshard(BlockStrategy(degree=2), BlockStrategy(degree=4), m)
    down = fam.reshard(BlockStrategy(degree=4), BlockStrategy(degree=1), m)
    assert up.backward is None and up.ranks_forward == (0, 2)
    # the whole degree-4 share, at once outside the Oases executor: 8 * 4/4 samples x s x h x 2 bytes
    assert up.forward.payload_bytes == 8 * 16 * 64 * 2 and up.forward.kind == "all_gather"
    assert down.forward is None and down.ranks_backward == (0, 1, 2, 3)
    assert fam.reshard(BlockStrategy(degree=2), BlockStrategy(degree=2), m).forward is None


# ---- cost model --------------------------------------------------------------------------------

def _forward_only(C: dict, M: dict, **kw):
    m = small_model(recompute=False, **kw)
    pricer = FakePricer(lambda name, t: 0.0 if name.endswith(".bwd") else C[name],
                        lambda name, n: 0.0 if ("bwd" in name or name == "grad.ar") else M[name.split(".")[0]])
    return build_cost_model(m, topology=flat(m.tp), global_batch_size=m.micro_batch_size, pricer=pricer,
                            grad_sync=False, degrees=(m.tp,))


def _two_stream(C: dict, M: dict, layers: int) -> float:
    from megatron_oases.pricing.event import Event
    from megatron_oases.sim.core.timeline import run_template

    evs, price = [], {}
    for _ in range(layers):
        for kind in ("attention", "mlp"):
            evs += [Event(key=f"c{kind}", name=kind, kind="compute"),
                    Event(key=f"m{kind}", name=kind, kind="collective")]
            price[f"c{kind}"], price[f"m{kind}"] = C[kind], M[kind]
    return run_template(tuple(evs), 2, price).duration


@pytest.mark.parametrize("C,M", [({"attention": 1.0, "mlp": 1.0}, {"attention": 3.0, "mlp": 3.0}),
                                 ({"attention": 3.0, "mlp": 2.0}, {"attention": 1.0, "mlp": 0.5}),
                                 ({"attention": 1.0, "mlp": 4.0}, {"attention": 3.0, "mlp": 2.0})])
def test_overlap_node_cost_against_the_simulators_two_streams(C, M):
    """Eq. 3 in lock-step: C_0 + sum max(C_v, M_v) + sum max(C_v, M_u) + M_last. It equals the
    simulator's two-stream template when every block is compute- or comm-bound, and is an upper
    bound otherwise (lock-step only adds waits)."""
    cm = _forward_only(C, M)
    uni = cm.uniform(2)
    t, _ = evaluate(cm.problem, uni)
    seq = [("attention", "mlp")[v % 2] for v in range(4)]
    want = (C[seq[0]] + sum(max(C[k], M[k]) for k in seq) + sum(max(C[b], M[a]) for a, b in zip(seq, seq[1:]))
            + M[seq[-1]])
    assert t == pytest.approx(want)
    sim = _two_stream(C, M, layers=2)
    bound = all(C[k] >= M[j] for k in C for j in M) or all(M[j] >= C[k] for k in C for j in M)
    assert t == pytest.approx(sim) if bound else t >= sim - 1e-9


def test_resharding_edge_is_allgather_plus_lost_overlap():
    m = small_model(tp=4, micro_batch_size=8, recompute=False)
    C = {1: 1.0, 2: 1.5, 4: 2.0}
    M = {1: 0.0, 2: 1.0, 4: 3.0}
    pricer = FakePricer(lambda name, t: 0.0 if name.endswith(".bwd") else C[t],
                        lambda name, n: 0.7 * n if name == "reshard.ag" else
                        (0.0 if "bwd" in name or name == "grad.ar" else M[n]))
    cm = build_cost_model(m, topology=flat(4), global_batch_size=8, pricer=pricer, grad_sync=False)
    k = {s.degree: i for i, s in enumerate(cm.strategies)}
    e = cm.problem.edge[0]
    ag_up = 0.7 * 2  # one all-gather of the whole share (the runtime's, outside the executor), group of 2
    assert e[k[2], k[4]] == pytest.approx(M[2] + ag_up + C[4])  # forward all-gather, overlap lost
    # forward slices, backward gathers; the sub-batches meet at the change either way (the
    # runtime runs each degree as its own executor pass): no overlap across the edge
    assert e[k[4], k[2]] == pytest.approx(M[4] + C[2] + 0.7 * 2)
    assert e[k[4], k[4]] == pytest.approx(max(C[4], M[4]))


def test_stock_cost_hides_the_async_input_gradient_all_reduce_behind_the_wgrad():
    """With one sub-batch (stock Megatron) the backward collectives of QKV / fc1 (``*.f.bwd``) run
    beside their weight-gradient GEMMs: the block's M' leaves out min(all-reduce, wgrad); the Oases
    executor (two sub-batches) and TP 1 do not get that credit."""
    wgrad = {"attention.wgrad": 2.0, "mlp.wgrad": 5.0}
    pricer = FakePricer(lambda name, t: wgrad.get(name, 1.0),
                        lambda name, n: 3.0 if name.endswith(".f.bwd") else 1.0 if "bwd" in name else 0.0)
    costs = {}
    for sb in (1, 2):
        cm = build_cost_model(small_model(sub_batches=sb, recompute=False), topology=flat(2), global_batch_size=4,
                              pricer=pricer)
        costs[sb] = {kind: cm.costs[(kind, i)] for (kind, i) in cm.costs if cm.strategies[i].degree == 2}
    full = {kind: c.m_bwd for kind, c in costs[2].items()}
    assert full["attention"] > 0 and full["mlp"] > 0
    assert costs[1]["attention"].m_bwd == pytest.approx(full["attention"] - 2.0)  # wgrad shorter: 2 ms hidden
    assert costs[1]["mlp"].m_bwd == pytest.approx(full["mlp"] - 3.0)  # all-reduce shorter: all of it hidden


def test_memory_terms_agree_with_the_simulator():
    from megatron_oases.describe.registry import layer_activation_bytes, layer_params

    m = PlanModel(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=4, tp=4,
                  dtype="bf16")
    fam = family_of(BlockStrategy(degree=2))
    for d in (1, 2, 4):
        s = BlockStrategy(degree=d)
        assert fam.params(s, m, "attention") + fam.params(s, m, "mlp") == layer_params("megatron", 256, 1024, d, None)
        acts = sum(block_activation_bytes(m, k, 4, d) for k in ("attention", "mlp"))
        want = layer_activation_bytes("megatron", b=4, s=64, h=256, a=8, f=1024, t=d, e=2, layout=None,
                                      hidden_dropout=False, attention_dropout=False)  # PlanModel's 0.0
        assert acts == pytest.approx(want)
    assert state_bytes_per_param(m, 1) == 18 and state_bytes_per_param(dataclasses.replace(m, dtype="fp32"), 1) == 16


def test_event_keys_are_the_simulators():
    """The planner prices the same events (same keys) the simulator asks a profile for."""
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.core.strategy import Strategy as SimStrategy

    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8, tp=8)
    pricer = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=8, pricer=pricer)
    for d in (2, 4, 8):
        sim = unique_events(build_stage_events(
            GPTShape(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, padded_vocab_size=51200,
                     micro_batch_size=8 * d // 8),
            SimStrategy(tp=d, dp=8 // d, schedule="oases", recompute=True), topo))
        ours = {k for k in pricer.events
                if f"t{d}_" in k and ("compute:" in k or "all_reduce:" in k) and "grad" not in k}
        assert ours and ours <= set(sim), sorted(ours - set(sim))
        assert all(pricer.events[k].dims == sim[k].dims and pricer.events[k].nbytes == sim[k].nbytes for k in ours)
    # stock (one sub-batch): the weight-gradient events it prices are the simulator's stock ones
    stock = dataclasses.replace(m, sub_batches=1)
    pricer = DevicePricer(topology=topo, model=stock)
    build_cost_model(stock, topology=topo, global_batch_size=8, pricer=pricer)
    wgrads = {k for k in pricer.events if ".wgrad[" in k and "t4_" in k}
    sim = unique_events(build_stage_events(GPTShape(num_layers=2, hidden_size=256, num_attention_heads=8,
                                                    seq_length=64, padded_vocab_size=51200,
                                                       micro_batch_size=4), SimStrategy(tp=4, dp=2,
                                                                                        recompute=True), topo))
    assert len(wgrads) == 2 and wgrads <= set(sim), sorted(wgrads - set(sim))


def test_degree_one_blocks_and_reshards_are_the_simulators_events():
    """As the runtime runs a plan (``schedules/oases/block.py``): a degree-1 block runs its
    replica's share whole (no Oases split, ``describe.split.sub_batches_at``) and a reshard moves
    the micro-batch's whole share once, outside the executor. The planner prices exactly the
    events the simulator builds for such a plan (keys, dims, bytes); it priced two half-size runs
    of each before, twice the host cost of a host-bound block."""
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.core.strategy import Strategy as SimStrategy

    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8, tp=8,
                  recompute=False)
    pricer = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=8, pricer=pricer, granularity="block")
    sim = unique_events(build_stage_events(
        GPTShape(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, padded_vocab_size=51200,
                 micro_batch_size=8), SimStrategy(tp=8, schedule="oases", block_degrees=(1, 8, 2, 1)), topo))
    planned = [k for k in sim if "t1_" in k or "reshard" in k]
    assert any(k.startswith("compute:attention[b1s64") for k in planned)  # 8 x 1/8 samples, one run
    assert sum("reshard" in k for k in planned) >= 2
    for k in planned:
        assert k in pricer.events, (k, sorted(pricer.events))
        assert pricer.events[k].dims == sim[k].dims and pricer.events[k].nbytes == sim[k].nbytes, k


@pytest.mark.parametrize("core_attention", ["local", "fused"])
def test_planner_prices_each_event_as_the_simulator(core_attention):
    """Same key, same milliseconds: the planner's analytical device model is the simulator's for
    the plan model's core attention (a fused kernel keeps the scores on chip in both), so a plan
    priced with ``--attention-backend auto`` is cheaper than with ``local``, as its runtime is."""
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.pricing.device_model import device_model
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.core.strategy import Strategy as SimStrategy

    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=2, hidden_size=1024, num_attention_heads=16, seq_length=2048, micro_batch_size=8,
                  tp=8, core_attention=core_attention, dtype="bf16")
    pricer = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=8, pricer=pricer)
    shape = GPTShape(num_layers=2, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                     padded_vocab_size=51200, micro_batch_size=8, core_attention=core_attention, dtype="bf16")
    dm = device_model(topo, bytes_per_element=shape.bytes_per_element, fused_attention=shape.fused_attention)
    sim = unique_events(build_stage_events(shape, SimStrategy(tp=8, schedule="oases", recompute=True), topo))
    both = [k for k in pricer.events if k in sim and k.startswith("compute:")]
    assert any(k.startswith("compute:attention[") for k in both), sorted(pricer.events)
    for k in both:
        e = sim[k]
        assert pricer.compute_ms(e.op, shape=k[k.index("[") + 1:-1]) == pytest.approx(
            dm.price(k, e.op, kind=e.kind, nbytes=e.nbytes, ranks=e.ranks)), k
    if core_attention == "fused":
        local = DevicePricer(topology=topo, model=dataclasses.replace(m, core_attention="local"))
        key = next(k for k in both if k.startswith("compute:attention["))
        assert pricer.compute_ms(sim[key].op, shape=key[key.index("[") + 1:-1]) < local._dm.compute_ms(sim[key].op)


def test_planner_events_can_be_profiled():
    """Every compute event the planner prices maps to the profiler's torch workload."""
    import torch

    from megatron_oases.sim.calibrate.layer_workloads import single_rank_world
    from megatron_oases.sim.calibrate.workloads import compute_workload

    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=4, tp=4)
    pricer = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=8, pricer=pricer)
    comp = [e for e in pricer.events.values() if e.kind == "compute"]
    assert len(comp) == 4 * 3  # attention, mlp, and their .bwd at degrees 1, 2, 4
    with single_rank_world():  # Megatron layer workloads build a real layer
        for e in comp:
            compute_workload(e.name, dict(e.dims), torch.device("cpu"))
    kinds = {(e.op.kind, e.name) for e in pricer.events.values() if e.kind == "collective"}
    assert {("all_gather", "reshard.ag"), ("all_reduce", "grad.ar"), ("all_reduce", "mlp.f.bwd")} <= kinds


def test_gpu_names_resolve():
    assert resolve_gpu("rtx3090-24gb") == "rtx-3090" and resolve_gpu("a100-80gb") == "a100-80gb"
    with pytest.raises(PlanError, match="--gpu"):
        resolve_gpu("tpu-v5")


def test_real_model_plan_respects_memory_and_trades_time():
    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=8, hidden_size=2048, num_attention_heads=32, seq_length=1024, micro_batch_size=4, tp=4)
    cm = build_cost_model(m, topology=topo, global_batch_size=16, grad_sync=False)
    free = solve(cm.problem)
    assert [cm.strategies[k].degree for k in free.assignment] == [1] * 16  # no memory limit: no TP traffic
    _, need_t4 = evaluate(cm.problem, cm.uniform(4))
    budget = (need_t4 + free.memory_bytes) / 2
    tight = solve(dataclasses.replace(cm.problem, budget=budget))
    assert tight.memory_bytes <= budget and free.time_ms < tight.time_ms < evaluate(cm.problem, cm.uniform(4))[0]
    ilp = solve_ilp(dataclasses.replace(cm.problem, budget=budget), solver="cbc")
    assert ilp.time_ms == pytest.approx(tight.time_ms, rel=1e-9)


# ---- ILP / DP optimality -----------------------------------------------------------------------

def random_problem(rng, n, k, ties=False, budget_frac=None, edge_bytes=False) -> PlanProblem:
    """``edge_bytes``: edges keep bytes where the strategy changes (none where it does not, as a
    reshard's output)."""
    node = rng.uniform(1, 10, (n, k))
    edge = rng.uniform(0, 4, (n - 1, k, k))
    mem = rng.uniform(1, 8, (n, k)) * GiB
    peak = rng.uniform(0, 3, (n, k)) * GiB
    tie = tuple((i, i + 1) for i in range(0, n - 1, 2)) if ties else ()
    edge_mem = rng.uniform(0, 6, (n - 1, k, k)) * GiB * (1 - np.eye(k)) if edge_bytes else None
    p = PlanProblem(node=node, edge=edge, mem=mem, peak=peak, mem_const=0.5 * GiB, ties=tie, edge_mem=edge_mem)
    lo, _ = min_memory(p)
    hi = max(evaluate(p, brute_force(p)[1])[1], lo)
    frac = rng.uniform(0, 1) if budget_frac is None else budget_frac
    return dataclasses.replace(p, budget=lo + frac * (hi - lo))


def test_ilp_and_dp_match_brute_force_on_random_instances():
    rng = np.random.default_rng(2024)
    for i in range(24):
        n, k = int(rng.integers(2, 9)), int(rng.integers(2, 5))
        if k ** n > 20000:
            n = 6
        p = random_problem(rng, n, k, ties=i % 4 == 3)
        best, _ = brute_force(p)
        ilp = solve_ilp(p, solver="cbc")
        dp_t, dp_a, _ = solve_chain(p)
        assert ilp.time_ms == pytest.approx(best, rel=1e-9, abs=1e-9), (i, n, k)
        assert dp_t == pytest.approx(best, rel=1e-9, abs=1e-9), (i, n, k)
        assert ilp.memory_bytes <= p.budget * (1 + 1e-9) and evaluate(p, dp_a)[1] <= p.budget * (1 + 1e-9)


def test_edge_bytes_are_exact_in_both_solvers_and_in_min_memory():
    """What a change of strategy keeps (``PlanProblem.edge_mem``, the Oases reshard's output):
    the DP adds it on each extension, the ILP through its edge product variables, and the least
    memory is a shortest path; each equals enumeration."""
    rng = np.random.default_rng(47)
    for i in range(12):
        n, k = int(rng.integers(2, 7)), int(rng.integers(2, 4))
        p = random_problem(rng, n, k, ties=i % 3 == 2, edge_bytes=True)
        best, _ = brute_force(p)
        assert solve_chain(p)[0] == pytest.approx(best, rel=1e-9, abs=1e-9), (i, n, k)
        assert solve_ilp(p, solver="cbc").time_ms == pytest.approx(best, rel=1e-9, abs=1e-9), (i, n, k)
        need, a = min_memory(p)
        groups = p.groups
        allm = [evaluate(p, [c[next(j for j, g in enumerate(groups) if v in g)] for v in range(n)])[1]
                for c in np.ndindex(*(k,) * len(groups))]
        assert need == pytest.approx(min(allm)) and evaluate(p, a)[1] == pytest.approx(need)


def test_dp_matches_brute_force_without_a_budget_and_min_memory_is_exact():
    rng = np.random.default_rng(7)
    for _ in range(10):
        p = dataclasses.replace(random_problem(rng, 6, 3), budget=None)
        assert solve_chain(p)[0] == pytest.approx(brute_force(p)[0])
        need, a = min_memory(p)
        k = p.node.shape[1]
        allm = [evaluate(p, c)[1] for c in np.ndindex(*(k,) * 6)]
        assert need == pytest.approx(min(allm)) and evaluate(p, a)[1] == pytest.approx(need)


def test_infeasible_budget_names_the_minimum():
    rng = np.random.default_rng(3)
    p = random_problem(rng, 5, 3)
    need, _ = min_memory(p)
    bad = dataclasses.replace(p, budget=need * 0.9)
    for solver in ("auto", "cbc"):
        with pytest.raises(MemoryInfeasible) as e:
            solve(bad, solver=solver)
        assert e.value.min_bytes == pytest.approx(need)
        assert "--memory-gb" in str(e.value) and f"{need / GiB:.2f}" in str(e.value) and "\n" not in str(e.value)


def test_96_blocks_x_4_strategies_solve_fast():
    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=48, hidden_size=4096, num_attention_heads=32, seq_length=1024, micro_batch_size=8, tp=8)
    cm = build_cost_model(m, topology=topo, global_batch_size=16, grad_sync=False)
    assert cm.problem.node.shape == (96, 4)
    lo, _ = min_memory(cm.problem)
    hi = evaluate(cm.problem, cm.uniform(2))[1]
    for frac in (0.05, 0.2, 0.5, 1.0):
        p = dataclasses.replace(cm.problem, budget=lo + frac * (hi - lo))
        t0 = time.process_time()
        sol = solve(p)
        assert time.process_time() - t0 < 0.5
        assert sol.memory_bytes <= p.budget


def test_exposed_grad_sync_charges_the_replica_all_reduce_once_per_iteration():
    seen = {}

    def comm(name, n):
        return 5.0 * n if name == "grad.ar" else 0.0

    class Recorder(FakePricer):
        def collective_ms(self, op, *, shape, ranks, dims=()):
            if op.name == "grad.ar":
                seen[shape] = ranks
            return super().collective_ms(op, shape=shape, ranks=ranks)

    m = small_model(tp=4, micro_batch_size=8)
    topo = Topology(name="two", device="a100-80gb", levels=(
        Level(name="nvlink", size=4, scope="intra_node", p2p_bandwidth_GBps=100, group_bandwidth_GBps=100),
        Level(name="ib", size=2, scope="inter_node", p2p_bandwidth_GBps=10, group_bandwidth_GBps=10)))
    kw = dict(topology=topo, global_batch_size=32, pricer=Recorder(lambda name, t: 1.0, comm))
    on, off = build_cost_model(m, grad_sync=True, **kw), build_cost_model(m, **kw)
    assert off.num_microbatches == 2 and off.data_parallel == 2
    k = {s.degree: i for i, s in enumerate(on.strategies)}
    diff = on.problem.node - off.problem.node
    assert diff[:, k[2]] == pytest.approx([5.0 * 4] * 4) and diff[:, k[4]] == pytest.approx([5.0 * 2] * 4)
    assert (0, 2, 4, 6) in seen.values() and (0, 4) in seen.values()


# ---- ATP meshes as a strategy family -----------------------------------------------------------

def test_atp_family_splits_prices_and_counts_like_the_simulator():
    """ATP's layer (many small segments) splits into the same two blocks; its parameters match
    ``describe.atp_2d``; its collectives run on the mesh-axis groups of TP rank 0."""
    from megatron_oases.describe.atp_2d import atp_2d_gpt_layer
    from megatron_oases.describe.registry import layer_params

    m = PlanModel(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=4, tp=8)
    s = BlockStrategy(degree=8, family="atp", layout=atp_layout(4, 2))
    fam = family_of(s)
    blocks = fam.split(fam.describe(s, m, 2))
    desc = atp_2d_gpt_layer(micro_batch=2, seq=64, hidden=256, heads=8, ffn=1024, d1=4, d2=2, bytes_per_element=2)
    assert [b.kind for b in blocks] == ["attention", "mlp"]
    assert sum(len(b.fwd_compute) + len(b.fwd_comm) for b in blocks) == len(desc.forward)
    assert sum(len(b.bwd_compute) + len(b.bwd_comm) for b in blocks) == len(desc.backward)
    assert blocks[1].fwd_compute[0].name == "atp.ln2" and blocks[0].bwd_compute[0].name == "atp.proj.bwd"
    assert fam.params(s, m, "attention") + fam.params(s, m, "mlp") == layer_params("atp", 256, 1024, 8, atp_layout(4, 2))
    assert fam.group_ranks(s, "mesh2") == (0, 1) and fam.group_ranks(s, "mesh1") == (0, 2, 4, 6)
    assert s.label == "atp4x2"
    with pytest.raises(PlanError, match="--families"):
        candidate_strategies(m, families=("megatron", "cube"))


def test_atp_plans_are_whole_model_and_win_when_memory_binds():
    """The runtime runs ATP as a backend, so a plan never mixes it with Megatron blocks (infinite
    edges); on ATP's IC2 (8 x 3090, NVLink-bridged pairs on PCIe) with TP 8, a budget too small
    for degree 4 picks ATP 4x2 over TP 8 (axis 2 inside the NVLink pairs). On two 3090 nodes it
    does not: ATP's two concurrent axis-1 rings would share each node's one InfiniBand card."""
    topo = load_topology("nvlink-pairs")
    m = PlanModel(num_layers=8, hidden_size=4096, num_attention_heads=32, seq_length=1024, micro_batch_size=4, tp=8,
                  recompute=True, dtype="bf16")  # the Oases fine-grained recompute (the budget is sized for it)
    cm = build_cost_model(m, topology=topo, global_batch_size=16, memory_gb=5.3, families=("megatron", "atp"),
                          gpu="rtx-3090")
    labels = [s.label for s in cm.strategies]
    assert labels[:2] == ["tp4", "tp8"] and "atp4x2" in labels
    k_tp8, k_atp = labels.index("tp8"), labels.index("atp4x2")
    n = len(cm.blocks)
    mixed = (k_atp,) * (n // 2) + (k_tp8,) * (n - n // 2)
    assert evaluate(cm.problem, mixed)[0] == np.inf
    uniform_atp, uniform_tp8 = evaluate(cm.problem, (k_atp,) * n)[0], evaluate(cm.problem, (k_tp8,) * n)[0]
    assert uniform_atp < uniform_tp8
    dp, ilp = solve(cm.problem, solver="dp"), solve(cm.problem, solver="cbc")
    assert dp.assignment == ilp.assignment == (k_atp,) * n
    assert dp.time_ms == pytest.approx(uniform_atp)


def test_atp_event_keys_are_the_simulators():
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.core.strategy import Strategy as SimStrategy

    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8, tp=8)
    pricer = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=8, pricer=pricer, families=("atp",))
    sim = unique_events(build_stage_events(
        GPTShape(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, padded_vocab_size=51200,
                 micro_batch_size=4),  # one sub-batch
        SimStrategy(tp=8, backend="atp", layout=atp_layout(4, 2), recompute=True), topo))
    ours = {k for k in pricer.events if "m4x2" in k and "grad" not in k}
    assert any("atp.leave" in k for k in ours) and any("compute:atp.qkv" in k for k in ours)
    assert ours <= set(sim), sorted(ours - set(sim))
    assert all(pricer.events[k].dims == sim[k].dims for k in ours)


def test_cube_event_keys_are_the_simulators():
    """The 3-D family's events carry the simulator's spelling (``cube``, no executor tag)."""
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.events import build_stage_events, unique_events
    from megatron_oases.sim.core.strategy import Strategy as SimStrategy

    topo = load_topology("pcie-3090-2node")
    m = PlanModel(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8,
                  tp=8, sub_batches=1)
    pricer = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=8, pricer=pricer, families=("3d",))
    sim = unique_events(build_stage_events(
        GPTShape(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, padded_vocab_size=51200,
                 micro_batch_size=8),
        SimStrategy(tp=8, backend="3d", recompute=True), topo))
    ours = {k for k in pricer.events if "cube" in k and "grad" not in k}
    assert ours and ours <= set(sim), sorted(ours - set(sim))
    assert all(pricer.events[k].dims == sim[k].dims for k in ours)


def test_rope_and_qk_norm_reach_the_variant_and_the_price():
    """QK-norm adds replicated q/k norm weights to attention blocks; both add element-wise work
    and saved bytes to attention, none to MLP; a plan with them solves."""
    topo = load_topology("pcie-3090-2node")
    base = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8, tp=8)
    m = model_from_mapping(dict(base, position_embedding_type="rope", rotary_percent=0.5, qk_layernorm=True))
    assert m.variant.rotary and m.variant.rotary_percent == 0.5 and m.variant.qk_norm
    gpt, s = PlanModel(**base), BlockStrategy(degree=2)
    fam = family_of(s)
    assert fam.params(s, m, "attention") - fam.params(s, gpt, "attention") == 4 * 256 // 8
    assert fam.params(s, m, "mlp") == fam.params(s, gpt, "mlp")
    assert block_activation_bytes(m, "attention", 4, 2) > block_activation_bytes(gpt, "attention", 4, 2)
    assert block_activation_bytes(m, "mlp", 4, 2) == block_activation_bytes(gpt, "mlp", 4, 2)
    cm = build_cost_model(m, topology=topo, global_batch_size=16)
    assert solve(cm.problem, solver="dp").time_ms > 0
    with pytest.raises(PlanError, match="rotary-percent"):
        model_from_mapping(dict(base, rotary_percent=0.5))


def test_gqa_blocks_never_split_a_key_value_group():
    """2 key/value groups on T = 8: attention blocks run at degree 1 or 2 only (MLP blocks are
    free); the optimum is still brute force's, and a SwiGLU/GQA model costs what its description
    says (its QKV is smaller, its MLP has a third matrix)."""
    topo = load_topology("pcie-3090-2node")
    base = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=8, tp=8)
    m = model_from_mapping(dict(base, num_query_groups=2, swiglu=True, ffn_hidden_size=512, normalization="RMSNorm",
                                add_bias_linear=False))
    cm = build_cost_model(m, topology=topo, global_batch_size=16)
    degrees = [s.degree for s in cm.strategies]
    for v, blk in enumerate(cm.blocks):
        allowed = [d for d, c in zip(degrees, cm.problem.node[v]) if np.isfinite(c)]
        assert allowed == ([d for d in degrees if 2 % d == 0] if blk.kind == "attention" else degrees)
    sol = solve(cm.problem, solver="dp")
    assert sol.time_ms == pytest.approx(brute_force(cm.problem)[0])
    assert all(cm.strategies[k].degree <= 2 for k, blk in zip(sol.assignment, cm.blocks) if blk.kind == "attention")
    gpt = PlanModel(**base, ffn_hidden_size=512)
    assert family_of(BlockStrategy(degree=2)).params(BlockStrategy(degree=2), m, "attention") < \
        family_of(BlockStrategy(degree=2)).params(BlockStrategy(degree=2), gpt, "attention")
    assert family_of(BlockStrategy(degree=2)).params(BlockStrategy(degree=2), m, "mlp") > \
        family_of(BlockStrategy(degree=2)).params(BlockStrategy(degree=2), gpt, "mlp")


def test_sequence_parallel_is_priced_at_the_uniform_degree_only():
    """``--sequence-parallel``: the Megatron blocks use the SP description (all-gathers and
    reduce-scatters, no all-reduce) and only degree T is a candidate (no per-block SP plan runs)."""
    from megatron_oases.plan.graph import candidate_strategies, family_of, BlockStrategy
    from megatron_oases.plan.model import PlanError, PlanModel

    m = PlanModel(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                  tp=4, sequence_parallel=True)
    assert [s.degree for s in candidate_strategies(m)] == [4]
    with pytest.raises(PlanError, match="uniform degree 4 only"):
        candidate_strategies(m, degrees=(1, 2))
    fam = family_of(BlockStrategy(degree=4))
    blocks = fam.split(fam.describe(BlockStrategy(degree=4), m, 2))
    for blk in blocks:
        assert sorted(c.kind for c in blk.fwd_comm) == ["all_gather", "reduce_scatter"]
        assert sorted(c.kind for c in blk.bwd_comm) == ["all_gather", "reduce_scatter"]  # Oases: no re-gather
