"""Flags of the reference trainer, named as in Megatron-LM, and their validation.

Validation runs before any process group exists, and every error is one line naming the flag and
the fix (``ConfigError``). ``validate_config`` takes the run's ``RunConfig`` and returns it
normalised; it never sees, let alone edits, the argparse namespace.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

from megatron_oases.describe.layout import Layout
from megatron_oases.describe.backends import BACKENDS as TP_BACKENDS, backend  # noqa: F401
from megatron_oases.describe.megatron_1d import sequence_parallel_refusal
from megatron_oases.errors import ConfigError, OneLineErrorParser, range_refusal
from megatron_oases.flags import add_flag, add_flags, option
from megatron_oases.output_paths import check_output_file
from megatron_oases.parallel.dims import ParallelDims, check_sizes
from megatron_oases.run_config import (DEFAULTS, SCHEDULES, RunConfig, check_gqa_flags,  # noqa: F401
                                       filled_ffn_hidden_size, gqa_groups, mesh_search_shape)


def build_parser(prog: str = "megatron-oases train") -> argparse.ArgumentParser:
    """The trainer's flags: the shared ones from the flag table (``megatron_oases.flags``), its own
    (optimizer, init, data, logging, checkpoints, exit) here and in the modules they configure."""
    p = OneLineErrorParser(
        prog=prog, allow_abbrev=False,  # as Megatron-LM: a flag is spelled out
        description="Reference GPT pretraining loop on Megatron-Core (GPTModel, Megatron DDP and "
                    "optimizer, get_forward_backward_func). The stock baseline every "
                    "megatron_oases feature is compared against. Runs on CUDA+NCCL or CPU+gloo.")
    g = p.add_argument_group("launch")
    add_flags(g, ("nproc_per_node", "device"))
    g.add_argument("--dist-timeout", type=float, default=DEFAULTS.dist_timeout,
                   help="seconds before a hung collective is aborted, on every process group "
                        "(Megatron's TP/PP/DP groups too); with --nproc-per-node, a rank that "
                        "makes no progress for this long (+60 s) ends the run, naming the rank")
    add_flag(g, "topology", note="validated at start")
    g = p.add_argument_group("parallelism")
    add_flags(g, ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "num_layers_per_virtual_pipeline_stage", "sequence_parallel", "use_distributed_optimizer",
                  "overlap_grad_reduce", "tp_backend", "atp_mesh", "atp_chunks", "schedule", "oases_plan"))
    from megatron_oases.schedules.oases.options import add_oases_args

    add_oases_args(p)
    g = p.add_argument_group("model")
    add_flags(g, ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length"))
    g.add_argument("--max-position-embeddings", type=int, default=DEFAULTS.max_position_embeddings,
                   help="default: --seq-length")
    add_flags(g, ("vocab_size", "make_vocab_size_divisible_by", "normalization", "position_embedding_type",
                  "rotary_base", "rotary_percent", "swiglu", "group_query_attention", "num_query_groups",
                  "add_bias_linear", "qk_layernorm", "hidden_dropout", "attention_dropout",
                  "attention_backend"))
    g.add_argument("--init-method-std", type=float, default=DEFAULTS.init_method_std)
    add_flag(g, "untie_embeddings_and_output_weights")
    from megatron_oases.moe import MOE_FIELDS

    moe = p.add_argument_group("mixture of experts (Megatron-Core's MoELayer; docs/trainer.md)")
    notes = {"moe_token_dispatcher_type": "flex (DeepEP / HybridEP) is refused",
             "moe_grouped_gemm": "refused where megatron-core's local spec has none (0.19: SequentialMLP only)"}
    for dest in ("num_experts", *MOE_FIELDS):
        add_flag(moe, dest, note=notes.get(dest, ""))
    g.add_argument("--no-tp-invariant-init", dest="tp_invariant_init", action="store_false",
                   help="keep Megatron's own init (depends on TP/PP); by default every parameter "
                        "is drawn from (seed, global name) so all layouts start identical")
    g = p.add_argument_group("training")
    add_flags(g, ("micro_batch_size", "global_batch_size"))
    g.add_argument("--train-iters", type=int, default=DEFAULTS.train_iters)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default=DEFAULTS.optimizer,
                   help="Megatron's optimizer; sgd keeps parity runs free of Adam's amplification "
                        "of float noise in near-zero gradients")
    g.add_argument("--sgd-momentum", type=float, default=DEFAULTS.sgd_momentum)
    g.add_argument("--lr", type=float, default=DEFAULTS.lr)
    g.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay)
    g.add_argument("--clip-grad", type=float, default=DEFAULTS.clip_grad)
    g.add_argument("--adam-beta1", type=float, default=DEFAULTS.adam_beta1)
    g.add_argument("--adam-beta2", type=float, default=DEFAULTS.adam_beta2)
    g.add_argument("--adam-eps", type=float, default=DEFAULTS.adam_eps,
                   help="Adam's denominator term (Megatron's --adam-eps, default 1e-08)")
    g.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_flags(g, ("bf16", "fp16", "fp32"))  # --fp32: refused, as by every front end (flags.py)
    g.add_argument("--loss-scale", type=float, default=DEFAULTS.loss_scale,
                   help="constant loss scale > 0 (--fp16; Megatron also applies it with --bf16 "
                        "or --use-distributed-optimizer); default: dynamic under --fp16")
    g.add_argument("--initial-loss-scale", type=float, default=DEFAULTS.initial_loss_scale,
                   help="--fp16 without --loss-scale: initial dynamic loss scale, >= 1 "
                        "(Megatron's minimum loss scale; default 2^32)")
    g.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction,
                   default=DEFAULTS.gradient_accumulation_fusion,
                   help="Megatron's fused weight-gradient accumulation into main_grad (needs "
                        "Apex's fused_weight_gradient_mlp_cuda; Megatron-LM's default on GPU). "
                        "Applies to Megatron's linears: all of --tp-backend megatron's, and the "
                        "output layer of atp / 3d, whose own linears accumulate unfused")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="train on after a NaN or Inf loss or gradient norm. By default, as in "
                        "Megatron-LM, every rank stops after that iteration with one line naming "
                        "it (exit 1) and saves nothing from it; an --fp16 step the loss scaler "
                        "skips (inf gradients) is not one, its loss is still checked")
    add_flags(g, ("recompute_granularity", "recompute_method", "recompute_num_layers"))
    from megatron_oases.datasets import add_data_args

    add_data_args(p)
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=DEFAULTS.log_interval)
    g.add_argument("--log-json", default=DEFAULTS.log_json,
                   help="also write one JSON object per iteration to this file")
    from megatron_oases.checkpoint import add_checkpoint_args

    add_checkpoint_args(p)
    from megatron_oases.exit_flags import add_exit_args

    add_exit_args(p)
    return p


def world_size_of(cfg: RunConfig) -> int:
    """Ranks this run will have: --nproc-per-node when spawning, else the launcher's WORLD_SIZE."""
    if cfg.nproc_per_node is not None and "RANK" not in os.environ:
        if cfg.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1 (got {cfg.nproc_per_node})")
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
        if tasks.isdigit() and int(tasks) > 1:
            # each srun task would spawn a world of its own on its node: several separate runs
            raise ConfigError(f"--nproc-per-node starts the ranks of one machine, and this srun step "
                              f"has {tasks} tasks, each of which would start a separate run; launch "
                              f"one task per node through torchrun (as scripts/slurm/*.sbatch do), "
                              f"or run srun with one task")
        return cfg.nproc_per_node
    return int(os.environ.get("WORLD_SIZE", "1"))


