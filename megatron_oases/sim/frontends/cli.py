"""``megatron-oases sim``: simulate one iteration, search strategies, or predict a trainer step.

    megatron-oases sim --topology T [--nodes N] <model> --tensor-model-parallel-size 8 \
        --pipeline-model-parallel-size 4 --global-batch-size G ...           one strategy: summary, trace
    megatron-oases sim --search --topology T --nodes N --memory-gb M <model> --global-batch-size G
    megatron-oases sim --predict --profile P.json -- <megatron-oases train flags>

Degrees take Megatron's names (``--tp/--pp/--dp`` are short aliases); the data-parallel size
defaults to what the topology leaves (GPUs / (TP x PP)), ``--global-batch-size`` sets the
micro-batches per data-parallel replica, and ``--vocab-size`` is padded as Megatron pads it.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ...errors import ConfigError, OneLineErrorParser, comma_names, range_refusal
from ...output_paths import check_output_file
from ...topology import TopologyError
from ...pricing.device_model import ProfileDB, SimError, device_model
from ...pricing.stack import stack_of
from ...describe.core_attention import TRANSFORMER_IMPLS, attention_kernels_of, check_flash_dtype, \
    core_attention_of
from ...describe.moe import MOE_SHAPE_FLAGS, ROUTING_ASSUMPTION, MoEShape, moe_shape, without_experts
from ...describe.ops import LayerVariant, is_loop_event
from ...describe.shapes import GPTShape, variant_from_flags
from ...describe.backends import backend as record
from ...describe.registry import BACKENDS
from ... import precision
from ...flags import FLAGS, RecordsGiven, Renamed, add_flag, add_flags, filled_recompute_num_layers, given_in, option
from ...run_config import DEFAULTS, SCHEDULES, check_gqa_flags, filled_ffn_hidden_size, gqa_groups, options_present
from ..core.strategy import Strategy
from ..calibrate.profiler import resolve_topology





def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SimError(f"{flag} must be a comma-separated list of integers (got {text!r})") from None
    if not vals or min(vals) < 1:
        raise SimError(f"{flag} must list positive integers (got {text!r})")
    return vals


MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
               "vocab_size", "make_vocab_size_divisible_by", "dtype")
"""The model flags of the flag table ``sim`` takes, before its own (the gradient reduction's)."""
LAYER_FLAGS = ("untie_embeddings_and_output_weights", "group_query_attention", "num_query_groups", "swiglu",
               "normalization", "add_bias_linear", "position_embedding_type", "rotary_percent", "rotary_base",
               "qk_layernorm", "hidden_dropout", "attention_dropout")
MOE_FLAGS = MOE_SHAPE_FLAGS
"""The MoE model flags of the table, those ``describe.moe.moe_shape`` reads (the aux loss, which
joins the Oases sub-batches after routing, as the router reads the last two:
``describe.moe.aux_loss_coeff``); ``--expert-model-parallel-size`` is a strategy flag."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (Megatron flag names, megatron-oases train's defaults)")
    add_flags(g, MODEL_FLAGS)
    add_flag(g, "bf16", note="priced as --dtype bf16")
    add_flag(g, "fp16", note="priced as --dtype fp16")
    add_flag(g, "fp32")  # refused, as by every front end (flags.py)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="reduce data-parallel gradients in fp32 under --dtype fp16 (Megatron-LM's flag; "
                        "bf16 and fp32 do unless --grad-reduce-in-bf16, as Megatron-LM)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce data-parallel gradients in bf16 under --dtype bf16 (Megatron-LM's flag; NeMo's "
                        "grad_sync_dtype bf16); refused where Megatron-LM would ignore it (another dtype) or "
                        "override another flag with it (--accumulate-allreduce-grads-in-fp32)")
    add_flags(g, LAYER_FLAGS)
    add_flags(g, MOE_FLAGS[:-1])
    add_flag(g, "moe_aux_loss_coeff", note="> 0 for --moe-router-load-balancing-type aux_loss (as Megatron's "
             "router pairs them) joins the Oases sub-batches after routing (the loss needs the micro-batch's counts)")


def add_strategy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("strategy (Megatron flag names; --tp/--pp/--dp are aliases)")
    add_flag(g, "tensor_model_parallel_size", "--tp")
    add_flag(g, "pipeline_model_parallel_size", "--pp")
    add_flag(g, "data_parallel_size", "--dp")
    g.add_argument("--num-microbatches", type=int, default=None,
                   help="per data-parallel replica; default: --global-batch-size / (micro-batch x DP)")
    add_flag(g, "num_layers_per_virtual_pipeline_stage", note="sets --virtual-stages to layers / PP / this")
    g.add_argument("--pipeline-schedule", default="1f1b", choices=("gpipe", "1f1b"),
                   help="the pipeline schedule: 1f1b (Megatron's; interleaved with --virtual-stages > 1) or gpipe")
    g.add_argument("--virtual-stages", default="1",
                   help="model chunks per device (interleaved 1F1B when > 1); with --search a list, e.g. 1,2")
    add_flag(g, "schedule")
    g.add_argument("--overlap", action=Renamed, new="--schedule default|oases (the trainer's name for the executor)")
    add_flag(g, "recompute_granularity")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's short form of --recompute-granularity selective")
    add_flags(g, ("recompute_method", "recompute_num_layers"))
    g.add_argument("--recompute", action="store_true",
                   help="short form of --recompute-granularity full --recompute-method uniform")
    g.add_argument("--recompute-layers", type=int, default=0,
                   help="short form of --recompute-granularity full --recompute-method block "
                        "--recompute-num-layers K")
    add_flag(g, "oases_fine_grained_recompute")
    g.add_argument("--no-fine-grained-recompute", action=Renamed,
                   new="--no-oases-fine-grained-recompute (the trainer's name)")
    add_flags(g, ("tp_backend", "atp_mesh", "use_distributed_optimizer"))
    g.add_argument("--distributed-optimizer", action=Renamed, new="--use-distributed-optimizer (Megatron-LM's name)")
    add_flag(g, "overlap_grad_reduce")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: per-bucket parameter all-gather ahead of the next forward")
    g.add_argument("--ddp-bucket-size", type=int, default=0,
                   help="parameters per DP bucket (default: Megatron's max(40M, 1M x DP))")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=0,
                   help="layers of the first pipeline stage (default: an even share), as Megatron-Core")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=0,
                   help="layers of the last pipeline stage (default: an even share), as Megatron-Core")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="Transformer Engine userbuffers: with --sequence-parallel, each layer's all-gather / "
                        "reduce-scatter pipelined with the GEMM beside it")
    add_flag(g, "async_tensor_model_parallel_allreduce")
    g.add_argument("--scatter-gather-tensors-in-pipeline", action="store_true",
                   help="each TP rank sends 1/TP of the activation between pipeline stages and the next "
                        "stage all-gathers it (Megatron-LM before Megatron-Core, DeepSpeed's pipeline engine)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="fused (flash) attention kernels: no s x s scores in HBM nor kept for backward, "
                        "causal blocks skipped")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                   help="transformer_engine: Megatron-Core's TE layer, whose attention is fused (as --use-flash-attn)")
    add_flag(g, "attention_backend", note="with --transformer-impl transformer_engine, TE's kernels")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="Megatron-LM's: torch's softmax (fp32, dtype copies) instead of Apex's fused kernel, "
                        "the software stack `local` (pricing/stack.py); default with --transformer-impl "
                        "local: apex-fused")
    add_flag(g, "sequence_parallel")
    add_flag(g, "expert_model_parallel_size", "--ep")


def add_search_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search (--search)")
    g.add_argument("--search", action="store_true", help="rank every TP x PP x DP strategy (+ backends, oases, recompute)")
    g.add_argument("--gpus", type=int, default=None, help="default: the topology's world size")
    add_flag(g, "global_batch_size", note="without --search it sets the micro-batches per replica, unless "
             "--num-microbatches is given")
    g.add_argument("--tp-sizes", default=None, help="e.g. 1,2,4,8 (default: powers of two up to heads)")
    g.add_argument("--pp-sizes", default=None, help="default: powers of two dividing GPUs / TP, up to layers")
    g.add_argument("--ep-sizes", default=None,
                   help="with --num-experts: expert-parallel sizes to try (default: powers of two dividing the "
                        "experts and DP)")
    g.add_argument("--backends", default="megatron,atp",
                   help="TP backends to try: megatron,atp (add 3d: cube TP degrees p^3 only)")
    g.add_argument("--schedules", default="default,oases", help="TP executors to try: default, oases")
    g.add_argument("--overlaps", action=Renamed, new="--schedules default,oases (the trainer's name for the executor)")
    g.add_argument("--recompute-options", default="off,full",
                   help="recompute modes to try: off, full (or on), selective (Megatron 1-D, stock schedule)")
    g.add_argument("--sequence-parallel-options", default="off,on",
                   help="sequence parallelism to try: off, on (on: at TP > 1, Megatron 1-D); --sequence-parallel "
                        "alone tries on only")
    g.add_argument("--show-refused", action="store_true",
                   help="list the strategies that do not fit or do not split, with their reasons (default: counted)")
    g.add_argument("--jobs", type=int, default=None,
                   help="processes that share the simulations (default: the CPU count; 1: in this process)")


def model_from_args(a: argparse.Namespace, tp: int = 1) -> GPTShape:
    """The model, its vocabulary padded as Megatron pads it at TP ``tp``."""
    for dest, value in (("vocab_size", a.vocab_size), ("make_vocab_size_divisible_by", a.make_vocab_size_divisible_by)):
        if range_refusal(option(dest), value, 1):
            raise SimError(range_refusal(option(dest), value, 1))
    dtype = priced_dtype(a)
    check_flash_dtype(a.attention_backend, half=dtype != "fp32", half_flags="--dtype bf16 or fp16", error=SimError)
    multiple = a.make_vocab_size_divisible_by * tp
    core = core_attention_of(attention_backend=a.attention_backend, transformer_impl=a.transformer_impl,
                             use_flash_attn=a.use_flash_attn, error=SimError)
    return GPTShape(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                    seq_length=a.seq_length, padded_vocab_size=-(-a.vocab_size // multiple) * multiple,
                    micro_batch_size=a.micro_batch_size, ffn_hidden_size=filled_ffn_hidden_size(a, SimError), dtype=dtype,
                    tied_embeddings=not a.untie_embeddings_and_output_weights,
                    hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
                    variant=_variant(a), moe=moe_from_args(a),
                    core_attention=core, attention_kernels=attention_kernels_of(
                        attention_backend=a.attention_backend, core_attention=core),
                    grad_reduce_bytes=_grad_reduce_bytes(a, dtype))


def moe_from_args(a: argparse.Namespace) -> MoEShape | None:
    """The MoE flags as ``describe.moe.MoEShape`` (``describe.moe.moe_shape``); an MoE flag
    without ``--num-experts`` is refused in one line."""
    values = options_present(a, MOE_FLAGS)
    if not values["num_experts"]:
        given = [option(d) for d in MOE_FLAGS[1:] if values[d] != FLAGS[d].default_value]
        if given:
            raise SimError(without_experts(given[0]))
        return None
    return moe_shape(**values, ffn_hidden_size=filled_ffn_hidden_size(a, SimError))


def priced_dtype(a: argparse.Namespace) -> str:
    """The element type priced (``precision.priced_dtype``: the rule ``plan`` reads too)."""
    return precision.priced_dtype(a, SimError)


def _grad_reduce_bytes(a: argparse.Namespace, dtype: str) -> int:
    """Bytes a DP gradient element travels in, as Megatron-LM decides it: fp16 reduces in fp16
    unless --accumulate-allreduce-grads-in-fp32, bf16 in fp32 unless --grad-reduce-in-bf16."""
    if a.grad_reduce_in_bf16 and dtype != "bf16":
        raise SimError(f"--grad-reduce-in-bf16 applies to --dtype bf16 (got {dtype}); drop it")
    if a.grad_reduce_in_bf16 and a.accumulate_allreduce_grads_in_fp32:
        raise SimError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other; keep one")
    return 2 if (dtype == "fp16" and not a.accumulate_allreduce_grads_in_fp32) or a.grad_reduce_in_bf16 else 4


def _variant(a: argparse.Namespace) -> LayerVariant:
    """The layer variant of the model flags (Megatron-LM's names)."""
    check_gqa_flags(a, SimError)
    groups = gqa_groups(a)
    if groups is not None and (groups < 1 or (a.num_attention_heads or 0) % groups):
        raise SimError(f"--num-query-groups {groups} must divide --num-attention-heads {a.num_attention_heads}")
    rope = a.position_embedding_type == "rope"
    if not rope and (a.rotary_percent != 1.0 or a.rotary_base != 10000):
        raise SimError("--rotary-percent and --rotary-base apply to --position-embedding-type rope only")
    if not 0.0 < a.rotary_percent <= 1.0:
        raise SimError(f"--rotary-percent must be in (0, 1] (got {a.rotary_percent})")
    return variant_from_flags(num_query_groups=groups, swiglu=a.swiglu, normalization=a.normalization,
                              add_bias_linear=a.add_bias_linear, position_embedding_type=a.position_embedding_type,
                              rotary_percent=a.rotary_percent, qk_layernorm=a.qk_layernorm, error=SimError)


def strategy_from_args(a: argparse.Namespace, world: int | None = None) -> Strategy:
    """The one strategy of the flags; ``world``: the topology's GPUs, which the data-parallel size
    fills by default."""
    vps = _virtual_stages(a)
    if len(vps) != 1:
        raise SimError("--virtual-stages takes one value unless --search is given")
    dp = a.data_parallel_size
    if dp is None:
        dp = world // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size) if world and world % (a.tensor_model_parallel_size * a.pipeline_model_parallel_size) == 0 else 1
    micro = a.num_microbatches
    gbs_given = "global_batch_size" in (given_in(a) or {"global_batch_size"})
    if micro is None or gbs_given:
        per = a.micro_batch_size * dp if a.micro_batch_size else 0
        if not per or a.global_batch_size % per:
            default = "" if gbs_given else (" (megatron-oases train's default; give --global-batch-size or "
                                            "--num-microbatches)")
            raise SimError(f"--global-batch-size {a.global_batch_size} is not a multiple of "
                           f"--micro-batch-size {a.micro_batch_size} x DP {dp}{default}")
        if micro is not None and micro != a.global_batch_size // per:
            raise SimError(f"--num-microbatches {micro} disagrees with --global-batch-size "
                           f"{a.global_batch_size} / (micro-batch {a.micro_batch_size} x DP {dp}); give one")
        micro = a.global_batch_size // per
    layout = record(a.tp_backend).parse_layout(a.atp_mesh, a.tensor_model_parallel_size)  # describe.backends
    granularity, rc_layers = recompute_from_args(a)
    return Strategy(tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size, dp=dp, num_microbatches=micro or 1, pipeline_schedule=a.pipeline_schedule,
                    virtual_stages=vps[0], recompute=granularity == "full", recompute_layers=rc_layers,
                    selective_recompute=granularity == "selective", schedule=a.schedule,
                    fine_grained_recompute=a.oases_fine_grained_recompute, backend=a.tp_backend,
                    layout=layout, distributed_optimizer=a.use_distributed_optimizer,
                    overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather,
                    ddp_bucket_size=a.ddp_bucket_size or 0, sequence_parallel=a.sequence_parallel,
                    tp_comm_overlap=a.tp_comm_overlap, scatter_gather_pipeline=a.scatter_gather_tensors_in_pipeline,
                    first_stage_layers=a.decoder_first_pipeline_num_layers,
                    last_stage_layers=a.decoder_last_pipeline_num_layers, ep=a.expert_model_parallel_size,
                    async_dgrad=a.async_tensor_model_parallel_allreduce)


def recompute_from_args(a: argparse.Namespace) -> tuple[str | None, int]:
    """(granularity: None | full | selective, layers per chunk for the block method, 0 = every
    layer) from Megatron's recompute flags or their short forms ``--recompute`` /
    ``--recompute-layers``; a combination Megatron would refuse, or one whose memory the
    simulator does not model, is one line."""
    granularity = a.recompute_granularity
    if a.recompute_activations:
        if granularity == "full":
            raise SimError("--recompute-activations is --recompute-granularity selective; give one")
        granularity = "selective"
    short = a.recompute or a.recompute_layers
    if short and (granularity or a.recompute_method or a.recompute_num_layers is not None):
        raise SimError("give --recompute / --recompute-layers or Megatron's --recompute-granularity flags, not both")
    if a.recompute_layers < 0:
        raise SimError(f"--recompute-layers must be >= 0 (got {a.recompute_layers})")
    if short:
        return "full", a.recompute_layers
    folded = argparse.Namespace(recompute_granularity=granularity, recompute_method=a.recompute_method,
                                recompute_num_layers=a.recompute_num_layers)  # --recompute-activations folded in
    n = filled_recompute_num_layers(folded, None, SimError)  # Megatron's pairing, the trainer's words
    if granularity != "full":
        return granularity, 0
    if a.recompute_method == "uniform":
        if n != 1:
            raise SimError("--recompute-method uniform with --recompute-num-layers > 1 (groups of layers "
                           "checkpointed together) is not modeled; use 1 or --recompute-method block")
        return "full", 0
    return "full", n or 0  # block without --recompute-num-layers: every layer of the stage, as the trainer


def _virtual_stages(a: argparse.Namespace) -> list[int]:
    """``--virtual-stages``, or Megatron's ``--num-layers-per-virtual-pipeline-stage``."""
    n = a.num_layers_per_virtual_pipeline_stage
    if n is None:
        return _ints(a.virtual_stages, "--virtual-stages")
    if a.virtual_stages != "1":
        raise SimError("give --virtual-stages or --num-layers-per-virtual-pipeline-stage, not both")
    if n < 1 or not a.num_layers or a.num_layers % (a.pipeline_model_parallel_size * n):
        raise SimError(f"--num-layers-per-virtual-pipeline-stage {n} must divide --num-layers "
                       f"{a.num_layers} / --pipeline-model-parallel-size {a.pipeline_model_parallel_size}")
    return [a.num_layers // (a.pipeline_model_parallel_size * n)]


def search_space_from_args(a: argparse.Namespace, model: GPTShape, gpus: int):
    from ..core.search import SearchSpace

    if a.global_batch_size is None:
        raise SimError("--search needs --global-batch-size")
    from ..core.search import RECOMPUTE_MODES

    rc = comma_names("--recompute-options", a.recompute_options, RECOMPUTE_MODES, aliases={"on": "full"}, error=SimError)
    sp = ("on",) if a.sequence_parallel else comma_names(
        "--sequence-parallel-options", a.sequence_parallel_options, ("off", "on"), error=SimError)
    return SearchSpace(gpus=gpus, global_batch=a.global_batch_size,
                       tp_sizes=_ints(a.tp_sizes, "--tp-sizes") if a.tp_sizes else None,
                       pp_sizes=_ints(a.pp_sizes, "--pp-sizes") if a.pp_sizes else None,
                       backends=comma_names("--backends", a.backends, tuple(BACKENDS), error=SimError),
                       schedules=comma_names("--schedules", a.schedules, SCHEDULES, error=SimError), recompute=rc,
                       virtual_stages=tuple(_virtual_stages(a)), pipeline_schedule=a.pipeline_schedule,
                       sequence_parallel=tuple(v == "on" for v in sp), tp_comm_overlap=a.tp_comm_overlap,
                       distributed_optimizer=a.use_distributed_optimizer, overlap_grad_reduce=a.overlap_grad_reduce,
                       overlap_param_gather=a.overlap_param_gather, ddp_bucket_size=a.ddp_bucket_size or 0,
                       ep_sizes=_ints(a.ep_sizes, "--ep-sizes") if a.ep_sizes else None)


class SimParser(RecordsGiven, OneLineErrorParser):
    """``sim``'s and ``profile``'s parser: one-line errors, and the flags given recorded
    (``--global-batch-size`` given or at its default, against ``--num-microbatches``)."""


def build_parser() -> argparse.ArgumentParser:
    p = SimParser(prog="megatron-oases sim", description=__doc__.splitlines()[0],
                  allow_abbrev=False,  # as Megatron-LM: a flag is spelled out
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="\n".join(__doc__.splitlines()[1:]))
    add_flag(p, "topology", note="or local (one flat level, as `profile` uses by default)")
    p.add_argument("--nodes", type=int, default=None,
                   help="replicate the topology's node to this many nodes (its inter-node level)")
    add_flags(p, ("gpu", "profile", "memory_gb"))
    add_model_args(p)
    add_strategy_args(p)
    add_search_args(p)
    g = p.add_argument_group("outputs")
    g.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    g.add_argument("--png", default=None, help="write a timeline PNG here (needs matplotlib)")
    g.add_argument("--csv", default=None, help="--search: write every strategy as CSV here")
    g.add_argument("--top", type=int, default=20, help="--search: feasible rows to print")
    g.add_argument("--search-plans", type=int, default=None,
                   help="--search: run the planner on this many of the best uniform strategies it can plan "
                        "and price its per-block plans (0: none; default 3, 0 with --profile, whose "
                        "`profile --search` measured the uniform strategies' events only)")
    g.add_argument("--plan-out", default=None, metavar="FILE",
                   help="--search: write the per-block plan here when one beats every uniform strategy "
                        "(its launch takes --oases-plan FILE)")
    p.add_argument("--predict", action="store_true",
                   help="predict the step time of `megatron-oases train` with the flags after `--` (needs --profile)")
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


SEARCH_APPLIES = frozenset({"pipeline_schedule", "virtual_stages", "num_layers_per_virtual_pipeline_stage",
                            "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                            "ddp_bucket_size", "sequence_parallel", "tp_comm_overlap",
                            # the model's core attention and the device's software stack
                            "use_flash_attn", "transformer_impl", "attention_backend", "masked_softmax_fusion"})
"""Strategy flags ``--search`` applies to every candidate; the other strategy flags name one
strategy, which a search enumerates instead (``--tp-sizes``, ``--backends``, ...)."""


def _set_flags(p: argparse.ArgumentParser, a: argparse.Namespace, title: str, *,
               only: frozenset | None = None, skip: frozenset = frozenset()) -> list[str]:
    """The flags of the argument group ``title`` (its first word) that ``a`` sets away from their
    defaults, as their first option string."""
    actions = [act for g in p._action_groups if g.title.split(" ")[0] == title for act in g._group_actions
               if act.dest not in skip and (only is None or act.dest in only) and act.default is not argparse.SUPPRESS]
    values = options_present(a, [act.dest for act in actions])
    return [act.option_strings[0] for act in actions if values[act.dest] != act.default]


AT_LEAST = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1, "num_microbatches": 1, "global_batch_size": 1, "gpus": 1, "top": 0,
            "jobs": 1, "search_plans": 0,
            # profile's own
            "nproc": 1, "warmup": 0, "reps": 1, "threads": 1, "repeats": 1}
"""The smallest value each count flag of ``sim`` and ``profile`` takes (by dest); a flag not given
(None) is not checked. A smaller one is one line naming the flag, not a division by zero, a
fallback (0 micro-batches read as 1, ``--gpus 0`` as the topology's) or every row printed."""
ABOVE_ZERO = frozenset({"memory_gb", "max_comm_mb"})
"""Sizes that must be positive (``--memory-gb -1`` made every strategy infeasible)."""


def check_numbers(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse, in one line naming it, the first count or size flag of parser ``p`` whose value
    ``a`` holds out of range (``AT_LEAST``, ``ABOVE_ZERO``): before anything is built."""
    values = options_present(a, [act.dest for act in p._actions if act.option_strings])
    for act in p._actions:
        value = values.get(act.dest)
        if value is None or not act.option_strings:
            continue
        if act.dest in AT_LEAST and range_refusal(act.option_strings[0], value, AT_LEAST[act.dest]):
            raise SimError(range_refusal(act.option_strings[0], value, AT_LEAST[act.dest]))
        if act.dest in ABOVE_ZERO and range_refusal(act.option_strings[0], value, 0, inclusive=False):
            raise SimError(range_refusal(act.option_strings[0], value, 0, inclusive=False))


def model_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[str]:
    """The model ``a`` prices as a launch's flags, each spelled out (a Megatron-LM launch has
    other defaults than ours): every model flag with a value, every switch that is on (both parsers
    use Megatron-LM's names; ``--dtype bf16`` is ``--bf16``), and the core attention priced
    (``core_attention_of``: not given, Megatron's local one). A model flag the trainer lacks is
    refused: the run could not be launched as priced."""
    from ...train_args import build_parser as train_parser

    trainer = {o for act in train_parser()._actions for o in act.option_strings}
    out: list[str] = []
    actions = [act for g in p._action_groups if g.title.split(" ")[0] == "model" for act in g._group_actions
               if act.default is not argparse.SUPPRESS]  # not a refused flag (flags.Refused)
    values = options_present(a, [act.dest for act in actions])
    for act in actions:
        value, flag = values[act.dest], act.option_strings[0]
        if act.dest in MOE_FLAGS and not a.num_experts:  # a dense model's launch names no MoE flag
            continue
        if act.dest in ("dtype", *precision.PRECISION_FLAGS):
            out += [f"--{priced_dtype(a)}"] if act.dest == "dtype" and priced_dtype(a) != "fp32" else []
        elif flag not in trainer:
            if value != act.default:
                raise SimError(f"{flag} has no trainer flag, so the searched run cannot be launched as priced; "
                               f"drop it")
        elif act.nargs == 0:
            out += [flag] if value != act.default else []
        elif isinstance(value, (list, tuple)):  # a list-valued flag (nargs="+", as Megatron-LM's)
            out += [flag, *map(str, value)]
        elif value is not None and not (act.dest == "ffn_hidden_size" and not value):  # 0: 4 x hidden
            out += [flag, str(value)]
    core = core_attention_of(attention_backend=a.attention_backend, transformer_impl=a.transformer_impl,
                             use_flash_attn=a.use_flash_attn, error=SimError)
    return out + [option("attention_backend"), a.attention_backend or ("auto" if core == "fused" else "local")]


def trainer_run_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[str]:
    """The model, strategy and search flags ``a`` sets: none acts where the run is the trainer's
    flags after ``--`` (``sim --predict``, ``profile -- <train flags>``)."""
    return [f for t in ("model", "strategy", "search") for f in _set_flags(p, a, t)]


def check_flag_scope(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse a flag the chosen mode would ignore (one line naming it): under ``--predict`` the
    run is the trainer's flags after ``--``; a ``--search`` enumerates the one-strategy flags; a
    single strategy has no use for the search's. Numbers out of range first (``check_numbers``)."""
    check_numbers(p, a)
    if a.predict:
        given = trainer_run_flags(p, a)
        given += _set_flags(p, a, "outputs", only=frozenset({"csv", "top"}))
        given += [f for f, v in (("--gpu", a.gpu), ("--memory-gb", a.memory_gb)) if v]
        if given:
            raise SimError(f"{given[0]} has no effect with --predict, which prices the trainer run of the flags "
                           f"after `--` on its profile; drop it (the run is what those trainer flags say)")
        return
    check_search_scope(p, a, one_strategy=_set_flags(p, a, "outputs", only=frozenset({"trace", "png"})),
                       search_only=_set_flags(p, a, "outputs",
                                              only=frozenset({"csv", "top", "search_plans", "plan_out"})))


def check_search_scope(p: argparse.ArgumentParser, a: argparse.Namespace, *, one_strategy: Sequence[str] = (),
                       search_only: Sequence[str] = ()) -> None:
    """``--search`` or one strategy (``sim`` and ``profile``): a search enumerates the one-strategy
    flags, one strategy has no use for the search's; ``one_strategy`` / ``search_only``: the
    caller's own flags of either kind that ``a`` sets. Then the one strategy's flag combinations
    that would be ignored or contradict each other."""
    if a.search:
        given = [*_set_flags(p, a, "strategy", skip=SEARCH_APPLIES), *one_strategy]
        if given:
            raise SimError(f"{given[0]} names one strategy, which --search enumerates; drop it (the search's "
                           f"own flags: --tp-sizes, --pp-sizes, --backends, --schedules, --recompute-options)")
        return
    given = [*_set_flags(p, a, "search", skip=frozenset({"global_batch_size"})), *search_only]
    if given:
        what = "the GPUs are TP x PP x DP" if given[0] == "--gpus" else "the flags name one strategy"
        raise SimError(f"{given[0]} applies to --search only ({what} without it); drop it or add --search")
    if a.atp_mesh is not None and record(a.tp_backend).parse_text is None:  # refused in the record's words
        record(a.tp_backend).parse_layout(a.atp_mesh, a.tensor_model_parallel_size)
    if a.recompute and a.recompute_layers:
        raise SimError("--recompute (every layer) and --recompute-layers (the first K of each chunk) "
                       "contradict each other; give one")
    if not a.oases_fine_grained_recompute and (a.schedule != "oases" or recompute_from_args(a)[0] != "full"):
        raise SimError("--no-oases-fine-grained-recompute chooses how Oases recomputes and has no effect without "
                       "--schedule oases and full recompute (--recompute); drop it or add them")


def sim_main(argv: list[str] | None = None) -> int:
    """Exit 0 and print the summary / table; exit 2 with one ``error:`` line on bad input."""
    own, rest = _split(list(sys.argv[1:] if argv is None else argv))
    p = build_parser()
    a = p.parse_args(own)
    try:
        check_flag_scope(p, a)
        for flag, path in (("--trace", a.trace), ("--png", a.png), ("--csv", a.csv), ("--plan-out", a.plan_out)):
            check_output_file(flag, path)
        profile = ProfileDB.load(a.profile) if a.profile else None
        if a.predict:
            return _predict(a, profile, rest)
        if rest:
            raise SimError(f"arguments after `--` are trainer flags for --predict (got {' '.join(rest)})")
        if a.topology is None:
            raise SimError("--topology is required (a YAML path, a shipped example name, or local)")
        model, strategy, dm = simulation_inputs(a, profile)
        if a.search:
            return _search(a, model, dm)
        from ..core.timeline import simulate, summary_table

        r = simulate(model, strategy, dm, memory_limit_GB=a.memory_gb)
    except (SimError, TopologyError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary_table(r))
    if model.moe is not None:
        print(ROUTING_ASSUMPTION)
    if profile is None:  # what the analytical model borrows or fits rather than measured here (issue 49)
        print("\n".join(dm.pricing_notes()))
    _write_outputs(a, r)
    return 0


def _write_outputs(a: argparse.Namespace, r) -> None:
    """``--trace`` and ``--png`` of one simulated (or predicted) iteration."""
    if a.trace:
        from ..core.trace import write_chrome_trace
        write_chrome_trace(r, a.trace)
        print(f"trace: {a.trace}")
    if a.png:
        from ..core.trace import plot_timeline
        plot_timeline(r, a.png)
        print(f"timeline: {a.png}")


def simulation_inputs(a: argparse.Namespace, profile: ProfileDB | None = None):
    """(model, strategy, device model) of parsed ``sim`` flags; the strategy is None with --search.
    ``sim.frontends.published`` simulates published runs (``scripts/validate_published.py``,
    ``scripts/seeds_experiments.py``) through this same mapping."""
    topo = _topology(a)
    strategy = None if a.search else strategy_from_args(a, topo.world_size if topo else None)
    model = model_from_args(a, strategy.tp if strategy else _largest_tp(a, topo))
    world = a.gpus if a.search else strategy.world_size
    if topo is None and not world:
        raise SimError("--topology local with --search needs --gpus")
    dm = device_model(topo or resolve_topology(a.topology, world), gpu=a.gpu, profile=profile,
                      bytes_per_element=model.bytes_per_element, fused_attention=model.fused_attention,
                      stack=stack_of(transformer_impl=a.transformer_impl,
                                     masked_softmax_fusion=a.masked_softmax_fusion, error=SimError))
    return model, strategy, dm


def _topology(a: argparse.Namespace):
    """The named topology, replicated to ``--nodes``; None for ``local`` (sized by the strategy)."""
    if a.topology == "local":
        if a.nodes is not None:
            raise SimError("--nodes needs a topology with an inter-node level (not local)")
        return None
    topo = resolve_topology(a.topology, 0)
    return topo if a.nodes is None else topo.with_nodes(a.nodes)


def _largest_tp(a: argparse.Namespace, topo) -> int:
    """The largest TP a search tries (Megatron pads the vocabulary per TP; a search prices one
    vocabulary, padded for its largest TP)."""
    if a.tp_sizes:
        return max(_ints(a.tp_sizes, "--tp-sizes"))
    gpus = a.gpus or (topo.world_size if topo else 1)
    heads = a.num_attention_heads or 1
    tp = 1
    while gpus % (tp * 2) == 0 and heads % (tp * 2) == 0:
        tp *= 2
    return tp


def _search(a: argparse.Namespace, model: GPTShape, dm) -> int:
    from ..core.search import search, search_table, write_csv
    from .launch import launch_commands, trainer_refusal

    gpus = a.gpus or dm.topology.world_size
    cands = search(model, search_space_from_args(a, model, gpus), dm, memory_limit_GB=a.memory_gb, jobs=a.jobs)
    print(search_table(cands, top=a.top, show_refused=a.show_refused))
    if model.moe is not None:
        print(ROUTING_ASSUMPTION)
    best = next((c for c in cands if c.feasible), None)
    best, plan_path = _search_plans(a, cands, best, model, dm)
    if best is not None:
        nodes = dm.topology.num_nodes if gpus == dm.topology.world_size else max(1, gpus // dm.topology.ranks_per_node)
        commands = launch_commands(best, model_flags(build_parser(), a), global_batch=a.global_batch_size,
                                   num_layers=model.num_layers, gpus=gpus, nodes=nodes, plan_path=plan_path)
        refused = trainer_refusal(commands["trainer"], gpus)
        if refused:
            raise SimError(f"the trainer refuses the launch of {best.label}: {refused}")
        for form, cmd in commands.items():
            print(f"launch ({form}): {cmd}")
    if a.csv:
        write_csv(cands, a.csv)
        print(f"csv: {a.csv}")
    return 0


def _search_plans(a: argparse.Namespace, cands, best, model: GPTShape, dm):
    """The per-block plan step (``search_plans``): prints the planned rows; returns the strategy
    to launch and its plan file (the best plan when it beats ``best`` and ``--plan-out`` names
    where to write it; else ``best`` and None)."""
    from .search_plans import best_plan, plan_search, plans_table

    top = a.search_plans if a.search_plans is not None else 0 if a.profile else 3
    if not top or best is None:
        return best, None
    rows = plan_search(cands, model, dm, top=top, global_batch=a.global_batch_size,
                       memory_limit_GB=a.memory_gb)
    if rows:
        print(plans_table(rows, best.result.iteration_ms))
    win = best_plan(rows, best)
    if win is None:
        return best, None
    if not a.plan_out:
        print(f"     the best plan beats {best.label}: give --plan-out FILE to write it and launch it "
              f"(degrees {win.plan['compact']}); the launch below is the best uniform strategy")
        return best, None
    from ...plan.plan_file import write_plan

    write_plan(a.plan_out, win.plan)
    print(f"plan: {a.plan_out} ({win.planned.label}, degrees {win.plan['compact']})")
    return win.planned, a.plan_out


def _predict(a: argparse.Namespace, profile: ProfileDB | None, train_argv: list[str]) -> int:
    from ...train_args import build_parser as train_parser
    from .predict import predict_train_step
    from ..core.timeline import summary_table

    if profile is None:
        raise SimError("--predict needs --profile (measure one with `megatron-oases profile -- <train flags>`)")
    if not train_argv:
        raise SimError("--predict needs the trainer's flags after `--`")
    targs = train_parser().parse_args(train_argv)
    # The world size: the trainer's --nproc-per-node, else the topology's (sim's or the trainer's).
    name = a.topology or targs.topology
    topo = _topology(argparse.Namespace(topology=name, nodes=a.nodes)) if name else None
    world = targs.nproc_per_node or (topo.world_size if topo else None)
    r = predict_train_step(targs, profile, world_size=world, topology=topo or a.topology)
    print(summary_table(r))
    loop = ""
    if any(is_loop_event(k) for k in profile.events_ms):  # measured by a trainer-flags profile
        with_loop = predict_train_step(targs, profile, world_size=world, topology=topo or a.topology,
                                       loop_overhead=True).iteration_ms
        loop = f" ({with_loop:.1f} ms with the trainer's loop overhead the profile measured)"
    print(f"predicted step time: {r.iteration_ms:.1f} ms{loop}")
    _write_outputs(a, r)
    return 0
