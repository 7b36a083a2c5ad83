"""How the Oases executor runs a tape's collective steps, forward (and recompute) and backward.

``executor.OasesRunner`` walks the tapes and owns the sub-batches, the saved boundaries and the
parameter gradients; this module owns what each collective step kind (``tape.py``'s step
dataclasses) launches: the async call in each direction, what a sub-batch yields while it is in
flight (its work handle, so ``executor.interleave`` runs the other sub-batch meanwhile), and how
the result lands in the step's environment or gradients:

| step                      | forward (and recompute)         | backward                           |
|---------------------------|---------------------------------|------------------------------------|
| ForwardAllReduce          | all-reduce                      | identity (Eq. 1), or all-reduce    |
|                           |                                 | (``reduce_grad``: a shared statistic)|
| BackwardAllReduce         | (nothing)                       | all-reduce                         |
| ForwardAllGather          | all-gather                      | own chunk                          |
| BackwardAllGather         | own chunk                       | all-gather                         |
| GatherSequence            | all-gather (uneven: ``sizes``)  | reduce-scatter                     |
| ReduceScatterSequence     | reduce-scatter (uneven)         | all-gather                         |
| AllToAll                  | all-to-all                      | all-to-all, splits swapped         |
| Barrier                   | (the executor yields ``BARRIER``)| (nothing)                         |

``skip_collectives`` (``--oases-skip-tp-collectives``) skips the even TP collectives; an MoE
layer's uneven ones and all-to-alls always run (the routed tokens must reach their experts).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_oases.parallel.collectives import all_gather_into, all_reduce, comm_tag, reduce_scatter_into
from megatron_oases.parallel.collectives_uneven import all_gather_uneven, all_to_all, reduce_scatter_uneven
from megatron_oases.schedules.oases.steps import (AllToAll, BackwardAllGather, BackwardAllReduce, BlockInputs,
                                                  ForwardAllGather, ForwardAllReduce, GatherSequence, LayerTape,
                                                  ReduceScatterSequence)


def accumulate(grads: dict, name: str, g: torch.Tensor) -> None:
    """``grads[name] += g`` (set when absent)."""
    grads[name] = g if name not in grads else grads[name] + g


def own_chunk(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of ``t`` along ``dim`` over ``group`` (local; no collective)."""
    n = dist.get_world_size(group)
    return t if n == 1 else t.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _sizes(step, inputs: BlockInputs):
    """Each rank's rows of an uneven gather / reduce-scatter step (None: equal chunks)."""
    sizes = getattr(step, "sizes", None)
    return None if sizes is None else sizes(inputs)


def _gathered(out) -> torch.Tensor:
    """An all-gather / reduce-scatter result once waited on (one along a non-leading dim, or an
    uneven one, is read with ``.get()``)."""
    return out if isinstance(out, torch.Tensor) else out.get()


class CommSteps:
    """The collective steps of one runner's tapes (``OasesOptions.skip_collectives`` applied)."""

    def __init__(self, skip_collectives: bool):
        self.skip = skip_collectives

    def forward(self, step, env: dict, tape: LayerTape, inputs: BlockInputs, recompute: bool):
        """Launch a forward collective step async (yield its handle), then store its output.
        In recompute (tagged "recompute") an all-reduce works on a copy: its input is the output
        of a graph the backward still walks."""
        group = tape.group_of(step)
        with comm_tag("recompute") if recompute else contextlib.nullcontext():
            if isinstance(step, ForwardAllReduce):  # in place, unless its input is kept
                out = env[step.src].clone() if recompute or step.src == tape.input else env[step.src]
                work = self.all_reduce(out, group)
            elif isinstance(step, ReduceScatterSequence):
                out, work = self.reduce_scatter(env[step.src], step.dim, group, _sizes(step, inputs))
            elif isinstance(step, AllToAll):
                out, work = all_to_all(env[step.src], *step.splits(inputs), group, async_op=True)
            else:  # ForwardAllGather, GatherSequence
                out, work = self.all_gather(env[step.src], step.dim, group, _sizes(step, inputs))
        if work is not None:
            yield work
        env[step.dst] = _gathered(out)

    def backward(self, step, grads: dict, tape: LayerTape, inputs: BlockInputs):
        """A collective step's backward for one sub-batch: ``grads`` (name -> gradient) goes
        from the step's output to its input; yields the work handle while it is in flight."""
        if isinstance(step, ForwardAllReduce) and not step.reduce_grad:
            grads[step.src] = grads.pop(step.dst)  # Eq. 1
            return
        out, work = None, None
        if isinstance(step, ForwardAllReduce):  # a statistic shared by the group
            out = grads.pop(step.dst).contiguous().clone()
            work = self.all_reduce(out, tape.group_of(step))
        elif isinstance(step, BackwardAllReduce):
            work = self.all_reduce(grads[step.tensor], tape.group_of(step))
        elif isinstance(step, ForwardAllGather):
            out = own_chunk(grads.pop(step.dst), step.dim, step.group)
        elif isinstance(step, (BackwardAllGather, ReduceScatterSequence)):
            out, work = self.all_gather(grads.pop(step.dst), step.dim, tape.group_of(step), _sizes(step, inputs))
        elif isinstance(step, GatherSequence):  # partial input gradients: sum, keep own
            out, work = self.reduce_scatter(grads.pop(step.dst), step.dim, tape.group_of(step),
                                            _sizes(step, inputs))
        elif isinstance(step, AllToAll):  # the all-to-all back: splits swapped
            out_splits, in_splits = step.splits(inputs)
            out, work = all_to_all(grads.pop(step.dst), in_splits, out_splits, tape.group_of(step), async_op=True)
        if work is not None:
            yield work
        if out is not None:
            accumulate(grads, step.src, _gathered(out))

    def all_reduce(self, t: torch.Tensor, group):
        """Launch an async in-place all-reduce (counted); None when there is nothing to wait for."""
        if self.skip:
            return None
        return all_reduce(t, group, async_op=True)

    def all_gather(self, t: torch.Tensor, dim: int, group, sizes=None):
        """Launch an async all-gather along ``dim`` (counted): (result, work or None); read the
        result with ``_gathered`` after the wait. ``sizes``: each rank's rows along dim 0, when
        they differ (an MoE layer's routed tokens; always communicated)."""
        if sizes is not None:
            return all_gather_uneven(t, sizes, group, async_op=True)
        if self.skip:
            return torch.cat([t] * dist.get_world_size(group), dim=dim), None
        return all_gather_into(t, dim, group, async_op=True)

    def reduce_scatter(self, t: torch.Tensor, dim: int, group, sizes=None):
        """Launch an async reduce-scatter along ``dim`` (counted): (result, work or None); read
        the result with ``_gathered`` after the wait. ``sizes``: as ``all_gather``'s."""
        if sizes is not None:
            return reduce_scatter_uneven(t, sizes, group, async_op=True)
        if self.skip:
            return own_chunk(t, dim, group), None
        return reduce_scatter_into(t, dim, group, async_op=True)
