"""The event a device runs and the group class that prices a collective: named once for the
simulator's timelines, the profiler and the planner's pricer."""
from __future__ import annotations

import dataclasses
from typing import Union

from ..describe.ops import Collective, Compute
from ..topology import Topology
from .device_model import link_level


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """One thing a device does; ``key`` names it for dedup and for the profile."""

    key: str
    name: str
    kind: str
    """compute | collective | p2p"""
    op: Union[Compute, Collective, None] = None
    ranks: tuple[int, ...] = ()
    """The collective's group, or (src, dst) for p2p; empty for compute."""
    nbytes: float = 0.0
    dims: tuple[tuple[str, Union[int, str, float]], ...] = ()
    """Sizes the work depends on (b s h a f t d1 d2 v p dtype; hd ad exec for layer events), for
    the profiler's workloads."""
    beside: "Event | None" = None
    """A collective that runs beside the tail of the compute before it: stock Megatron's
    column-parallel linear launches its input-gradient all-reduce async and computes this event
    (its weight gradient) meanwhile. Not placed itself; the timeline starts the collective that
    much before the compute ends."""
    hidden_by: "Compute | None" = None
    """A collective that Transformer Engine's userbuffers (``--tp-comm-overlap``) pipeline with
    this GEMM (chunk by chunk): only the part of the collective the GEMM cannot cover is exposed
    (``DeviceModel.price``). The GEMM itself stays in its compute event."""


def group_tag(topo: Topology, ranks: tuple[int, ...]) -> str:
    """Group class: size + the link levels its ring crosses (same class -> same price)."""
    n = len(ranks)
    levels = sorted({topo.levels[link_level(topo, ranks[i], ranks[(i + 1) % n])].name
                     for i in range(n) if ranks[i] != ranks[(i + 1) % n]})
    return f"{n}:{'+'.join(levels) or 'self'}"
