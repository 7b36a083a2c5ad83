"""Flags of the reference trainer, named as in Megatron-LM, and their validation.

Validation runs before any process group exists, and every error is one line naming the flag and
the fix (``ConfigError``). Later issues add ``--tp-backend atp|3d`` and ``--schedule oases``.
"""
from __future__ import annotations

import argparse
import os

from megatron_oases.parallel.dims import ConfigError, ParallelDims

TP_BACKENDS = ("megatron", "atp", "3d")
SCHEDULES = ("default", "oases")


def build_parser(prog: str = "megatron-oases train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Reference GPT pretraining loop on Megatron-Core (GPTModel, Megatron DDP and "
                    "optimizer, get_forward_backward_func). The stock baseline every "
                    "megatron_oases feature is compared against. Runs on CUDA+NCCL or CPU+gloo.")
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="spawn this many local ranks (omit under torchrun / srun, which set RANK "
                        "and WORLD_SIZE)")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu (gloo)")
    g.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds before a hung collective (or spawned run) is aborted")
    g.add_argument("--topology", default=None,
                   help="cluster topology YAML (file or shipped example name); validated at start")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="enables the interleaved 1F1B schedule")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--tp-backend", choices=TP_BACKENDS, default="megatron",
                   help="tensor-parallel layer implementation: megatron = stock 1-D TP, "
                        "atp = ATP's 2-D device mesh inside the TP group (needs --atp-mesh)")
    g.add_argument("--atp-mesh", default=None, metavar="D1,D2|auto",
                   help="ATP DeviceMesh(d1, d2) with d1 x d2 = TP size (d2 is the fastest-"
                        "varying, innermost axis); auto picks it from --topology with the search "
                        "`megatron-oases mesh` prints")
    g.add_argument("--atp-chunks", type=int, choices=(1, 2, 4), default=1,
                   help="ATP chunk-based overlap: split the batch into this many chunks")
    g.add_argument("--schedule", choices=SCHEDULES, default="default",
                   help="executor of the TP layers: default = Megatron's sequential one; oases = "
                        "two sub-batches per micro-batch whose TP collectives overlap the other's "
                        "compute (see the oases group)")
    from megatron_oases.plan.plan_file import PLAN_HELP

    g.add_argument("--oases-plan", default=None, metavar="FILE", help=PLAN_HELP)
    from megatron_oases.schedules.oases.options import add_oases_args

    add_oases_args(p)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: --seq-length")
    g.add_argument("--vocab-size", type=int, default=1024,
                   help="token ids 0..V-1 of the data, synthetic or --data-path/--mock-data "
                        "(padded as Megatron does)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--no-tp-invariant-init", dest="tp_invariant_init", action="store_false",
                   help="keep Megatron's own init (depends on TP/PP); by default every parameter "
                        "is drawn from (seed, global name) so all layouts start identical")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="Megatron's optimizer; sgd keeps parity runs free of Adam's amplification "
                        "of float noise in near-zero gradients")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 params (Float16Module); CUDA only")
    g.add_argument("--fp16", action="store_true", help="fp16 params with loss scaling; CUDA only")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    from megatron_oases.datasets import add_data_args

    add_data_args(p)
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-json", default=None,
                   help="also write one JSON object per iteration to this file")
    return p


