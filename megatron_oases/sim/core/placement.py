"""Where the pipeline puts each forward / backward block: DistSim Algorithm 1 (``place_pipeline``).

One dependency rule, two ways of timing the blocks: fixed durations (the usual case, and the
search's hot loop), or durations that depend on how many stages compute at once (ranks that share
cores; ``contention``). With equal durations at every level the two agree (test_sim_accuracy).
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

from ...pricing.device_model import SimError
from .contention import block_duration


class Placement(NamedTuple):
    """A template placed on the pipeline: stage, 'F' or 'B', micro-batch, absolute ms, chunk."""

    stage: int
    phase: str
    micro_batch: int
    start: float
    end: float
    chunk: int = 0


def place_pipeline(orders: list[list[tuple[str, int, int]]], dur: list[list[tuple]],
                   p2p: list[list[tuple[float, float]]], *, compute_fractions: list[list[tuple[float, float]]] | None = None,
                   record: bool = True) -> tuple[list[Placement], list[float]]:
    """DistSim Algorithm 1: repeatedly run the next op of any stage whose input is ready.

    Virtual stage ``g = chunk * pp + stage``; F of g waits for F of g - 1 plus its send, B of g
    for B of g + 1 plus its send, and B of the last virtual stage for its own F. A stage's next op
    also waits for its own send (Megatron's P2P calls wait on their requests; DistSim Algorithm 1
    appends the send to the sender's event list). ``orders[s]``: stage s's (phase, chunk,
    micro-batch) ops; ``p2p[s][c]``: the (forward, backward) sends' durations.

    ``dur[s][c]``: the (F, B) block durations; with ``compute_fractions`` (``frac[s][c]``: the
    blocks' compute busy / duration) each is a list indexed by busy stages - 1 and the blocks share
    compute (a fluid placement). Returns the placements (always with ``compute_fractions``, else
    when ``record``) and each stage's end, including its last send.
    """
    if compute_fractions is not None:
        return _fluid(orders, dur, p2p, compute_fractions)
    return _algorithm_1(orders, dur, p2p, record)


def _algorithm_1(orders: list[list[tuple[str, int, int]]], dur: list[list[tuple[float, float]]],
                 p2p: list[list[tuple[float, float]]], record: bool) -> tuple[list[Placement], list[float]]:
    """Fixed block durations: each stage runs ops back to back as soon as their inputs are ready
    (event-driven, one pass per stage woken by the op that may unblock it)."""
    pp = len(orders)
    vp = len(dur[0])
    last = pp * vp - 1
    m_all = 1 + max((max(map(operator.itemgetter(2), o), default=0) for o in orders), default=0)
    end_f = [[-1.0] * m_all for _ in range(last + 1)]  # end time per virtual stage and micro-batch
    end_b = [[-1.0] * m_all for _ in range(last + 1)]
    send = [p2p[g % pp][g // pp] for g in range(last + 1)]
    pos, free, out = [0] * pp, [0.0] * pp, []
    todo = list(range(pp - 1, -1, -1))  # stages that may be able to run their next op
    queued = [True] * pp
    while todo:
        s = todo.pop()
        queued[s] = False
        order, ds = orders[s], dur[s]
        n, p, fr = len(order), pos[s], free[s]  # locals: this loop runs pp x m x vp times per search strategy
        while p < n:
            phase, c, m = order[p]
            g = c * pp + s
            if phase == "F":
                if g == 0:
                    dep = 0.0
                else:
                    dep = end_f[g - 1][m]
                    if dep < 0:
                        break
                    dep += send[g - 1][0]
                start = fr if fr > dep else dep
                end_f[g][m] = e = start + ds[c][0]
                fr = e + send[g][0]  # Megatron waits on its sends
                nxt = (g + 1) % pp
            else:
                if g == last:
                    dep = end_f[g][m]
                    if dep < 0:
                        break
                else:
                    dep = end_b[g + 1][m]
                    if dep < 0:
                        break
                    dep += send[g + 1][1]
                start = fr if fr > dep else dep
                end_b[g][m] = e = start + ds[c][1]
                fr = e + send[g][1]
                nxt = (g - 1) % pp
            if record:
                out.append(Placement(s, phase, m, start, e, c))
            p += 1
            if not queued[nxt] and nxt != s:  # the stage this op may unblock
                queued[nxt] = True
                todo.append(nxt)
        pos[s], free[s] = p, fr
    if any(pos[s] < len(orders[s]) for s in range(pp)):
        raise SimError("pipeline schedule deadlocks: no stage can start its next micro-batch")
    return out, free


def _fluid(orders: list[list[tuple[str, int, int]]], dur: list[list[tuple[list[float], list[float]]]],
           p2p: list[list[tuple[float, float]]], frac: list[list[tuple[float, float]]]
           ) -> tuple[list[Placement], list[float]]:
    """Shared compute: every running block progresses at ``1 / D(j)`` for j busy stages, j = 1 +
    the other running blocks' compute fractions (``contention.block_duration``); time advances
    to the next block end or the next stage becoming ready."""
    pp = len(orders)
    vp = len(dur[0])
    last = pp * vp - 1
    m_all = 1 + max((m for o in orders for _, _, m in o), default=0)
    ready_f = [[math.inf] * m_all for _ in range(last + 1)]  # when the consumer may start
    ready_b = [[math.inf] * m_all for _ in range(last + 1)]
    send = [p2p[g % pp][g // pp] for g in range(last + 1)]
    pos, free = [0] * pp, [0.0] * pp
    running: dict[int, list] = {}  # stage -> [phase, chunk, mb, start, progress]
    out: list[Placement] = []
    t = 0.0
    eps = 1e-12

    def dep_time(s: int) -> float:
        phase, c, m = orders[s][pos[s]]
        g = c * pp + s
        if phase == "F":
            return 0.0 if g == 0 else ready_f[g - 1][m]
        return ready_f[g][m] - send[g][0] if g == last else ready_b[g + 1][m]

    while True:
        # start every stage whose next op is ready now
        for s in range(pp):
            if s not in running and pos[s] < len(orders[s]) and max(free[s], dep_time(s)) <= t + eps:
                phase, c, m = orders[s][pos[s]]
                running[s] = [phase, c, m, t, 0.0]
        if not running:
            if all(pos[s] >= len(orders[s]) for s in range(pp)):
                break
            nxt = min((max(free[s], dep_time(s)) for s in range(pp) if pos[s] < len(orders[s])), default=math.inf)
            if math.isinf(nxt):
                raise SimError("pipeline schedule deadlocks: no stage can start its next micro-batch")
            t = nxt
            continue
        fr = {s: frac[s][r[1]][0 if r[0] == "F" else 1] for s, r in running.items()}
        total = sum(fr.values())
        rate = {}
        for s, r in running.items():
            ds = dur[s][r[1]][0 if r[0] == "F" else 1]
            d = block_duration(ds, 1.0 + total - fr[s])
            rate[s] = 1.0 / d if d > 0 else math.inf
        # next event: a block finishes, or an idle stage becomes ready
        t_fin = min(t + (1.0 - running[s][4]) / rate[s] if rate[s] < math.inf else t for s in running)
        t_start = min((max(free[s], dep_time(s)) for s in range(pp)
                       if s not in running and pos[s] < len(orders[s])), default=math.inf)
        t_new = min(t_fin, t_start) if t_start > t + eps else t_fin
        for s, r in running.items():
            r[4] = 1.0 if rate[s] == math.inf else r[4] + (t_new - t) * rate[s]
        t = t_new
        for s in [s for s, r in running.items() if r[4] >= 1.0 - 1e-9]:
            phase, c, m, start, _ = running.pop(s)
            g = c * pp + s
            if phase == "F":
                ready_f[g][m] = t + send[g][0]
                free[s] = t + send[g][0]
            else:
                ready_b[g][m] = t + send[g][1]
                free[s] = t + send[g][1]
            out.append(Placement(s, phase, m, start, t, c))
            pos[s] += 1
    return out, free
