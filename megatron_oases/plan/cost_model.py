"""The Oases cost model (paper §4.2): node, edge and memory costs of every block x strategy.

Per block and strategy the Pricer gives, for ONE sub-batch, forward compute C, forward
communication M, backward compute C' (recompute + dgrad + wgrad) and backward communication M'.
With the Oases split (``sub_batches=2``, ``describe.split``) the executor runs the blocks in lock-step: one
sub-batch's compute overlaps the other's collective, so a chain of blocks 0..N-1 costs (forward)

    C_0 + sum_v max(C_v, M_v) + sum_(u,v) max(C_v, M_u) + M_(N-1)

(the first compute and the last collective have no partner; backward is the same in reverse with
C', M'). The node cost (Eq. 3) is ``max(C_v, M_v)`` plus the first/last terms; the cross term
``max(C_v, M_u)`` depends on both neighbours and lives on the edge. When neighbours differ in
layout (Eq. 4), an exclusive all-gather reshards the activation (forward, when the next block
has fewer replicas) or its gradient (backward, when the previous block has fewer), the other
direction slices, and the overlap across that edge is lost both ways (the runtime runs each
degree as its own executor pass): the edge costs ``M_u + AG + C_v`` (AG 0 where it slices)
instead of ``max(C_v, M_u)``. Where the sub-batches join inside a block (an MoE block's routing
with the aux loss on, ``BlockCost.fwd_joined``) its forward is two such chains: the block's part
up to the join (C_a, M_a) ends one, the rest (C_b, M_b) starts the next, so its node costs
``max(C_a, M_a) + M_a + C_b + max(C_b, M_b)``, its incoming edge reads C_a and its outgoing M_b.
A collective its rank waits for where it issues it (``Collective.blocking``: the MoE block's
gather of the token counts) overlaps nothing of the other sub-batch: it counts in C, as the
simulator runs it on the compute stream (``describe.ops.holds_compute``, one rule for both).
The embedding and the logits run at degree T; blocks next to them pay that resharding too.
With ``sub_batches=1`` (stock executor) node ``C + M``, edge ``AG``; the only overlap is stock
Megatron's own: a column-parallel linear's input-gradient all-reduce runs async beside its
weight-gradient GEMM, so ``M'`` excludes ``min(all-reduce, wgrad)`` (as the simulator models it).

Per iteration: ``num_microbatches`` x (forward + backward). With ``grad_sync`` also, per block,
the all-reduce of its fp32 weight gradient over its data-parallel replicas (T/d inside the TP
group x DP), unoverlapped (as the simulator models DP); off by default, as in the paper's Eq. 5,
where it hides behind the backward pass (DDP / ``--overlap-grad-reduce``). Memory (Eq. 6) per
block: parameters + gradients + Adam states, the tensors saved for backward, and the backward
working set (see ``block_memory``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from megatron_oases.describe.backends import backend
from megatron_oases.describe.ops import Collective, holds_compute
from megatron_oases.describe.head import head_param_tensors, head_saved_bytes
from megatron_oases.describe.megatron_1d import STOCK_ASYNC_DGRAD, column_wgrad
from megatron_oases.describe.moe import moe_refusal
from megatron_oases.describe.planned import reshard_shape
from megatron_oases.describe.shapes import batch_split_refusal
from megatron_oases.describe.plan_degrees import replica_share
from megatron_oases.describe.split import split_refusal, sub_batch_sizes, sub_batches_at
from megatron_oases.topology import Topology

from .graph import (Block, PlanError, PlanModel, BlockStrategy, attention_fits, block_ops, build_graph,
                    candidate_strategies, family_of, split_blocks)
from .moe_blocks import (MOE_KIND, expert_dp_ranks, moe_group_ranks, moe_joined_ops, moe_memory, moe_ops, moe_params,
                         moe_shape_of)
from .memory import reshard_kept_bytes, state_bytes_per_param
from .problem import PlanProblem
from .pricing import DevicePricer, Pricer, event_shape

GRANULARITIES = ("block", "layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockCost:
    """One block kind under one strategy; times in ms for one sub-batch."""

    c_fwd: float
    m_fwd: float
    c_bwd: float
    m_bwd: float
    params: int
    state_bytes: float
    saved_bytes: float
    runtime_bytes: float
    grad_sync_ms: float
    """Per iteration: fp32 gradient all-reduce over the block's data-parallel replicas."""
    fwd_joined: tuple[float, float] | None = None
    """(C, M) of the forward up to where the Oases sub-batches join inside the block (an MoE
    block's routing with the aux loss on: ``moe_blocks.moe_joined_ops``); None where they do not."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """Everything the ILP and the reports need for one planning request."""

    model: PlanModel
    strategies: tuple[BlockStrategy, ...]
    blocks: tuple[Block, ...]
    costs: dict[tuple[str, int], BlockCost]
    """(block kind, strategy index) -> costs."""
    reshard_fwd_ms: np.ndarray
    """(K, K) all-gather ms per micro-batch (all sub-batches) from strategy a to b, forward."""
    reshard_bwd_ms: np.ndarray
    embed_bwd_ms: np.ndarray
    """(K,) backward all-gather from block 0 at strategy k into the degree-T embedding."""
    head_fwd_ms: np.ndarray
    """(K,) forward all-gather from the last block into the degree-T logits."""
    reshard_saved_bytes: np.ndarray
    """(K, K) bytes one micro-batch keeps at an edge from strategy a to b (under Oases the
    reshard's output where the degree changes: ``memory.reshard_kept_bytes``); the edge from the
    degree-T embedding into block 0 is in ``problem.mem[0]``."""
    num_microbatches: int
    data_parallel: int
    global_batch_size: int
    grad_sync: bool
    granularity: str
    problem: PlanProblem
    pricing: dict[str, Any]

    @property
    def degrees(self) -> list[int]:
        return [s.degree for s in self.strategies]

    def uniform(self, degree: int) -> tuple[int, ...] | None:
        """The assignment with every block at Megatron 1-D ``degree`` (None if that strategy is not
        a candidate)."""
        ks = [k for k, s in enumerate(self.strategies) if family_of(s).mixes and s.degree == degree]
        return (ks[0],) * len(self.blocks) if ks else None

    def breakdown(self, assignment) -> list[dict[str, Any]]:
        """Per block: degree, node / incoming-edge / grad-sync ms per iteration, memory bytes."""
        p, out = self.problem, []
        for v, k in enumerate(assignment):
            c = self.costs[(self.blocks[v].kind, k)]
            grad = c.grad_sync_ms if self.grad_sync else 0.0
            edge = float(p.edge[v - 1, assignment[v - 1], k]) if v else 0.0
            kept_in = float(p.edge_mem[v - 1, assignment[v - 1], k]) if v else 0.0
            out.append({"block": v, "layer": self.blocks[v].layer, "kind": self.blocks[v].kind,
                        "degree": self.strategies[k].degree, "strategy": self.strategies[k].label,
                        "node_ms": float(p.node[v, k]) - grad, "edge_in_ms": edge, "grad_sync_ms": grad,
                        "time_ms": float(p.node[v, k]) + edge,
                        "state_bytes": c.state_bytes, "saved_bytes": c.saved_bytes,
                        # the saved bytes of each micro-batch in flight, with what its incoming edge keeps
                        "memory_bytes": float(p.mem[v, k]) + kept_in,
                        "runtime_bytes": c.runtime_bytes})
        return out


def _strategy_costs(m: PlanModel, s: BlockStrategy, pricer: Pricer, dp: int) -> dict[str, BlockCost]:
    fam = family_of(s)
    share = replica_share(m.micro_batch_size, s.degree, m.tp)  # describe.plan_degrees
    chains = sub_batches_at(s.degree, oases=m.sub_batches > 1,  # as the runtime runs the block
                            expert_parallel=m.ep if m.moe is not None else 1)
    if chains > 1:
        sub, scale = sub_batch_sizes(share, chains)[0], 1.0
    else:  # degree 1 (no collective) or stock: the whole share in one run, split evenly in time
        sub, scale = share, 1.0 / m.sub_batches
    shape, dims = event_shape(m, sub, s)
    ops = (fam.split or split_blocks)(fam.describe(s, m, sub))
    joined = None
    if m.moe is not None:  # an MoE layer's second block (moe_blocks: describe.moe's MoE block)
        moe_f, moe_b = moe_ops(m, s.degree, sub)
        ops.append(block_ops(MOE_KIND, moe_f, moe_b))
        pre = moe_joined_ops(m, moe_f)
        joined = block_ops(MOE_KIND, pre, ()) if pre else None
    grad_ranks = tuple(j * s.degree + m.tp * i for i in range(dp) for j in range(m.tp // s.degree))
    out = {}

    def keyed(op) -> dict:  # an MoE op's event carries the MoE flags (moe_blocks.moe_shape_of)
        op_shape, op_dims = moe_shape_of(m, op.name, shape, dims)
        return {"shape": op_shape, "dims": op_dims}

    def comm(cs) -> float:
        return sum(pricer.collective_ms(c, **keyed(c), ranks=moe_group_ranks(m, s.degree, c.axis)
                                        or fam.group_ranks(s, c.axis)) for c in cs)

    def compute(cs) -> float:
        return scale * sum(pricer.compute_ms(c, **keyed(c)) for c in cs)

    def hidden_by_wgrad(cs) -> float:
        """Stock Megatron (one sub-batch, 1-D TP) runs a column-parallel linear's input-gradient
        all-reduce async beside its weight-gradient GEMM: that much of the collective is hidden."""
        if m.sub_batches != 1 or not backend(s.family).megatron_modules or s.degree == 1:
            return 0.0
        out = 0.0
        for c in cs:
            if c.name in STOCK_ASYNC_DGRAD:
                w = column_wgrad(STOCK_ASYNC_DGRAD[c.name], b=sub, s=m.seq_length, h=m.hidden_size,
                                 heads=m.num_attention_heads, f=m.ffn_hidden_size, t=s.degree, e=m.bytes_per_element,
                                 variant=m.variant)
                out += min(comm([c]), scale * pricer.compute_ms(w, shape=shape, dims=dims))
        return out

    def grad_sync(params: int, ranks: tuple[int, ...]) -> float:
        g_op = Collective(name="grad.ar", kind="all_reduce", axis="dp", group_size=len(ranks), payload_bytes=4 * params)
        return pricer.collective_ms(g_op, shape=f"p{params}_fp32", ranks=ranks, dims=(("p", params), ("dtype", "fp32")))

    def on_stream(cs) -> tuple[float, float]:
        """(compute, comm) ms of collectives ``cs``: one its rank waits for where it issues it
        holds the compute stream (``describe.ops.holds_compute``, as the simulator places it)."""
        return comm([c for c in cs if holds_compute(c)]), comm([c for c in cs if not holds_compute(c)])

    for blk in ops:
        (held_f, m_f), (held_b, m_b) = on_stream(blk.fwd_comm), on_stream(blk.bwd_comm)
        c_own = compute(blk.fwd_compute)
        c_f, c_b = c_own + held_f, compute(blk.bwd_compute) + held_b
        c_b += c_own if m.recompute else 0.0  # full recompute reruns the block's forward before its backward,
        rerun = m.recompute and not m.fine_grained  # its collectives too unless fine-grained
        c_b += held_f if rerun else 0.0
        moe = blk.kind == MOE_KIND
        params, experts = moe_params(m, s.degree) if moe else (fam.params(s, m, blk.kind), 0)
        # the experts' gradients and optimizer states live on the expert-data-parallel group (DP / EP)
        expert_ranks = expert_dp_ranks(m, dp) if moe else grad_ranks
        shard, expert_shard = ((len(grad_ranks), len(expert_ranks)) if m.distributed_optimizer else (1, 1))
        saved, runtime = fam.memory(s, m, "mlp" if moe else blk.kind, share)
        if moe:
            saved, runtime = moe_memory(m, saved, runtime)
        out[blk.kind] = BlockCost(c_fwd=c_f, m_fwd=m_f, c_bwd=c_b,
                                  m_bwd=m_b + (m_f if rerun else 0.0)
                                  - hidden_by_wgrad(blk.bwd_comm),
                                  params=params, state_bytes=(params - experts) * state_bytes_per_param(m, shard)
                                  + experts * state_bytes_per_param(m, expert_shard),
                                  saved_bytes=saved, runtime_bytes=runtime,
                                  grad_sync_ms=grad_sync(params - experts, grad_ranks)
                                  + (grad_sync(experts, expert_ranks) if experts else 0.0),
                                  fwd_joined=_joined_costs(compute(joined.fwd_compute), on_stream(joined.fwd_comm))
                                  if moe and joined else None)
    return out


def _joined_costs(compute_ms: float, comm_ms: tuple[float, float]) -> tuple[float, float]:
    """``BlockCost.fwd_joined``'s (C, M) of the part before the join: its compute and the
    collectives that hold the compute stream, and the others."""
    return compute_ms + comm_ms[0], comm_ms[1]


def _reshard_ms(m: PlanModel, a: BlockStrategy, b: BlockStrategy, pricer: Pricer) -> tuple[float, float]:
    """(forward, backward) all-gather ms of one micro-batch (every sub-batch) between a and b:
    between Megatron degrees one reshard of the whole share (the runtime's, keyed as the
    simulator keys it); at an ATP / 3-D edge the backend's conversion, once per sub-batch."""
    other = a if not family_of(a).mixes else b  # the family that knows how to enter / leave it
    rs = family_of(other).reshard(a, b, m)
    hi = max(a.degree, b.degree)
    if family_of(other).mixes:
        runs = 1
        shape, dims = reshard_shape(share=replica_share(m.micro_batch_size, hi, m.tp), seq=m.seq_length, hidden=m.hidden_size,
                                    degree=hi, dtype=m.dtype)
    else:
        runs = m.sub_batches
        samples = replica_share(m.micro_batch_size, hi, m.tp) // m.sub_batches or 1
        shape, dims = event_shape(m, samples, dataclasses.replace(other, degree=hi))

    def total(first, first_ranks, more) -> float:
        steps = ((first, first_ranks),) + tuple(more) if first else tuple(more)
        return sum(pricer.collective_ms(op, shape=shape, ranks=ranks, dims=dims) for op, ranks in steps)

    f = total(rs.forward, rs.ranks_forward, rs.more_forward)
    g = total(rs.backward, rs.ranks_backward, rs.more_backward)
    return runs * f, runs * g


def build_cost_model(m: PlanModel, *, topology: Topology, global_batch_size: int, pricer: Pricer | None = None,
                     data_parallel: int | None = None, memory_gb: float | None = None, grad_sync: bool = False, granularity: str = "block",
                     degrees: tuple[int, ...] | None = None, gpu: str | None = None,
                     families: tuple[str, ...] = ("megatron",), pipeline: int = 1) -> CostModel:
    """Price every block x strategy and assemble the ILP arrays (Eq. 3-6) for ``data_parallel``
    replicas of the TP group (None: the topology's ranks / TP). ``pipeline``: the stages of a
    pipeline whose one stage ``m`` is (its layers; each stage runs the same degrees): 1F1B runs a
    stage's forward and backward ``num_microbatches + pipeline - 1`` times in the time of an
    iteration (its bubble), and the first stage keeps ``min(pipeline, num_microbatches)``
    micro-batches' saved bytes at its peak, as the simulator's schedule does."""
    if granularity not in GRANULARITIES:
        raise PlanError(f"--granularity must be one of {', '.join(GRANULARITIES)} (got {granularity!r})")
    world = topology.world_size
    if data_parallel is None and world % m.tp:
        raise PlanError(f"topology {topology.name!r} has {world} ranks, not a multiple of "
                        f"--tensor-model-parallel-size {m.tp}")
    dp = world // m.tp if data_parallel is None else data_parallel
    if m.moe is not None and dp % m.ep:  # the trainer's rule (describe.moe.moe_refusal)
        raise PlanError(moe_refusal(m.moe, tp=m.tp, ep=m.ep, dp=dp, sequence_parallel=m.sequence_parallel,
                                    bias=m.variant.bias))
    refused = batch_split_refusal(global_batch=global_batch_size, micro_batch=m.micro_batch_size, dp=dp)
    if refused:
        raise PlanError(refused)
    n_micro = global_batch_size // (m.micro_batch_size * dp)
    runs, in_flight = n_micro + pipeline - 1, min(pipeline, n_micro)
    if m.sub_batches > 1 and split_refusal(m.micro_batch_size, m.sub_batches):
        raise PlanError(split_refusal(m.micro_batch_size, m.sub_batches))
    pricer = pricer or DevicePricer(topology=topology, model=m, gpu=gpu)
    strategies = candidate_strategies(m, degrees, families)
    blocks = build_graph(m)
    costs = {}
    for k, s in enumerate(strategies):
        for kind, c in _strategy_costs(m, s, pricer, dp).items():
            costs[(kind, k)] = c
    K, N, S = len(strategies), len(blocks), m.sub_batches
    full = BlockStrategy(degree=m.tp)
    rf, rb = np.zeros((K, K)), np.zeros((K, K))
    for a in range(K):
        for b in range(K):
            if a != b and not (family_of(strategies[a]).mixes and family_of(strategies[b]).mixes):
                rf[a, b] = rb[a, b] = np.inf  # the runtime cannot put these blocks side by side
            else:
                rf[a, b], rb[a, b] = _reshard_ms(m, strategies[a], strategies[b], pricer)
    embed_b = np.array([_reshard_ms(m, full, s, pricer)[1] for s in strategies])
    head_f = np.array([_reshard_ms(m, s, full, pricer)[0] for s in strategies])

    def arr(kind: str, field: str) -> np.ndarray:
        return np.array([getattr(costs[(kind, k)], field) for k in range(K)])

    kinds = [b.kind for b in blocks]
    C = {kd: arr(kd, "c_fwd") for kd in set(kinds)}
    M = {kd: arr(kd, "m_fwd") for kd in set(kinds)}
    Cb = {kd: arr(kd, "c_bwd") for kd in set(kinds)}
    Mb = {kd: arr(kd, "m_bwd") for kd in set(kinds)}
    # where the sub-batches join inside a block, the chain ends there and a new one starts
    # (module docstring): its entry compute and exit collective are those of its two parts
    Cin, Mout, Fnode = {}, {}, {}
    for kd in set(kinds):
        parts = [costs[(kd, k)].fwd_joined for k in range(K)]
        ca = np.array([p[0] if p else c for p, c in zip(parts, C[kd])])
        ma = np.array([p[1] if p else 0.0 for p in parts])
        cb, mb = C[kd] - ca, M[kd] - ma
        joined = np.array([p is not None for p in parts])
        Cin[kd], Mout[kd] = ca, np.where(joined, mb, M[kd])
        Fnode[kd] = np.where(joined, np.maximum(ca, ma) + ma + cb + np.maximum(cb, mb), np.maximum(C[kd], M[kd]))
    node = np.zeros((N, K))
    for v, kd in enumerate(kinds):
        if S > 1:  # the lock-step of the Oases split's two sub-batches (module docstring)
            f = Fnode[kd] + (Cin[kd] if v == 0 else 0) + (Mout[kd] if v == N - 1 else 0)
            g = np.maximum(Cb[kd], Mb[kd]) + (Cb[kd] if v == N - 1 else 0) + (Mb[kd] if v == 0 else 0)
        else:
            f, g = C[kd] + M[kd], Cb[kd] + Mb[kd]
        edge_terms = (embed_b if v == 0 else 0) + (head_f if v == N - 1 else 0)
        node[v] = runs * (f + g + edge_terms) + (arr(kd, "grad_sync_ms") if grad_sync else 0)
        if kd == "attention":  # GQA: a degree that splits a key/value group is not allowed
            node[v] = np.where([attention_fits(s, m) for s in strategies], node[v], np.inf)
    edge = np.zeros((max(N - 1, 0), K, K))
    # Each run of blocks at one strategy is its own pass of the Oases executor (the runtime's
    # segments, schedules/oases/block.py; the simulator's chains join there too): the two
    # sub-batches meet at every change of strategy, whether the reshard gathers or slices.
    change = np.array([[a != b for b in strategies] for a in strategies])
    for v in range(N - 1):
        u_k, v_k = kinds[v], kinds[v + 1]
        if S > 1:
            same_f = np.maximum(Cin[v_k][None, :], Mout[u_k][:, None])
            lost_f = Mout[u_k][:, None] + rf + Cin[v_k][None, :]
            same_b = np.maximum(Cb[u_k][:, None], Mb[v_k][None, :])
            lost_b = Mb[v_k][None, :] + rb + Cb[u_k][:, None]
            fwd = np.where(change, lost_f, same_f)
            bwd = np.where(change, lost_b, same_b)
        else:
            fwd, bwd = rf, rb
        edge[v] = runs * (fwd + bwd)
    kept = np.array([[reshard_kept_bytes(m, a.degree, b.degree) for b in strategies] for a in strategies])
    mem = np.array([arr(kd, "state_bytes") + in_flight * arr(kd, "saved_bytes") for kd in kinds])
    mem[0] += in_flight * np.array([reshard_kept_bytes(m, m.tp, s.degree) for s in strategies])  # from the embedding
    edge_mem = np.broadcast_to(in_flight * kept, (max(N - 1, 0), K, K)).copy()
    peak = np.array([arr(kd, "runtime_bytes") for kd in kinds])
    e, h, V, T, b, s = (m.bytes_per_element, m.hidden_size, m.padded_vocab_size, m.tp, m.micro_batch_size, m.seq_length)
    # the head on the plan's one stage (describe.head): embedding + final norm (+ an untied output
    # layer: the planner's model ties them); what it keeps; the embedding's output while the
    # layers run
    head = dict(v=V, h=h, t=T, first=True, last=True)
    emb_params = sum(head_param_tensors(**head, seq=s, variant=m.variant, output_copy=False))
    const = (emb_params * state_bytes_per_param(m, dp if m.distributed_optimizer else 1)
             + b * s * h * e + head_saved_bytes(**head, b=b, s=s, e=e, hidden_dropout=False))
    ties = tuple((2 * i, 2 * i + 1) for i in range(m.num_layers)) if granularity == "layer" else ()
    budget = memory_gb * float(1 << 30) if memory_gb is not None else None
    problem = PlanProblem(node=node, edge=edge, mem=mem, peak=peak, mem_const=float(const), budget=budget, ties=ties,
                          edge_mem=edge_mem)
    return CostModel(model=m, strategies=tuple(strategies), blocks=tuple(blocks), costs=costs, reshard_fwd_ms=rf,
                     reshard_bwd_ms=rb, embed_bwd_ms=embed_b, head_fwd_ms=head_f, reshard_saved_bytes=kept,
                     num_microbatches=n_micro,
                     data_parallel=dp, global_batch_size=global_batch_size, grad_sync=grad_sync,
                     granularity=granularity, problem=problem, pricing=pricer.summary())
