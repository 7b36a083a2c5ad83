"""Per-stage op orders of the pipeline schedules, as Megatron-Core 0.16 runs them.

An order is a list of ``(phase, chunk, micro_batch)`` with phase ``"F"`` or ``"B"``; ``chunk`` is
the model chunk (virtual stage) on this device, 0 unless interleaved. Virtual stage ``g = chunk *
pp + stage`` holds layers ``[g L/(pp v), (g+1) L/(pp v))``, Megatron's interleaved layout.

* GPipe: all forwards, then all backwards.
* 1F1B (``forward_backward_pipelining_without_interleaving``): ``pp - stage - 1`` warm-up
  forwards, then one forward / one backward, then the cool-down backwards. PP = 1 gives F B F B
  (``forward_backward_no_pipelining``).
* Interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): virtual micro-batch k
  maps to (micro-batch, chunk) through Megatron's schedule table (groups of
  ``microbatch_group_size_per_vp_stage``, default pp, micro-batches per chunk); warm-up is
  ``2 (pp - stage - 1) + (v - 1) * group`` forwards (all of them if that reaches m v); backward k
  runs chunk ``v - 1 - chunk(k)``. ``tests/test_sim_schedule.py`` checks this against Megatron's
  own ``get_schedule_table`` and ``get_pp_rank_microbatches``.
"""
from __future__ import annotations

Order = list[tuple[str, int, int]]


def schedule_table(num_microbatches: int, num_chunks: int, group: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: virtual micro-batch -> (micro-batch, chunk)."""
    table: list[tuple[int, int]] = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table += [(m, c) for c in range(num_chunks) for m in range(lo, hi)]
    return table


def warmup_count(stage: int, pp: int, num_microbatches: int, num_chunks: int, group: int) -> int:
    """Megatron's ``get_pp_rank_microbatches`` warm-up (forwards before the first backward)."""
    total = num_microbatches * num_chunks
    if pp == 1:
        return 0
    if num_chunks == 1:
        warm = pp - stage - 1
    else:
        warm = 2 * (pp - stage - 1) + (num_chunks - 1) * group
    return min(warm, total)


def schedule_order(schedule: str, stage: int, pp: int, m: int, vp: int = 1, group: int | None = None) -> Order:
    """The op order of ``stage``: GPipe, 1F1B or (vp > 1) interleaved 1F1B."""
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    g = group or pp
    table = schedule_table(m, vp, g)
    total = m * vp
    warm = warmup_count(stage, pp, m, vp, g)
    fwd = [("F", c, mb) for mb, c in table]
    bwd = [("B", vp - 1 - c, mb) for mb, c in table]
    steady = [None] * (2 * (total - warm))  # one forward, one backward, ...
    steady[0::2], steady[1::2] = fwd[warm:], bwd[:total - warm]
    return fwd[:warm] + steady + bwd[total - warm:]
