"""Oases dropout masks: bool storage, fp32 scale, stock generator order (single process)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_oases.schedules.oases.dropout import MicroBatchMasks, active_sub_batch, dropout

P = 0.1


def _both_sub_batches(x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, MicroBatchMasks]:
    """Dropout of ``x`` [s, b, h] as the executor runs it: two sub-batches of the batch dim."""
    torch.manual_seed(seed)
    masks = MicroBatchMasks([x.shape[1] // 2, x.shape[1] - x.shape[1] // 2])
    outs = []
    for sub, part in enumerate(x.split(masks.sizes, dim=1)):
        with active_sub_batch(masks, sub, recompute=False):
            outs.append(dropout(part, P, True, site="s", batch_dim=1))
    return torch.cat(outs, dim=1), masks


def test_fp32_equals_stock_dropout_bit_for_bit():
    x = torch.randn(4, 6, 8)
    got, _ = _both_sub_batches(x)
    torch.manual_seed(0)
    assert torch.equal(got, F.dropout(x, P, True))


def test_kept_values_are_exactly_the_fp32_scale():
    got, _ = _both_sub_batches(torch.ones(4, 6, 8))
    scale = torch.ones((), dtype=torch.float32).div_(1 - P)
    assert set(got.unique().tolist()) == {0.0, float(scale)}


def test_bf16_scales_in_fp32_not_with_a_rounded_bf16_mask():
    x = torch.randn(8, 6, 64).to(torch.bfloat16)
    got, _ = _both_sub_batches(x)
    torch.manual_seed(0)
    keep = F.dropout(torch.ones_like(x), P, True) != 0  # the same draws as stock's bf16 dropout
    want = (x.float() * keep * torch.ones(()).div_(1 - P)).to(torch.bfloat16)
    assert torch.equal(got, want)
    rounded = x * (keep.to(torch.bfloat16) / (1 - P))  # a bf16 mask of 1/(1-p) = 1.109375
    assert not torch.equal(got, rounded)


def test_masks_are_stored_as_bool_and_freed_after_the_last_sub_batch():
    x = torch.randn(2, 4, 8)
    masks = MicroBatchMasks([2, 2])
    with active_sub_batch(masks, 0, recompute=False):
        dropout(x[:, :2], P, True, site="s", batch_dim=1)
    (mask, users), = masks._drawn.values()
    assert mask.dtype == torch.bool and users == 1
    with active_sub_batch(masks, 1, recompute=False):
        dropout(x[:, 2:], P, True, site="s", batch_dim=1)
    assert masks._drawn == {}


def test_replica_keeps_its_slice_of_the_whole_batch_mask():
    """A planned block's replica k of r draws the mask of the whole batch and keeps slice k."""
    x = torch.ones(3, 8, 4)
    torch.manual_seed(1)
    whole = F.dropout(torch.ones(3, 16, 4), P, True) != 0
    torch.manual_seed(1)
    masks = MicroBatchMasks([4, 4])
    parts = []
    for sub, part in enumerate(x.split(4, dim=1)):
        with active_sub_batch(masks, sub, recompute=False):
            parts.append(dropout(part, P, True, site="s", batch_dim=1, batch_shard=(2, 1)))
    assert torch.equal(torch.cat(parts, dim=1) != 0, whole[:, 8:])
