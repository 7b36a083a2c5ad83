"""What the core attention of a Megatron 1-D layer keeps for backward, per kernel (``describe.core_attention``:
Megatron's local ``DotProductAttention``, SDPA's fused and math kernels), with RoPE and QK-norm;
the layer's other tensors and the schedules are ``describe.saved``'s.

Rotary embeddings and QK-norm (per rank; q k = b s (a + g) d / t elements of queries and keys, d
the head dim, g the key/value groups): either one gives the attention core new q and k, kept
beside QKV's output without GQA (+ e q k; with GQA they replace its copies: + 0). QK-norm adds
its statistics per head and token (2 for LayerNorm, 1 for RMSNorm, ``norm_stat`` bytes each, per
q k / d rows; on CPU RMSNorm also its normalised input, + e q k) and, with GQA, QKV's output,
which its input views (+ e b s d (a + 2 g) / t). RoPE builds cos and sin for q and for k on
every call: 4 s r e bytes (r the rotated dim, ``rotary_percent`` of d), once per Oases
sub-batch; its frequency table is the model's, not the layer's. Measured at TP 2, fp32, b 4,
s 16, h 32, 4 heads: + 10,240 bytes a layer for RoPE, + 10,240 for QK-norm, + 12,288 for both
(the rotated q and k replace the normalised ones); under the Oases schedule + 2,048 more for
RoPE's second sub-batch. For CUDA the same torch ops run (no RoPE fusion, local spec), so the
same inventory with ``CUDA_KERNELS``' fp32 statistics and a fused RMSNorm that keeps no
normalised input is assumed (not measured).

Under SDPA (``--attention-backend flash|fused|auto|unfused`` on our builds; ``core_attention_bytes``)
no causal mask is built (``is_causal``) and the kernel that runs decides the rest. A fused kernel
(CPU flash: ``auto`` without dropout; CUDA flash, assumed) keeps its inputs as the checkpoint of
selective recompute does (QKV's output, which V views; the rotated or normalised queries and keys
under RoPE or QK-norm; under GQA the groups' keys and values, not repeated: ``enable_gqa``), its
output, which is the context the proj keeps (allocated in the query's layout, so the context is
a view), and logsumexp (4 bytes per rank head and token); no s x s tensor. Measured at TP 2,
fp32, b 4, s 16, h 32, 4 heads, stock: 83,456 bytes a layer against the local attention's 91,392
(Llama with GQA, RoPE on half of each head and QK-norm: 137,984 against 152,064). SDPA's math
kernel (``unfused``, and on CPU ``auto`` with dropout, which the CPU flash kernel lacks:
``Kernels.fused_attention_dropout``) computes in fp32: it keeps the scaled queries and keys
(repeated to the heads), the values as given when they need no cast nor repeat (else an fp32
copy), the fp32 softmax output and, with dropout, its fp32 mask and the dropped-out
probabilities: 99,328 bytes without dropout, 132,096 with (the local attention 124,160, which
keeps e-byte probabilities and masks). The Oases recompute keeps SDPA's dropout generator state
per sub-batch (``draws_in_kernel``). ``tests/test_saved_bytes_budget.py`` checks every number
here against saved-tensor hooks, for each of these kernels.
"""
from __future__ import annotations

from .core_attention import attention_kernel
from .ops import GPT2, LayerVariant
from .saved_kernels import CUDA_KERNELS, Kernels, norm_beyond_input


