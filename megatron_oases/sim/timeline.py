"""Places events on streams: TP inside a stage, then the pipeline schedule, then DP (DistSim §4.3).

Every micro-batch runs the same events on a stage, so the stage's forward and backward are
simulated once each on a compute and a communication stream (a *template*), and the pipeline
(Algorithm 1) places those templates with P2P dependencies. This keeps 3,000+ GPUs under a
second while the expanded trace (``sim.trace``) stays exact.
"""
from __future__ import annotations

import dataclasses

from ..flops import gpt_flops_per_iteration
from .device_model import DeviceModel, SimError
from .events import Event, ModelConfig, StageEvents, Strategy, build_stage_events, unique_events


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slot:
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
    """One micro-batch's forward or backward on one stage."""

    slots: tuple[Slot, ...]
    duration: float
    compute_busy: float
    comm_busy: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """A template placed on the pipeline: stage, 'F' or 'B', micro-batch, absolute ms."""

    stage: int
    phase: str
    micro_batch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageStats:
    stage: int
    rank: int
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    """Time the compute stream waits on TP collectives and the DP all-reduce."""
    bubble_ms: float
    """Time the stage waits on other stages (pipeline fill/drain)."""
    idle_ms: float
    """iteration - compute = exposed comm + bubble."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    model: ModelConfig
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
    templates: tuple[tuple[Template, Template], ...]
    """Per stage: (forward, backward)."""
    p2p_ms: tuple[tuple[float, float], ...]
    """Per stage: (send forward, send backward) durations."""
    grad_ms: tuple[float, ...]
    unique_events: int


def run_template(events: tuple[Event, ...], chains: int, price: dict[str, float]) -> Template:
    """Compute and comm streams, ``chains`` sub-batches; each op waits for its chain's previous op.

    chains=1 is the stock executor (compute waits on every collective). chains=2 is Oases: the
    compute stream alternates sub-batches, so one sub-batch's collective runs on the comm stream
    while the other's next segment computes.
    """
    free = {"compute": 0.0, "comm": 0.0}
    prev = [0.0] * chains
    slots, busy = [], {"compute": 0.0, "comm": 0.0}
    for ev in events:
        stream = "compute" if ev.kind == "compute" else "comm"
        d = price[ev.key]
        for c in range(chains):
            start = max(free[stream], prev[c])
            free[stream] = prev[c] = start + d
            busy[stream] += d
            slots.append(Slot(stream=stream, name=ev.name, key=ev.key, chain=c, start=start, dur=d))
    return Template(slots=tuple(slots), duration=max(prev, default=0.0),
                    compute_busy=busy["compute"], comm_busy=busy["comm"])


def schedule_order(schedule: str, stage: int, pp: int, m: int) -> list[tuple[str, int]]:
    """The stage's order of (phase, micro-batch): GPipe all F then all B; 1F1B warm-up, steady, cool-down."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def place_pipeline(orders: list[list[tuple[str, int]]], dur: list[tuple[float, float]],
                   p2p: list[tuple[float, float]]) -> list[Placement]:
    """DistSim Algorithm 1: repeatedly run the next op of any stage whose input is ready."""
    pp = len(orders)
    end: dict[tuple[int, str, int], float] = {}
    pos, free, out = [0] * pp, [0.0] * pp, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                phase, m = orders[s][pos[s]]
                if phase == "F":
                    ready = s == 0 or (s - 1, "F", m) in end
                    dep = 0.0 if s == 0 else end.get((s - 1, "F", m), 0.0) + p2p[s - 1][0]
                elif s == pp - 1:
                    ready, dep = (s, "F", m) in end, end.get((s, "F", m), 0.0)
                else:
                    ready = (s + 1, "B", m) in end
                    dep = end.get((s + 1, "B", m), 0.0) + p2p[s + 1][1]
                if not ready:
                    break
                start = max(free[s], dep)
                free[s] = end[(s, phase, m)] = start + dur[s][0 if phase == "F" else 1]
                out.append(Placement(stage=s, phase=phase, micro_batch=m, start=start, end=free[s]))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise SimError("pipeline schedule deadlocks: no stage can start its next micro-batch")
    return out