def cuda_wanted(cfg: RunConfig) -> bool:
    """Whether this run uses CUDA: ``--device`` when given (``cuda`` must then be visible),
    else whether CUDA is available."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible (torch.cuda.is_available() "
                          "is False); use --device cpu or drop --device")
    return cfg.device == "cuda" or (cfg.device is None and torch.cuda.is_available())


# (field, lowest allowed, lowest inclusive?, highest exclusive or None); the flag is option(field)
_RANGES = (
    ("global_batch_size", 1, True, None),
    ("micro_batch_size", 1, True, None),
    ("make_vocab_size_divisible_by", 1, True, None),
    ("ffn_hidden_size", 1, True, None),
    ("dist_timeout", 0.0, False, None),
    ("lr", 0.0, True, None),
    ("init_method_std", 0.0, True, None),
    ("weight_decay", 0.0, True, None),
    ("clip_grad", 0.0, True, None),
    ("adam_beta1", 0.0, True, 1.0),
    ("adam_beta2", 0.0, True, 1.0),
    ("adam_eps", 0.0, False, None),
    ("sgd_momentum", 0.0, True, 1.0),
    ("hidden_dropout", 0.0, True, 1.0),
    ("attention_dropout", 0.0, True, 1.0),
    ("train_iters", 1, True, None),
    ("seq_length", 1, True, None),
    ("vocab_size", 1, True, None),
    ("log_interval", 1, True, None),
)


def _check_ranges(cfg: RunConfig) -> None:
    """Each numeric flag within its range (the table above), one line naming the flag."""
    values = cfg.as_dict()
    for name, low, inclusive, high in _RANGES:
        refusal = range_refusal(option(name), values[name], low, inclusive=inclusive, high=high)
        if refusal:
            raise ConfigError(refusal)


def query_groups(cfg: RunConfig) -> int:
    """Key/value groups of the attention (``run_config.gqa_groups``), one per head without GQA."""
    groups = gqa_groups(cfg)
    return cfg.num_attention_heads if groups is None else groups


def _check_model_features(cfg: RunConfig) -> None:
    """Llama-family flags: meaningful values and combinations (one line naming the flag)."""
    check_gqa_flags(cfg, ConfigError)
    groups = query_groups(cfg)  # >= 1: check_gqa_flags, and the heads' check_sizes
    if cfg.num_attention_heads % groups:
        raise ConfigError(f"--num-query-groups {groups} must divide --num-attention-heads "
                          f"{cfg.num_attention_heads}")
    if not 0.0 < cfg.rotary_percent <= 1.0:
        raise ConfigError(f"--rotary-percent must be in (0, 1] (got {cfg.rotary_percent})")
    if cfg.rotary_base < 1:
        raise ConfigError(f"--rotary-base must be >= 1 (got {cfg.rotary_base})")
    if cfg.position_embedding_type != "rope":
        for flag, value, default in (("--rotary-base", cfg.rotary_base, 10000),
                                     ("--rotary-percent", cfg.rotary_percent, 1.0)):
            if value != default:
                raise ConfigError(f"{flag} applies to --position-embedding-type rope only (got "
                                  f"{cfg.position_embedding_type}); drop it or use rope")


def virtual_stages_of(per_vstage: int, num_layers: int, pp: int) -> int:
    """Virtual stages per rank for ``--num-layers-per-virtual-pipeline-stage per_vstage``; one
    line naming the flag when it does not divide a pipeline stage's layers."""
    per_stage = num_layers // max(pp, 1)
    if per_vstage < 1:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage must be >= 1 (got {per_vstage})")
    if per_stage % per_vstage != 0:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_vstage} must divide "
                          f"the {per_stage} layers of each pipeline stage")
    return per_stage // per_vstage


