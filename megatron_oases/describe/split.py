"""The Oases split: how the Oases schedule cuts a micro-batch into sub-batches, described once.

The executor (``schedules/oases``), the simulator (``sim/core/events.py``, ``sim/core/memory.py``), the
planner (``plan/cost_model.py``, ``plan/graph.py``, ``plan/plan_file.py``) and the saved-bytes
description (``describe/saved.py``) read these facts here, so they cannot disagree about them:

* ``SUB_BATCHES``: two sub-batches per micro-batch (§3.1: one sub-batch's TP collectives overlap
  the other's compute);
* ``sub_batches_at``: the sub-batches a block at a TP degree runs (a degree-1 block of a plan
  has no collective to overlap and runs its replica's share whole; an MoE model over EP > 1
  splits at TP 1 too, its all-to-alls to overlap);
* ``sub_batch_sizes`` / ``split_refusal``: equal sub-batches only. A micro-batch that does not
  split evenly (an odd one) is refused everywhere with one message, at parse time: the
  simulator's timeline runs every sub-batch through the same events and the planner's lock-step
  node and edge costs assume equal sub-batches, so neither can price a 2 + 1 split the executor
  could run;
* ``recompute_boundaries``: what a layer keeps between its forward and its recompute, per
  recompute mode.
"""
from __future__ import annotations

from .ops import ModelingError

SUB_BATCHES = 2
"""Sub-batches per micro-batch under the Oases schedule."""


def sub_batches_at(degree: int | None = None, *, oases: bool = True, expert_parallel: int = 1) -> int:
    """Sub-batches a block runs at TP ``degree`` (None: the stage's whole TP group, no plan):
    ``SUB_BATCHES`` under the Oases schedule, except at degree 1, where a planned block issues
    no collective and its replica's share runs whole (``schedules/oases/block.py``); 1 without
    the Oases schedule (``oases=False``: the stock executor). ``expert_parallel``: the run's
    ``--expert-model-parallel-size`` for a model with MoE layers; above 1 their all-to-alls are
    there to overlap, so the model splits at degree 1 too (``options.oases_runs``; a dense model
    at TP 1 runs whole)."""
    return SUB_BATCHES if oases and (degree is None or degree > 1 or expert_parallel > 1) else 1


def split_refusal(micro_batch: int, sub_batches: int = SUB_BATCHES) -> str:
    """Empty when ``micro_batch`` samples split into ``sub_batches`` equal sub-batches; else the
    one line that refuses it (naming the flag and the fix)."""
    if micro_batch >= sub_batches and micro_batch % sub_batches == 0:
        return ""
    lower = max(sub_batches, micro_batch - micro_batch % sub_batches)
    upper = lower if micro_batch < sub_batches else lower + sub_batches
    fix = f"{lower}" if lower == upper else f"{lower} or {upper}"
    return (f"the Oases schedule splits each micro-batch into {sub_batches} equal sub-batches and "
            f"needs --micro-batch-size >= {sub_batches} and a multiple of {sub_batches} (got "
            f"{micro_batch}); use --micro-batch-size {fix}, or the stock schedule")


def sub_batch_sizes(samples: int, sub_batches: int = SUB_BATCHES) -> tuple[int, ...]:
    """Samples of each sub-batch of ``samples`` (along the batch dimension, in order); raises
    ``ModelingError`` with ``split_refusal``'s line when they do not split evenly."""
    why = split_refusal(samples, sub_batches)
    if why:
        raise ModelingError(why)
    return (samples // sub_batches,) * sub_batches


def recompute_boundaries(*, fine_grained: bool, sequence_parallel: bool = False, tp: int = 1) -> float:
    """Hidden states (of the micro-batch, all sub-batches together) one Megatron 1-D layer keeps
    for its recompute under full recompute: its input (1; under sequence parallelism its chunk,
    1/t) and, with the Oases fine-grained recompute, the outputs of the forward collectives
    recompute would otherwise repeat, so it issues none: the two all-reduce outputs (2), or under
    sequence parallelism the two reduce-scattered chunks (2/t) and the two all-gathered norm
    outputs (2). ``fine_grained=False`` is also Megatron's stock full recompute."""
    if sequence_parallel and tp > 1:
        return 2 + 3 / tp if fine_grained else 1 / tp
    return 3 if fine_grained else 1
