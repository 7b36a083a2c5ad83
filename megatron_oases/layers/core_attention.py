"""The core attention every build uses: ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the ``[b, np, sq, sk]`` scores, masks them
and (without Apex) runs the softmax in torch; on a GPU that costs more than the two GEMMs around
it (docs/gpu.md). Transformer Engine's fused kernels cannot be had on our machines, but torch's
SDPA carries flash, memory-efficient and cuDNN kernels on CUDA and a flash kernel on CPU. This
module is a drop-in for ``DotProductAttention`` (same constructor and call as Megatron's
``SelfAttention`` uses them on megatron-core 0.16-0.19: q ``[sq, b, np, hn]``, k / v
``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``), so the stock local spec, the Oases tapes, ATP, 3-D
and planned layers all take it through one function, ``core_attention_class``: the one place
that knows what Megatron-LM's ``--attention-backend`` values mean for our builds.

| ``--attention-backend`` | class                   | kernels on CUDA                | on CPU (torch 2.13)          |
|-------------------------|-------------------------|--------------------------------|------------------------------|
| ``local``               | Megatron's DotProductAttention | its own (materialised scores, torch softmax) | the same |
| ``unfused``             | ``UnfusedSDPAttention`` | SDPA's math kernel (materialised scores)     | the same |
| ``flash``               | ``FlashSDPAttention``   | SDPA flash only                | SDPA's CPU flash kernel; math when dropout > 0 (the CPU flash kernel has none) |
| ``fused``               | ``FusedSDPAttention``   | SDPA cuDNN or memory-efficient | as ``flash`` (torch has no cuDNN / efficient kernel on CPU) |
| ``auto``                | ``SDPAttention``        | torch's choice                 | torch's choice (flash; math when dropout > 0) |

Semantics kept from ``DotProductAttention``:

* Mask: without a mask, causal when the mask type is causal (``is_causal``); a given boolean mask
  (True = masked out, Megatron's convention) that is the standard causal one also runs as
  ``is_causal`` (checked once per mask tensor), any other is passed to SDPA. A row whose keys are
  all masked is NaN here where Megatron's ``-10000`` fill gives a uniform row.
* Scale: ``softmax_scale`` or ``1 / sqrt(hn)``. ``apply_query_key_layer_scaling`` divides Megatron's
  scores by the layer number and its fp32 softmax multiplies them back, the same product; SDPA's
  kernels accumulate in fp32, so the scale is used as is.
* GQA: query head ``i`` uses key/value group ``i // (np / ng)`` (Megatron's ``repeat_interleave``),
  through ``enable_gqa``; on CUDA the k / v are expanded instead for ``fused`` and for fp32, since
  the memory-efficient kernel has no ``enable_gqa`` (measured on an H100, torch 2.11: fp32 GQA
  fell to the math kernel, slower than ``local``).
* Dropout: drawn by SDPA inside the model-parallel RNG tracker's fork (not under sequence
  parallelism, where the block already forked), as ``DotProductAttention`` draws it, so Megatron's
  recompute (``CheckpointFunction`` restores the tracker) redraws the same mask (every kernel
  redraws from a restored generator state: CPU, and CUDA's flash, efficient and cuDNN kernels on an
  H100). The Oases executor splits a micro-batch into sub-batches and recomputes per sub-batch: it
  sets ``dropout_rng`` (``schedules/oases/dropout.kernel_rng``) to keep and replay each draw.
* No parameters: ``softmax_type`` other than vanilla and sliding windows need ``local``.
"""
from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch
import torch.nn.functional as F

from megatron_oases.describe.core_attention import (ATTENTION_BACKENDS as BACKENDS, BACKEND_HELP,  # noqa: F401
                                                    check_flash_dtype)
from megatron_oases.errors import ConfigError
from megatron_oases.flags import option

FLAG = option("attention_backend")


def check_backend(backend, *, cuda: bool, half: bool) -> None:
    """Refuse, in one line, a value the run cannot honour: SDPA's flash kernel on CUDA runs only
    in bf16 / fp16 (it would find no kernel at the first step)."""
    name = backend_name(backend)
    if cuda:
        check_flash_dtype(name, half=half, half_flags="--bf16 or --fp16", error=ConfigError)


@functools.lru_cache(maxsize=1)
def _kernel_sets():
    """SDPA kernels per backend name and device type (None: torch's choice)."""
    from torch.nn.attention import SDPBackend as K

    cpu = [K.FLASH_ATTENTION, K.MATH]
    return {
        "auto": {"cuda": None, "cpu": None},
        "flash": {"cuda": [K.FLASH_ATTENTION], "cpu": cpu},
        "fused": {"cuda": [K.CUDNN_ATTENTION, K.EFFICIENT_ATTENTION], "cpu": cpu},
        "unfused": {"cuda": [K.MATH], "cpu": [K.MATH]},
    }


def backend_name(backend) -> str:
    """``backend`` (a name, or Megatron's ``AttnBackend``) as Megatron-LM's flag value."""
    name = getattr(backend, "name", backend)
    if name not in BACKENDS:
        raise ConfigError(f"{FLAG} {name!r} is not one of {', '.join(BACKENDS)}")
    return name


def core_attention_class(backend) -> type:
    """The core-attention class our builds use for ``--attention-backend backend`` (a name or
    ``AttnBackend``): Megatron's ``DotProductAttention`` for ``local``, else an SDPA class."""
    name = backend_name(backend)
    if name == "local":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    return _SDPA_CLASSES[name]


def _no_replay(device):
    return contextlib.nullcontext()