def _virtual_stages(cfg: RunConfig) -> int | None:
    """Virtual stages per rank from ``--num-layers-per-virtual-pipeline-stage`` (None: off)."""
    per_vstage = cfg.num_layers_per_virtual_pipeline_stage
    if per_vstage is None:
        return None
    vp = virtual_stages_of(per_vstage, cfg.num_layers, cfg.pipeline_model_parallel_size)
    per_stage = per_vstage * vp
    if vp == 1:
        # One virtual stage is no interleaving, and Megatron's interleaved schedule then fails.
        what = (f"--num-layers-per-virtual-pipeline-stage {per_vstage} equals the layers of each "
                f"pipeline stage (one virtual stage: no interleaving)")
        divisors = [d for d in range(1, per_stage) if per_stage % d == 0]
        if not divisors:  # one layer per stage: nothing to interleave
            raise ConfigError(f"{what}; a stage of {per_stage} layer cannot be split into virtual "
                              f"stages, so drop the flag (or give each stage more layers: more "
                              f"--num-layers or a smaller --pipeline-model-parallel-size)")
        choices = ", ".join(f"{d} ({per_stage // d} virtual stages)" for d in divisors)
        raise ConfigError(f"{what}; use {'one of ' if len(divisors) > 1 else ''}{choices} or "
                          f"drop the flag")
    return vp


MIN_LOSS_SCALE = 1.0
"""Megatron's minimum dynamic loss scale (``OptimizerConfig.min_loss_scale``'s default, which the
trainer keeps: it has no ``--min-loss-scale``); a test checks the two agree."""


