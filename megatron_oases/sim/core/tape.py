"""Which version of the Oases executor's program the simulator describes (issue 49 item 2).

The simulator prices the executor as the code now runs it. A measured run made with an older
executor issued a different program, and comparing the two prices one program against another's
time. Two changes of 2026-11-28 moved what the executor issues:

* ``84a03c2``: the head's large TP collectives (the embedding's all-reduce, the output layer's
  input-gradient all-reduce) run per sub-batch inside the executor (``describe/head.py``'s
  ``split_*``); before, each ran once on the whole micro-batch, outside the sub-batch chains.
* ``69398c8``: one ``main_grad`` add per weight and micro-batch (``schedules/oases/wgrad.py``:
  the sub-batches' 16-bit sums first); before, each sub-batch's weight gradient was added into
  DDP's fp32 ``main_grad`` on its own, two full adds a micro-batch where stock runs one.

``OasesTape()`` is the current executor; ``PRE_SPLIT_HEAD`` the one that ran before both (the
H100 stand-in runs of 2026-11-26 and -27: their benchmark JSON records each collective's payload,
so ``tape_of_issued`` tells the head from it; the two changes landed six minutes apart and no
run was made between them, so a whole head also means two adds).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class OasesTape:
    """What the Oases executor issues beyond the layer description's split."""

    head_split: bool = True
    """The head's TP collectives run per sub-batch (since ``84a03c2``); False: once on the whole
    micro-batch before / after the layers' sub-batch chains."""
    grad_add_per_sub_batch: bool = False
    """Each sub-batch's weight gradients added into ``main_grad`` on their own (before
    ``69398c8``); False: once per micro-batch (``sim.core.events.grad_accumulate``)."""


CURRENT = OasesTape()
PRE_SPLIT_HEAD = OasesTape(head_split=False, grad_add_per_sub_batch=True)


def tape_of_issued(issued: list, micro_batch_payload: int) -> OasesTape:
    """The tape of a recorded Oases step from its collectives (``[kind, ranks, bytes, async]``,
    ``benchmarks.standin``'s ``issued`` list): a head collective of the whole micro-batch's
    ``[s, b, h]`` payload means the executor before the head's split (and before the one add)."""
    whole = any(int(c[2]) == micro_batch_payload for c in issued)
    return PRE_SPLIT_HEAD if whole else CURRENT
