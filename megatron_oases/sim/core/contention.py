"""Compute contention between ranks that share CPU cores (or any shared compute resource).

When more ranks run on a machine than it has cores, a rank's compute slows down by how many
ranks compute at the same moment. ``sim.emulated_profile`` measures every compute event with
k ranks busy at once, for k = the ranks of 1, 2, ..., PP stages (TP peers and DP replicas compute
together); ``ProfileDB.contention[key] = {k: ms}``.

* A stage's collectives slow down too when other stages compute beside them (gloo's worker
  thread and the kernel's network work wait for a core): ``contention[key] = {k: ms}`` for a
  collective holds its time with the ranks of k / (TP x DP) stages busy, its own included (the
  plain time at one stage); ``events_ms`` keeps the plain time.
* Without pipelining, or when all stages compute together, the all-busy price (``events_ms``) is
  exact by construction.
* With a pipeline the number of busy stages changes over the step (fill, drain, stages waiting
  on P2P). :func:`place_pipeline_shared` places the schedule as a fluid (processor-sharing)
  simulation: every forward / backward block of a stage has a duration ``D(j)`` for j busy stages
  (its template priced at ``j x TP x DP`` busy ranks) and progresses at rate ``1 / D(j)``, where
  j = 1 + the summed compute fractions (compute busy / duration) of the other stages' running
  blocks: a stage blocked on a TP collective or a send leaves the cores to the others (a
  mean-field view of the block's inside). ``D`` is linear between measured levels.

Nothing here is fitted to trainer step times: the only inputs are the per-level measurements.
"""
from __future__ import annotations

import math
from typing import Mapping

from ...pricing.device_model import SimError
from .placement import Placement


def interpolate(levels: Mapping[int, float], k: float) -> float:
    """Piecewise-linear value at ``k`` busy ranks from ``{busy ranks: ms}``, clamped at the ends."""
    if not levels:
        raise SimError("no contention levels to interpolate")
    pts = sorted((int(n), float(v)) for n, v in levels.items())
    if k <= pts[0][0]:
        return pts[0][1]
    for (k0, v0), (k1, v1) in zip(pts, pts[1:]):
        if k <= k1:
            return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
    return pts[-1][1]


def level_prices(price: Mapping[str, float], contention: Mapping[str, Mapping[int, float]],
                 busy_ranks: float) -> dict[str, float]:
    """``price`` with every event that has contention measurements priced at ``busy_ranks``."""
    return {k: interpolate(contention[k], busy_ranks) if k in contention else v for k, v in price.items()}


def block_duration(durations: list[float], busy_stages: float) -> float:
    """A block's duration with ``busy_stages`` (>= 1, fractional) stages computing;
    ``durations[j - 1]`` is the measured-price duration with j stages busy."""
    j = min(max(busy_stages, 1.0), float(len(durations)))
    lo = int(math.floor(j))
    if lo >= len(durations):
        return durations[-1]
    return durations[lo - 1] + (durations[lo] - durations[lo - 1]) * (j - lo)


def place_pipeline_shared(orders: list[list[tuple[str, int, int]]],
                          dur: list[list[tuple[list[float], list[float]]]],
                          frac: list[list[tuple[float, float]]],
                          p2p: list[list[tuple[float, float]]]):
    """Algorithm 1 with shared compute: returns (placements, each stage's end incl. its last send).

    ``dur[s][c] = (F durations, B durations)``, each indexed by busy stages - 1; ``frac[s][c]`` the
    blocks' compute fractions; ``p2p[s][c]`` their sends' durations (which do not compute). The
    dependencies are ``timeline.place_pipeline``'s: F of virtual stage g after F of g-1 plus its
    send, B of g after B of g+1 plus its send, B of the last after its own F, and a stage's next
    op after its own send.
    """

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
