"""Model + strategy -> the events each pipeline stage runs, read from the shared layer description.

DistSim §4.1-4.2: TP maps a layer onto compute and collective events; identical events (same
name, shapes, dtype and group class) are priced once. One representative device per stage stands
for its TP peers and DP replicas, which run the same events. Each event carries ``dims`` (the
sizes its work depends on) so the profiler can run the matching torch ops.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

from ...describe.backends import backend as record
from ...describe.head import head_ops, head_param_tensors
from ...describe.megatron_1d import OUTPUT_ASYNC_DGRAD, STOCK_ASYNC_DGRAD, column_wgrad
from ...describe.event_key import layer_shape
from ...describe.moe import MOE_AXES
from ...describe.ops import LOOP_EVENTS, Collective, Compute
from ...describe.planned import degree_reshard, megatron_blocks, reshard_shape
from ...describe.shapes import GPTShape
from ...describe.registry import (MLP_PARAM_TENSORS, axis_ranks, block_edges, block_param_tensors,
                                 layer_description, layer_param_tensors)
from ...pricing.event import Event, group_tag
from ...topology import Topology
from .moe import expert_dp_ranks, expert_tensor_count, is_moe_layer, is_moe_op, layer_expert_params, \
    moe_axis_ranks, moe_layer_tensors
from .strategy import Strategy, block_sub_batches, check, stage_layer_counts
from .tape import CURRENT, OasesTape


class ChunkTensor(NamedTuple):
    """One parameter tensor of a chunk on one rank."""

    params: int
    need: int
    """Events of the chunk's flattened forward that run before the tensor is first used."""
    ready: int
    """Events of the chunk's flattened backward that must finish before its gradient is complete."""
    shared: bool = False
    """The tied word embedding / output-layer copy across pipeline stages (Megatron's
    ``shared_embedding``): its own bucket under the distributed optimizer."""
    expert: bool = False
    """An MoE expert's: in Megatron-Core's expert buffer, reduced over the expert-data-parallel
    group (``sim.core.moe.expert_dp_ranks``), not in the DP buckets."""


