"""Which core attention a layer runs, named once: Megatron's local ``DotProductAttention`` (the
s x s scores materialised, softmax and dropout on them, a causal mask built per call) or a fused
kernel that keeps no s x s tensor (torch's ``scaled_dot_product_attention`` on our builds,
Transformer Engine's flash / fused attention on Megatron-LM's), or SDPA's math kernel. The
saved-bytes inventory (``describe.saved``), hence the simulator's memory and the planner's memory
constraint, and the device model's attention price read the one kind this module derives from
the flags (``GPTShape.core_attention``).

Megatron-LM's flags and what they mean for the core attention:

* ``--attention-backend {flash,fused,unfused,local,auto}`` (Megatron-LM's vocabulary). With
  ``--transformer-impl transformer_engine`` Megatron-Core maps it to TE's ``NVTE_*_ATTN``
  variables: flash, fused and auto (TE picks flash or cuDNN fused) keep no scores; unfused (TE's
  ``UnfusedDotProductAttention``) and local (Megatron's ``DotProductAttention``) do. With
  ``--transformer-impl local`` stock Megatron-LM always runs ``DotProductAttention``; our builds
  (issue 34: ``layers/core_attention.py``) run SDPA: its fused kernels for flash, fused and auto,
  its math kernel for unfused (the scores materialised), and Megatron's module for local.
* Not given: Transformer Engine's default (auto: fused) with ``transformer_engine``; Megatron's
  local layer (unfused) with ``local``, unless ``--use-flash-attn`` (Megatron-LM's older flag for
  the flash-attn package) is set.

What a fused kernel keeps instead of the scores (per call, for backward; ``describe.saved``
prices it):

* CPU, measured (torch 2.13, ``tests/test_saved_bytes_budget.py`` and ``scripts``-free probes
  with saved-tensor hooks): without dropout torch picks ``_scaled_dot_product_flash_attention_for_cpu``
  for fp32 and bf16, causal or not, with or without ``enable_gqa``; it saves q, k, v as given
  (views of QKV's output in Megatron's ``[s, b, np, d]`` layout; the keys and values of the
  groups, not repeated, under ``enable_gqa``), its output (allocated in the query's layout, so the
  context the output projection reads is a view of it: no second copy) and logsumexp
  ``[b, np, s]`` in fp32 (the computation dtype, also under bf16); no mask under ``is_causal``.
  With dropout it falls back to the math kernel, which materialises the scores (its softmax
  output, dropout mask and dropped-out probabilities, in fp32 on CPU even for bf16):
  ``Kernels.fused_attention_dropout`` is False there.
* CUDA, not measured (from torch's meta registrations, ``torch/_meta_registrations.py``, and
  its SDPA priority order flash > efficient > math > cuDNN): flash (fp16 / bf16, head dim <= 256,
  sm80+) saves q, k, v, its output (``empty_like`` the query), logsumexp ``[b, np, s]`` fp32 and
  the philox seed ``[2]`` and offset ``[]`` (uint64: 24 bytes; dropout is redrawn from them in
  backward, no mask kept); the memory-efficient kernel (fp32 too) the same with logsumexp padded to
  ``ceil(s / 32) * 32`` and a ``[b, s, np, d]`` output (a copy for the context), seed and offset
  int64 (16 bytes); cuDNN logsumexp ``[b, np, s, 1]`` fp32, seed and offset int64. Under
  ``enable_gqa`` flash and math take the groups' keys and values unrepeated. ``CUDA_KERNELS``
  assumes flash (bf16 training).
"""
from __future__ import annotations

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
"""Megatron-LM's ``--attention-backend`` values (``AttnBackend``)."""
BACKEND_HELP = ("core attention of every build, Megatron-LM's values: auto = torch's "
                "scaled_dot_product_attention with its kernel choice (default: measured faster "
                "than local on CPU), flash = SDPA's flash kernel only (CUDA: bf16/fp16), fused = "
                "SDPA's cuDNN or memory-efficient kernels (on CPU flash and fused both use "
                "torch's CPU kernels), unfused = SDPA's math kernel (materialised scores), "
                "local = Megatron's DotProductAttention")
"""The flag's help (the trainer's and Megatron-LM's), here where torch is not imported."""
TRANSFORMER_IMPLS = ("local", "transformer_engine")
CORE_ATTENTIONS = ("local", "unfused", "fused")
"""What a layer's core attention is: Megatron's ``DotProductAttention`` (``local``); torch's SDPA
math kernel (``unfused``: our builds' ``--attention-backend unfused``, and what a fused kernel
falls back to where the device has none for the case); a fused kernel (``fused``)."""


