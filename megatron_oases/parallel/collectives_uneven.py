"""MoE's token exchange: collectives over pieces of different sizes along dim 0, counted like
``collectives.py``'s.

The Oases executor calls these itself (``schedules/oases/comm_steps.py``), each pair's backward
being the other's forward: ``all_to_all`` (uneven splits; its backward is the all-to-all with the
splits swapped), ``all_gather_uneven`` and ``reduce_scatter_uneven`` (Megatron's sequence-parallel
gather / reduce-scatter with ``output_split_sizes`` / ``input_split_sizes``). Gloo gathers and
reduce-scatters equal pieces only, so those two pad each piece to the largest; the all-to-all goes
through ``torch.distributed.all_to_all_single``, which ``collectives.replace_watched_collectives``
(the one-GPU stand-in benchmark) replaces like the others.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_oases.parallel.collectives import record_collective


class _Pieces:
    """An uneven all-gather's padded result: ``.get()`` after the wait drops each piece's padding."""

    def __init__(self, flat, sizes: list[int]):
        self.flat, self.sizes = flat, sizes

    def get(self) -> torch.Tensor:
        rows = max(self.sizes)
        return torch.cat([self.flat[i * rows:i * rows + n] for i, n in enumerate(self.sizes)])


def all_to_all(x: torch.Tensor, output_splits, input_splits, group, async_op: bool = False):
    """All-to-all of ``x``'s rows over ``group``: ``input_splits[j]`` rows go to rank j and
    ``output_splits[j]`` rows come from it (None: equal pieces); returns (output, work-or-None),
    the output filled on wait. Counted with what this rank sends as payload; through
    ``torch.distributed.all_to_all_single``, so the one-GPU stand-in benchmark replaces it too."""
    record_collective("all_to_all", x, group)
    if dist.get_world_size(group) == 1:
        return x, None
    rows = x.shape[0] if output_splits is None else int(sum(output_splits))
    out = x.new_empty((rows, *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=_ints(output_splits),
                                  input_split_sizes=_ints(input_splits), group=group, async_op=async_op)
    return out, work


def _ints(splits):
    return None if splits is None else [int(n) for n in splits]


def all_gather_uneven(x: torch.Tensor, sizes, group, async_op: bool = False):
    """All-gather of pieces of ``sizes[j]`` rows (this rank's is ``x``) along dim 0, as Megatron's
    ``gather_from_sequence_parallel_region(output_split_sizes=...)``: (output, work-or-None), read
    with ``.get()`` after the wait when it is not a tensor. Each piece travels padded to the
    largest (gloo gathers equal pieces only)."""
    n, sizes = dist.get_world_size(group), _ints(sizes)
    if n == 1:
        return x, None
    rows = max(sizes)
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[:x.shape[0]] = x
    flat = x.new_empty((n * rows, *x.shape[1:]))
    record_collective("all_gather", flat, group)
    work = dist.all_gather_into_tensor(flat, padded, group=group, async_op=async_op)
    return _Pieces(flat, sizes), work


def reduce_scatter_uneven(x: torch.Tensor, sizes, group, async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's piece of ``sizes[rank]`` rows along dim 0
    (Megatron's ``reduce_scatter_to_sequence_parallel_region(input_split_sizes=...)``):
    (output, work-or-None) like ``all_gather_uneven``; the pieces are padded to the largest
    (adding zeros is exact)."""
    n, sizes = dist.get_world_size(group), _ints(sizes)
    if n == 1:
        return x, None
    rows = max(sizes)
    padded = x.new_zeros((n, rows, *x.shape[1:]))
    for i, piece in enumerate(torch.split(x, sizes)):
        padded[i, :sizes[i]] = piece
    flat = x.new_empty((rows, *x.shape[1:]))
    record_collective("reduce_scatter", padded, group)
    work = dist.reduce_scatter_tensor(flat, padded.view(n * rows, *x.shape[1:]), group=group,
                                      async_op=async_op)
    return _Pieces(flat, [sizes[dist.get_rank(group)]]), work