def core_attention_bytes(*, b: int, s: int, h: int, a: int, t: int, e: int, attention_dropout: bool,
                         softmax_in_fp32: bool = True, kernels: Kernels = CUDA_KERNELS,
                         variant: LayerVariant = GPT2, core_attention: str = "local") -> tuple[float, float]:
    """(Q, K and V as kept, what the core attention keeps beyond them and its output, the context
    the proj reads) for one call on ``b`` samples without recompute, per kernel
    (``describe.core_attention.attention_kernel``).

    ``local`` (Megatron's ``DotProductAttention``): the queries and the keys and values repeated
    to the heads (``_rope_qk_norm_bytes`` on top), the s x s tensors (``score_bytes``) and the
    causal mask it builds. ``fused``: its inputs as the checkpoint of selective recompute keeps
    them (``checkpoint_inputs_bytes``: the groups' keys and values, not repeated), its output
    (the context, counted by the caller) and logsumexp (``logsumexp_bytes``). ``unfused`` (SDPA's
    math kernel): ``_sdpa_math_bytes``."""
    kernel = attention_kernel(core_attention, attention_dropout=attention_dropout,
                              fused_dropout=kernels.fused_attention_dropout)
    tok = b * s
    per_call = per_call_bytes(s=s, h=h, a=a, e=e, variant=variant, core_attention=kernel, kernels=kernels)
    if kernel == "unfused":
        qkv, kept = _sdpa_math_bytes(b=b, s=s, h=h, a=a, t=t, e=e, attention_dropout=attention_dropout,
                                     kernels=kernels, variant=variant)
        return qkv, kept + per_call
    if kernel == "fused":
        qkv = checkpoint_inputs_bytes(tok=tok, h=h, a=a, t=t, e=e, kernels=kernels, variant=variant)
        return qkv, logsumexp_bytes(b=b, s=s, heads=a / t) + per_call
    qkv = tok * e * 3 * h / t + _rope_qk_norm_bytes(tok=tok, h=h, a=a, t=t, e=e, kernels=kernels, variant=variant)
    scores = score_bytes(b=b, s=s, a=a, t=t, e=e, attention_dropout=attention_dropout,
                         softmax_in_fp32=softmax_in_fp32, kernels=kernels)
    return qkv, scores + per_call


def score_bytes(*, b: int, s: int, a: int, t: int, e: int, attention_dropout: bool, softmax_in_fp32: bool = True,
                kernels: Kernels = CUDA_KERNELS) -> float:
    """The s x s tensors Megatron's local core attention keeps per call on ``b`` samples, besides
    the causal mask it builds (``per_call_bytes``): the softmax output (fp32 by Megatron's default
    ``attention_softmax_in_fp32``) and the attention-over-V GEMM's input in e bytes: the dropped-out
    probabilities and the dropout mask, or without attention dropout the softmax output itself (or
    its cast to e bytes)."""
    probs = b * a * s * s / t
    mask = e if kernels.dropout_mask is None else kernels.dropout_mask
    soft = 4 if softmax_in_fp32 else e
    gemm_input = (mask + e) if attention_dropout else (e if soft != e else 0)
    return (soft + gemm_input) * probs


def logsumexp_bytes(*, b: int, s: int, heads: float) -> float:
    """A fused attention's softmax statistics: one fp32 logsumexp per query head and token (flash
    on CUDA and CPU; the efficient kernel pads s to a multiple of 32, not modeled)."""
    return 4 * b * heads * s


SDPA_MATH_BYTES = 4
"""SDPA's math kernel computes in fp32 whatever the inputs' dtype (torch's default
``allow_fp16_bf16_reduction_math_sdp(False)`` upcasts fp16 / bf16; measured on CPU, assumed on CUDA)."""


def _sdpa_math_bytes(*, b: int, s: int, h: int, a: int, t: int, e: int, attention_dropout: bool,
                     kernels: Kernels, variant: LayerVariant) -> tuple[float, float]:
    """(Q, K and V as kept, the scores) of SDPA's math kernel, in ``SDPA_MATH_BYTES`` elements
    (measured on CPU): the scaled queries and the scaled keys repeated to the heads; the values as
    given (a view of QKV's output, whose storage stays) when they need neither a cast nor a
    repeat, else their fp32 copy; the softmax output and, with dropout, its mask and the
    dropped-out probabilities (the mask as a float tensor), b a s^2 / t each. Neither RoPE's
    rotated queries and keys nor a causal mask are kept. QK-norm keeps its statistics and its
    input (a view of QKV's output)."""
    c, tok = SDPA_MATH_BYTES, b * s
    heads = c * tok * h / t  # one fp32 tensor of the rank's query heads
    grouped = (variant.query_groups or a) != a
    values_as_given = e == c and not grouped
    qkv_output = e * tok * variant.qkv_rows(h, a) / t
    kept = 2 * heads + (0 if values_as_given else heads)
    if values_as_given or variant.qk_norm:
        kept += qkv_output
    if variant.qk_norm:
        kept += _qknorm_beyond_input(tok=tok, h=h, a=a, t=t, e=e, kernels=kernels, variant=variant)
    return kept, (3 if attention_dropout else 1) * c * b * a * s * s / t


