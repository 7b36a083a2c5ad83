"""Dropout masks of a whole micro-batch, shared by its sub-batches and redrawn in recompute.

Stock Megatron draws one dropout mask per site for the whole micro-batch. Two sub-batches that
each drew their own would consume the generator differently (CPU bernoulli is filled in parallel
blocks, CUDA Philox by element index), so their masks would differ from stock and losses would
not match. Here the first sub-batch to reach a site draws the mask at full micro-batch shape, in
exactly the generator state stock Megatron would have there, and each sub-batch multiplies by its
slice. The generator state before the draw is kept, so the recompute pass redraws the identical
mask without disturbing the generator (as Megatron's CheckpointFunction restores RNG states).

Sites are visited in the same order by both sub-batches, and the first arrival draws, so the
draws per generator happen in stock order. Attention dropout runs inside Megatron's RNG-tracker
fork, so its draws come from the tracker's stream, as in stock.

A fused attention kernel (SDPA, ``layers/core_attention.py``) draws its dropout inside the kernel,
so no mask can be shared: each sub-batch draws its own. The batch is the kernel's leading dim, and
torch's CPU dropout and CUDA's flash and memory-efficient kernels draw in position order, so the
sub-batches' consecutive draws are stock's draw of the whole micro-batch (measured: CPU; flash and
efficient on an H100, torch 2.11); cuDNN's (what ``auto`` picks for bf16 on an H100) are not (same
statistics; ``--attention-backend local`` shares stock's mask on every device). ``kernel_rng`` keeps the generator
state before each sub-batch's draw and restores it around the recompute's call, so recompute
(fine-grained or full) redraws exactly the forward's mask.

Masks are kept as ``bool`` (a quarter of a bf16 mask's bytes, an eighth of fp32) and applied as
``x * keep * 1/(1-p)`` with the scale in fp32, as CUDA's fused dropout scales: a bf16 mask of
``1/(1-p)`` would round the scale itself (1.109375 instead of 1.1111 at p = 0.1). The draw still
runs ``F.dropout`` on a tensor of the input's dtype and shape, so the generator is consumed
exactly as stock's dropout consumes it.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from megatron_oases.runtime.device import get_rng_state, set_rng_state


class MicroBatchMasks:
    """The dropout masks of one micro-batch split into sub-batches along the batch dimension."""

    def __init__(self, sub_batch_sizes: list[int], redraw: bool = True):
        self.sizes = list(sub_batch_sizes)
        self.redraw = redraw
        """Keep each site's generator state for a recompute redraw (only the recompute needs it:
        a CPU generator state is 5 KB per site)."""
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._drawn: dict = {}
        """site -> [scaled full mask, sub-batches still to use it]; freed after the last one."""
        self._states: dict = {}
        """site -> generator state before the forward draw (for the recompute redraw)."""
        self._kernel_states: dict = {}
        """(site, sub-batch) -> generator state before a fused kernel's own draw (``kernel_rng``)."""

    def keep_mask(self, site, x: torch.Tensor, batch_dim: int, p: float, sub: int,
                  recompute: bool, last_dim_shard: tuple[int, int] = (1, 0),
                  batch_shard: tuple[int, int] = (1, 0)) -> torch.Tensor:
        """The ``bool`` keep-mask of sub-batch ``sub``'s slice; ``x`` is that sub-batch's tensor.
        ``last_dim_shard = (n, j)``: ``x`` holds chunk ``j`` of ``n`` of the last dim (ATP's
        hidden shard); ``batch_shard = (r, k)``: the micro-batch is slice ``k`` of ``r`` of a
        larger batch (a planned block's replica). The mask is drawn at full size and the slices
        are kept, so it equals the mask the whole layer would draw."""
        n, j = last_dim_shard
        r, k = batch_shard
        entry = self._drawn.get(site)
        if entry is None:
            shape = list(x.shape)
            shape[batch_dim] = sum(self.sizes) * r
            shape[-1] *= n
            if recompute:
                current = get_rng_state(x.device)
                set_rng_state(self._states[site], x.device)
                full = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), p, True) != 0
                set_rng_state(current, x.device)
            else:
                if self.redraw:
                    self._states[site] = get_rng_state(x.device)
                full = F.dropout(torch.ones(shape, dtype=x.dtype, device=x.device), p, True) != 0
            entry = self._drawn[site] = [full, len(self.sizes)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._drawn[site]
        start = k * sum(self.sizes) + self.starts[sub]
        mask = entry[0].narrow(batch_dim, start, self.sizes[sub])
        return mask if n == 1 else mask.narrow(-1, j * x.shape[-1], x.shape[-1])


    @contextlib.contextmanager
    def kernel_draw(self, site, sub: int, recompute: bool, device):
        """Around a kernel that draws its own dropout for sub-batch ``sub``: the forward keeps the
        generator state; the recompute draws from that state and leaves the generator as it was."""
        key = (site, sub)
        if not recompute:
            if self.redraw:
                self._kernel_states[key] = get_rng_state(device)
            yield
            return
        current = get_rng_state(device)
        set_rng_state(self._kernel_states.pop(key), device)
        try:
            yield
        finally:
            set_rng_state(current, device)


@dataclasses.dataclass
class _Active:
    masks: MicroBatchMasks
    sub: int
    recompute: bool


_ACTIVE: list[_Active] = []


@contextlib.contextmanager
def active_sub_batch(masks: MicroBatchMasks, sub: int, recompute: bool):
    """Dropout inside refers to sub-batch ``sub`` of ``masks`` (set by the executor per resume)."""
    _ACTIVE.append(_Active(masks, sub, recompute))
    try:
        yield
    finally:
        _ACTIVE.pop()


_SCALES: dict = {}


def _keep_scale(p: float, device) -> torch.Tensor:
    """``1 / (1 - p)`` as an fp32 scalar tensor, one per (p, device): every site's product saves
    the same small tensor instead of a new one."""
    key = (p, str(device))
    if key not in _SCALES:
        _SCALES[key] = torch.ones((), dtype=torch.float32, device=device).div_(1.0 - p)
    return _SCALES[key]


def apply_keep_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``x * keep / (1 - p)`` with the scale in fp32 (fp32 inputs: bit-equal to ``F.dropout``)."""
    scale = _keep_scale(p, x.device)
    if x.dtype == torch.float32:
        return x * keep * scale
    return (x.float() * keep * scale).to(x.dtype)


def dropout(x: torch.Tensor, p: float, training: bool, site, batch_dim: int,
            last_dim_shard: tuple[int, int] = (1, 0),
            batch_shard: tuple[int, int] = (1, 0)) -> torch.Tensor:
    """``F.dropout`` that, inside the Oases executor, applies the micro-batch's mask slice
    (``last_dim_shard``, ``batch_shard``: see ``MicroBatchMasks.keep_mask``; executor only)."""
    if not training or p == 0.0:
        return x
    if not _ACTIVE:
        if last_dim_shard[0] != 1 or batch_shard[0] != 1:
            raise RuntimeError("a sharded dropout runs only inside the Oases executor")
        return F.dropout(x, p, True)
    a = _ACTIVE[-1]
    keep = a.masks.keep_mask(site, x, batch_dim, p, a.sub, a.recompute, last_dim_shard, batch_shard)
    return apply_keep_mask(x, keep, p)


def kernel_rng(site, device):
    """Context for a fused kernel's own dropout draw at ``site`` (set as the SDPA core
    attention's ``dropout_rng`` by the Oases tape): inside the executor, the sub-batch's draw is
    kept and replayed in recompute (``MicroBatchMasks.kernel_draw``); outside it, nothing."""
    if not _ACTIVE:
        return contextlib.nullcontext()
    a = _ACTIVE[-1]
    return a.masks.kernel_draw(site, a.sub, a.recompute, device)


class SubBatchDropout(torch.nn.Module):
    """Replaces ``DotProductAttention.attention_dropout`` (probabilities are [b, np, sq, sk]) and
    the embedding's dropout (``[s, b, h]``, ``batch_dim`` 1)."""

    def __init__(self, p: float, site, batch_dim: int = 0):
        super().__init__()
        self.p = p
        self.site = site
        self.batch_dim = batch_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.site, batch_dim=self.batch_dim)