def core_attention_of(*, attention_backend: str | None = None, transformer_impl: str = "local",
                      use_flash_attn: bool = False, error: type[Exception] = ValueError) -> str:
    """The ``CORE_ATTENTIONS`` kind the flags run (see the module docstring); ``attention_backend``
    None: the flag was not given. Transformer Engine's unfused attention is priced as Megatron's
    local one (not measured). Contradictions are one line naming the flags."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise error(f"--transformer-impl must be local or transformer_engine (got {transformer_impl!r})")
    if attention_backend is None:
        return "fused" if use_flash_attn or transformer_impl == "transformer_engine" else "local"
    if attention_backend not in ATTENTION_BACKENDS:
        raise error(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)} (got {attention_backend!r})")
    if use_flash_attn and attention_backend in ("unfused", "local"):
        raise error(f"--use-flash-attn contradicts --attention-backend {attention_backend}; give one")
    if attention_backend == "unfused":
        return "local" if transformer_impl == "transformer_engine" else "unfused"
    return "local" if attention_backend == "local" else "fused"


SDPA_CHOICES = ("auto", "flash", "fused")
"""Which kernels a ``fused`` core attention runs on our builds (``layers.core_attention``): torch's
choice (``auto``; also what Transformer Engine's default and ``--use-flash-attn`` are priced from,
which our machines cannot run), SDPA's flash kernel only (``flash``), its cuDNN / memory-efficient
ones (``fused``; with Transformer Engine, ``--attention-backend flash|fused`` price from these too). They keep the same tensors but take different times (docs/gpu.md: 0.58 vs 0.37 ms
forward on an H100), so profile keys name the choice (``describe.event_key.attention_tag``)."""


def attention_kernels_of(*, attention_backend: str | None, core_attention: str) -> str:
    """The ``SDPA_CHOICES`` entry a run of ``core_attention`` (``core_attention_of``'s kind) with
    ``--attention-backend attention_backend`` times its fused kernel with: the flag's value for
    flash and fused, torch's choice otherwise (auto, ``--use-flash-attn``, Transformer Engine's
    default); ``auto`` for a kind that is not fused."""
    if core_attention == "fused" and attention_backend in SDPA_CHOICES:
        return attention_backend
    return "auto"


def attention_kernels_refusal(core_attention: str, kernels: str) -> str:
    """Empty when ``kernels`` (``SDPA_CHOICES``) can name the kernels of ``core_attention``
    (``CORE_ATTENTIONS``): any choice for a fused kind, ``auto`` for the others; else one line."""
    if core_attention not in CORE_ATTENTIONS:
        return f"core attention must be one of {', '.join(CORE_ATTENTIONS)} (got {core_attention!r})"
    if kernels not in SDPA_CHOICES or (kernels != "auto" and core_attention != "fused"):
        return (f"attention kernels must be one of {', '.join(SDPA_CHOICES)}, and auto unless the core "
                f"attention is fused (got {kernels!r} for {core_attention!r})")
    return ""


def attention_backend_of(core_attention: str, kernels: str = "auto") -> str:
    """The ``--attention-backend`` value our builds run ``core_attention`` with ``kernels`` by: the
    inverse of ``core_attention_of`` and ``attention_kernels_of`` (plan files write it)."""
    if core_attention == "fused":
        return kernels
    return core_attention


def check_flash_dtype(attention_backend: str | None, *, half: bool, half_flags: str,
                      error: type[Exception] = ValueError) -> None:
    """Refuse ``--attention-backend flash`` without a 16-bit dtype (``half``), in one line naming
    the dtype flags of the caller (``half_flags``): the flash kernel (SDPA's, Transformer
    Engine's) runs only in bf16 / fp16 on a GPU, so such a run finds no kernel at its first step
    (torch: "No available kernel", docs/gpu.md). The trainer checks it on CUDA only (torch's CPU
    kernels take fp32); the simulator and the planner, which price GPUs, always."""
    if attention_backend == "flash" and not half:
        raise error(f"--attention-backend flash has no fp32 kernel; add {half_flags}, or use auto / fused")


def attention_kernel(core_attention: str, *, attention_dropout: bool, fused_dropout: bool) -> str:
    """The kernel that runs (a ``CORE_ATTENTIONS`` kind): a fused core attention falls back to
    SDPA's math kernel (``unfused``) when dropout is on and the device has no fused kernel with
    dropout (``fused_dropout``: ``Kernels.fused_attention_dropout``; False on CPU)."""
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core attention must be one of {', '.join(CORE_ATTENTIONS)} (got {core_attention!r})")
    if core_attention == "fused" and attention_dropout and not fused_dropout:
        return "unfused"
    return core_attention


def draws_in_kernel(core_attention: str) -> bool:
    """Whether the attention dropout is drawn inside the kernel (SDPA, fused or math), so that no
    mask can be shared between the Oases executor's sub-batches: it keeps the generator state of
    each sub-batch's draw for the recompute (``schedules/oases/dropout.kernel_rng``; measured),
    where Megatron's local attention draws one mask per micro-batch (one state)."""
    return core_attention != "local"


def scores_on_chip(core_attention: str) -> bool:
    """Whether a run of ``core_attention`` (a ``CORE_ATTENTIONS`` kind) is priced with a fused
    kernel: the scores stay on chip and the causal half is skipped (``DeviceModel.fused_attention``;
    the simulator and the planner both build their device model from this)."""
    return not keeps_scores(core_attention)


def keeps_scores(kernel: str) -> bool:
    """Whether the core attention ``kernel`` (``attention_kernel``'s) keeps s x s tensors for
    backward: every kernel but a fused one."""
    return kernel != "fused"
