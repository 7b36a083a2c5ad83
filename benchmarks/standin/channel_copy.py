"""A copy on a fixed number of thread blocks, as NCCL moves a collective's bytes on its channels.

NCCL runs a collective as one kernel of a few blocks (its channels, one block each, 16 to 32 on an
NVLink node), so it takes a few SMs and the memory bandwidth those blocks draw, not the whole GPU.
``torch``'s ``copy_`` spreads over every SM, which bounds the contention from above; this kernel
(Triton, imported only when the ``channels`` stand-in is used) takes ``channels`` blocks that walk
the buffer with a grid stride, which is the closer model. Under ``TRITON_INTERPRET=1`` it runs on
CPU tensors (how it is tested here).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""32-bit words per block per step."""


@triton.jit
def _grid_stride_copy(src, dst, n, programs, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def channel_copy(src: torch.Tensor, dst: torch.Tensor, nbytes: int, channels: int) -> None:
    """Copy the first ``nbytes`` of ``src`` (bytes, contiguous) into ``dst`` with ``channels``
    blocks; ``nbytes`` is rounded down to whole 32-bit words."""
    if channels < 1:
        raise ValueError(f"channels must be >= 1 (got {channels})")
    n = nbytes // 4
    if n == 0:
        return
    words_src, words_dst = src[:n * 4].view(torch.int32), dst[:n * 4].view(torch.int32)
    _grid_stride_copy[(channels,)](words_src, words_dst, n, channels, BLOCK=BLOCK)