@dataclasses.dataclass(frozen=True)
class GradBucket:
    """One DDP bucket under ``overlap_grad_reduce``: its reduction, released when the chunk's last
    micro-batch's backward has run ``ready`` events, and (``overlap_param_gather``) its parameter
    all-gather, needed by the chunk's first forward after ``need`` events."""

    chunk: int
    params: int
    ready: int
    need: int
    reduce: Event
    gather: Event | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkEvents:
    """One micro-batch (or sub-batch, under oases) through one model chunk of one stage."""

    stage: int
    chunk: int
    layers: int
    forward_segments: tuple[tuple[tuple[Event, ...], int], ...]
    """(events, chains) in order: under oases the layers run as one chain per sub-batch of the
    Oases split (``describe.split``), and so do the head's TP collectives (``describe.head``'s
    ``split_*``), while the embedding's and the logits' compute and the loss run on the whole
    micro-batch (1 chain)."""
    backward_segments: tuple[tuple[tuple[Event, ...], int], ...]
    """Includes the recomputed forward of each layer before its backward when recompute is on."""
    send_forward: Event | None
    send_backward: Event | None
    param_tensors: tuple[ChunkTensor, ...] = ()
    """The chunk's parameter tensors in Megatron's registration (forward) order, with where in
    the chunk's events each is first used and has its gradient: the DDP buckets' timing."""

    @property
    def forward(self) -> tuple[Event, ...]:
        return tuple(ev for evs, _ in self.forward_segments for ev in evs)

    @property
    def backward(self) -> tuple[Event, ...]:
        return tuple(ev for evs, _ in self.backward_segments for ev in evs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageEvents:
    """A stage's chunks plus its end-of-step work (DP all-reduce, tie all-reduce, optimizer)."""

    stage: int
    chunks: tuple[ChunkEvents, ...]
    grad_allreduce: Event | None
    tie_allreduce: Event | None
    """Embedding-gradient all-reduce between the first and the last stage (tied, PP > 1)."""
    grad_norm: Event | None
    norm_allreduce: Event | None
    optimizer: Event | None
    param_allgather: Event | None
    """Distributed optimizer: updated parameters all-gathered over DP after the step."""
    params_per_rank: int
    chains: int
    """Sub-batches that run the layers' events concurrently: 1, or 2 under oases (the chunks'
    segments say which events run that way)."""
    replica_allreduce: tuple[Event, ...] = ()
    """A plan's blocks of degree d < T: their gradients summed over the T/d replicas (one
    all-reduce per degree, after the DP and tie reductions, as ``finalize_with_replica_grads``)."""
    grad_buckets: tuple[GradBucket, ...] = ()
    """``overlap_grad_reduce``: the DP reduction per bucket, in launch order per chunk (then
    ``grad_allreduce`` is None); with ``overlap_param_gather`` each carries its gather (then
    ``param_allgather`` is None)."""

    # One-chunk conveniences (the non-interleaved schedules).
    @property
    def forward(self) -> tuple[Event, ...]:
        return self.chunks[0].forward

    @property
    def backward(self) -> tuple[Event, ...]:
        return self.chunks[0].backward

    @property
    def send_forward(self) -> Event | None:
        return self.chunks[0].send_forward

    @property
    def send_backward(self) -> Event | None:
        return self.chunks[0].send_backward




@functools.lru_cache(maxsize=4096)
def _collective(op: Collective, shape: str, topo: Topology, ranks: tuple[int, ...], dims) -> Event:
    axis = op.axis
    key = f"{op.kind}:{op.name}[{shape}]@{axis}x{group_tag(topo, ranks)}"
    return Event(key=key, name=op.name, kind="collective", op=op, ranks=ranks, nbytes=op.payload_bytes,
                 dims=dims)


def _compute(op: Compute, shape: str, dims) -> Event:
    return Event(key=f"compute:{op.name}[{shape}]", name=op.name, kind="compute", op=op, dims=dims)


def build_stage_events(model: GPTShape, strategy: Strategy, topo: Topology,
                       tape: OasesTape = CURRENT) -> list[StageEvents]:
    """Per-stage event lists for stage representatives (tp rank 0, dp replica 0); under Oases
    the executor's program as ``tape`` says (``sim.core.tape``: the current one by default)."""
    check(model, strategy, topo.world_size)
    s, m = strategy, model
    chains = block_sub_batches(s)
    b, e, t, vp = m.micro_batch_size // chains, m.bytes_per_element, s.tp, s.virtual_stages
    layer = layer_description(backend=s.backend, layout=s.layout, micro_batch=b, seq=m.seq_length, hidden=m.hidden_size,
                              heads=m.num_attention_heads, ffn=m.ffn_hidden_size, tp=t, bytes_per_element=e,
                              variant=m.variant, sequence_parallel=s.sequence_parallel,
                              schedule="oases" if s.oases_runs else "stock",
                              attention_dropout=m.attention_dropout > 0, hidden_dropout=m.hidden_dropout > 0,
                              recompute_core_attention=s.selective_recompute, core_attention=m.core_attention)
    moe_layer = None if m.moe is None else layer_description(
        backend=s.backend, layout=s.layout, micro_batch=b, seq=m.seq_length, hidden=m.hidden_size,
        heads=m.num_attention_heads, ffn=m.ffn_hidden_size, tp=t, bytes_per_element=e, variant=m.variant,
        sequence_parallel=s.sequence_parallel, schedule="oases" if s.oases_runs else "stock",
        attention_dropout=m.attention_dropout > 0, hidden_dropout=m.hidden_dropout > 0,
        recompute_core_attention=s.selective_recompute, core_attention=m.core_attention, moe=m.moe, ep=s.ep)
    # where the chunk's run of layers meets Megatron's replicated [s, b, h] (ATP, 3-D)
    leave, enter_b = block_edges(backend=s.backend, layout=s.layout, micro_batch=b, seq=m.seq_length, hidden=m.hidden_size,
                                 tp=t, bytes_per_element=e)
    shape, dims = _block_shape(m, s, t, chains)
    # the head's compute runs on the whole micro-batch, its TP collectives per sub-batch under oases
    hb = m.micro_batch_size
    head_shape = f"b{hb}s{m.seq_length}h{m.hidden_size}v{m.padded_vocab_size}t{t}_{m.dtype}"
    head_dims = (("b", hb),) + dims[1:10]  # the layer's sizes, without dropout and executor
    sub_shape = f"b{hb // chains}s{m.seq_length}h{m.hidden_size}v{m.padded_vocab_size}t{t}_{m.dtype}"
    sub_dims = (("b", hb // chains),) + dims[1:10]
    head_unit = None if s.block_degrees is None else t  # a plan runs the head at the whole TP group
    act = b * m.seq_length * m.hidden_size * e
    counts = stage_layer_counts(m, s)
    out = []
    for st in range(s.pp):
        per_chunk = counts[st]
        n_rc = 0 if not s.recompute else min(s.recompute_layers, per_chunk) if s.recompute_layers else per_chunk
        offset = sum(counts[:st])  # the stage's first layer (vp = 1 when counts are uneven)
        tp_ranks = tuple(s.rank(tp=i, pp=st) for i in range(t))

        def ev(op):
            return _op_event(op, m, s, topo, tp_ranks, t, chains, (shape, dims))

        def head_ev(op):
            if isinstance(op, Compute):
                return _compute(op, head_shape, head_dims)
            return _collective(op, head_shape, topo, tp_ranks, head_dims)

        fine = s.oases_runs and s.fine_grained_recompute

        def layer_events(desc, index):  # (forward, backward, recomputed forward, joins) of one layer
            fwd_l = [ev(op) for op in desc.forward]
            bwd_l = [ev(op) for op in desc.backward] + [_grad_event(m, sum(layer_tensors(m, s, index)), chains, tape)]
            return fwd_l, bwd_l, [x for x in fwd_l if x.kind == "compute"] if fine else fwd_l, \
                desc.joins if chains > 1 else ()
        kinds = {False: layer_events(layer, 1 if m.moe is not None and m.moe.layer_freq > 1 else 0)}
        if moe_layer is not None:  # layer 0 is always an MoE layer (``MoEShape.is_moe``)
            kinds[True] = layer_events(moe_layer, 0)
        chunks = []
        for c in range(vp):
            g = c * s.pp + st
            first, last = g == 0, g == s.pp * vp - 1
            if s.block_degrees is None:
                # each layer's events: dense, or MoE (``--moe-layer-freq``)
                base = g * per_chunk if vp > 1 else offset
                mine = [kinds[is_moe_layer(m, base + i)] for i in range(per_chunk)]
                # Backward visits layers last to first; the first n_rc layers of the chunk recompute.
                bwd_layers = [(mine[i][2] if i < n_rc else []) + mine[i][1] for i in reversed(range(per_chunk))]
                bwd = [x for evs in bwd_layers for x in evs]
                fwd_parts = _joined([(f_l, joins) for f_l, _, _, joins in mine], [ev(op) for op in leave], chains)
                bwd_parts = [(bwd + [ev(op) for op in enter_b], chains)]
                starts = [sum(len(f_l) for f_l, *_ in mine[:i]) for i in range(per_chunk)]
                ends = [sum(len(evs) for evs in bwd_layers[:j + 1]) for j in range(per_chunk)]
            else:
                blocks = s.block_degrees[2 * g * per_chunk:2 * (g + 1) * per_chunk]
                fwd_parts, bwd_parts = _planned_chunk(m, s, topo, tp_ranks, blocks, g * per_chunk)
                # each layer: (reshard, block) parts for its attention and its MLP
                starts = [sum(len(p[0]) for p in fwd_parts[:4 * i]) for i in range(per_chunk)]
                ends = [sum(len(p[0]) for p in bwd_parts[:4 * (j + 1)]) for j in range(per_chunk)]
            # the head around the layers (describe.head); the output layer's wgrad runs beside
            # the all-reduce of its input gradient
            hd = head_ops(b=hb, s=m.seq_length, h=m.hidden_size, v=m.padded_vocab_size, t=t, e=e,
                          first=first, last=last, sequence_parallel=s.sequence_parallel,
                          learned_positions=not m.variant.rotary,
                          sub_batches=chains if tape.head_split else 1)
            pre_f, post_f, post_b = ([head_ev(op) for op in ops]
                                     for ops in (hd.pre_forward, hd.post_forward, hd.post_backward))
            split_pre_f, split_post_f, split_pre_b, split_post_b = (
                [_collective(op, sub_shape, topo, tp_ranks, sub_dims) for op in ops]
                for ops in (hd.split_pre_forward, hd.split_post_forward, hd.split_pre_backward,
                            hd.split_post_backward))
            if s.loop_overhead:  # the trainer's host work of this chunk's micro-batch, up front
                mb, per_layer = (head_ev(Compute(name=n, gemm_flops=0.0)) for n in LOOP_EVENTS)
                pre_f = [mb] + [per_layer] * per_chunk + pre_f
            pre_b = [head_ev(op) for op in hd.pre_backward]
            for i, op in enumerate(hd.pre_backward):
                if op.name in OUTPUT_ASYNC_DGRAD and s.async_dgrad:
                    pre_b[i] = dataclasses.replace(pre_b[i], beside=_compute(hd.output_wgrad, head_shape, head_dims))
            me = s.rank(pp=st)
            send_f = send_b = None
            if not last:
                nxt = s.rank(pp=(g + 1) % s.pp)
                send_f = Event(key=f"p2p:activation[{shape}]@ppx{group_tag(topo, (me, nxt))}", name="send_forward",
                               kind="p2p", ranks=(me, nxt), nbytes=act * chains, dims=dims)
            if not first:
                prv = s.rank(pp=(g - 1) % s.pp)
                send_b = Event(key=f"p2p:activation[{shape}]@ppx{group_tag(topo, (me, prv))}", name="send_backward",
                               kind="p2p", ranks=(me, prv), nbytes=act * chains, dims=dims)
            fwd_segs = _segments((pre_f, 1), (split_pre_f, chains, head_unit), *fwd_parts,
                                 (split_post_f, chains, head_unit), (post_f, 1))
            bwd_segs = _segments((pre_b, 1), (split_pre_b, chains, head_unit), *bwd_parts,
                                 (split_post_b, chains, head_unit), (post_b, 1))
            n_f, n_b = (sum(len(evs) for evs, _ in segs) for segs in (fwd_segs, bwd_segs))
            base = g * per_chunk if vp > 1 else offset
            f0, b0 = len(pre_f) + len(split_pre_f), len(pre_b) + len(split_pre_b)
            where = _TensorWhere(layers=[base + i for i in range(per_chunk)],
                                 starts=[f0 + x for x in starts], ends=[b0 + x for x in ends],
                                 head_need=n_f - len(post_f) - len(split_post_f), head_ready=len(pre_b),
                                 total_ready=n_b)
            chunks.append(ChunkEvents(stage=st, chunk=c, layers=per_chunk, forward_segments=fwd_segs,
                                      backward_segments=bwd_segs, send_forward=send_f, send_backward=send_b,
                                      param_tensors=_chunk_tensors(m, s, first, last, where)))
        out.append(_stage_tail(m, s, topo, st, tuple(chunks), chains))
    return out


def grad_accumulate(params: int, bytes_per_element: int, chains: int, per_sub_batch: bool = False) -> Compute:
    """A layer's weight gradients (``params`` on this rank) added into Megatron DDP's fp32
    ``main_grad`` once per micro-batch, as one of ``chains`` sub-batch events sharing it: read
    main_grad, read the gradient, write main_grad ((8 + e) bytes a parameter in e-byte training;
    DDP's hook, stock and Oases alike since ``schedules/oases/wgrad.py``). Under Oases with 16-bit
    weights each sub-batch after the first accumulates into the first's 16-bit sum (``addmm_``
    reads it: e bytes a parameter); with fp32 weights each sub-batch's GEMM accumulates into
    main_grad itself (its 4-byte read) and no add follows. A stack with gradient-accumulation
    fusion (Apex's or Transformer Engine's fp32-output weight GEMM) prices it 0
    (``DeviceModel.gpu_compute_ms``). ``per_sub_batch`` (the executor before ``69398c8``,
    ``sim.core.tape``): every sub-batch adds its own gradient, (8 + e) bytes a parameter each."""
    from ...pricing.device_model import GRAD_ACCUMULATE

    e = bytes_per_element
    if per_sub_batch:
        per_param = 8.0 + e
    else:
        per_param = 4.0 if e == 4 and chains > 1 else ((8 + e) + e * (chains - 1)) / chains
    return Compute(name=GRAD_ACCUMULATE, gemm_flops=0.0, elementwise_bytes=per_param * params)


def _grad_event(m: GPTShape, params: int, chains: int, tape: OasesTape = CURRENT) -> Event:
    """``grad_accumulate`` as the layer's event, keyed by what it moves: the elements of one
    fp32 += e-byte add of the same bytes (what the profiler's workload adds,
    ``sim.calibrate.workloads``)."""
    op = grad_accumulate(params, m.bytes_per_element, chains, tape.grad_add_per_sub_batch and chains > 1)
    n = round(op.elementwise_bytes / (8 + m.bytes_per_element))
    return _compute(op, f"n{n}_{m.dtype}", (("grad_elems", n), ("dtype", m.dtype)))


class _TensorWhere(NamedTuple):
    """Where a chunk's tensors are used and get their gradients (events of its flattened
    forward / backward): ``starts[i]`` before layer i's forward, ``ends[j]`` after the backward of
    the chunk's j-th layer from the end; the head's output layer and final norm have theirs after
    ``head_ready`` backward events, the embeddings (used first) at the end of the backward."""

    layers: list[int]
    starts: list[int]
    ends: list[int]
    head_need: int
    head_ready: int
    total_ready: int


def _chunk_tensors(m: GPTShape, s: Strategy, first: bool, last: bool, w: _TensorWhere) -> tuple[ChunkTensor, ...]:
    """The chunk's parameter tensors in Megatron's registration order (embeddings, layers, final
    norm, output layer), each with where it is used and gets its gradient."""
    tied_copy = m.tied_embeddings and s.pp > 1
    out: list[ChunkTensor] = []
    if first:
        emb = head_param_tensors(v=m.padded_vocab_size, h=m.hidden_size, seq=m.seq_length, t=s.tp, first=True,
                                 last=False, variant=m.variant, output_copy=False)
        out += [ChunkTensor(n, 0, w.total_ready, shared=tied_copy and i == 0) for i, n in enumerate(emb)]
    for i, layer in enumerate(w.layers):
        ready = w.ends[len(w.layers) - 1 - i]
        tensors = layer_tensors(m, s, layer)
        dense = len(tensors) - expert_tensor_count(m, s, layer)  # the experts' last (reduced over expert DP)
        out += [ChunkTensor(n, w.starts[i], ready, expert=j >= dense) for j, n in enumerate(tensors)]
    if last:
        head = head_param_tensors(v=m.padded_vocab_size, h=m.hidden_size, seq=m.seq_length, t=s.tp, first=False,
                                  last=True, variant=m.variant, output_copy=s.pp > 1 or not m.tied_embeddings)
        # the output layer of a tied single-stage model is the word embedding: ready at the end
        out += [ChunkTensor(n, w.head_need, w.head_ready, shared=tied_copy and i == len(head) - 1)
                for i, n in enumerate(head)]
    return tuple(out)


JOIN = None
"""A part of ``_segments`` that ends the segment before it: every sub-batch arrives there before
any goes on (``LayerDescription.joins``)."""


def _joined(layers: list[tuple[list[Event], tuple[int, ...]]], leave: list[Event], chains: int) -> list:
    """The forward parts of a chunk's layers (each its events and joins) then ``leave``: one part of
    ``chains`` sub-batches, cut by a ``JOIN`` after each layer's joins (an MoE layer's routing when
    its load-balancing loss is on, under Oases)."""
    parts: list = []
    run: list[Event] = []
    for evs, joins in layers:
        cut = 0
        for j in joins:
            parts += [(run + evs[cut:j + 1], chains), JOIN]
            run, cut = [], j + 1
        run += evs[cut:]
    return parts + [(run + leave, chains)]


def _segments(*parts: tuple | None) -> tuple[tuple[tuple[Event, ...], int], ...]:
    """Non-empty (events, chains[, unit]) parts in order, neighbours with the same chain count
    joined; sub-batch chains only within one unit (a plan's run of blocks at one degree is one
    Oases executor: its sub-batches join where the degree changes) and not across a ``JOIN``."""
    out: list[tuple[tuple[Event, ...], int]] = []
    units: list = []
    cut = False
    for part in parts:
        if part is JOIN:
            cut = True
            continue
        evs, chains, *unit = part
        if not evs:
            continue
        u = unit[0] if unit else None
        if out and not cut and out[-1][1] == chains and (chains == 1 or units[-1] == u):
            out[-1] = (out[-1][0] + tuple(evs), chains)
        else:
            out.append((tuple(evs), chains))
            units.append(u)
        cut = False
    return tuple(out)


def _block_shape(m: GPTShape, s: Strategy, degree: int, chains: int):
    """(shape, dims) of a layer's events at ``degree`` on one of ``chains`` sub-batches of the
    replica's share (``m.micro_batch_size * degree / tp``); the executor tag is the schedule's."""
    b = m.micro_batch_size * degree // s.tp // chains
    return layer_shape(b=b, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads, f=m.ffn_hidden_size, t=degree,
                       v=m.padded_vocab_size, dtype=m.dtype,
                       backend=s.backend, layout=s.layout, hidden_dropout=m.hidden_dropout,
                       attention_dropout=m.attention_dropout, chains=block_sub_batches(s),
                       variant=m.variant, sequence_parallel=s.sequence_parallel, core_attention=m.core_attention,
                       attention_kernels=m.attention_kernels)


def _op_event(op, m: GPTShape, s: Strategy, topo: Topology, tp_ranks: tuple[int, ...], degree: int,
              chains: int, shape_dims: tuple | None = None) -> Event:
    """One layer op at ``degree`` (TP rank 0's sub-group: the first ``degree`` TP ranks); stock
    Megatron's async input-gradient all-reduce carries its weight gradient ``beside`` it.
    ``shape_dims``: ``_block_shape(m, s, degree, chains)`` when the caller has it."""
    shape, dims = shape_dims or _block_shape(m, s, degree, chains)
    if is_moe_op(op.name):  # the MoE block's work depends on the MoE flags and EP too
        shape, dims = shape + m.moe.key(s.ep), dims + (("moe", m.moe.key(s.ep)),)
    if isinstance(op, Compute):
        return _compute(op, shape, dims)
    ranks = (moe_axis_ranks(op.axis, tp_ranks[:degree], s) if op.axis in MOE_AXES
             else axis_ranks(op.axis, tp_ranks[:degree], s.layout))
    coll = _collective(op, shape, topo, ranks, dims)
    if s.tp_comm_overlap and (gemm := _ub_gemm(op.name, m, degree)) is not None:
        return dataclasses.replace(coll, key=coll.key + "~ub", hidden_by=gemm)
    if chains == 1 and s.async_dgrad and record(s.backend).megatron_modules and op.name in STOCK_ASYNC_DGRAD:
        b = m.micro_batch_size * degree // s.tp
        wgrad = column_wgrad(STOCK_ASYNC_DGRAD[op.name], b=b, s=m.seq_length, h=m.hidden_size,
                             heads=m.num_attention_heads, f=m.ffn_hidden_size, t=degree, e=m.bytes_per_element,
                             variant=m.variant)
        coll = dataclasses.replace(coll, beside=_compute(wgrad, shape, dims))
    return coll


def _ub_gemm(name: str, m: GPTShape, t: int) -> Compute | None:
    """The GEMM Transformer Engine's userbuffers pipeline an SP collective with
    (``--tp-comm-overlap``): forward, the input all-gather with the column GEMM (QKV, fc1) and the
    output reduce-scatter with the row GEMM (proj, fc2); backward, the output gradient's
    all-gather with the row input-gradient GEMM and the input re-gather with the column one. The
    input gradient's reduce-scatter already runs beside the weight gradient (``beside``)."""
    block, _, what = name.partition(".")
    if block not in ("attention", "mlp") or what not in ("ag", "rs", "rs.bwd", "ag.wgrad"):
        return None
    b, sq, h, v, f = m.micro_batch_size, m.seq_length, m.hidden_size, m.variant, m.ffn_hidden_size
    # the column linear's output features and the row linear's input features on this rank
    out = v.qkv_rows(h, m.num_attention_heads) // t if block == "attention" else v.fc1_rows(f) // t
    inner = h // t if block == "attention" else f // t
    gemm = {"ag": (b * sq, out, h),  # column forward
            "rs": (b * sq, h, inner),  # row forward
            "rs.bwd": (b * sq, inner, h),  # row input gradient
            "ag.wgrad": (b * sq, h, out)}[what]  # column input gradient
    return Compute(name=f"{name}.ub_gemm", gemm_flops=2.0 * math.prod(gemm), gemms=(gemm,))


@functools.lru_cache(maxsize=256)
def _blocks_at(m: GPTShape, s: Strategy, degree: int) -> dict[str, tuple[tuple, tuple]]:
    """The Megatron 1-D layer at ``degree`` on one sub-batch of its replica's share, split into
    its attention and MLP blocks (``describe.planned.megatron_blocks``)."""
    b = m.micro_batch_size * degree // s.tp // block_sub_batches(s, degree)
    layer = layer_description(backend=s.backend, layout=s.layout, micro_batch=b, seq=m.seq_length, hidden=m.hidden_size,
                              heads=m.num_attention_heads, ffn=m.ffn_hidden_size, tp=degree,
                              bytes_per_element=m.bytes_per_element, variant=m.variant,
                              attention_dropout=m.attention_dropout > 0, hidden_dropout=m.hidden_dropout > 0,
                              core_attention=m.core_attention)
    return megatron_blocks(layer)


def _reshard_events(m: GPTShape, s: Strategy, topo: Topology, tp_ranks: tuple[int, ...], src: int,
                    dst: int) -> tuple[list[Event], list[Event]]:
    """(forward, backward) events moving a micro-batch's hidden states from degree ``src`` to
    ``dst`` (``describe.planned.degree_reshard``): the runtime reshards the whole micro-batch,
    outside the Oases executor (one chain)."""
    r = degree_reshard(src, dst, tp=s.tp, micro_batch=m.micro_batch_size, seq=m.seq_length, hidden=m.hidden_size,
                       bytes_per_element=m.bytes_per_element)
    hi = max(src, dst)
    shape, dims = reshard_shape(share=m.micro_batch_size * hi // s.tp, seq=m.seq_length, hidden=m.hidden_size,
                                degree=hi, dtype=m.dtype)
    ranks = tuple(tp_ranks[i] for i in r.ranks)
    return ([_collective(op, shape, topo, ranks, dims) for op in (r.forward,) if op is not None],
            [_collective(op, shape, topo, ranks, dims) for op in (r.backward,) if op is not None])


def _planned_chunk(m: GPTShape, s: Strategy, topo: Topology, tp_ranks: tuple[int, ...],
                   degrees: tuple[int, ...], first_layer: int = 0) -> tuple[list[tuple], list[tuple]]:
    """(forward, backward) parts (events, chains, degree) of a chunk's blocks (attention, mlp,
    attention, ...) at their ``degrees``, resharded between degrees and to degree T at the
    chunk's edges (``layers/planned_layer.py``, ``schedules/oases/block.py``)."""
    kinds = ("attention", "mlp")
    edge = [s.tp, *degrees, s.tp]  # the degree before / after each block
    fwd: list[tuple] = []
    bwd: list[tuple] = []
    for i, d in enumerate(degrees):
        chains = block_sub_batches(s, d)
        ops_f, _ = _blocks_at(m, s, d)[kinds[i % 2]]
        fwd += [(_reshard_events(m, s, topo, tp_ranks, edge[i], d)[0], 1),
                ([_op_event(op, m, s, topo, tp_ranks, d, chains) for op in ops_f], chains, d)]
    fwd.append((_reshard_events(m, s, topo, tp_ranks, edge[-2], s.tp)[0], 1))
    for i in reversed(range(len(degrees))):
        d = degrees[i]
        chains = block_sub_batches(s, d)
        _, ops_b = _blocks_at(m, s, d)[kinds[i % 2]]
        evs = [_op_event(op, m, s, topo, tp_ranks, d, chains) for op in ops_b]
        if i % 2 == 0:  # the layer's last block backward: its gradients accumulated (grad_accumulate)
            evs.append(_grad_event(m, sum(layer_tensors(m, s, first_layer + i // 2)), chains))
        bwd += [(_reshard_events(m, s, topo, tp_ranks, d, edge[i + 2])[1], 1), (evs, chains, d)]
    bwd.append((_reshard_events(m, s, topo, tp_ranks, s.tp, edge[1])[1], 1))
    return fwd, bwd


def stage_param_tensors(model: GPTShape, strategy: Strategy, stage: int) -> tuple[int, ...]:
    """Sizes of the parameter tensors one rank of ``stage`` holds (layers of all its chunks, then
    the word and learned position embeddings on the first stage, the final norm and the output layer on
    the last)."""
    m, s = model, strategy
    out = tuple(n for layer in stage_layers(m, s, stage) for n in layer_tensors(m, s, layer))
    return out + head_param_tensors(v=m.padded_vocab_size, h=m.hidden_size, seq=m.seq_length, t=s.tp, first=stage == 0,
                                    last=stage == s.pp - 1, variant=m.variant,
                                    output_copy=s.pp > 1 or not m.tied_embeddings)


def stage_layers(model: GPTShape, strategy: Strategy, stage: int) -> list[int]:
    """The layers ``stage`` holds, chunk by chunk (chunk c is virtual stage c * pp + stage)."""
    if strategy.first_stage_layers or strategy.last_stage_layers:
        counts = stage_layer_counts(model, strategy)
        return list(range(sum(counts[:stage]), sum(counts[:stage + 1])))
    n = model.num_layers // (strategy.pp * strategy.virtual_stages)
    return [g * n + i for c in range(strategy.virtual_stages) for g in (c * strategy.pp + stage,) for i in range(n)]


def layer_tensors(model: GPTShape, strategy: Strategy, layer: int) -> tuple[int, ...]:
    """``layer_param_tensors`` of one layer on TP rank 0; under a plan each tensor at the degree of
    the block it belongs to (``describe.registry.MLP_PARAM_TENSORS``)."""
    m, s = model, strategy
    if is_moe_layer(m, layer):  # the attention block's tensors, then the MoE block's (describe.moe)
        return moe_layer_tensors(m, s, s.tp)
    degrees = (s.tp, s.tp) if s.block_degrees is None else s.block_degrees[2 * layer:2 * layer + 2]
    at = {d: layer_param_tensors(s.backend, m.hidden_size, m.ffn_hidden_size, d, s.layout, heads=m.num_attention_heads,
                                 variant=m.variant)
          for d in set(degrees)}
    return tuple(at[degrees[1] if i in MLP_PARAM_TENSORS else degrees[0]][i] for i in range(len(at[degrees[0]])))


def _replica_allreduce(m: GPTShape, s: Strategy, topo: Topology, stage: int) -> tuple[Event, ...]:
    """Per degree d < T of the stage's blocks (in order of first use): the fp32 gradient sum over
    the T/d replicas of TP rank 0 (stride d), as ``layers.planned_layer.all_reduce_replica_grads``
    runs it; the q/k norms are left out (Megatron's TP reduction already sums them)."""
    if s.block_degrees is None:
        return ()
    n_layer = len(layer_param_tensors(s.backend, m.hidden_size, m.ffn_hidden_size, s.tp, s.layout,
                                      heads=m.num_attention_heads))  # no q/k norms
    sizes: dict[int, int] = {}
    for layer in stage_layers(m, s, stage):
        tensors = layer_tensors(m, s, layer)[:n_layer]
        for kind, d in zip(("attention", "mlp"), s.block_degrees[2 * layer:2 * layer + 2]):
            if d < s.tp:
                sizes[d] = sizes.get(d, 0) + sum(block_param_tensors(kind, tensors))
    out = []
    for d, n in sizes.items():
        ranks = tuple(s.rank(tp=i, pp=stage) for i in range(0, s.tp, d))
        op = Collective(name="replica_grad.ar", kind="all_reduce", axis="tp", group_size=len(ranks),
                        payload_bytes=4 * n)
        out.append(_collective(op, f"p{n}_fp32", topo, ranks, (("p", n), ("dtype", "fp32"))))
    return tuple(out)


def _stage_tail(m: GPTShape, s: Strategy, topo: Topology, st: int, chunks: tuple[ChunkEvents, ...],
                chains: int) -> StageEvents:
    tensors = stage_param_tensors(m, s, st)
    params = sum(tensors)
    experts = sum(layer_expert_params(m, s, layer) for layer in stage_layers(m, s, st))
    gdtype = m.grad_dtype
    grad = tie = norm = norm_ar = opt = gather = None
    buckets: tuple[GradBucket, ...] = ()
    if s.dp > 1:
        dp_ranks = tuple(s.rank(dp=d, pp=st) for d in range(s.dp))
        if s.overlap_grad_reduce:
            buckets = tuple(_dp_bucket(m, s, topo, dp_ranks, c, n, need, ready)
                            for c, ch in enumerate(chunks) for n, need, ready in ddp_buckets(s, st, c, ch.param_tensors))
            buckets += _expert_buckets(m, s, topo, st, chunks)
        else:
            grad = _dp_reduce(m, s, topo, dp_ranks, params - experts)
        if s.distributed_optimizer and not s.overlap_param_gather:  # all-gather updated params after the step
            gather = _dp_gather(m, s, topo, dp_ranks, params - experts)
    if m.tied_embeddings and s.pp > 1 and st in (0, s.pp - 1):
        pair = (s.rank(pp=0), s.rank(pp=s.pp - 1))
        n = m.padded_vocab_size * m.hidden_size // s.tp
        op = Collective(name="embedding.tie", kind="all_reduce", axis="pp", group_size=2,
                        payload_bytes=m.grad_reduce_bytes * n)
        tie = _collective(op, f"v{m.padded_vocab_size}h{m.hidden_size}t{s.tp}_{gdtype}", topo, pair,
                          (("p", n), ("dtype", gdtype)))
    if s.optimizer_step:
        # both run tensor by tensor: the key names the tensor count, the dims carry the sizes
        tdims = (("p", params), ("sizes", tensors))
        if s.clip_grad:
            norm = _compute(Compute(name="grad_norm", gemm_flops=0.0, elementwise_bytes=4 * params),
                            f"p{params}n{len(tensors)}_fp32", tdims + (("dtype", "fp32"),))
            if s.tp * s.pp > 1:
                norm_ar = _norm_allreduce(topo, s.tp, s.pp, s.dp)
        shard = s.dp if s.distributed_optimizer else 1
        op = optimizer_compute(params, shard=shard, bytes_per_element=m.bytes_per_element, clip=s.clip_grad)
        oshape = f"p{params}n{len(tensors)}d{shard}_{m.dtype}" + ("" if s.clip_grad else "_noclip")
        opt = _compute(op, oshape, tdims + (("shard", shard), ("dtype", m.dtype))
                       + (() if s.clip_grad else (("clip", 0),)))
    return StageEvents(stage=st, chunks=chunks, grad_allreduce=grad, tie_allreduce=tie, grad_norm=norm,
                       norm_allreduce=norm_ar, optimizer=opt, param_allgather=gather if opt else None,
                       params_per_rank=params, chains=chains,
                       replica_allreduce=_replica_allreduce(m, s, topo, st) + _expert_reduce(m, s, topo, st, experts),
                       grad_buckets=buckets if opt else tuple(dataclasses.replace(b, gather=None) for b in buckets))


def _expert_reduce(m: GPTShape, s: Strategy, topo: Topology, stage: int, experts: int) -> tuple[Event, ...]:
    """The experts' gradient reduction over the expert-data-parallel group (DP / EP replicas,
    ``sim.core.moe.expert_dp_ranks``), as the DP reduction of those parameters (Megatron-Core
    keeps them in their own buffer); priced after the backward, not per bucket, and, under the
    distributed optimizer, followed by their parameters' all-gather over that group."""
    ranks = expert_dp_ranks(s, stage)
    if not experts or len(ranks) < 2 or s.overlap_grad_reduce:  # overlapped: _expert_buckets
        return ()
    edp = dataclasses.replace(s, dp=len(ranks))  # the reduction's group size and kind, as _dp_reduce
    out = [_dp_reduce(m, edp, topo, ranks, experts)]
    if s.distributed_optimizer and s.optimizer_step:
        out.append(_dp_gather(m, edp, topo, ranks, experts))
    return tuple(out)


def _expert_buckets(m: GPTShape, s: Strategy, topo: Topology, stage: int,
                    chunks: tuple[ChunkEvents, ...]) -> tuple[GradBucket, ...]:
    """Under ``overlap_grad_reduce``: per chunk, its experts' gradients as one bucket on the
    expert-data-parallel group (Megatron-Core's expert buffer, launched when the chunk's last
    expert gradient is ready), with its parameters' all-gather under ``overlap_param_gather``."""
    ranks = expert_dp_ranks(s, stage)
    if len(ranks) < 2:
        return ()
    edp = dataclasses.replace(s, dp=len(ranks))
    out = []
    for c, ch in enumerate(chunks):
        mine = [t for t in ch.param_tensors if t.expert]
        if mine:
            n = sum(t.params for t in mine)
            out.append(GradBucket(chunk=c, params=n, ready=max(t.ready for t in mine), need=min(t.need for t in mine),
                                  reduce=_dp_reduce(m, edp, topo, ranks, n),
                                  gather=_dp_gather(m, edp, topo, ranks, n) if s.overlap_param_gather else None))
    return tuple(out)


def ddp_buckets(s: Strategy, stage: int, chunk: int, tensors: tuple[ChunkTensor, ...]) -> list[tuple[int, int, int]]:
    """(params, need, ready) of a chunk's DDP buckets in launch order, as Megatron-Core's
    ``_ParamAndGradBuffer`` forms them: tensors in reverse registration order (roughly the
    backward's), a bucket closed once it holds ``bucket_params``, the shared embedding alone in
    its bucket under the distributed optimizer. Stages after the first keep one bucket
    (``DistributedDataParallel``: their reduction is off the critical path) and chunks after the
    first reduce all theirs as one group (``disable_bucketing``). Buckets are not padded."""
    limit = s.bucket_params if stage == 0 and chunk == 0 else None
    out: list[list[int]] = []
    open_ = False
    for t in reversed(tensors):
        if t.expert:  # the expert buffer's (``_expert_buckets``)
            continue
        split = t.shared and s.distributed_optimizer
        if not open_ or (split and out[-1][0]):
            out.append([0, t.need, 0])
        b = out[-1]
        b[0], b[1], b[2] = b[0] + t.params, min(b[1], t.need), max(b[2], t.ready)
        open_ = not (split or (limit is not None and b[0] >= limit))
    if chunk > 0:  # one bucket group: launched when all its gradients are ready
        out = [[sum(b[0] for b in out), min(b[1] for b in out), max(b[2] for b in out)]]
    return [tuple(b) for b in out if b[0]]


def _dp_reduce(m: GPTShape, s: Strategy, topo: Topology, dp_ranks: tuple[int, ...], n: int) -> Event:
    """The DP gradient reduction of ``n`` parameters: reduce-scatter under the distributed
    optimizer, all-reduce otherwise, in the gradient-reduction dtype. Equal sizes share a key."""
    gdtype = m.grad_dtype
    kind, name = ("reduce_scatter", "grad.rs") if s.distributed_optimizer else ("all_reduce", "grad.ar")
    op = Collective(name=name, kind=kind, axis="dp", group_size=s.dp, payload_bytes=m.grad_reduce_bytes * n)
    return _collective(op, f"p{n}_{gdtype}", topo, dp_ranks, (("p", n), ("dtype", gdtype)))


def _dp_gather(m: GPTShape, s: Strategy, topo: Topology, dp_ranks: tuple[int, ...], n: int) -> Event:
    """The distributed optimizer's all-gather of ``n`` updated parameters (training dtype)."""
    ag = Collective(name="param.ag", kind="all_gather", axis="dp", group_size=s.dp,
                    payload_bytes=m.bytes_per_element * n)
    return _collective(ag, f"p{n}_{m.dtype}", topo, dp_ranks, (("p", n), ("dtype", m.dtype)))


def optimizer_compute(params: int, *, shard: int, bytes_per_element: int, clip: bool = True) -> Compute:
    """One rank's optimizer step over ``params`` parameters, ``shard``-way sharded by the
    distributed optimizer: zero the grads (4 bytes a parameter) and, with ``clip``, scale them (8)
    on every parameter, then on the rank's shard Adam (its traffic per parameter is the software
    stack's, ``Compute.optimizer_params``) and, in bf16 / fp16, the copy of the updated fp32
    parameters into the model's (read 4, write 2)."""
    copy = 6 if bytes_per_element == 2 else 0
    return Compute(name="optimizer", gemm_flops=0.0, elementwise_bytes=params * (4 + 8 * clip + copy / shard),
                   optimizer_params=params / shard)


def _dp_bucket(m: GPTShape, s: Strategy, topo: Topology, dp_ranks: tuple[int, ...], chunk: int, n: int,
               need: int, ready: int) -> GradBucket:
    gather = _dp_gather(m, s, topo, dp_ranks, n) if s.overlap_param_gather else None
    return GradBucket(chunk=chunk, params=n, ready=ready, need=need,
                      reduce=_dp_reduce(m, s, topo, dp_ranks, n), gather=gather)


@functools.lru_cache(maxsize=256)
def _norm_allreduce(topo: Topology, tp: int, pp: int, dp: int) -> Event:
    """Grad-norm all-reduce over the model-parallel group (TP x PP ranks of DP replica 0)."""
    mp = tuple(i + tp * dp * j for j in range(pp) for i in range(tp))
    op = Collective(name="grad_norm.ar", kind="all_reduce", axis="mp", group_size=len(mp), payload_bytes=4)
    return _collective(op, "n1_fp32", topo, mp, (("p", 1), ("dtype", "fp32")))


def stage_event_list(st: StageEvents) -> list[Event]:
    out: list[Event] = []
    for ch in st.chunks:
        out += [*ch.forward, *ch.backward]
        out += [ev.beside for ev in ch.backward if ev.beside is not None]
        out += [x for x in (ch.send_forward, ch.send_backward) if x is not None]
    out += [x for b in st.grad_buckets for x in (b.reduce, b.gather) if x is not None]
    out += [x for x in (st.grad_allreduce, st.tie_allreduce, *st.replica_allreduce, st.grad_norm,
                        st.norm_allreduce, st.optimizer, st.param_allgather) if x is not None]
    return out


def unique_events(stages: list[StageEvents]) -> dict[str, Event]:
    """Each distinct event once (DistSim's profiling dedup): key -> first occurrence."""
    seen: dict[str, Event] = {}
    for st in stages:
        for ev in stage_event_list(st):
            if ev.key not in seen:
                seen[ev.key] = ev
    return seen


def overlapped_keys(stages: list[StageEvents]) -> set[str]:
    """Keys of the events that run while the rank's other stream is busy: every forward / backward
    event of a segment whose sub-batches (chains > 1) overlap one's collectives with the other's
    compute, and stock Megatron's async input-gradient all-reduces with the weight gradients beside
    them. ``sim.calibrate.emulated_profile`` measures these also under that overlap."""
    keys = {ev.key for st in stages for ch in st.chunks for evs, chains in (*ch.forward_segments, *ch.backward_segments)
            if chains > 1 for ev in evs}
    return keys | {k for st in stages for ch in st.chunks for ev in ch.backward if ev.beside is not None
                   for k in (ev.key, ev.beside.key)}
