"""A copy paced to a link's rate on a fixed number of resident blocks, as NCCL runs a collective.

NCCL runs a collective as one kernel of one block per channel; each block stays resident for the
whole collective and moves its share of the bytes as fast as the link delivers them, not at
memory speed. This kernel (Triton, imported only when the ``nccl`` stand-in runs on CUDA) does the
same: ``blocks`` programs walk the bytes with a grid stride, each step released when the link would
have delivered it (``step_ns`` apart, from the block's start on the GPU's nanosecond
``%globaltimer``), then each spins until ``total_ns`` from its start. Each block writes its start
and end times into ``stamps`` (what the calibration reads). Under ``TRITON_INTERPRET=1`` (CPU, the
tests) inline assembly does not run, so a ``fake_clock`` tensor stands in for the timer: each read
returns it and adds one tick.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
"""32-bit words a block moves per step (32 KiB: 64 bytes a thread in flight, so one block is not
held to a few GB/s by the memory latency; NCCL's slices are larger still)."""
NUM_WARPS = 16
"""512 threads a block: NCCL's default thread count per channel (``NCCL_NTHREADS``)."""


@triton.jit
def _now(clock, FAKE_CLOCK: tl.constexpr):
    if FAKE_CLOCK:
        t = tl.atomic_add(clock, 1)
    else:
        t = tl.extra.cuda.globaltimer()
    return t


@triton.jit
def _paced_copy(src, dst, clock, stamps, n, scratch_words, step_ns, total_ns, programs,
                BLOCK: tl.constexpr, FAKE_CLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t0 = _now(clock, FAKE_CLOCK)
    k = 0
    for start in range(pid * BLOCK, n, programs * BLOCK):
        due = t0 + tl.cast(k, tl.int64) * step_ns
        now = _now(clock, FAKE_CLOCK)
        while now < due:
            now = _now(clock, FAKE_CLOCK)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        offs = offs % scratch_words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
        k += 1
    end = t0 + total_ns
    now = _now(clock, FAKE_CLOCK)
    while now < end:
        now = _now(clock, FAKE_CLOCK)
    tl.store(stamps + 2 * pid, t0)
    tl.store(stamps + 2 * pid + 1, now)


def paced_copy(src: torch.Tensor, dst: torch.Tensor, nbytes: int, *, ms: float, GBps: float, blocks: int,
               stamps: torch.Tensor, fake_clock: torch.Tensor | None = None) -> None:
    """Move ``nbytes`` (whole 32-bit words, wrapping around the scratch ``src`` / ``dst``) on
    ``blocks`` blocks at ``GBps`` in all, and keep the blocks resident for ``ms``; ``stamps``
    (int64, 2 x ``blocks``) gets each block's start and end on the clock. ``GBps`` <= 0 copies
    unpaced (the calibration's top rate)."""
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1 (got {blocks})")
    scratch_words = min(src.numel(), dst.numel()) // 4
    words_src, words_dst = src[:scratch_words * 4].view(torch.int32), dst[:scratch_words * 4].view(torch.int32)
    step_ns = int(BLOCK * 4 * blocks / GBps) if GBps > 0 else 0  # bytes / (GB/s) = ns
    clock = fake_clock if fake_clock is not None else stamps
    _paced_copy[(blocks,)](words_src, words_dst, clock, stamps, nbytes // 4, scratch_words, step_ns,
                           int(ms * 1e6), blocks, BLOCK=BLOCK, FAKE_CLOCK=fake_clock is not None,
                           num_warps=NUM_WARPS)
