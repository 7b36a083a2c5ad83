"""The Oases split: how the Oases schedule cuts a micro-batch into sub-batches, described once.

The executor (``schedules/oases``), the simulator (``sim/core/events.py``, ``sim/core/memory.py``), the
planner (``plan/cost_model.py``, ``plan/graph.py``, ``plan/plan_file.py``) and the saved-bytes
description (``describe/saved.py``) read these facts here, so they cannot disagree about them:

* ``SUB_BATCHES``: two sub-batches per micro-batch (§3.1: one sub-batch's TP collectives overlap
  the other's compute);
* ``oases_splits`` / ``sub_batches_at``: the one rule of where the split happens, which every
  tool reads (the trainer's ``schedules/oases/options.oases_runs``, ``sim``'s
  ``Strategy.oases_runs``, ``plan``'s ``PlanModel.sub_batches``): under ``--schedule oases`` a
  block at TP degree > 1 splits, and so does one at degree 1 of an MoE model over EP > 1 (its
  all-to-alls to overlap); a dense block at degree 1 has no collective to overlap and runs whole,
  so a dense model at TP 1 runs stock layers (Megatron's recompute included);
* ``sub_batch_sizes`` / ``split_refusal``: equal sub-batches only. A micro-batch that does not
  split evenly (an odd one) is refused everywhere with one message, at parse time: the
  simulator's timeline runs every sub-batch through the same events and the planner's lock-step
  node and edge costs assume equal sub-batches, so neither can price a 2 + 1 split the executor
  could run. Only a micro-batch that is split is checked (``--micro-batch-size 1`` runs at
  TP 1 under ``--schedule oases``, whose layers are stock there);
* ``recompute_boundaries``: what a layer keeps between its forward and its recompute, per
  recompute mode.
"""
from __future__ import annotations

from .ops import ModelingError

SUB_BATCHES = 2
"""Sub-batches per micro-batch under the Oases schedule."""


def oases_splits(degree: int, *, oases: bool = True, expert_parallel: int = 1) -> bool:
    """Whether the Oases executor splits a block at TP ``degree`` into sub-batches (the rule; the
    stage's whole TP group when the run has no per-block plan): under the Oases schedule
    (``oases``, ``--schedule oases``) at degree > 1, or at degree 1 when ``expert_parallel`` (the
    run's ``--expert-model-parallel-size`` for a model with MoE layers, else 1) is above 1, its
    all-to-alls to overlap. Else the block issues no collective to overlap: a degree-1 block of a
    plan runs its replica's share whole (``schedules/oases/block.py``), and at TP 1 a dense model's
    layers are stock ones (``options.oases_runs``: the executor's half-size GEMMs and per-step
    autograd calls would only cost time)."""
    return oases and (degree > 1 or expert_parallel > 1)


def sub_batches_at(degree: int, *, oases: bool = True, expert_parallel: int = 1) -> int:
    """Sub-batches a block at TP ``degree`` runs: ``SUB_BATCHES`` where :func:`oases_splits`,
    else 1 (the stock executor, ``oases=False``, too)."""
    return SUB_BATCHES if oases_splits(degree, oases=oases, expert_parallel=expert_parallel) else 1


def unsplit_refusal(flag: str) -> str:
    """The one line for an Oases switch ``flag`` where nothing splits (a dense model at TP 1,
    :func:`oases_splits` false): the trainer's and ``sim``'s words."""
    return (f"{flag} has no effect at --tensor-model-parallel-size 1 (there are no TP collectives, "
            f"and --schedule oases runs stock layers there); drop it or use "
            f"--tensor-model-parallel-size 2 or more")


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


def recompute_boundaries(*, fine_grained: bool, tp: int, sequence_parallel: bool = False) -> float:
    """Hidden states (of the micro-batch, all sub-batches together) one Megatron 1-D layer at TP
    degree ``tp`` keeps for its recompute under full recompute: its input (1; under sequence
    parallelism its chunk, 1/t) and, with the Oases fine-grained recompute, the outputs of the
    forward collectives recompute would otherwise repeat, so it issues none: the two all-reduce
    outputs (2), or under sequence parallelism the two reduce-scattered chunks (2/t) and the two
    all-gathered norm outputs (2). At ``tp`` 1 those collectives are one rank's identities, which
    the executor does not keep (``LayerTape.saved_boundaries``, since 30b7d40): the input only, as
    a dense layer of an MoE run at TP 1 x EP 2 keeps under ``--schedule oases``. The rule is read
    here by ``sim.core.memory``, ``plan.memory`` and ``describe.saved``; ``fine_grained=False``
    is also Megatron's stock full recompute."""
    if sequence_parallel and tp > 1:
        return 2 + 3 / tp if fine_grained else 1 / tp
    return 3 if fine_grained and tp > 1 else 1