def _check_loss_scale(cfg: RunConfig) -> None:
    """``--loss-scale`` and ``--initial-loss-scale``: the ranges Megatron's grad scalers assert
    (``ConstantGradScaler``: scale > 0; ``DynamicGradScaler``: initial scale >= the minimum loss
    scale > 0), and only where the flag takes effect (``get_megatron_optimizer``: a constant
    scale with --fp16, --bf16 or the distributed optimizer, the dynamic one with --fp16 alone)."""
    scale, initial = cfg.loss_scale, cfg.initial_loss_scale
    if scale is not None:
        if not (math.isfinite(scale) and scale > 0):
            raise ConfigError(f"--loss-scale must be a finite number > 0 (got {scale}); drop it "
                              f"for --fp16's dynamic loss scaling")
        if not (cfg.fp16 or cfg.bf16 or cfg.use_distributed_optimizer):
            raise ConfigError(f"--loss-scale {scale} has no effect in fp32 training (Megatron "
                              f"scales the loss with --fp16, --bf16 or --use-distributed-optimizer "
                              f"only); add --fp16 or drop it")
    if initial == DEFAULTS.initial_loss_scale:
        return
    floor = MIN_LOSS_SCALE
    if not (math.isfinite(initial) and initial >= floor):
        raise ConfigError(f"--initial-loss-scale must be a finite number >= {floor}, Megatron's "
                          f"minimum loss scale (got {initial}); e.g. 65536, or drop it for 2^32")
    if not cfg.fp16:
        raise ConfigError(f"--initial-loss-scale {initial} starts --fp16's dynamic loss scaling "
                          f"and has no effect without it; add --fp16 or drop it")
    if scale is not None:
        raise ConfigError(f"--initial-loss-scale {initial} has no effect with --loss-scale "
                          f"{scale} (a constant scale); drop one of them")


def _check_optimizer_flags(cfg: RunConfig) -> None:
    """An optimizer's hyper-parameter given for the other optimizer would be ignored: refused."""
    other = {"adam": ("sgd_momentum",), "sgd": ("adam_beta1", "adam_beta2", "adam_eps")}[cfg.optimizer]
    for name in other:
        if getattr(cfg, name) != getattr(DEFAULTS, name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(cfg, name)} has no effect with --optimizer {cfg.optimizer}; "
                              f"drop it or pass --optimizer {'sgd' if cfg.optimizer == 'adam' else 'adam'}")