def _rope_qk_norm_bytes(*, tok: int, h: int, a: int, t: int, e: int, kernels: Kernels,
                        variant: LayerVariant) -> float:
    """What RoPE and QK-norm make attention keep beyond GPT-2's Q, K and V (measured on CPU).

    Either gives the attention core new query and key tensors: without GQA it then keeps them
    beside QKV's output (V views it still); with GQA they replace the copies it makes anyway.
    QK-norm keeps its statistics per head and token and its input, a view of QKV's output (which
    under GQA nothing else keeps). RoPE's own tensors are per call (``per_call_bytes``)."""
    qk = tok * variant.qk_rows(h, a) / t
    grouped = (variant.query_groups or a) != a
    kept = e * qk if (variant.rotary or variant.qk_norm) and not grouped else 0
    if variant.qk_norm:
        kept += _qknorm_beyond_input(tok=tok, h=h, a=a, t=t, e=e, kernels=kernels, variant=variant)
        kept += e * tok * variant.qkv_rows(h, a) / t if grouped else 0
    return kept


def checkpoint_inputs_bytes(*, tok: int, h: int, a: int, t: int, e: int, kernels: Kernels,
                             variant: LayerVariant) -> float:
    """What the queries, keys and values keep under selective recompute: the checkpointed core
    attention's inputs (``Attention._checkpointed_attention_forward``). V is a view of QKV's
    output, so that storage stays; Q and K are views of it too, or new tensors under RoPE or
    QK-norm (+ e q k). GQA's repeat of K and V to every head happens inside the core attention,
    so unlike the stock inventory nothing of the heads' size is kept (measured). QK-norm's own
    statistics (and CPU RMSNorm's normalised input) stay, as without recompute."""
    kept = e * tok * variant.qkv_rows(h, a) / t
    if variant.rotary or variant.qk_norm:
        kept += e * tok * variant.qk_rows(h, a) / t
    if variant.qk_norm:
        kept += _qknorm_beyond_input(tok=tok, h=h, a=a, t=t, e=e, kernels=kernels, variant=variant)
    return kept


def _qknorm_beyond_input(*, tok: int, h: int, a: int, t: int, e: int, kernels: Kernels,
                          variant: LayerVariant) -> float:
    """What QK-norm keeps besides its input: a ``variant.normalization`` per head and token of
    the rank's queries and keys (``norm_beyond_input`` over head_dim features)."""
    head_dim = h // a
    return norm_beyond_input(tok * variant.qk_rows(h, a) / t / head_dim, head_dim, e=e, kernels=kernels,
                              variant=variant)


def per_call_bytes(*, s: int, h: int, a: int, e: int, variant: LayerVariant = GPT2, core_attention: str = "local",
                   kernels: Kernels = CUDA_KERNELS) -> float:
    """What an attention call keeps whatever its batch size, built anew by every call (so once per
    Oases sub-batch): RoPE's tables (``rope_table_bytes``) and the local attention's causal mask
    (s^2 bools); SDPA masks inside (``is_causal``): a fused kernel keeps its philox state instead,
    the math kernel nothing. ``core_attention``: the kernel that runs (``attention_kernel``)."""
    mask = {"local": s * s, "fused": kernels.fused_attention_rng}.get(core_attention, 0)
    return mask + rope_table_bytes(s=s, h=h, a=a, e=e, variant=variant)


def rope_table_bytes(*, s: int, h: int, a: int, e: int, variant: LayerVariant = GPT2) -> float:
    """RoPE's cos and sin tables for the queries and for the keys (s x the rotated dim each, in the
    activations' dtype), applied before the core attention; 0 without RoPE."""
    return 4 * s * variant.rotary_dim(h // a) * e


SELECTIVE_MASK_TYPE_BYTES = 4
"""Megatron's checkpointed core attention passes its mask type through the checkpoint as an int32
tensor (``Attention._checkpointed_attention_forward``), which the checkpoint keeps."""
