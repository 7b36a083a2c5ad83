"""Compute contention between ranks that share CPU cores (or any shared compute resource).

When more ranks run on a machine than it has cores, a rank's compute slows down by how many
ranks compute at the same moment. ``sim.calibrate.emulated_profile`` measures every compute event with
k ranks busy at once, for k = the ranks of 1, 2, ..., PP stages (TP peers and DP replicas compute
together); ``ProfileDB.contention[key] = {k: ms}``.

* A stage's collectives slow down too when other stages compute beside them (gloo's worker
  thread and the kernel's network work wait for a core): ``contention[key] = {k: ms}`` for a
  collective holds its time with the ranks of k / (TP x DP) stages busy, its own included (the
  plain time at one stage); ``events_ms`` keeps the plain time.
* Without pipelining, or when all stages compute together, the all-busy price (``events_ms``) is
  exact by construction.
* With a pipeline the number of busy stages changes over the step (fill, drain, stages waiting
  on P2P). ``placement.place_pipeline`` with ``compute_fractions`` places the schedule as a fluid
  (processor-sharing) simulation: every forward / backward block of a stage has a duration ``D(j)`` for j busy stages
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