def validate_config(cfg: RunConfig, world_size: int, cuda: bool | None) -> RunConfig:
    """Check every flag and combination; returns the run's config normalised: ``ffn_hidden_size``
    and ``max_position_embeddings`` filled in, ``recompute_num_layers`` set under full recompute,
    ``atp_mesh`` as (d1, d2) (``auto`` resolved), ``oases_layer_degrees`` from ``--oases-plan``.
    Validating a config this returned again returns it unchanged (and is silent).
    ``cuda=None``: ``cuda_wanted(cfg)``, asked only after the checks that need no torch, so a
    bad flag is refused before torch imports (``main``)."""
    check_sizes(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size,
                num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads)  # before deriving from them
    cfg = dataclasses.replace(cfg, ffn_hidden_size=filled_ffn_hidden_size(cfg, ConfigError))  # Megatron-LM's
    if cfg.max_position_embeddings is None:
        cfg = dataclasses.replace(cfg, max_position_embeddings=cfg.seq_length)
    _check_ranges(cfg)
    _check_model_features(cfg)
    check_output_file("--log-json", cfg.log_json)
    dims = parallel_dims(cfg, world_size)
    n_micro = dims.check_batch(cfg.micro_batch_size, cfg.global_batch_size)
    if dims.vp is not None and n_micro % dims.pp != 0:
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches ({n_micro}) to be a "
            f"multiple of --pipeline-model-parallel-size {dims.pp}; raise --global-batch-size")
    if cfg.max_position_embeddings < cfg.seq_length:
        raise ConfigError(f"--max-position-embeddings {cfg.max_position_embeddings} is smaller "
                          f"than --seq-length {cfg.seq_length}")
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    _check_loss_scale(cfg)
    if cfg.gradient_accumulation_fusion:
        from megatron.core.tensor_parallel import layers

        if not layers._grad_accum_fusion_available:
            raise ConfigError("--gradient-accumulation-fusion needs Apex's "
                              "fused_weight_gradient_mlp_cuda extension (CUDA); install Apex or "
                              "drop the flag")
    _check_optimizer_flags(cfg)
    if cfg.use_distributed_optimizer and cfg.optimizer != "adam":
        raise ConfigError(f"--use-distributed-optimizer needs --optimizer adam (Megatron's "
                          f"distributed optimizer does not support {cfg.optimizer})")
    cfg = validate_backend_config(cfg, dims)
    if cfg.sequence_parallel and sequence_parallel_refusal(dims.tp, cfg.seq_length):
        raise ConfigError(sequence_parallel_refusal(dims.tp, cfg.seq_length))
    if cfg.recompute_granularity == "full" or cfg.recompute_method is not None \
            or cfg.recompute_num_layers is not None:  # Megatron's pairing of the flags, one home
        from megatron_oases.flags import filled_recompute_num_layers

        cfg = dataclasses.replace(cfg, recompute_num_layers=filled_recompute_num_layers(
            cfg, cfg.num_layers // dims.pp, ConfigError))
    if cfg.topology is not None:
        check_topology(cfg.topology)
    from megatron_oases.checkpoint import validate_checkpoint_config

    validate_checkpoint_config(cfg, world_size)
    from megatron_oases.exit_flags import validate_exit_config

    validate_exit_config(cfg)

    from megatron_oases.layers.core_attention import check_backend  # imports torch: last

    check_backend(cfg.attention_backend, cuda=cuda_wanted(cfg) if cuda is None else cuda,
                  half=cfg.bf16 or cfg.fp16)
    from megatron_oases.datasets import validate_data_config

    return validate_data_config(cfg)


def parallel_dims(cfg: RunConfig, world_size: int) -> ParallelDims:
    """The run's validated degrees on ``world_size`` ranks (``ffn_hidden_size`` filled in)."""
    return ParallelDims(
        world_size=world_size, tp=cfg.tensor_model_parallel_size,
        pp=cfg.pipeline_model_parallel_size, vp=_virtual_stages(cfg), num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size)


def validate_backend_config(cfg: RunConfig, dims: ParallelDims, *, ours: bool = True) -> RunConfig:
    """The checks of ``--tp-backend``, ``--schedule``, ``--oases-plan`` and the MoE flags against
    the validated degrees, shared by the trainer (``validate_config``) and Megatron-LM
    (``megatron_lm.flags``). Returns ``cfg`` with ``atp_mesh`` as (d1, d2), ``oases_layer_degrees``
    set (None without a plan) and the MoE flags filled in. ``ours=False``: Megatron-LM's own
    provider builds the layers (a stock run with a checkout; ``moe.validate_moe_config``)."""
    from megatron_oases.plan.plan_file import validate_plan_args
    from megatron_oases.moe import validate_moe_config
    from megatron_oases.schedules.oases.options import validate_oases_config

    cfg = validate_moe_config(cfg, tp=dims.tp, dp=dims.dp, ours=ours)
    cfg = dataclasses.replace(cfg, atp_mesh=validate_layout(cfg, dims))
    check_selective_recompute(cfg)
    validate_oases_config(cfg, dims)
    cfg = dataclasses.replace(cfg, oases_layer_degrees=validate_plan_args(cfg, dims))
    check_query_groups_split(cfg, dims)
    return cfg


def check_selective_recompute(cfg: RunConfig) -> None:
    """Megatron's selective recompute checkpoints the core attention inside Megatron's own
    ``SelfAttention``; the ATP and 3-D attention modules call ``DotProductAttention`` directly,
    so there it would do nothing: refused."""
    if cfg.selective_recompute and not backend(cfg.tp_backend).megatron_modules:
        raise ConfigError(f"{cfg.selective_recompute_flag} has no effect with --tp-backend {cfg.tp_backend} "
                          f"(its attention does not checkpoint Megatron's core attention); use "
                          f"--recompute-granularity full or drop it")


def check_topology(path: str) -> None:
    """``--topology`` names a topology that loads (a file or a shipped example); one line if not."""
    from megatron_oases.topology import TopologyError, load_topology

    try:
        load_topology(path)
    except (TopologyError, OSError) as exc:
        raise ConfigError(f"--topology: {exc}") from None


def check_query_groups_split(cfg: RunConfig, dims: ParallelDims) -> None:
    """Megatron 1-D attention gives each rank whole key/value groups: the groups must divide by
    the attention's TP degree (each attention block's degree under --oases-plan)."""
    rec = backend(cfg.tp_backend)
    if not rec.per_block_plans:  # the others' groups: the record's split (validate_layout)
        return
    groups = query_groups(cfg)
    plan = cfg.oases_layer_degrees  # set by validate_plan_args
    for degree in sorted({a for a, _ in plan}) if plan else [dims.tp]:
        if groups % rec.kv_groups_divisor(degree, None):
            where = (f"attention degree {degree} of --oases-plan" if plan
                     else f"--tensor-model-parallel-size {degree}")
            raise ConfigError(f"--num-query-groups {groups} must be divisible by the {where} "
                              f"(each rank holds whole key/value groups)")


def validate_layout(cfg: RunConfig, dims: ParallelDims | None) -> tuple[int, ...] | None:
    """The TP backend's layout and refusals, from its record (``describe.backends``): the layout
    flag's text (``--atp-mesh``; none for a backend whose layout follows from the TP size), then
    the record's refusal of the run's other flags and of the model's split, in its words.
    Returns ``atp_mesh`` as validated ((d1, d2); None for a backend without the flag).
    ``dims`` None: only the flags given to a backend that takes none (before the degrees).

    ``--atp-mesh auto`` prices every mesh on ``--topology`` with ``megatron-oases mesh``'s search
    (:func:`auto_mesh`) first. It runs before any process group exists; a second validation of
    the returned config (``train.setup``) sees (d1, d2) and is silent.
    """
    from megatron_oases.describe.ops import ModelingError

    rec = backend(cfg.tp_backend)
    text = cfg.atp_mesh
    if text is not None and not isinstance(text, str):
        text = ",".join(map(str, text))  # validated before: (d1, d2)
    try:
        if rec.parse_text is None:
            if text is not None:
                rec.parse_layout(text, 0)  # one line naming the backend that takes the flag
            if cfg.atp_chunks != DEFAULTS.atp_chunks:
                raise ConfigError(f"--atp-chunks {cfg.atp_chunks} splits ATP's layers and has no effect "
                                  f"without --tp-backend atp; drop it or add --tp-backend atp")
        if dims is None:
            return None
        if text == "auto":
            text = auto_mesh(cfg, dims)
        layout = rec.parse_layout(text, dims.tp)
    except ModelingError as exc:
        raise ConfigError(str(exc)) from None
    refused = rec.run_refusal(cfg)
    if refused:
        raise ConfigError(refused)
    if not rec.per_block_plans:  # a per-block backend's groups: check_query_groups_split
        _refuse_split(cfg, dims, layout)
    return layout.shape if rec.layout_flag else None


def auto_mesh(cfg: RunConfig, dims: ParallelDims) -> str:
    """``--atp-mesh auto``: the mesh ``megatron-oases mesh``'s search (ATP Eq. 2-4,
    ``plan.atp_mesh.search_mesh``) picks on ``--topology`` for this model and micro-batch, as
    ``D1,D2`` text; rank 0 prints it with its predicted time."""
    if cfg.topology is None:
        raise ConfigError("--atp-mesh auto needs --topology FILE (the cluster the meshes are "
                          "priced on), or pass --atp-mesh D1,D2")
    from megatron_oases.describe.ops import ModelingError
    from megatron_oases.plan.atp_mesh import MeshError, search_mesh
    from megatron_oases.plan.mesh_cli import model_summary, pick_summary
    from megatron_oases.topology import TopologyError, load_topology

    try:
        topology = load_topology(cfg.topology)
    except (TopologyError, OSError) as exc:
        raise ConfigError(f"--topology: {exc}") from None
    try:
        shape = mesh_search_shape(cfg, dims.pp)
        choice = search_mesh(topology, dims.tp, shape,
                             min_gain=cfg.atp_min_gain)
    except (MeshError, ModelingError) as exc:
        raise ConfigError(f"--atp-mesh auto on --topology {cfg.topology}: {exc}") from None
    import torch.distributed as dist

    rank0 = (dist.get_rank() == 0 if dist.is_available() and dist.is_initialized()
             else os.environ.get("RANK", "0") == "0")
    if rank0:
        print(f"--atp-mesh auto: {pick_summary(choice)} (topology {topology.name}, tp={dims.tp}, "
              f"{model_summary(shape)}; "
              "`megatron-oases mesh` prints every mesh)", flush=True)
    return f"{choice.pick.d1},{choice.pick.d2}"


def _refuse_split(cfg: RunConfig, dims: ParallelDims, layout: Layout | None) -> None:
    """The backend record's divisibility check (``describe.backends``), in its words."""
    refused = backend(cfg.tp_backend).refusal(
        tp=dims.tp, layout=layout, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
        ffn=cfg.ffn_hidden_size, micro_batch=cfg.micro_batch_size, query_groups=query_groups(cfg))
    if refused:
        raise ConfigError(refused)