def world_size_of(args: argparse.Namespace) -> int:
    """Ranks this run will have: --nproc-per-node when spawning, else the launcher's WORLD_SIZE."""
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1 (got {args.nproc_per_node})")
        return args.nproc_per_node
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_args(args: argparse.Namespace, world_size: int, cuda: bool) -> ParallelDims:
    """Check every flag and combination; returns the validated ``ParallelDims``."""
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    vp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // max(args.pipeline_model_parallel_size, 1)
        if (args.num_layers_per_virtual_pipeline_stage < 1
                or per_stage % args.num_layers_per_virtual_pipeline_stage != 0):
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}"
                f" must divide the {per_stage} layers of each pipeline stage")
        vp = per_stage // args.num_layers_per_virtual_pipeline_stage
    dims = ParallelDims(
        world_size=world_size, tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size, vp=vp, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size)
    n_micro = dims.check_batch(args.micro_batch_size, args.global_batch_size)
    if vp is not None and n_micro % dims.pp != 0:
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches ({n_micro}) to be a "
            f"multiple of --pipeline-model-parallel-size {dims.pp}; raise --global-batch-size")
    if args.max_position_embeddings < args.seq_length:
        raise ConfigError(f"--max-position-embeddings {args.max_position_embeddings} is smaller "
                          f"than --seq-length {args.seq_length}")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    if (args.bf16 or args.fp16) and not cuda:
        flag = "--bf16" if args.bf16 else "--fp16"
        raise ConfigError(f"{flag} needs CUDA: Megatron's mixed-precision optimizer accepts only "
                          f"torch.cuda tensors; drop {flag} on CPU (fp32 runs there)")
    if args.use_distributed_optimizer and not cuda:
        raise ConfigError("--use-distributed-optimizer needs CUDA: Megatron's distributed "
                          "optimizer accepts only torch.cuda tensors; drop it on CPU")
    _validate_atp(args, dims)
    _validate_3d(args, dims)
    from megatron_oases.schedules.oases.options import validate_oases_args

    validate_oases_args(args, dims)
    from megatron_oases.plan.plan_file import validate_plan_args

    validate_plan_args(args, dims)
    if args.sequence_parallel and dims.tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel:
        from megatron_oases.runtime.optional import have

        if not (have("apex") or have("te")):
            raise ConfigError("--sequence-parallel needs Apex or Transformer Engine norms "
                              "(Megatron's torch LayerNorm refuses sequence parallelism); "
                              "install one or drop --sequence-parallel")
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method uniform|block")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1 if args.recompute_method == "uniform" else args.num_layers // dims.pp
        if args.recompute_num_layers < 1:
            raise ConfigError(f"--recompute-num-layers must be >= 1 (got {args.recompute_num_layers})")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        raise ConfigError("--recompute-method / --recompute-num-layers need "
                          "--recompute-granularity full")
    for flag, value in (("--hidden-dropout", args.hidden_dropout),
                        ("--attention-dropout", args.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1) (got {value})")
    for flag, value in (("--train-iters", args.train_iters), ("--seq-length", args.seq_length),
                        ("--vocab-size", args.vocab_size), ("--log-interval", args.log_interval)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    if args.topology is not None:
        from megatron_oases.topology import TopologyError, load_topology

        try:
            load_topology(args.topology)
        except (TopologyError, OSError) as exc:
            raise ConfigError(f"--topology: {exc}") from None
    from megatron_oases.datasets import validate_data_args

    validate_data_args(args)
    return dims


def _validate_atp(args: argparse.Namespace, dims: ParallelDims) -> None:
    """Parse --atp-mesh into (d1, d2) and check it against TP and the model.

    ``auto`` prices every mesh on ``--topology`` with ``megatron-oases mesh``'s search (ATP
    Eq. 2-4, ``plan.atp_mesh.search_mesh``) for this model and micro-batch, replaces the flag
    by the pick and prints it with its predicted time on rank 0. It runs before any process
    group exists; once resolved, a second validation (``train.setup``) sees D1,D2 and is silent.
    """
    if args.tp_backend != "atp":
        if args.atp_mesh is not None:
            raise ConfigError("--atp-mesh needs --tp-backend atp")
        return
    if args.atp_mesh is None:
        raise ConfigError("--tp-backend atp needs --atp-mesh D1,D2 (e.g. from `megatron-oases mesh`)")
    if args.atp_mesh == "auto":
        if args.topology is None:
            raise ConfigError("--atp-mesh auto needs --topology FILE (the cluster the meshes are "
                              "priced on), or pass --atp-mesh D1,D2")
        from megatron_oases.plan.atp_mesh import DEFAULT_MIN_GAIN, MeshError, ModelShape, search_mesh
        from megatron_oases.plan.mesh_cli import pick_summary
        from megatron_oases.topology import TopologyError, load_topology

        try:
            topology = load_topology(args.topology)
        except (TopologyError, OSError) as exc:
            raise ConfigError(f"--topology: {exc}") from None
        try:
            shape = ModelShape(hidden=args.hidden_size, layers=args.num_layers // dims.pp,
                               micro_batch=args.micro_batch_size, seq_length=args.seq_length,
                               bytes_per_element=2 if (args.bf16 or args.fp16) else 4)
            choice = search_mesh(topology, dims.tp, shape,
                                 min_gain=getattr(args, "atp_min_gain", DEFAULT_MIN_GAIN))
        except MeshError as exc:
            raise ConfigError(f"--atp-mesh auto on --topology {args.topology}: {exc}") from None
        args.atp_mesh = (choice.pick.d1, choice.pick.d2)
        import torch.distributed as dist

        rank0 = (dist.get_rank() == 0 if dist.is_available() and dist.is_initialized()
                 else os.environ.get("RANK", "0") == "0")
        if rank0:
            print(f"--atp-mesh auto: {pick_summary(choice)} (topology {topology.name}, tp={dims.tp}, "
                  f"h={shape.hidden} L={shape.layers} b={shape.micro_batch} s={shape.seq_length}; "
                  "`megatron-oases mesh` prints every mesh)", flush=True)
    if isinstance(args.atp_mesh, str):
        try:
            d1, d2 = (int(v) for v in args.atp_mesh.split(","))
        except ValueError:
            raise ConfigError(f"--atp-mesh must be D1,D2 (got {args.atp_mesh!r})") from None
        args.atp_mesh = (d1, d2)
    d1, d2 = args.atp_mesh
    if d1 < 1 or d2 < 1 or d1 * d2 != dims.tp:
        raise ConfigError(f"--atp-mesh {d1},{d2}: d1 x d2 = {d1 * d2} must equal "
                          f"--tensor-model-parallel-size {dims.tp}")
    if args.sequence_parallel:
        raise ConfigError("--tp-backend atp does not support --sequence-parallel yet; drop it")


def _validate_3d(args: argparse.Namespace, dims: ParallelDims) -> None:
    """--tp-backend 3d: TP is a cube p^3 (p >= 2); the model and micro-batch split over it."""
    if args.tp_backend != "3d":
        return
    from megatron_oases.parallel.cube import Cube

    try:
        p = Cube(tp_size=dims.tp).p
    except ConfigError as exc:
        raise ConfigError(f"--tp-backend 3d: {exc}") from None
    if p < 2:
        raise ConfigError("--tp-backend 3d needs --tensor-model-parallel-size = p^3 with p >= 2 "
                          f"(8, 27, 64, ...); got {dims.tp}")
    q = p * p
    for flag, value in (("--hidden-size", args.hidden_size),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value % q:
            raise ConfigError(f"--tp-backend 3d splits {flag} over p^2 = {q} ranks of the cube "
                              f"(--tensor-model-parallel-size {dims.tp}); {value} is not a multiple "
                              f"of {q}")
    if args.num_attention_heads % p:
        raise ConfigError(f"--tp-backend 3d splits heads over p = {p}: --num-attention-heads "
                          f"{args.num_attention_heads} is not a multiple of {p}")
    if args.micro_batch_size % q:
        raise ConfigError(f"--tp-backend 3d splits each micro-batch into p^2 = {q} blocks of whole "
                          f"sequences: --micro-batch-size {args.micro_batch_size} is not a multiple "
                          f"of {q}")
    if args.sequence_parallel:
        raise ConfigError("--tp-backend 3d does not support --sequence-parallel (its activations "
                          "are already split p^3 ways); drop it")


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Megatron's padding: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((args.vocab_size + multiple - 1) // multiple) * multiple
