"""The sizes of saved tensors that depend on the device's kernels (``Kernels``: CUDA's and the
CPU's, each measured or marked assumed), and what a norm keeps beyond its input, which they decide:
read by every inventory of saved bytes (``describe.saved``, ``describe.saved_attention``,
``describe.moe``). CUDA's fused dropout keeps a 1-byte mask and CUDA norms fp32 statistics; CPU
dropout keeps its scaled noise, CPU norms their statistics in the input's dtype, and CPU RMSNorm
also its normalised input."""
from __future__ import annotations

import dataclasses

from .ops import LayerVariant


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernels:
    """Bytes of the saved tensors whose size depends on the device's kernels; ``None`` means
    the element size ``e``."""

    dropout_mask: int | None
    norm_stat: int | None
    rng_state: int
    """One generator state of the device (the Oases recompute redraws each dropout mask from it;
    Megatron's checkpoint snapshots the device's and its tracker's). On CUDA a host tensor of 16
    bytes, counted as the device's (negligible); on CPU the CPU generator's 5,056 bytes (measured)."""
    host_rng_state: int = 0
    """What the CPU generator's state (5,056 bytes, ``torch.get_rng_state()``), which Megatron's
    checkpoint snapshots beside the device's, takes of the device's memory: all of it on CPU (the
    host is the device; measured), none on CUDA (host memory)."""
    rms_norm_keeps_normalized: bool = False
    """torch's RMSNorm on CPU is composite and also keeps the normalised input (e h a token);
    CUDA's fused kernel keeps the input and the statistic only (assumed: not measured here)."""
    fused_attention_dropout: bool = True
    """The fused attention has a kernel with dropout (CUDA's flash / efficient / cuDNN draw it from
    a philox seed); on CPU torch's SDPA falls back to its math kernel, which keeps the scores
    (``describe.core_attention``)."""
    fused_attention_rng: int = 0
    """Bytes of the philox seed and offset a fused attention call saves (CUDA flash: 24, not
    measured; CPU: none, measured)."""


CUDA_KERNELS = Kernels(dropout_mask=1, norm_stat=4, rng_state=16, fused_attention_rng=24)
CPU_KERNELS = Kernels(dropout_mask=None, norm_stat=None, rng_state=5056, host_rng_state=5056,
                      rms_norm_keeps_normalized=True, fused_attention_dropout=False)

_NORM_STATS = {"LayerNorm": 2, "RMSNorm": 1}


def norm_beyond_input(rows: float, width: int, *, e: int, kernels: Kernels, variant: LayerVariant) -> float:
    """What a norm of ``variant.normalization`` over ``rows`` vectors of ``width`` features keeps
    besides its input: its statistics per row and, on CPU, RMSNorm's normalised input."""
    stat = e if kernels.norm_stat is None else kernels.norm_stat
    kept = rows * _NORM_STATS[variant.normalization] * stat
    if variant.normalization == "RMSNorm" and kernels.rms_norm_keeps_normalized:
        kept += rows * width * e
    return kept
