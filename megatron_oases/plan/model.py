"""The GPT and training setup a plan is made for (``PlanModel``), and the planner's error."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from megatron_oases.describe.core_attention import attention_backend_of, attention_kernels_of, core_attention_of
from megatron_oases.describe.megatron_1d import sequence_parallel_refusal, tp_split_refusal
from megatron_oases.describe.moe import MOE_SHAPE_FLAGS, moe_refusal, moe_shape, without_experts
from megatron_oases.describe.split import SUB_BATCHES, sub_batches_at, unsplit_refusal
from megatron_oases.describe.shapes import DTYPES, GPTShape, is_positive_int, variant_flags, variant_from_flags
from megatron_oases.errors import ConfigError
from megatron_oases.flags import option
from megatron_oases.run_config import DEFAULTS, megatron_ffn_hidden_size

__all__ = ["BLOCK_KINDS", "DTYPES", "PlanError", "PlanModel", "model_from_mapping"]

BLOCK_KINDS = ("attention", "mlp")


class PlanError(ConfigError):
    """Bad planner input or an unsatisfiable request; one line naming the flag and the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanModel(GPTShape):
    """The GPT (``describe.shapes.GPTShape``: its sizes, dtype, dropouts and layer variant) and the
    training setup a plan is made for (Megatron-LM flag names in comments)."""

    error: ClassVar[type[Exception]] = PlanError

    tp: int
    """--tensor-model-parallel-size T: the TP group every block's degree divides."""
    recompute: bool = False
    """--recompute-granularity full (every layer of the stage): each layer keeps its input and
    reruns its forward before its backward, the forward's collectives too, unless
    :attr:`fine_grained` (``describe.split.recompute_boundaries``)."""
    fine_grained_recompute: bool = True
    """--oases-fine-grained-recompute, the trainer's default: under the Oases schedule full
    recompute also keeps each forward all-reduce's output and so issues no collective again."""
    selective_recompute: bool = False
    """--recompute-granularity selective: the core attention reruns in backward, its s^2 tensors
    are not kept (``describe.saved``)."""
    sub_batches: int = 2
    """2: the Oases two-sub-batch overlap (Eq. 3); 1: the stock sequential executor. Given 2 (the
    Oases schedule), it becomes what the executor runs for the whole TP group
    (``describe.split.sub_batches_at``): 1 for a dense model at TP 1, whose layers the trainer
    runs as stock ones under ``--schedule oases``, so the plan prices what the default schedule's
    prices there."""
    distributed_optimizer: bool = False
    """Optimizer states sharded over each block's data-parallel replicas."""
    sequence_parallel: bool = False
    """--sequence-parallel: priced at the uniform degree T only (Megatron family; the runtime
    runs no per-block plan with it), with the SP layer description and saved bytes."""
    ep: int = 1
    """--expert-model-parallel-size: the experts of an MoE model (``GPTShape.moe``) split over EP
    data-parallel replicas, fixed by the launch (the planner chooses TP degrees only)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_moe()
        if not is_positive_int(self.tp):
            raise PlanError(f"--tensor-model-parallel-size must be a positive integer (got {self.tp!r})")
        if self.sequence_parallel and sequence_parallel_refusal(self.tp, self.seq_length):  # the trainer's rule
            raise PlanError(sequence_parallel_refusal(self.tp, self.seq_length))
        if not self.tied_embeddings:
            raise PlanError("--untie-embeddings-and-output-weights is not priced by the planner (its head "
                            "memory is the tied embedding's); plan with tied embeddings")
        if self.grad_reduce_bytes != 4:
            raise PlanError("the planner prices fp32 gradients (main grads and their reduction); "
                            "grad_reduce_bytes must be 4")
        if self.sub_batches not in (1, SUB_BATCHES):
            raise PlanError(f"sub_batches must be 1 (stock executor) or {SUB_BATCHES} (Oases) "
                            f"(got {self.sub_batches!r})")
        if self.recompute and self.selective_recompute:
            raise PlanError(f"{option('recompute_granularity')} is full or selective, not both")
        if self.selective_recompute and self.sub_batches > 1:  # the trainer's refusal (schedules/oases/options)
            raise PlanError(f"{option('recompute_granularity')} selective cannot be combined with --schedule oases "
                            "(Oases recomputes whole layers); use full or no recompute")
        refused = tp_split_refusal(tp=self.tp, hidden=self.hidden_size, heads=self.num_attention_heads,
                                   ffn=self.ffn_hidden_size)
        if refused:
            raise PlanError(refused)
        self._split_as_run()

    def _split_as_run(self) -> None:
        """``sub_batches`` as the trainer runs it (``describe.split``, after the refusals the
        trainer makes of ``--schedule oases`` itself, selective recompute among them)."""
        runs = sub_batches_at(self.tp, oases=self.sub_batches > 1, expert_parallel=self.ep if self.moe else 1)
        if runs < self.sub_batches and not self.fine_grained_recompute:  # the trainer's check
            raise PlanError(unsplit_refusal("--no-" + option("oases_fine_grained_recompute")[2:]))
        object.__setattr__(self, "sub_batches", runs)

    def _check_moe(self) -> None:
        """What the trainer refuses for MoE (``megatron_oases.moe``, ``describe.moe.moe_refusal``):
        EP divides the experts, SP and no biases at TP > 1; and the Oases executor does not run
        MoE layers at TP > 1 yet (issue 51 item 2). EP's division of DP is checked with the launch."""
        if not is_positive_int(self.ep):
            raise PlanError(f"{option('expert_model_parallel_size')} must be a positive integer (got {self.ep!r})")
        refused = moe_refusal(self.moe, tp=self.tp, ep=self.ep, dp=None, sequence_parallel=self.sequence_parallel,
                              bias=self.variant.bias, oases=self.sub_batches > 1)
        if refused:
            raise PlanError(refused)

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` of the chain (``graph.build_graph``) is an MoE layer's MoE block."""
        layer, kind = divmod(index, len(BLOCK_KINDS))
        return self.moe is not None and kind == 1 and self.moe.is_moe(layer)

    @property
    def fine_grained(self) -> bool:
        """Full recompute that reissues no collective: the Oases schedule's fine-grained one."""
        return self.recompute and self.fine_grained_recompute and self.sub_batches > 1

    @property
    def num_blocks(self) -> int:
        return self.num_layers * len(BLOCK_KINDS)

    def to_dict(self) -> dict[str, Any]:
        """The plan file's ``inputs.model``: the fields ``model_from_mapping`` reads, flat."""
        d = {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
             "num_attention_heads": self.num_attention_heads, "seq_length": self.seq_length,
             "micro_batch_size": self.micro_batch_size, "tp": self.tp, "ffn_hidden_size": self.ffn_hidden_size,
             "vocab_size": self.padded_vocab_size, "dtype": self.dtype, "recompute": self.recompute,
             "fine_grained_recompute": self.fine_grained_recompute, "selective_recompute": self.selective_recompute,
             "sub_batches": self.sub_batches, "distributed_optimizer": self.distributed_optimizer,
             "hidden_dropout": self.hidden_dropout, "attention_dropout": self.attention_dropout,
             # the --attention-backend value that maps back to the kind and its kernels
             # (``core_attention_of``, ``attention_kernels_of``), so the file reads back the same model
             "attention_backend": attention_backend_of(self.core_attention, self.attention_kernels)}
        d.update(variant_flags(self.variant))
        d["sequence_parallel"] = self.sequence_parallel
        # the MoE flags (Megatron-LM's names; a dense model's at the trainer's defaults, no experts)
        if self.moe is None:
            d.update({k: getattr(DEFAULTS, k) for k in MOE_FIELDS}, num_experts=None)
        else:
            d.update(num_experts=self.moe.num_experts, moe_ffn_hidden_size=self.moe.ffn,
                     moe_router_topk=self.moe.topk, moe_layer_freq=self.moe.layer_freq,
                     moe_expert_capacity_factor=self.moe.capacity_factor,
                     moe_token_dispatcher_type=self.moe.dispatcher, moe_grouped_gemm=self.moe.grouped_gemm,
                     moe_router_load_balancing_type=_listed(self.moe.load_balancing),
                     moe_aux_loss_coeff=_listed(self.moe.aux_loss_coeffs))
        d["expert_model_parallel_size"] = self.ep
        return d


def _listed(value):
    """A tuple-valued flag as the plan file's JSON list (a scalar as itself)."""
    return list(value) if isinstance(value, tuple) else value


_ALIASES = {"vocab": "vocab_size", "tensor_model_parallel_size": "tp", "micro_batch": "micro_batch_size",
            "layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "seq": "seq_length", "ffn": "ffn_hidden_size", "padded_vocab_size": "vocab_size"}


FILE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "tp",
               "ffn_hidden_size", "vocab_size", "dtype", "recompute", "fine_grained_recompute",
               "selective_recompute", "sub_batches", "distributed_optimizer",
               "hidden_dropout", "attention_dropout", "attention_backend", "num_query_groups", "swiglu", "normalization",
               "add_bias_linear", "position_embedding_type", "rotary_percent", "qk_layernorm", "sequence_parallel")
MOE_FIELDS = MOE_SHAPE_FLAGS
"""The MoE flags of a model file (``describe.moe.moe_shape``'s, which the trainer's
``megatron_oases.moe.moe_shape_of`` reads too; the load-balancing type and the aux loss
coefficient give the aux loss, which under the Oases executor joins the sub-batches after routing)."""
FILE_FIELDS += MOE_FIELDS + ("expert_model_parallel_size",)
"""The keys of a ``--model`` file and of a plan file's ``inputs.model`` (``PlanModel.to_dict``)."""
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "tp")
_VARIANT_FLAGS = ("num_query_groups", "swiglu", "normalization", "add_bias_linear", "position_embedding_type",
                  "rotary_percent", "qk_layernorm")


def field_name(key: Any) -> str:
    """The ``FILE_FIELDS`` name a model file's key stands for (``-`` read as ``_``, aliases
    such as ``vocab`` resolved); unknown keys come back normalised, for the caller to refuse."""
    k = str(key).replace("-", "_")
    return _ALIASES.get(k, k)


def stated_fields(data: Any) -> dict[str, Any]:
    """The fields a model file states, by ``field_name``, with their values as written (none for
    a non-mapping)."""
    return {field_name(k): v for k, v in data.items()} if isinstance(data, Mapping) else {}


def model_from_mapping(data: Any, source: str = "--model", **overrides: Any) -> PlanModel:
    """A PlanModel from a parsed YAML/JSON mapping (Megatron flag names with ``_``; aliases such
    as ``vocab`` and ``tensor_model_parallel_size`` accepted) plus non-None ``overrides``."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise PlanError(f"{source}: must be a mapping of model fields (got {type(data).__name__})")
    d: dict[str, Any] = {}
    for k, v in data.items():
        key = field_name(k)
        if key not in FILE_FIELDS:
            raise PlanError(f"{source}: unknown field {k!r}; allowed: {', '.join(FILE_FIELDS)}")
        d[key] = v
    d.update({k: v for k, v in overrides.items() if v is not None})
    missing = [name for name in _REQUIRED if name not in d]
    if missing:
        flags = ", ".join(option("tensor_model_parallel_size" if m == "tp" else m) for m in missing)
        raise PlanError(f"{source}: missing {', '.join(missing)} (set them in the file or pass {flags})")
    variant = variant_from_flags(**{k: d.pop(k) for k in _VARIANT_FLAGS if k in d}, error=PlanError)
    if "ffn_hidden_size" in d and not is_positive_int(d["ffn_hidden_size"]):
        # GPTShape reads 0 as "not given" (4h): a stated 0 is a mistake, as in the trainer
        raise PlanError(f"--ffn-hidden-size must be a positive integer (got {d['ffn_hidden_size']!r})")
    if "ffn_hidden_size" not in d and variant.gated and is_positive_int(d.get("hidden_size")):
        # not given: Megatron-LM's default, which the plan's launch runs (int(4h x 2/3 / 64) x 64)
        d["ffn_hidden_size"] = megatron_ffn_hidden_size(d["hidden_size"], True)
    if "vocab_size" in d:
        d["padded_vocab_size"] = d.pop("vocab_size")
    d["moe"], d["ep"] = _moe_of(d), d.pop("expert_model_parallel_size", None) or 1
    # Megatron-LM's --attention-backend (describe.core_attention maps it); absent, as in plan files
    # written before it was priced: Megatron's local attention (what they priced)
    flag = d.pop("attention_backend", None)
    d["core_attention"] = core_attention_of(attention_backend=flag, error=PlanError)
    d["attention_kernels"] = attention_kernels_of(attention_backend=flag, core_attention=d["core_attention"])
    return PlanModel(**d, variant=variant)


def _moe_of(d: dict[str, Any]):
    """The MoE flags popped from ``d`` as ``describe.moe.MoEShape`` (None: dense); an MoE flag
    without ``num_experts`` is refused in one line."""
    given = {k: d.pop(k) for k in MOE_FIELDS if k in d}
    values = {k: given.get(k, getattr(DEFAULTS, k)) for k in MOE_FIELDS}  # the trainer's defaults
    if not values["num_experts"]:
        extra = [k for k, v in given.items() if k != "num_experts" and v != getattr(DEFAULTS, k)]
        if extra:
            raise PlanError(without_experts(option(extra[0])))
        return None
    from megatron_oases.describe.ops import ModelingError
    try:
        return moe_shape(**values, ffn_hidden_size=d.get("ffn_hidden_size") or 4 * d["hidden_size"])
    except ModelingError as e:
        raise PlanError(str(e)) from None
