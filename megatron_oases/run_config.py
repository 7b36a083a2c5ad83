"""The typed run configuration: one frozen dataclass built from an argparse namespace.

``run_config(args)`` is the one place that reads a namespace of run arguments by name: the
reference trainer's (``train_args.build_parser``), Megatron-LM's (with our flags added by
``megatron_lm.flags``), or a partial one from a test. A field the namespace lacks takes its
default here, so the specs, options, plan files and the simulator read typed fields
(``cfg.schedule``) instead of ``getattr(args, "schedule", "default")``.

Defaults live in one place, here: the trainer's parsers read them (``default=DEFAULTS.seed``;
``store_true`` flags default to False as their fields do, which a test checks for every flag);
the Megatron-LM options our code reads, which the trainer does not have
(``RunConfig.megatron_lm``), default to what a namespace without them means (a stock,
local-spec, single-context run).

The field names are the namespace's (``args.hidden_size`` is ``cfg.hidden_size``). The entries
(``train.main``, Megatron-LM's parse hook and model provider, the simulator's ``--predict`` front
end) call ``run_config`` once; validation (``train_args.validate_config``,
``megatron_lm.flags.validate_megatron_args``) returns the config normalised (``atp_mesh`` as
``(d1, d2)``, the filled-in ``ffn_hidden_size``, ``oases_layer_degrees``...) and never edits the
namespace; everything below the entries takes the config (``tests/test_run_config.py`` checks).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

_MISSING = object()

SCHEDULES = ("default", "oases")
"""``--schedule``: the TP layers' executor (Megatron's sequential one, or the Oases sub-batch
overlap); here, below the planner, which records the executor a plan is made for."""

DEFAULT_MIN_GAIN = 0.10
"""The gain over the 1-D mesh ``--atp-mesh auto`` and ``megatron-oases mesh`` need before they pick
a 2-D mesh (``plan.atp_mesh.search_mesh``); here, below the planner, as ``RunConfig``'s default."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronLMOptions:
    """Megatron-LM options our checks read that the trainer has no flag for. The defaults are what
    a namespace without them (the trainer's, a test's) means: nothing of the kind is set."""

    num_virtual_stages_per_pipeline_rank: int | None = None
    context_parallel_size: int | None = 1
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: Any = None
    transformer_impl: str = "local"
    spec: Any = None
    """Megatron-LM's ``--spec`` (a module and function name, or ``local``)."""
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    recompute_activations: bool = False
    """Megatron-LM's short form of ``--recompute-granularity selective``, which its own
    ``validate_args`` expands after our parse-time checks (``RunConfig.selective_recompute``)."""
    moe_router_pre_softmax: bool = False
    """Megatron-LM's softmax before the router's top-k (which ``--moe-router-topk 1`` needs)."""
    cuda_graph_impl: str | None = "none"
    distributed_backend: str = "gloo"
    # CUDA-only options (runtime.cpu_training_compat.CUDA_ONLY_FLAGS)
    log_memory_to_tensorboard: bool = False
    record_memory_history: bool = False
    profile: bool = False
    inprocess_restart: bool = False
    use_torch_fsdp2: bool = False
    use_megatron_fsdp: bool = False

    @property
    def uneven_pipeline(self) -> bool:
        """An uneven pipeline split is set (Megatron-LM checks those; ours want equal stages)."""
        return any((self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers,
                    self.account_for_embedding_in_pipeline_split,
                    self.account_for_loss_in_pipeline_split, self.pipeline_model_parallel_layout))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run's arguments, typed; fields named and defaulted as the trainer's flags."""

    # -- launch
    nproc_per_node: int | None = None
    device: str | None = None
    dist_timeout: float = 600.0
    topology: str | None = None
    # -- parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    # -- backend and schedule
    tp_backend: str = "megatron"
    atp_mesh: str | tuple[int, int] | None = None
    """"D1,D2" or "auto" as given; (d1, d2) once validated."""
    atp_min_gain: float = DEFAULT_MIN_GAIN
    """Not a flag: the gain ``--atp-mesh auto`` needs over the 1-D mesh (``search_mesh``)."""
    atp_chunks: int = 1
    schedule: str = "default"
    oases_plan: str | None = None
    oases_layer_degrees: tuple[tuple[int, int], ...] | None = None
    """Not a flag: per layer, the (attention, mlp) TP degrees of ``--oases-plan`` (set by
    ``plan_file.validate_plan_args``); None without a plan."""
    oases_cross_pass: bool = True
    oases_fine_grained_recompute: bool = True
    oases_skip_tp_collectives: bool = False
    # -- model
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 4
    seq_length: int = 32
    max_position_embeddings: int | None = None
    vocab_size: int = 1024
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    swiglu: bool = False
    group_query_attention: bool = False
    num_query_groups: int | None = None
    add_bias_linear: bool = True
    qk_layernorm: bool = False
    attention_backend: str = "auto"
    """Megatron-LM's ``--attention-backend`` value (a name; its namespace holds an ``AttnBackend``):
    the core attention of our builds, ``layers.core_attention.core_attention_class``. ``auto``
    (torch's SDPA kernels) is measured faster than ``local`` (Megatron's DotProductAttention) on
    CPU at the test and medium sizes (docs/architecture.md)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    tp_invariant_init: bool = True
    # -- mixture of experts (Megatron-LM's names and defaults; TransformerConfig's num_moe_experts...)
    num_experts: int | None = None
    """Experts per MoE layer (None: dense MLPs)."""
    moe_router_topk: int = 2
    expert_model_parallel_size: int = 1
    """Expert-parallel (EP) group size; the experts' TP size is TP's (Megatron-LM's default), so
    EP divides the data-parallel size."""
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float | tuple[float, ...] = 0.0
    """One coefficient per load-balancing type (a tuple for several, once validated; Megatron-LM's
    parser gives a list)."""
    moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss"
    moe_ffn_hidden_size: int | None = None
    """Each expert's FFN width (None: ``ffn_hidden_size``, as Megatron-LM fills it)."""
    moe_layer_freq: int | list[int] = 1
    """One MoE layer every N layers (the trainer's integer form); Megatron-LM's parser also takes a
    per-layer list of 1 (MoE) and 0 (dense)."""
    moe_expert_capacity_factor: float | None = None
    """None: dropless (every routed token is computed)."""
    moe_grouped_gemm: bool = False
    # -- training
    micro_batch_size: int = 2
    global_batch_size: int | None = 8
    train_iters: int = 10
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    lr: float = 0.001
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    gradient_accumulation_fusion: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    """Megatron-LM's default: stop on a NaN or Inf loss or gradient norm (``train.nonfinite_stop``)."""
    # -- recompute
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # -- data and validation
    mock_data: bool = False
    data_path: list[str] | None = None
    split: str | None = None
    data_cache_path: str | None = None
    eod_token_id: int | None = None
    eval_interval: int | None = None
    eval_iters: int | None = None
    # -- logging
    log_interval: int = 1
    log_json: str | None = None
    # -- checkpoint
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    ckpt_format: str = "torch_dist"
    ckpt_step: int | None = None
    """Load this iteration of ``load`` instead of the latest (Megatron-LM's ``--ckpt-step``)."""
    verify_integrity: bool = True
    """Checksum manifest written at save, checked before a load starts (runtime/ckpt_manifest.py)."""
    # -- preemption and time limits (runtime/exit_signal.py)
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"
    """A name of ``exit_signal.EXIT_SIGNALS`` (Megatron-LM's namespace holds a ``signal.Signals``)."""
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None
    dist_ckpt_optim_fully_reshardable: bool | None = None  # None: yes (checkpoint.py)
    # -- Megatron-LM's own options
    megatron_lm: MegatronLMOptions = dataclasses.field(default_factory=MegatronLMOptions)

    @property
    def selective_recompute(self) -> bool:
        """Megatron's selective recompute (the core attention) is asked for, in either spelling."""
        return self.recompute_granularity == "selective" or self.megatron_lm.recompute_activations

    @property
    def selective_recompute_flag(self) -> str:
        """The spelling of selective recompute this run used, for refusals to name."""
        return ("--recompute-granularity selective" if self.recompute_granularity == "selective"
                else "--recompute-activations")

    @property
    def layout(self):
        """The TP backend's layout of this run (``describe.layout.Layout``): its record reads
        ``--atp-mesh`` (D1,D2 text, or (d1, d2) once validated) or the TP size
        (``Backend.parse_layout``; ModelingError, one line, if it is not one)."""
        from megatron_oases.describe.backends import backend

        mesh = self.atp_mesh
        text = mesh if mesh is None or isinstance(mesh, str) else ",".join(map(str, mesh))
        return backend(self.tp_backend).parse_layout(text, self.tensor_model_parallel_size)

    def as_dict(self) -> dict[str, Any]:
        """The flat fields (the namespace's names) and their values; without ``megatron_lm``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "megatron_lm"}


DEFAULTS = RunConfig()
"""Every field at its default: what the trainer's parsers use as their flags' defaults."""

FLAT_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name != "megatron_lm")
MEGATRON_LM_FIELDS = tuple(f.name for f in dataclasses.fields(MegatronLMOptions))


def run_config(args: argparse.Namespace | RunConfig) -> RunConfig:
    """The run configuration of ``args``: the trainer's namespace, Megatron-LM's (with our flags)
    or a partial one; a field it lacks takes the default. A ``RunConfig`` is returned as is.

    The only function that reads a namespace of run arguments by name."""
    if isinstance(args, RunConfig):
        return args

    flat = options_present(args, FLAT_FIELDS)
    if "attention_backend" in flat:  # Megatron-LM's parser stores AttnBackend members
        flat["attention_backend"] = getattr(flat["attention_backend"], "name", flat["attention_backend"])
    return RunConfig(**flat,
                     megatron_lm=MegatronLMOptions(**options_present(args, MEGATRON_LM_FIELDS)))


def check_gqa_flags(cfg, error: type[Exception] = ValueError) -> None:
    """Refuse ``--num-query-groups`` without ``--group-query-attention``, or below 1, with
    ``error`` (each caller's one-line error class), for parsers whose default is None (ours;
    Megatron-LM's is 1). Callers check that the groups divide the heads after this. ``cfg``: a
    ``RunConfig``, or the ``plan`` / ``sim`` CLI's namespace, which has the same two fields."""
    if cfg.num_query_groups is not None and not cfg.group_query_attention:
        raise error("--num-query-groups needs --group-query-attention (without it every head has "
                    "its own keys and values); add it or drop --num-query-groups")
    if cfg.num_query_groups is not None and cfg.num_query_groups < 1:
        raise error(f"--num-query-groups must be >= 1 (got {cfg.num_query_groups})")


def gqa_groups(cfg) -> int | None:
    """Key/value groups the flags set: ``--num-query-groups`` under ``--group-query-attention``
    (Megatron-LM's default 1), None without grouped-query attention. ``cfg``: as for
    ``check_gqa_flags``."""
    if not cfg.group_query_attention:
        return None
    return 1 if cfg.num_query_groups is None else cfg.num_query_groups


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default ``--ffn-hidden-size``: 4h, or int(4h x 2/3 / 64) x 64 with SwiGLU."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def dtype_name(cfg: RunConfig) -> str:
    """The run's element type as ``describe.shapes.GPTShape.dtype`` names it: bf16 with ``--bf16``,
    fp16 with ``--fp16``, else fp32."""
    return "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"


def filled_ffn_hidden_size(cfg: RunConfig, error: type[Exception] = ValueError) -> int:
    """``--ffn-hidden-size``, or Megatron-LM's default for the run (``megatron_ffn_hidden_size``);
    ``error`` (the caller's one-line class) where SwiGLU's default rounds down to 0."""
    if cfg.ffn_hidden_size is not None:
        return cfg.ffn_hidden_size
    ffn = megatron_ffn_hidden_size(cfg.hidden_size, cfg.swiglu)
    if ffn < 1:  # --swiglu rounds 4h x 2/3 down to a multiple of 64
        raise error(f"--swiglu with --hidden-size {cfg.hidden_size} gives Megatron-LM's default FFN size "
                    f"int(4h x 2/3 / 64) x 64 = 0; pass --ffn-hidden-size or a --hidden-size of at least 24")
    return ffn


def mesh_search_shape(cfg: RunConfig, pp: int):
    """The model ATP's mesh search prices for the run (``--atp-mesh auto`` on the trainer's and
    Megatron-LM's paths, ``megatron-oases mesh``): one pipeline stage's layers of the run's layer
    (its FFN size, filled in as Megatron-LM fills it, heads, and the SwiGLU / GQA / normalization
    / bias variant) at the run's micro-batch, sequence and element type."""
    from megatron_oases.describe.shapes import GPTShape, variant_from_flags

    rope = cfg.position_embedding_type == "rope"
    variant = variant_from_flags(num_query_groups=gqa_groups(cfg), swiglu=cfg.swiglu,
                                 normalization=cfg.normalization, add_bias_linear=cfg.add_bias_linear,
                                 position_embedding_type="rope" if rope else "learned_absolute",
                                 rotary_percent=cfg.rotary_percent if rope else 1.0,
                                 qk_layernorm=cfg.qk_layernorm)
    return GPTShape(hidden_size=cfg.hidden_size, num_layers=max(cfg.num_layers // pp, 1),
                    num_attention_heads=cfg.num_attention_heads, micro_batch_size=cfg.micro_batch_size,
                    seq_length=cfg.seq_length, dtype=dtype_name(cfg), variant=variant,
                    ffn_hidden_size=filled_ffn_hidden_size(cfg))


def options_present(args, names) -> dict[str, Any]:
    """The named options a namespace has (by its parser's dest names), and their values: how
    Megatron-LM's own options are read where a table names them (the refused-options check)."""
    values = {name: getattr(args, name, _MISSING) for name in names}
    return {name: value for name, value in values.items() if value is not _MISSING}
