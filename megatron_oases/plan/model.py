"""The GPT and training setup a plan is made for (``PlanModel``), and the planner's error."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from megatron_oases.describe.ops import LayerVariant
from megatron_oases.parallel.dims import ConfigError, ParallelDims

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
BLOCK_KINDS = ("attention", "mlp")


class PlanError(ConfigError):
    """Bad planner input or an unsatisfiable request; one line naming the flag and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanModel:
    """The GPT and the training setup a plan is made for (Megatron-LM flag names in comments)."""

    num_layers: int
    """--num-layers"""
    hidden_size: int
    """--hidden-size"""
    num_attention_heads: int
    """--num-attention-heads"""
    seq_length: int
    """--seq-length"""
    micro_batch_size: int
    """--micro-batch-size: samples of one micro-batch on one TP group."""
    tp: int
    """--tensor-model-parallel-size T: the TP group every block's degree divides."""
    ffn_hidden_size: int = 0
    """--ffn-hidden-size; 0 means 4 x hidden."""
    vocab_size: int = 51200
    """Padded vocabulary (embedding / logits memory only)."""
    dtype: str = "bf16"
    """bf16 | fp16 | fp32 (activation and weight element size; Adam states are fp32)."""
    recompute: bool = True
    """Oases fine-grained recompute: each block saves its input and forward all-reduce output and
    recomputes its compute (no collective) before its backward."""
    sub_batches: int = 2
    """2: the Oases two-sub-batch overlap (Eq. 3); 1: the stock sequential executor."""
    distributed_optimizer: bool = False
    """Optimizer states sharded over each block's data-parallel replicas."""
    hidden_dropout: float = 0.0
    """--hidden-dropout (default 0, as ``megatron-oases train``; Megatron-LM's is 0.1): part of
    the layer events' profile keys."""
    attention_dropout: float = 0.0
    """--attention-dropout (default 0, as ``megatron-oases train``)."""
    num_query_groups: int = 0
    """--group-query-attention --num-query-groups G (0: one per head). A block's degree must
    divide G: each rank holds whole key/value groups."""
    swiglu: bool = False
    """--swiglu: gated MLP (fc1 computes gate and up)."""
    normalization: str = "LayerNorm"
    """--normalization LayerNorm | RMSNorm"""
    add_bias_linear: bool = True
    """False with --disable-bias-linear."""
    position_embedding_type: str = "learned_absolute"
    """--position-embedding-type learned_absolute | rope (rotary embeddings on queries and keys)."""
    rotary_percent: float = 1.0
    """--rotary-percent: the part of each head RoPE rotates (rope only)."""
    qk_layernorm: bool = False
    """--qk-layernorm: a --normalization over each head's query and key."""
    sequence_parallel: bool = False
    """--sequence-parallel: priced at the uniform degree T only (Megatron family; the runtime
    runs no per-block plan with it), with the SP layer description and saved bytes."""

    def __post_init__(self) -> None:
        if not self.ffn_hidden_size:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "tp", "ffn_hidden_size", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"model {name} must be a positive integer (got {v!r})")
        if self.tp & (self.tp - 1):
            raise PlanError(f"--tensor-model-parallel-size {self.tp} must be a power of two for the "
                            "planner (block degrees are powers of two dividing it)")
        if self.dtype not in DTYPES:
            raise PlanError(f"model dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                raise PlanError(f"--{name.replace('_', '-')} must be in [0, 1) (got {v!r})")
        if self.num_query_groups < 0 or (self.num_query_groups and self.num_attention_heads % self.num_query_groups):
            raise PlanError(f"--num-query-groups {self.num_query_groups} must divide --num-attention-heads "
                            f"{self.num_attention_heads}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise PlanError(f"--normalization must be LayerNorm or RMSNorm (got {self.normalization!r})")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise PlanError(f"--position-embedding-type must be learned_absolute or rope "
                            f"(got {self.position_embedding_type!r})")
        rope = self.position_embedding_type == "rope"
        if isinstance(self.rotary_percent, bool) or not isinstance(self.rotary_percent, (int, float)) \
                or not 0.0 < self.rotary_percent <= 1.0 or (self.rotary_percent != 1.0 and not rope):
            raise PlanError(f"--rotary-percent must be in (0, 1] and applies to --position-embedding-type rope "
                            f"only (got {self.rotary_percent!r})")
        if self.sequence_parallel and self.seq_length % self.tp:
            raise PlanError(f"--sequence-parallel needs --seq-length {self.seq_length} divisible by "
                            f"--tensor-model-parallel-size {self.tp}")
        if self.sub_batches not in (1, 2):
            raise PlanError(f"sub_batches must be 1 (stock executor) or 2 (Oases) (got {self.sub_batches!r})")
        ParallelDims(world_size=self.tp, tp=self.tp, num_layers=self.num_layers, hidden_size=self.hidden_size,
                     num_attention_heads=self.num_attention_heads, ffn_hidden_size=self.ffn_hidden_size)

    @property
    def variant(self) -> LayerVariant:
        """The layer variant the descriptions price (GPT-2's, or Llama-family options)."""
        rope = self.position_embedding_type == "rope"
        return LayerVariant(query_groups=self.num_query_groups or None, gated=self.swiglu,
                            normalization=self.normalization, bias=self.add_bias_linear, rotary=rope,
                            rotary_percent=self.rotary_percent, qk_norm=self.qk_layernorm)

    @property
    def bytes_per_element(self) -> int:
        return DTYPES[self.dtype]

    @property
    def num_blocks(self) -> int:
        return self.num_layers * len(BLOCK_KINDS)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ALIASES = {"vocab": "vocab_size", "tensor_model_parallel_size": "tp", "micro_batch": "micro_batch_size",
            "layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "seq": "seq_length", "ffn": "ffn_hidden_size", "padded_vocab_size": "vocab_size"}


def model_from_mapping(data: Any, source: str = "--model", **overrides: Any) -> PlanModel:
    """A PlanModel from a parsed YAML/JSON mapping (Megatron flag names with ``_``; aliases such
    as ``vocab`` and ``tensor_model_parallel_size`` accepted) plus non-None ``overrides``."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise PlanError(f"{source}: must be a mapping of model fields (got {type(data).__name__})")
    allowed = [f.name for f in dataclasses.fields(PlanModel)]
    d: dict[str, Any] = {}
    for k, v in data.items():
        key = _ALIASES.get(str(k).replace("-", "_"), str(k).replace("-", "_"))
        if key not in allowed:
            raise PlanError(f"{source}: unknown field {k!r}; allowed: {', '.join(allowed)}")
        d[key] = v
    d.update({k: v for k, v in overrides.items() if v is not None})
    missing = [f.name for f in dataclasses.fields(PlanModel)
               if f.default is dataclasses.MISSING and f.name not in d]
    if missing:
        flags = ", ".join("--tensor-model-parallel-size" if m == "tp" else "--" + m.replace("_", "-")
                          for m in missing)
        raise PlanError(f"{source}: missing {', '.join(missing)} (set them in the file or pass {flags})")
    return PlanModel(**d)
