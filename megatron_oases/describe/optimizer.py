"""Bytes of model state per parameter under Megatron's mixed-precision DDP and Adam, described once.

The planner's memory constraint (``plan/memory.py``, ``plan/cost_model.py``) and the simulator's
(``sim/core/memory.py``) read these numbers here, so a plan the planner fits in memory is one the
simulator fits too:

* the weights, in the run's dtype (e bytes);
* the gradient buffer Megatron's DDP reduces (``main_grad``: fp32, 4 bytes, unless
  ``--grad-reduce-in-bf16`` makes it 2);
* Adam's two moments in fp32 (8 bytes), plus an fp32 master copy of 2-byte weights (4 bytes):
  the distributed optimizer (``--use-distributed-optimizer``) shards these over ``shard`` ranks
  (the data-parallel group).

bf16 weights: 2 + 4 + 12 = 18 bytes a parameter; fp32: 4 + 4 + 8 = 16.
"""
from __future__ import annotations

ADAM_MOMENT_BYTES = 8
"""Adam's first and second moments, fp32 each."""

MASTER_WEIGHT_BYTES = 4
"""The fp32 master copy Megatron's mixed-precision optimizer keeps of 2-byte weights."""


def state_bytes_per_param(*, bytes_per_element: int, grad_reduce_bytes: int = 4,
                          shard: int = 1) -> tuple[float, float, float]:
    """(weights, gradient buffer, optimizer states) bytes of one parameter on one rank; the
    optimizer states are divided by ``shard`` (the distributed optimizer's DP size, else 1)."""
    master = MASTER_WEIGHT_BYTES if bytes_per_element == 2 else 0
    return float(bytes_per_element), float(grad_reduce_bytes), (master + ADAM_MOMENT_BYTES) / shard
