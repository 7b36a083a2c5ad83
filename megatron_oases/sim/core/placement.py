"""Where the pipeline put one template: shared by the timeline and the contention model."""
from __future__ import annotations

from typing import NamedTuple


class Placement(NamedTuple):
    """A template placed on the pipeline: stage, 'F' or 'B', micro-batch, absolute ms, chunk."""

    stage: int
    phase: str
    micro_batch: int
    start: float
    end: float
    chunk: int = 0
