"""What a plan (``--oases-plan``) may give a block, and how it splits the micro-batch, described once.

A plan gives each block a TP degree ``d``: a power of two dividing the TP size ``T`` (the runtime
builds one sub-group per such degree and the batch reshard between two of them needs one to divide
the other: ``parallel/degree_groups.py``). A degree-``d`` block runs as ``T / d`` replicas, each on
its share of the micro-batch (``d / T`` of it), which the Oases executor then cuts into its
sub-batches (``describe.split.sub_batches_at``: none at degree 1). The planner's strategies
(``plan/graph.py``), its prices (``plan/cost_model.py``), the plan file's checks
(``plan/plan_file.py``), the simulator (``sim/core``) and the runtime read these rules here, so a
plan the planner offers is one the trainer runs and the simulator prices.
"""
from __future__ import annotations

from collections.abc import Iterable

from .split import sub_batches_at


def plan_degrees(tp: int) -> tuple[int, ...]:
    """The degrees a plan may give a block at TP ``tp``, ascending: the powers of two dividing it
    (1 and ``tp`` itself when ``tp`` is a power of two)."""
    return tuple(1 << i for i in range(tp.bit_length()) if tp % (1 << i) == 0)


def degree_refusal(degree: int, tp: int) -> str:
    """Empty when a block may run at ``degree`` under TP ``tp``; else why not, in words the callers
    put after the block they name."""
    if degree < 1 or tp % degree or degree & (degree - 1):
        return f"degree {degree} is not a power of two dividing --tensor-model-parallel-size {tp}"
    return ""


def replica_share(micro_batch: int, degree: int, tp: int) -> int:
    """Samples of the micro-batch one replica of a degree-``degree`` block runs (``degree / tp``
    of it; :func:`micro_batch_multiple` says when that is whole)."""
    return micro_batch * degree // tp


def micro_batch_multiple(degrees: Iterable[int], *, tp: int, oases: bool) -> tuple[int, int]:
    """(m, d): ``--micro-batch-size`` must be a multiple of m for blocks at ``degrees`` to split it
    over their ``tp / d`` replicas and then, under the Oases executor (``oases``), each share into
    its sub-batches; d is the degree that needs the most. The degrees are powers of two, so the
    largest need is a multiple of every other."""
    need, neg = max(((tp // d) * sub_batches_at(d, oases=oases), -d) for d in degrees)
    return need, -neg
