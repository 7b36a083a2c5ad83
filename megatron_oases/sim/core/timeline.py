"""Places events on streams: TP inside a stage, then the pipeline schedule, then DP (DistSim §4.3).

Every micro-batch runs the same events on a model chunk, so each chunk's forward and backward are
simulated once on a compute and a communication stream (a *template*), and the pipeline
(Algorithm 1) places those templates with P2P dependencies. The step ends with each stage's
tail: DP gradient all-reduce, the tied-embedding all-reduce between first and last stage, the
grad-norm all-reduce over TP x PP (a barrier across stages), Adam. This keeps 3,000+ GPUs under
a second while the expanded trace (``sim.core.trace``) stays exact.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ...flops import gpt_flops_per_iteration
from ...pricing.device_model import DeviceModel, SimError
from ...pricing.event import Event
from ...describe.shapes import GPTShape
from ...describe.backends import backend as record
from ...describe.ops import holds_compute
from .moe import flops_ffn
from .events import GradBucket, StageEvents, build_stage_events, unique_events
from .strategy import Strategy
from .tape import CURRENT, OasesTape
from .contention import level_prices
from .memory import GiB, StageMemory, stage_memory
from .placement import Placement, place_pipeline
from .schedules import schedule_order


class Slot(NamedTuple):
    """One event placed in a template, times relative to the template's start (ms)."""

    stream: str
    """compute | comm"""
    name: str
    key: str
    chain: int
    start: float
    dur: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Template:
    """One micro-batch's forward or backward on one model chunk of one stage."""

    slots: tuple[Slot, ...]
    duration: float
    compute_busy: float
    comm_busy: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class TailSlot:
    """End-of-step work on one stage (absolute ms): grad.ar, embedding.tie, grad_norm, optimizer..."""

    stage: int
    stream: str
    """compute | comm | dp (a DP bucket, which may start during the backward)"""
    name: str
    key: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageStats:
    stage: int
    rank: int
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    """Time the compute stream waits on TP collectives, its own P2P sends and the end-of-step collectives."""
    bubble_ms: float
    """Time the stage waits on other stages (pipeline fill/drain, the step's barriers)."""
    idle_ms: float
    """iteration - compute = exposed comm + bubble."""
    memory_GB: float = 0.0
    """Peak memory of one device of this stage (GiB)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    model: GPTShape
    strategy: Strategy
    iteration_ms: float
    stages: tuple[StageStats, ...]
    bubble_fraction: float
    """Mean over stages of bubble / iteration."""
    exposed_comm_ms: float
    """Mean over stages."""
    tokens_per_s: float
    mfu: float
    placements: tuple[Placement, ...]
    templates: tuple[tuple[tuple[Template, Template], ...], ...]
    """Per stage, per chunk: (forward, backward)."""
    p2p_ms: tuple[tuple[tuple[float, float], ...], ...]
    """Per stage, per chunk: (send forward, send backward) durations."""
    grad_ms: tuple[float, ...]
    tail: tuple[TailSlot, ...]
    unique_events: int
    memory: tuple[StageMemory, ...] = ()
    memory_limit_GB: float = 0.0

    @property
    def peak_memory_GB(self) -> float:
        return max((m.total for m in self.memory), default=0.0) / GiB

    @property
    def fits(self) -> bool:
        return not self.memory_limit_GB or self.peak_memory_GB <= self.memory_limit_GB

    @property
    def infeasible_reason(self) -> str:
        if self.fits:
            return ""
        worst = max(self.memory, key=lambda m: m.total)
        return (f"memory {self.peak_memory_GB:.1f} GB > {self.memory_limit_GB:g} GB on stage {worst.stage} "
                f"(states {(worst.weights + worst.grads + worst.optimizer) / GiB:.1f}, "
                f"activations {worst.activations / GiB:.1f})")


def run_template(events: tuple[Event, ...], chains: int, price: dict[str, float],
                 overlapped: dict[str, float] | None = None,
                 host: dict[str, tuple[float, float]] | None = None) -> Template:
    """Compute and comm streams, ``chains`` sub-batches; each op waits for its chain's previous op.

    chains=1 is the stock executor (compute waits on every collective, except that a collective
    with ``beside`` starts that event's time before the compute before it ends: Megatron's async
    input-gradient all-reduce beside the weight gradient). chains > 1 is Oases (one chain per
    sub-batch of the split, ``describe.split``): the compute stream alternates sub-batches, so one sub-batch's collective runs on the comm stream
    while the other's next segment computes. ``overlapped[key]`` (a profile's ``overlapped``
    section) is the event's duration while the other stream is busy: an op progresses at
    ``1 / overlapped`` while both streams run and at ``1 / price`` alone (where ranks share
    cores, an in-flight collective and the compute slow each other down).

    ``host[key]`` = (GPU ms, host ms) of an analytically priced compute event: the host issues
    the events in program order without waiting for the GPU (collectives, async in Megatron and
    Oases, cost it nothing), so an event ends at ``max(start + GPU, host done issuing it)`` and
    starts no earlier than the host began issuing it. Host time thus overlaps the collectives and
    the GPU time of earlier events instead of adding to them: a host-bound layer between two
    all-reduces costs max(host, GPU + all-reduce), not their sum. Without ``host`` each event
    costs its price (``max(GPU, host)``, issued on its own). Every template starts with the host
    at its start (conservative: no run-ahead across micro-batches or pipeline sends).
    """
    ops = [(_stream(ev), ev, c) for ev in events for c in range(chains)]
    if chains > 1 and overlapped:
        return _run_template_shared(ops, chains, price, overlapped)
    free = {"compute": 0.0, "comm": 0.0}
    prev = [0.0] * chains
    slots, busy = [], {"compute": 0.0, "comm": 0.0}
    host_t = 0.0
    for stream, ev, c in ops:
        d = price[ev.key]
        start = max(free[stream], prev[c])
        split = host.get(ev.key) if host else None
        if split is not None:  # issued by the host from host_t on, run on the GPU when issued
            start = max(start, host_t)
            host_t += split[1]
            d = max(split[0], host_t - start)
        end = start + d
        if ev.beside is not None and slots and slots[-1].chain == c and slots[-1].stream == "compute":
            # launched async before the compute's tail (its weight gradient); the next op waits for both
            start, d, tail_end = _beside(slots[-1], prev[c], ev, free[stream], price, overlapped or {})
            free["compute"] = tail_end
            slots[-1] = slots[-1]._replace(dur=tail_end - slots[-1].start)
            busy["compute"] += tail_end - prev[c]
            end = max(tail_end, start + d)
        free[stream] = start + d
        prev[c] = end
        busy[stream] += d
        slots.append(Slot(stream, ev.name, ev.key, c, start, d))
    return Template(slots=tuple(slots), duration=max(prev, default=0.0),
                    compute_busy=busy["compute"], comm_busy=busy["comm"])


def _stream(ev: Event) -> str:
    """The stream an event runs on: compute, or comm for a collective, but for one the rank waits
    on where it is issued, which holds the compute stream too (``describe.ops.holds_compute``, the
    planner's rule too)."""
    return "compute" if ev.kind == "compute" or holds_compute(ev.op) else "comm"


def run_segments(segments: tuple[tuple[tuple[Event, ...], int], ...], price: dict[str, float],
                 overlapped: dict[str, float] | None = None,
                 host: dict[str, tuple[float, float]] | None = None) -> Template:
    """A chunk's forward or backward: its segments' templates one after the other (the Oases
    executor's sub-batches join before the output layer and after the embedding)."""
    slots: list[Slot] = []
    t = compute = comm = 0.0
    for events, chains in segments:
        seg = run_template(events, chains, price, overlapped, host)
        slots += [sl._replace(start=sl.start + t) for sl in seg.slots]
        t, compute, comm = t + seg.duration, compute + seg.compute_busy, comm + seg.comm_busy
    return Template(slots=tuple(slots), duration=t, compute_busy=compute, comm_busy=comm)


def _beside(compute: Slot, compute_end: float, ev: Event, comm_free: float, price: dict[str, float],
            overlapped: dict[str, float]) -> tuple[float, float, float]:
    """A collective launched async before the tail ``ev.beside`` of ``compute`` (which ends at
    ``compute_end``): (its start, its duration, the compute's new end). While both run they
    progress at their ``overlapped`` rates (shared cores), alone at their plain prices."""
    w, c = price[ev.beside.key], price[ev.key]
    w_ov, c_ov = overlapped.get(ev.beside.key, w), overlapped.get(ev.key, c)
    tail = max(compute.start, compute_end - w)
    start = max(comm_free, tail)
    if start >= compute_end:  # the comm stream was busy until the compute had finished
        return start, c, compute_end
    done_w = (start - tail) / w  # the tail's progress before the collective starts
    left_w = (1.0 - done_w) * w_ov  # the tail's remaining time at the shared rate
    if left_w <= c_ov:  # the tail finishes first; the collective goes on alone
        tail_end = start + left_w
        comm_d = left_w + (1.0 - left_w / c_ov) * c if c_ov > 0 else 0.0
    else:  # the collective finishes first; the tail goes on alone
        comm_d = c_ov
        tail_end = start + c_ov + (1.0 - done_w - c_ov / w_ov) * w
    return start, comm_d, tail_end


def _run_template_shared(ops: list[tuple[str, Event, int]], chains: int, price: dict[str, float],
                         overlapped: dict[str, float]) -> Template:
    """``run_template`` with rates that depend on whether the other stream is busy (fluid: the
    rates change whenever an op starts or ends). Same op order and dependencies."""
    last: dict[int, int] = {}
    pred = []
    for i, (_, _, c) in enumerate(ops):
        pred.append(last.get(c))
        last[c] = i
    queue = {st: [i for i, op in enumerate(ops) if op[0] == st] for st in ("compute", "comm")}
    head = {"compute": 0, "comm": 0}
    done: dict[int, float] = {}
    running: dict[str, list] = {}  # stream -> [op index, progress, start]
    slots: list[Slot] = [None] * len(ops)  # type: ignore[list-item]
    busy = {"compute": 0.0, "comm": 0.0}
    t = 0.0
    while len(done) < len(ops):
        for st in ("compute", "comm"):
            if st not in running and head[st] < len(queue[st]):
                i = queue[st][head[st]]
                if pred[i] is None or pred[i] in done:
                    running[st] = [i, 0.0, t]
                    head[st] += 1
        if not running:
            raise SimError("template deadlocks: no stream can start its next op")
        rate = {}
        for st, (i, _, _) in running.items():
            key = ops[i][1].key
            d = overlapped.get(key, price[key]) if len(running) == 2 else price[key]
            rate[st] = 1.0 / d if d > 0 else float("inf")
        dt = min((1.0 - r[1]) / rate[st] if rate[st] != float("inf") else 0.0 for st, r in running.items())
        t += dt
        for st in list(running):
            r = running[st]
            r[1] = 1.0 if rate[st] == float("inf") else r[1] + dt * rate[st]
            if r[1] >= 1.0 - 1e-9:
                i, _, start = running.pop(st)
                done[i] = t
                stream, ev, c = ops[i]
                slots[i] = Slot(stream, ev.name, ev.key, c, start, t - start)
                busy[stream] += t - start
    return Template(slots=tuple(slots), duration=max(done.values(), default=0.0),
                    compute_busy=busy["compute"], comm_busy=busy["comm"])


def price_events(stages: list[StageEvents], device: DeviceModel) -> dict[str, float]:
    """Each unique event priced once (profile first, if given)."""
    uniq = unique_events(stages)
    if device.profile is not None and device.strict_profile:
        device.profile.require(list(uniq))
    return {k: device.price(k, e.op, kind=e.kind, nbytes=e.nbytes, ranks=e.ranks, hidden_by=e.hidden_by)
            for k, e in uniq.items()}


def pipeline_send_ms(ev: Event | None, price: dict[str, float], device: DeviceModel, strategy: Strategy) -> float:
    """A pipeline send's time as Megatron-Core runs it: the sequence-parallel shard only, and
    between nodes at the sending GPU's share of its node's network cards, not the whole node's.

    * With ``--sequence-parallel`` the activation between stages is ``[s / TP, b, h]`` on each TP
      rank (Megatron-Core's ``get_tensor_shapes`` divides the sequence), not the full ``[s, b, h]``
      the send event carries.
    * A topology's inter-node bandwidth is a node's aggregate over its cards (DGX A100: 8 x 200 Gb/s
      HDR, one card per GPU). ``DeviceModel.p2p_ms`` gives one pair of ranks all of it, as if a
      single GPU drove every card; NCCL sends a point-to-point message through the card next to
      the GPU, and in the pipeline every rank of a stage sends at once (each TP rank its copy, each
      DP replica its own). The send gets the share the collectives already get for a
      one-GPU-per-node group (``DeviceModel.nic_share``): an eighth of a DGX node, one card.

    * With ``--scatter-gather-tensors-in-pipeline`` (Megatron-LM before Megatron-Core,
      ``p2p_communication._communicate``; DeepSpeed's pipeline engine, ``PartitionedTensor``) each
      TP rank sends its ``1 / TP`` slice and the receiving stage all-gathers the whole tensor over
      its TP group before using it (neither when the sequence-parallel shard is sent).

    Measured sends (a profile) keep their price; the latency is paid once either way."""
    if ev is None:
        return 0.0
    t = price[ev.key]
    if device.profile is not None and ev.key in device.profile.events_ms:
        return t
    a, b = ev.ranks
    latency_ms = device.topology.link_latency(a, b) / 1e3
    wire = t - latency_ms
    tp = strategy.tp
    scattered = strategy.scatter_gather_pipeline and not strategy.sequence_parallel and tp > 1
    if (strategy.sequence_parallel and tp > 1) or scattered:
        wire /= tp
    send = wire / min(1.0, device.nic_share((a, b), a, b)) + latency_ms
    if not scattered:
        return send
    group = tuple(b + strategy.rank(tp=i) - strategy.rank(tp=0) for i in range(tp))
    return send + device.collective_ms("all_gather", ev.nbytes, group)


def beside_compute(stages: list[StageEvents], device: DeviceModel, price: dict[str, float],
                   measured: dict[str, float]) -> dict[str, float]:
    """Each analytically priced collective's time while the compute stream runs
    (``DeviceModel.collective_beside_compute`` times its price; the templates' ``overlapped``);
    none when the factor is 1 or the profile measured it."""
    f = device.collective_beside_compute
    if f == 1.0:
        return {}
    return {k: price[k] * f for k, e in unique_events(stages).items()
            if e.kind == "collective" and k not in measured}


def host_splits(stages: list[StageEvents], device: DeviceModel) -> dict[str, tuple[float, float]]:
    """(GPU ms, host ms) of each analytically priced compute event with a host cost: the templates
    let the host issue ahead of the GPU (``run_template``); measured events keep their price."""
    out = {}
    for k, e in unique_events(stages).items():
        split = device.host_split(k, e.op, kind=e.kind)
        if split is not None and split[1] > 0:
            out[k] = split
    return out


def events_done(t: Template, segments: tuple[tuple[tuple[Event, ...], int], ...], n: int) -> float:
    """When ``t`` (run from ``segments``) has finished its first ``n`` events on every sub-batch:
    the templates keep one slot per event and sub-batch, in event order."""
    k = 0
    for evs, chains in segments:
        take = min(n, len(evs))
        k, n = k + take * chains, n - take
    return max((sl.start + sl.dur for sl in t.slots[:k]), default=0.0)


def bucket_releases(stages: list[StageEvents], templates, placements) -> list[list[tuple[float, GradBucket]]]:
    """Per stage, its DP buckets with the times their gradients are ready, in launch order: in the
    last backward of the bucket's chunk, where the backward template has run the bucket's
    ``ready`` events (scaled to the placed duration, which shared compute may stretch)."""
    last_b: dict[tuple[int, int], Placement] = {}
    for p in placements:
        if p.phase == "B" and ((p.stage, p.chunk) not in last_b or p.end > last_b[p.stage, p.chunk].end):
            last_b[p.stage, p.chunk] = p
    out = []
    for i, st in enumerate(stages):
        rel = []
        for b in st.grad_buckets:
            pl, tb = last_b[i, b.chunk], templates[i][b.chunk][1]
            done = events_done(tb, st.chunks[b.chunk].backward_segments, b.ready)
            rel.append((pl.start + (pl.end - pl.start) * (done / tb.duration if tb.duration > 0 else 1.0), b))
        out.append(sorted(rel, key=lambda x: x[0]))
    return out


def _while_busy(start: float, busy_until: float, plain: float, shared: float) -> float:
    """End of a collective started at ``start`` that progresses at its ``overlapped`` rate while
    the stage still computes (until ``busy_until``) and at its plain rate after, as ``_beside``
    (the two are equal unless a profile measured the event under overlap)."""
    if start >= busy_until or shared <= 0:
        return start + plain
    if start + shared <= busy_until:
        return start + shared
    return busy_until + (1.0 - (busy_until - start) / shared) * plain


def gather_wait(st: StageEvents, templates, price: dict[str, float]) -> float:
    """Exposed part of a stage's per-bucket parameter all-gathers (``overlap_param_gather``) in
    steady state, as the wait of each chunk's first forward of the next iteration: chunk 0's first
    bucket (in forward order) is gathered whole, as the first module's pre-hook dispatches it; each
    later bucket's gather, dispatched when the forward reaches the previous bucket, shows where it
    outlasts the previous bucket's forward; a later chunk's single gather shows where it outlasts
    the previous chunk's forward (Megatron-LM dispatches it a chunk ahead)."""
    wait = 0.0
    for c, ch in enumerate(st.chunks):
        bs = [b for b in reversed(st.grad_buckets) if b.chunk == c and b.gather is not None]
        f = templates[c][0]
        for i, b in enumerate(bs):
            a = price[b.gather.key]
            if i:
                hidden = (events_done(f, ch.forward_segments, b.need)
                          - events_done(f, ch.forward_segments, bs[i - 1].need))
            else:
                hidden = templates[c - 1][0].duration if c else 0.0
            wait += max(0.0, a - hidden)
    return wait


def _tail(stages: list[StageEvents], price: dict[str, float], last_end: list[float],
          releases: list[list[tuple[float, GradBucket]]] | None = None, templates=None,
          overlapped: dict[str, float] | None = None) -> list[TailSlot]:
    """DP reduction (whole, or per bucket from its release under ``overlap_grad_reduce``: on the
    DP stream while the backward goes on, the step waits for the last) -> tie all-reduce (stage 0
    and pp-1 together) -> a plan's replica gradient all-reduces -> grad norm -> its all-reduce
    over all stages (a barrier) -> Adam -> distributed optimizer's parameter all-gather (whole,
    or the per-bucket gathers' exposed part, ``gather_wait``)."""
    out: list[TailSlot] = []
    t = list(last_end)
    overlapped = overlapped or {}

    def put(s: int, ev: Event | None, stream: str, start: float | None = None) -> None:
        if ev is None:
            return
        st = t[s] if start is None else start
        t[s] = st + price[ev.key]
        out.append(TailSlot(stage=s, stream=stream, name=ev.name, key=ev.key, start=st, end=t[s]))

    for s, st in enumerate(stages):
        put(s, st.grad_allreduce, "comm")
        free = 0.0
        for ready, b in (releases[s] if releases else ()):
            k = b.reduce.key
            start = max(ready, free)
            free = _while_busy(start, last_end[s], price[k], overlapped.get(k, price[k]))
            out.append(TailSlot(stage=s, stream="dp", name=b.reduce.name, key=k, start=start, end=free))
        t[s] = max(t[s], free)
    tied = [s for s, st in enumerate(stages) if st.tie_allreduce is not None]
    if tied:
        start = max(t[s] for s in tied)
        for s in tied:
            put(s, stages[s].tie_allreduce, "comm", start)
    for s, st in enumerate(stages):
        for ev in st.replica_allreduce:  # a plan's replica gradient sums, after Megatron's reductions
            put(s, ev, "comm")
        put(s, st.grad_norm, "compute")
    if any(st.norm_allreduce is not None for st in stages):
        start = max(t)
        for s, st in enumerate(stages):
            put(s, st.norm_allreduce, "comm", start)
    for s, st in enumerate(stages):
        put(s, st.optimizer, "compute")
        put(s, st.param_allgather, "comm")
        wait = gather_wait(st, templates[s], price) if templates is not None else 0.0
        if wait > 0:
            out.append(TailSlot(stage=s, stream="comm", name="param.ag.wait", key="", start=t[s], end=t[s] + wait))
            t[s] += wait
    return out


def simulate(model: GPTShape, strategy: Strategy, device: DeviceModel, *,
             memory_limit_GB: float | None = None, timeline: bool = True, tape: OasesTape = CURRENT) -> SimResult:
    """One training iteration on ``device.topology``; memory checked against ``memory_limit_GB``
    (default: the GPU's memory; 0 disables the check). ``timeline=False`` keeps no placements
    (the numbers are the same; a search needs no trace). ``tape``: which Oases executor's
    program (``sim.core.tape``; the current one by default)."""
    stages = build_stage_events(model, strategy, device.topology, tape)
    price = price_events(stages, device)
    host = host_splits(stages, device)
    s = strategy
    cache: dict[tuple, Template] = {}
    overlapped = dict(device.profile.overlapped) if device.profile is not None else {}
    overlapped.update(beside_compute(stages, device, price, overlapped))

    def template(segments: tuple[tuple[tuple[Event, ...], int], ...]) -> Template:
        k = tuple((chains, *(e.key for e in evs)) for evs, chains in segments)  # middle stages share theirs
        if k not in cache:
            cache[k] = run_segments(segments, price, overlapped, host)
        return cache[k]
    templates = tuple(tuple((template(ch.forward_segments), template(ch.backward_segments))
                            for ch in st.chunks) for st in stages)
    p2p = [[(pipeline_send_ms(ch.send_forward, price, device, s), pipeline_send_ms(ch.send_backward, price, device, s))
            for ch in st.chunks] for st in stages]
    orders = [schedule_order(s.pipeline_schedule, i, s.pp, s.num_microbatches, s.virtual_stages) for i in range(s.pp)]
    contention = device.profile.contention if device.profile is not None else {}
    if s.pp > 1 and any(k in contention for k in price):
        # stages share compute (ranks > cores): durations by busy stages, fluid placement
        levels = []
        # overlapped times were measured with every rank busy: scale them by the event's level
        # price over its all-busy price (compute: events_ms; a collective: its loaded top level)
        top = level_prices(price, contention, s.world_size)
        for j in range(1, s.pp + 1):
            pj = level_prices(price, contention, j * s.tp * s.dp)
            oj = {k: v * pj[k] / top[k] if top.get(k) else v for k, v in overlapped.items() if k in pj}
            levels.append([[(run_segments(ch.forward_segments, pj, oj).duration,
                             run_segments(ch.backward_segments, pj, oj).duration) for ch in st.chunks]
                           for st in stages])
        dur = [[([lv[i][c][0] for lv in levels], [lv[i][c][1] for lv in levels]) for c in range(len(st.chunks))]
               for i, st in enumerate(stages)]
        frac = [[tuple(min(1.0, x.compute_busy / x.duration) if x.duration > 0 else 0.0 for x in fb) for fb in tt]
                for tt in templates]
        placements, last_end = place_pipeline(orders, dur, p2p, compute_fractions=frac)
    else:
        placements, last_end = place_pipeline(orders, [[(f.duration, b.duration) for f, b in tt] for tt in templates],
                                              p2p, record=timeline or s.overlap_grad_reduce)
    releases = bucket_releases(stages, templates, placements) if s.overlap_grad_reduce else None
    tail = _tail(stages, price, last_end, releases, templates, overlapped)
    if not timeline:
        placements = []
    iteration = max([*last_end, *(x.end for x in tail)])
    mem = tuple(stage_memory(model, s, st, orders[i]) for i, st in enumerate(stages))
    m = s.num_microbatches
    stats = []
    for i, tt in enumerate(templates):
        compute = m * sum(f.compute_busy + b.compute_busy for f, b in tt)
        sends = m * sum(a + b for a, b in p2p[i])
        exposed = m * sum(f.duration - f.compute_busy + b.duration - b.compute_busy for f, b in tt) + sends
        comm = m * sum(f.comm_busy + b.comm_busy for f, b in tt) + sends
        for x in tail:
            if x.stage == i:
                if x.stream == "compute":
                    compute += x.end - x.start
                else:  # a bucket's reduction shows only after the stage's last backward
                    exposed += max(0.0, x.end - max(x.start, last_end[i]))
                    comm += x.end - x.start
        bubble = iteration - compute - exposed  # float sums: round-off of a no-bubble stage to 0
        stats.append(StageStats(stage=i, rank=s.rank(pp=i), compute_ms=compute, comm_ms=comm,
                                exposed_comm_ms=exposed, bubble_ms=0.0 if abs(bubble) < 1e-6 else bubble,
                                idle_ms=iteration - compute, memory_GB=mem[i].total / GiB))
    global_batch = model.micro_batch_size * m * s.dp
    flops = gpt_flops_per_iteration(global_batch_size=global_batch, seq_length=model.seq_length,
                                    num_layers=model.num_layers, hidden_size=model.hidden_size,
                                    num_attention_heads=model.num_attention_heads,
                                    ffn_hidden_size=flops_ffn(model), padded_vocab_size=model.padded_vocab_size)
    secs = iteration / 1e3
    peak = device.peak_tflops * 1e12 * s.world_size
    grad = tuple(price[st.grad_allreduce.key] if st.grad_allreduce else sum(price[b.reduce.key] for b in st.grad_buckets)
                 for st in stages)
    limit = device.gpu.memory_GB if memory_limit_GB is None else memory_limit_GB
    return SimResult(model=model, strategy=s, iteration_ms=iteration, stages=tuple(stats),
                     bubble_fraction=sum(x.bubble_ms for x in stats) / (len(stats) * iteration),
                     exposed_comm_ms=sum(x.exposed_comm_ms for x in stats) / len(stats),
                     tokens_per_s=global_batch * model.seq_length / secs, mfu=flops / (secs * peak),
                     placements=tuple(placements), templates=templates,
                     p2p_ms=tuple(tuple(x) for x in p2p), grad_ms=grad, tail=tuple(tail),
                     unique_events=len(price), memory=mem, memory_limit_GB=limit)


def summary_table(r: SimResult) -> str:
    """Plain-text per-stage breakdown plus the headline numbers."""
    s = r.strategy
    vp = f" x {s.virtual_stages} virtual" if s.virtual_stages > 1 else ""
    title = record(s.backend).title(s.layout)  # "ATP mesh 2x4", "3-D cube"; Megatron's none
    be = f", {title}" if title else ""
    if s.block_degrees is not None:
        be += f", per-block degrees {list(s.block_degrees)}"
    stock = " (stock layers at TP 1)" if s.schedule == "oases" and not s.oases_runs else ""  # describe.split
    lines = [f"TP {s.tp} x PP {s.pp}{vp} x DP {s.dp} = {s.world_size} GPUs{be}, {s.pipeline_schedule}, "
             f"{s.num_microbatches} micro-batches, schedule {s.schedule}{stock}, recompute {'on' if s.recompute else 'selective' if s.selective_recompute else 'off'}"
             + (", DP overlap grad" + (" + param" if s.overlap_param_gather else "") if s.overlap_grad_reduce else ""),
             f"iteration {r.iteration_ms:.2f} ms | {r.tokens_per_s:,.0f} tokens/s | MFU {100 * r.mfu:.1f}% | "
             f"bubble {100 * r.bubble_fraction:.1f}% | exposed comm {r.exposed_comm_ms:.2f} ms | "
             f"{r.unique_events} unique events",
             f"memory peak {r.peak_memory_GB:.2f} GB"
             + (f" of {r.memory_limit_GB:g} GB" if r.memory_limit_GB else "")
             + (f" -- INFEASIBLE: {r.infeasible_reason}" if not r.fits else ""),
             f"{'stage':>5} {'rank':>6} {'compute ms':>11} {'comm ms':>9} {'exposed':>9} {'bubble':>9} "
             f"{'idle':>9} {'mem GB':>8}"]
    for x in r.stages:
        lines.append(f"{x.stage:>5} {x.rank:>6} {x.compute_ms:>11.2f} {x.comm_ms:>9.2f} "
                     f"{x.exposed_comm_ms:>9.2f} {x.bubble_ms:>9.2f} {x.idle_ms:>9.2f} {x.memory_GB:>8.2f}")
    return "\n".join(lines)