def price_events(stages: list[StageEvents], device: DeviceModel) -> dict[str, float]:
    """Each unique event priced once (profile first, if given)."""
    uniq = unique_events(stages)
    if device.profile is not None and device.strict_profile:
        device.profile.require(list(uniq))
    return {k: device.price(k, e.op, kind=e.kind, nbytes=e.nbytes, ranks=e.ranks) for k, e in uniq.items()}


def simulate(model: ModelConfig, strategy: Strategy, device: DeviceModel) -> SimResult:
    """One training iteration (no optimizer step) on ``device.topology``."""
    stages = build_stage_events(model, strategy, device.topology)
    price = price_events(stages, device)
    s = strategy
    templates = tuple((run_template(st.forward, st.chains, price), run_template(st.backward, st.chains, price))
                      for st in stages)
    p2p = [(price[st.send_forward.key] if st.send_forward else 0.0,
            price[st.send_backward.key] if st.send_backward else 0.0) for st in stages]
    grad = tuple(price[st.grad_allreduce.key] if st.grad_allreduce else 0.0 for st in stages)
    orders = [schedule_order(s.schedule, i, s.pp, s.num_microbatches) for i in range(s.pp)]
    placements = place_pipeline(orders, [(f.duration, b.duration) for f, b in templates], p2p)
    last_b = [0.0] * s.pp
    for p in placements:
        last_b[p.stage] = max(last_b[p.stage], p.end)
    iteration = max(last_b[i] + grad[i] for i in range(s.pp))
    m = s.num_microbatches
    stats = []
    for i, (f, b) in enumerate(templates):
        compute = m * (f.compute_busy + b.compute_busy)
        exposed = m * (f.duration - f.compute_busy + b.duration - b.compute_busy) + grad[i]
        comm = m * (f.comm_busy + b.comm_busy) + m * sum(p2p[i]) + grad[i]
        stats.append(StageStats(stage=i, rank=s.rank(pp=i), compute_ms=compute, comm_ms=comm,
                                exposed_comm_ms=exposed, bubble_ms=iteration - compute - exposed,
                                idle_ms=iteration - compute))
    global_batch = model.micro_batch * m * s.dp
    flops = gpt_flops_per_iteration(global_batch_size=global_batch, seq_length=model.seq,
                                    num_layers=model.num_layers, hidden_size=model.hidden,
                                    num_attention_heads=model.heads, ffn_hidden_size=model.ffn,
                                    padded_vocab_size=model.vocab)
    secs = iteration / 1e3
    peak = device.peak_tflops * 1e12 * s.world_size
    return SimResult(model=model, strategy=s, iteration_ms=iteration, stages=tuple(stats),
                     bubble_fraction=sum(x.bubble_ms for x in stats) / (len(stats) * iteration),
                     exposed_comm_ms=sum(x.exposed_comm_ms for x in stats) / len(stats),
                     tokens_per_s=global_batch * model.seq / secs, mfu=flops / (secs * peak),
                     placements=tuple(placements), templates=templates, p2p_ms=tuple(p2p),
                     grad_ms=grad, unique_events=len(price))


def summary_table(r: SimResult) -> str:
    """Plain-text per-stage breakdown plus the headline numbers."""
    s = r.strategy
    lines = [f"TP {s.tp} x PP {s.pp} x DP {s.dp} = {s.world_size} GPUs, {s.schedule}, "
             f"{s.num_microbatches} micro-batches, overlap {s.overlap}, recompute {'on' if s.recompute else 'off'}",
             f"iteration {r.iteration_ms:.2f} ms | {r.tokens_per_s:,.0f} tokens/s | MFU {100 * r.mfu:.1f}% | "
             f"bubble {100 * r.bubble_fraction:.1f}% | exposed comm {r.exposed_comm_ms:.2f} ms | "
             f"{r.unique_events} unique events",
             f"{'stage':>5} {'rank':>6} {'compute ms':>11} {'comm ms':>9} {'exposed':>9} {'bubble':>9} {'idle':>9}"]
    for x in r.stages:
        lines.append(f"{x.stage:>5} {x.rank:>6} {x.compute_ms:>11.2f} {x.comm_ms:>9.2f} "
                     f"{x.exposed_comm_ms:>9.2f} {x.bubble_ms:>9.2f} {x.idle_ms:>9.2f}")
    return "\n".join(lines)