class SDPAttention(torch.nn.Module):
    """Drop-in for Megatron's ``DotProductAttention`` on SDPA (see the module docstring);
    ``kernels``: the ``--attention-backend`` value whose SDPA kernels it may use."""

    kernels = "auto"

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        _check_config(config, type(self).kernels)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        if heads % tp or groups % tp:
            raise ConfigError(f"{FLAG} {self.kernels}: heads {heads} and key/value groups {groups} "
                              f"must be divisible by the attention's TP size {tp}")
        self.heads_per_partition = heads // tp
        self.groups_per_partition = groups // tp
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.dropout_rng = _no_replay
        """``dropout_rng(device)``: the context around each SDPA call that draws dropout; the
        Oases tape sets its replay of each sub-batch's draw in recompute; a no-op otherwise."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``query [sq, b, np, hn]``, ``key / value [sk, b, ng, hn]`` -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(f"{FLAG} {self.kernels}: packed sequences and attention "
                                      "bias are not supported (nor by Megatron's local attention)")
        sq, b, np_, hn = query.shape
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal, mask = sdpa_mask(attention_mask, mask_type, sq, key.shape[0])
        kernels = _kernel_sets()[self.kernels]["cuda" if query.is_cuda else "cpu"]
        gqa = np_ != key.shape[2]
        if gqa and query.is_cuda and (self.kernels == "fused" or query.dtype == torch.float32):
            # CUDA's memory-efficient kernel (fp32's only fused one) has no enable_gqa: expand
            # the groups as DotProductAttention does (else fp32 GQA falls to the math kernel)
            key = key.repeat_interleave(np_ // key.shape[2], dim=2)
            value = value.repeat_interleave(np_ // value.shape[2], dim=2)
            gqa = False
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        p = self.dropout_p if self.training else 0.0
        with self._dropout_context(p, query.device), _kernel_context(kernels):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _dropout_context(self, p: float, device):
        """Where the dropout draws come from: the tracker's fork (as ``DotProductAttention``),
        and the Oases replay inside it."""
        if p == 0.0:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())
        stack.enter_context(self.dropout_rng(device))
        return stack

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """No parameters or buffers (vanilla softmax only), so nothing to checkpoint."""
        return {}


class FlashSDPAttention(SDPAttention):
    """``--attention-backend flash``: SDPA's flash kernel only."""

    kernels = "flash"


class FusedSDPAttention(SDPAttention):
    """``--attention-backend fused``: SDPA's cuDNN or memory-efficient kernels only."""

    kernels = "fused"


class UnfusedSDPAttention(SDPAttention):
    """``--attention-backend unfused``: SDPA's math kernel (the scores materialised)."""

    kernels = "unfused"


_SDPA_CLASSES = {"auto": SDPAttention, "flash": FlashSDPAttention, "fused": FusedSDPAttention,
                 "unfused": UnfusedSDPAttention}


def _check_config(config, backend: str) -> None:
    """What ``DotProductAttention`` supports and SDPA cannot: one line naming the fix."""
    if getattr(config, "context_parallel_size", 1) != 1:
        raise ConfigError(f"{FLAG} {backend}: --context-parallel-size > 1 is not supported")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ConfigError(f"{FLAG} {backend}: --softmax-type {config.softmax_type} needs "
                          f"{FLAG} local")
    if getattr(config, "window_size", None) is not None:
        raise ConfigError(f"{FLAG} {backend}: --window-size needs {FLAG} local")


def backend_kernel_context(backend: str, device: torch.device):
    """The ``sdpa_kernel`` context that restricts SDPA to ``--attention-backend backend``'s kernels
    on ``device`` (a no-op for torch's choice): the profiler's synthetic cores run under it."""
    return _kernel_context(_kernel_sets()[backend_name(backend)][device.type if device.type == "cuda" else "cpu"])


def _kernel_context(kernels):
    if kernels is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(kernels)


def sdpa_mask(attention_mask, mask_type, sq: int, sk: int):
    """``(is_causal, attn_mask)`` for SDPA from Megatron's mask (True = masked out) and type."""
    from megatron.core.transformer.enums import AttnMaskType

    if attention_mask is None:
        return mask_type == AttnMaskType.causal and sq > 1, None
    if is_standard_causal(attention_mask):
        return True, None
    return False, ~attention_mask.bool()


_CAUSAL_SEEN: dict = {}
"""id(mask) -> (weakref, version, verdict): a mask tensor is compared with the causal one once
(the same mask object is passed to every layer of a step)."""


def is_standard_causal(mask: torch.Tensor) -> bool:
    """Whether ``mask`` (``[b or 1, 1, s, s]``, True = masked) masks exactly the future keys
    of every query."""
    seen = _CAUSAL_SEEN.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    sq, sk = mask.shape[-2:]
    verdict = sq == sk and torch.equal(
        mask.bool(), torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1).expand_as(mask))
    _remember(mask, verdict)
    return verdict


def _remember(mask: torch.Tensor, verdict: bool) -> None:
    if len(_CAUSAL_SEEN) > 64:
        for key in [k for k, v in _CAUSAL_SEEN.items() if v[0]() is None]:
            del _CAUSAL_SEEN[key]
    _CAUSAL_SEEN[id(mask)] = (weakref.ref(mask), mask._version, verdict)


def split_batch(mask: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``mask`` split along its batch dimension into ``sizes``, each part knowing the whole
    mask's causal verdict: the Oases executor splits each micro-batch's mask into fresh views, and
    comparing each view on the device (``torch.equal``: a host synchronisation) would stall the
    host inside the overlapped region, once per sub-batch; this compares once, before it."""
    verdict = is_standard_causal(mask)
    parts = list(torch.split(mask, sizes, dim=0))
    for part in parts:  # a batch slice of [b, 1, s, s] keeps the per-query pattern
        _remember(part, verdict)
    return parts
