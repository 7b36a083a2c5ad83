"""The one model-shape type: the GPT the planner, the simulator, ATP's mesh picker and the layer
descriptions are sized by (``GPTShape``), its element types (``DTYPES``) and the Llama-family
flags -> ``LayerVariant`` mapping. Pure Python (no torch).

Field names are Megatron-LM's (``args.<name>``); each field's docstring names its flag. The
parallel layout (TP / PP / DP / virtual stages) is not a shape: it is ``parallel.ParallelDims``
for the runtime, ``sim.core.strategy.Strategy`` for the simulator and ``plan.model.PlanModel.tp`` for
the planner.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..precision import UNSTATED
from .core_attention import attention_kernels_refusal, scores_on_chip
from .moe import MoEShape
from .ops import GPT2, LayerVariant, ModelingError

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Element types of activations and weights, and their bytes."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
_FLAG = {"padded_vocab_size": "--vocab-size (padded)"}


def is_positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _fraction(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 <= v < 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTShape:
    """A dense GPT (GPT-2's layer, or Llama-family options through ``variant``) and the
    micro-batch it runs on; every size a layer description, a memory estimate or an event key
    needs. Validated once, here; a bad value is one line naming its flag."""

    error: ClassVar[type[Exception]] = ModelingError
    """The exception a bad value raises (the planner's ``PlanModel`` raises ``PlanError``)."""

    num_layers: int
    """``--num-layers``: transformer layers of the whole model."""
    hidden_size: int
    """``--hidden-size``"""
    num_attention_heads: int
    """``--num-attention-heads``"""
    seq_length: int
    """``--seq-length``"""
    micro_batch_size: int
    """``--micro-batch-size``: samples of one micro-batch on one TP group."""
    ffn_hidden_size: int = 0
    """``--ffn-hidden-size`` (SwiGLU: the gate's size); 0 means 4 x ``hidden_size``."""
    padded_vocab_size: int = 51200
    """Megatron's ``args.padded_vocab_size``: ``--vocab-size`` padded to a multiple of
    ``--make-vocab-size-divisible-by`` x TP (``megatron_oases.vocab.padded_vocab_size``)."""
    dtype: str = UNSTATED
    """``--bf16`` | ``--fp16`` | fp32 (neither): activation and weight elements (Adam states are fp32).
    Unstated it is fp32, as a launch without either flag runs (``precision.UNSTATED``, the rule
    ``sim`` and ``plan`` read their flags by)."""
    hidden_dropout: float = 0.0
    """``--hidden-dropout`` (0 by default, as ``megatron-oases train``; Megatron-LM's pretrain_gpt.py
    uses 0.1): part of the layer events' profile keys, since the profiler runs them with it."""
    attention_dropout: float = 0.0
    """``--attention-dropout`` (0 by default, as ``megatron-oases train``)."""
    tied_embeddings: bool = True
    """False with ``--untie-embeddings-and-output-weights``: input and output embeddings share one
    weight (Megatron's default); with PP > 1 the first and last stage each hold a copy and
    all-reduce its gradient. (The planner prices tied embeddings only.)"""
    variant: LayerVariant = GPT2
    """GPT-2's layer, or the Llama-family flags (``--group-query-attention --num-query-groups``,
    ``--swiglu``, ``--normalization``, ``--disable-bias-linear``, ``--position-embedding-type rope``,
    ``--rotary-percent``, ``--qk-layernorm``); ``variant_from_flags`` maps the flags."""
    core_attention: str = "local"
    """The core attention (``describe.core_attention.CORE_ATTENTIONS``): Megatron's local
    ``DotProductAttention`` (the s x s scores kept), ``unfused`` (SDPA's math kernel, our builds'
    ``--attention-backend unfused``) or ``fused`` (a kernel that keeps no s x s tensor: SDPA with
    ``--attention-backend flash|fused|auto`` on our builds, ``--use-flash-attn``, Transformer
    Engine's default); ``core_attention_of`` maps the flags. The saved-bytes inventory, the
    simulator's memory and time and the planner's memory read it."""
    attention_kernels: str = "auto"
    """The kernels a ``fused`` core attention runs (``describe.core_attention.SDPA_CHOICES``:
    ``auto``, ``flash``, ``fused``; ``attention_kernels_of`` maps the flags): part of the layer
    events' profile keys, since the profiler times them with it; the same tensors and the same
    analytical price whichever it is. ``auto`` for other kinds."""
    grad_reduce_bytes: int = 4
    """Bytes of a gradient in the main-grad buffers and the data-parallel reduction: 4 (fp32:
    ``megatron-oases train`` always; Megatron-LM under bf16 or with
    ``--accumulate-allreduce-grads-in-fp32``), 2 (Megatron-LM's fp16 default, and bf16 with
    ``--grad-reduce-in-bf16``). (The simulator reads it; the planner prices fp32 gradients only.)"""

    moe: MoEShape | None = None
    """The MoE flags (``describe.moe``: ``--num-experts`` and the rest); None: dense MLPs."""

    def __post_init__(self) -> None:
        if self.moe is not None and not isinstance(self.moe, MoEShape):
            raise self.error(f"model moe must be a MoEShape (got {type(self.moe).__name__})")
        if not self.ffn_hidden_size and is_positive_int(self.hidden_size):
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                     "ffn_hidden_size", "padded_vocab_size"):
            v = getattr(self, name)
            if not is_positive_int(v):
                raise self.error(f"{_FLAG.get(name, '--' + name.replace('_', '-'))} must be a positive integer "
                                 f"(got {v!r})")
        if self.dtype not in DTYPES:
            raise self.error(f"model dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        for name in ("hidden_dropout", "attention_dropout"):
            if not _fraction(getattr(self, name)):
                raise self.error(f"--{name.replace('_', '-')} must be in [0, 1) (got {getattr(self, name)!r})")
        if attention_kernels_refusal(self.core_attention, self.attention_kernels):
            raise self.error(attention_kernels_refusal(self.core_attention, self.attention_kernels))
        if self.grad_reduce_bytes not in (2, 4):
            raise self.error(f"gradient reduction bytes must be 2 or 4 (got {self.grad_reduce_bytes!r})")
        if not isinstance(self.variant, LayerVariant):
            raise self.error(f"model variant must be a LayerVariant (got {type(self.variant).__name__})")
        groups = self.variant.query_groups
        if groups is not None and (not is_positive_int(groups) or self.num_attention_heads % groups):
            raise self.error(f"--num-query-groups {groups} must divide --num-attention-heads "
                             f"{self.num_attention_heads}")

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation / weight element (``dtype``'s)."""
        return DTYPES[self.dtype]

    @property
    def fused_attention(self) -> bool:
        """A fused core attention (the device model then prices the scores on chip)."""
        return scores_on_chip(self.core_attention)

    @property
    def grad_dtype(self) -> str:
        """The element type of the DP gradient reduction (and the tied-embedding all-reduce)."""
        return "fp32" if self.grad_reduce_bytes == 4 else self.dtype

    @property
    def num_query_groups(self) -> int:
        """Key/value groups (``--num-query-groups``; ``num_attention_heads`` without GQA)."""
        return self.variant.query_groups or self.num_attention_heads


def dtype_of(bytes_per_element: int, error: type[Exception] = ModelingError) -> str:
    """The dtype of ``bytes_per_element``-byte elements: bf16 for 2, fp32 for 4."""
    if bytes_per_element not in (2, 4):
        raise error(f"bytes per element must be 2 (bf16) or 4 (fp32) (got {bytes_per_element!r})")
    return "bf16" if bytes_per_element == 2 else "fp32"


def variant_from_flags(*, num_query_groups: int | None = None, swiglu: bool = False,
                       normalization: str = "LayerNorm", add_bias_linear: bool = True,
                       position_embedding_type: str = "learned_absolute", rotary_percent: float = 1.0,
                       qk_layernorm: bool = False, error: type[Exception] = ModelingError) -> LayerVariant:
    """The layer variant of Megatron-LM's Llama-family flags (``num_query_groups`` None or 0: one
    group per head); a bad value is one line naming its flag."""
    if num_query_groups is not None and (isinstance(num_query_groups, bool) or not isinstance(num_query_groups, int)
                                         or num_query_groups < 0):
        raise error(f"--num-query-groups must be a positive integer (got {num_query_groups!r})")
    if normalization not in NORMALIZATIONS:
        raise error(f"--normalization must be LayerNorm or RMSNorm (got {normalization!r})")
    if position_embedding_type not in POSITION_EMBEDDINGS:
        raise error(f"--position-embedding-type must be learned_absolute or rope (got {position_embedding_type!r})")
    rope = position_embedding_type == "rope"
    if isinstance(rotary_percent, bool) or not isinstance(rotary_percent, (int, float)) \
            or not 0.0 < rotary_percent <= 1.0 or (rotary_percent != 1.0 and not rope):
        raise error(f"--rotary-percent must be in (0, 1] and applies to --position-embedding-type rope "
                    f"only (got {rotary_percent!r})")
    return LayerVariant(query_groups=num_query_groups or None, gated=bool(swiglu), normalization=normalization,
                        bias=bool(add_bias_linear), rotary=rope, rotary_percent=rotary_percent,
                        qk_norm=bool(qk_layernorm))


def variant_flags(v: LayerVariant) -> dict[str, Any]:
    """``variant_from_flags``'s keywords for ``v`` (0 query groups: one per head)."""
    return {"num_query_groups": v.query_groups or 0, "swiglu": v.gated, "normalization": v.normalization,
            "add_bias_linear": v.bias, "position_embedding_type": "rope" if v.rotary else "learned_absolute",
            "rotary_percent": v.rotary_percent, "qk_layernorm": v.qk_norm}


def batch_split_refusal(*, global_batch: int, micro_batch: int, dp: int) -> str:
    """Why ``global_batch`` samples do not split into micro-batches of ``micro_batch`` on each of
    ``dp`` data-parallel replicas ("" when they do). The rule's one home: the runtime's
    ``ParallelDims.check_batch`` and the planner's cost model."""
    if not is_positive_int(global_batch):
        return f"--global-batch-size must be a positive integer (got {global_batch!r})"
    per_step = micro_batch * dp
    if global_batch % per_step:
        return (f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                f"{micro_batch} x data-parallel size {dp} = {per_step}")
    return ""
