"""One table of the flags more than one front end takes, and the parsers built from it.

``megatron-oases train``, ``sim``, ``profile``, ``plan``, ``mesh`` and our additions to
Megatron-LM's parser read the same run, so a flag they share is declared once, here: Megatron-LM's
name, the ``RunConfig`` field it fills (its ``dest``), type or action, choices, help, and the
default, read from that field (``run_config.DEFAULTS``), so every front end shows and uses the
same one. Each front end builds its parser by picking the flags it takes from the table
(``add_flags``), in the spirit of torchtitan's CLI generated from its config dataclasses; a flag
only one front end takes stays in that front end. ``megatron_lm=True`` marks the flags
Megatron-LM's parser lacks, which ``megatron_lm.flags`` adds to it from here. A flag Megatron-LM
does not have and no front end takes (``--fp32``) is declared with its ``refusal``: every front
end, Megatron-LM's parser included, refuses it with that one line (``Refused``).

A front end may add aliases (``--tp``), require a flag (``plan --topology``) or append a note to
its help, never change its name, ``dest``, default, type or choices:
``tests/test_flag_table.py`` builds every front end's parser and checks that, and that each
flag's name is written at most twice as a string literal in the package (use ``option(dest)``).

No heavy import here (no torch, no Megatron): the trainer's parse must not import torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from typing import Any

from megatron_oases.describe.backends import BACKENDS as TP_BACKENDS
from megatron_oases.describe.layout import BACKEND_FLAG
from megatron_oases.describe.core_attention import ATTENTION_BACKENDS, BACKEND_HELP
from megatron_oases.describe.split import SUB_BATCHES
from megatron_oases.run_config import DEFAULTS, SCHEDULES

_FIELD = object()


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: how argparse takes it, and the ``RunConfig`` field (``dest``) it fills."""

    name: str
    """Megatron-LM's spelling (``--tensor-model-parallel-size``)."""
    dest: str
    """The ``RunConfig`` field it fills (or, for a pricing flag, the namespace name)."""
    help: str | None = None
    type: Any = None
    action: Any = None
    choices: tuple | None = None
    metavar: str | None = None
    nargs: Any = None
    """argparse's ``nargs`` where Megatron-LM's parser takes a list (``--moe-aux-loss-coeff``)."""
    default: Any = _FIELD
    """Only for a flag that fills no ``RunConfig`` field; else ``DEFAULTS.<dest>``."""
    megatron_lm: bool = False
    """Megatron-LM's parser lacks it: ``megatron_lm.flags`` adds it."""
    refusal: str | None = None
    """A flag no front end takes (Megatron-LM has no such flag), declared so that every front end
    refuses it alike: argparse's error with this text, which names the fix (``Refused``)."""

    @property
    def default_value(self) -> Any:
        return getattr(DEFAULTS, self.dest) if self.default is _FIELD else self.default

    def kwargs(self) -> dict[str, Any]:
        """``add_argument``'s keywords (argparse's store_true / store_false carry their own type)."""
        if self.refusal is not None:
            return {"dest": self.dest, "action": Refused, "why": self.refusal}
        kw = {"dest": self.dest, "default": self.default_value, "help": self.help, "type": self.type,
              "action": self.action, "choices": self.choices, "metavar": self.metavar, "nargs": self.nargs}
        return {k: v for k, v in kw.items() if v is not None or k == "default"}


def _bool(name: str, dest: str, help: str | None = None, **kw) -> Flag:
    """A switch: ``store_true`` for a False field, ``store_false`` (``--disable-...``) for a True one."""
    return Flag(name, dest, help, action="store_false" if getattr(DEFAULTS, dest) else "store_true", **kw)


_TABLE = (
    # -- launch
    Flag("--nproc-per-node", "nproc_per_node", type=int,
         help="ranks per node of the launch (the trainer spawns them; omit under torchrun / srun, which set "
              "RANK and WORLD_SIZE)"),
    Flag("--device", "device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu (gloo)"),
    Flag("--topology", "topology", metavar="FILE", megatron_lm=True,
         help="cluster topology YAML (a file or a shipped example name)"),
    # -- parallelism
    Flag("--tensor-model-parallel-size", "tensor_model_parallel_size", type=int, help="TP group size"),
    Flag("--pipeline-model-parallel-size", "pipeline_model_parallel_size", type=int, help="pipeline stages"),
    Flag("--data-parallel-size", "data_parallel_size", type=int, default=None,
         help="the launch's data-parallel size (Megatron-LM derives it: world / (TP x PP)); default: the "
              "ranks the topology leaves"),
    Flag("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage", type=int,
         help="enables the interleaved 1F1B schedule"),
    _bool("--sequence-parallel", "sequence_parallel",
          help="Megatron's sequence parallelism (--tp-backend megatron): all-gathers and reduce-scatters "
               "instead of all-reduces, norms and residual on s/t tokens"),
    _bool("--use-distributed-optimizer", "use_distributed_optimizer",
          help="Megatron's distributed optimizer: optimizer states sharded over data-parallel ranks"),
    _bool("--overlap-grad-reduce", "overlap_grad_reduce",
          help="data-parallel gradient reduction per bucket, overlapping the last micro-batch's backward"),
    # -- backend, layout and executor
    Flag(BACKEND_FLAG, "tp_backend", choices=TP_BACKENDS, megatron_lm=True,  # the records, live
         help="tensor-parallel layer implementation: " + "; ".join(
             f"{name} = {b.summary}" for name, b in TP_BACKENDS.items())
         + " (atp needs --atp-mesh; 3d needs --tensor-model-parallel-size p^3)"),
    Flag(TP_BACKENDS["atp"].layout_flag, "atp_mesh", metavar="D1,D2|auto", megatron_lm=True,
         help="ATP DeviceMesh(d1, d2) with d1 x d2 = TP size (d2 is the fastest-varying, innermost "
              "axis); auto picks it from --topology with the search `megatron-oases mesh` prints"),
    Flag("--atp-chunks", "atp_chunks", type=int, choices=(1, 2, 4), megatron_lm=True,
         help="ATP chunk-based overlap: split the batch into this many chunks"),
    Flag("--schedule", "schedule", choices=SCHEDULES, megatron_lm=True,
         help=f"executor of the transformer layers: default = Megatron's sequential one; oases = {SUB_BATCHES} "
              "sub-batches per micro-batch, each one's TP collectives (and, over MoE layers with "
              "--moe-token-dispatcher-type alltoall, its expert-parallel all-to-alls) overlapping the "
              "other's compute; at --tensor-model-parallel-size 1 a dense model's layers run as stock ones"),
    Flag("--oases-plan", "oases_plan", metavar="FILE", megatron_lm=True,
         help="run the per-block TP degrees of a plan written by `megatron-oases plan` (attention and MLP "
              "blocks of degree t < T run on TP sub-groups of t ranks, each replica on its slice of the "
              "micro-batch; works with --schedule default and oases); needs --tp-backend megatron"),
    Flag("--oases-cross-pass", "oases_cross_pass", action=argparse.BooleanOptionalAction, megatron_lm=True,
         help="overlap one sub-batch's recompute with the other's backward across layer boundaries (off: a "
              "barrier between each layer's recompute and backward pass)"),
    Flag("--oases-fine-grained-recompute", "oases_fine_grained_recompute",
         action=argparse.BooleanOptionalAction, megatron_lm=True,
         help="with --recompute-granularity full: save each forward all-reduce's output so recomputation "
              "starts after it and issues no collective (off: Megatron-style full recompute from each "
              "layer's input)"),
    _bool("--oases-skip-tp-collectives", "oases_skip_tp_collectives", megatron_lm=True,
          help="benchmark only: the transformer layers launch no TP collective (with --schedule oases: the "
               "executor's; with the default schedule: the Megatron linears'), to time compute alone (the "
               "perfect-overlap bound, the executor-overhead benchmark); losses are wrong"),
    # -- model
    Flag("--num-layers", "num_layers", type=int),
    Flag("--hidden-size", "hidden_size", type=int),
    Flag("--ffn-hidden-size", "ffn_hidden_size", type=int,
         help="default 4 x hidden size; with --swiglu Megatron-LM's int(4h x 2/3 / 64) x 64"),
    Flag("--num-attention-heads", "num_attention_heads", type=int),
    Flag("--seq-length", "seq_length", type=int),
    Flag("--vocab-size", "vocab_size", type=int,
         help="token ids 0..V-1, padded as Megatron pads it (a multiple of --make-vocab-size-divisible-by, "
              "x TP unless the TP-invariant init)"),
    Flag("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by", type=int,
         help="pad the vocabulary to a multiple of this"),
    Flag("--normalization", "normalization", choices=("LayerNorm", "RMSNorm")),
    Flag("--position-embedding-type", "position_embedding_type", choices=("learned_absolute", "rope", "none"),
         help="as Megatron-LM: learned absolute positions, rotary embeddings (RoPE) or none"),
    Flag("--rotary-base", "rotary_base", type=int, help="RoPE base (rope only)"),
    Flag("--rotary-percent", "rotary_percent", type=float,
         help="part of each head's dimension that RoPE rotates, in (0, 1] (rope only)"),
    _bool("--swiglu", "swiglu",
          help="gated linear unit with SiLU (SwiGLU) MLP; --ffn-hidden-size then defaults to Megatron-LM's "
               "int(4h x 2/3 / 64) x 64"),
    _bool("--group-query-attention", "group_query_attention",
          help="grouped-query attention with --num-query-groups key/value groups"),
    Flag("--num-query-groups", "num_query_groups", type=int,
         help="key/value groups under --group-query-attention (Megatron-LM's default 1)"),
    _bool("--disable-bias-linear", "add_bias_linear", help="linears without bias (Llama-style)"),
    _bool("--qk-layernorm", "qk_layernorm", help="normalise queries and keys per head (--normalization's kind)"),
    Flag("--hidden-dropout", "hidden_dropout", type=float),
    Flag("--attention-dropout", "attention_dropout", type=float),
    Flag("--attention-backend", "attention_backend", choices=ATTENTION_BACKENDS, help=BACKEND_HELP),
    _bool("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
    # -- mixture of experts (the trainer and Megatron-LM's parser; moe.py checks them)
    Flag("--num-experts", "num_experts", type=int, help="experts per MoE layer (omit: dense MLPs)"),
    Flag("--moe-router-topk", "moe_router_topk", type=int, help="experts each token is routed to"),
    Flag("--expert-model-parallel-size", "expert_model_parallel_size", type=int,
         help="expert-parallel (EP) group size: the experts are split over EP ranks"),
    Flag("--moe-token-dispatcher-type", "moe_token_dispatcher_type", choices=("allgather", "alltoall", "flex"),
         help="how routed tokens reach their experts' ranks"),
    Flag("--moe-aux-loss-coeff", "moe_aux_loss_coeff", type=float, nargs="+",
         help="load-balancing loss coefficient (one per --moe-router-load-balancing-type)"),
    Flag("--moe-router-load-balancing-type", "moe_router_load_balancing_type", nargs="+",
         choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
         help="the router's load balancing: aux_loss (GShard), seq_aux_loss (per sample), global_aux_loss, "
              "sinkhorn, none; several: one loss each"),
    Flag("--moe-ffn-hidden-size", "moe_ffn_hidden_size", type=int,
         help="each expert's FFN width (default: --ffn-hidden-size)"),
    Flag("--moe-layer-freq", "moe_layer_freq", type=int,
         help="one MoE layer every N layers (layers 0, N, 2N...; the others dense)"),
    Flag("--moe-expert-capacity-factor", "moe_expert_capacity_factor", type=float,
         help="tokens an expert takes, as a factor of the even share (omit: dropless)"),
    _bool("--moe-grouped-gemm", "moe_grouped_gemm", help="the local experts as one grouped GEMM"),
    # -- batch and precision
    Flag("--micro-batch-size", "micro_batch_size", type=int),
    Flag("--global-batch-size", "global_batch_size", type=int,
         help="samples per iteration: micro-batch x data-parallel size x micro-batches"),
    _bool("--bf16", "bf16", help="bf16 params (Float16Module), fp32 main params and gradient reduction"),
    _bool("--fp16", "fp16", help="fp16 params with loss scaling"),
    Flag("--fp32", "fp32", default=None, megatron_lm=True,  # was sim's and profile's own switch
         refusal="is not a Megatron-LM flag: a run without --bf16 / --fp16 is fp32 in every tool; drop it "
                 "(sim and plan also take --dtype fp32)"),
    # -- recompute
    Flag("--recompute-granularity", "recompute_granularity", choices=("full", "selective"),
         help="as Megatron: full (with --recompute-method) reruns whole layers; selective reruns each "
              "layer's core attention"),
    Flag("--recompute-method", "recompute_method", choices=("uniform", "block"),
         help="with --recompute-granularity full: uniform (every layer) or block (the first "
              "--recompute-num-layers of each chunk)"),
    Flag("--recompute-num-layers", "recompute_num_layers", type=int),
    # -- pricing (the simulator's and the planner's)
    Flag("--dtype", "dtype", choices=("bf16", "fp16", "fp32"), default=None,
         help="element type of the priced run, for a run not written as a launch (a launch's --bf16 / "
              "--fp16 say it; neither and no --dtype: fp32, as Megatron-LM)"),
    Flag("--gpu", "gpu", default=None, help="GPU model of the device model (default: the topology's device)"),
    Flag("--memory-gb", "memory_gb", type=float, default=None, help="device memory, GiB (default: the GPU's)"),
    Flag("--profile", "profile", default=None, metavar="DB.json",
         help="ProfileDB JSON of measured event times (`megatron-oases profile`)"),
    # Megatron-LM's flag from 3f65246 (2021-09-02) to core_v0.15; megatron-core 0.16+ lacks it, so the
    # trainer and Megatron-LM's parser refuse it (unrecognized) and only the simulator takes it.
    Flag("--no-async-tensor-model-parallel-allreduce", "async_tensor_model_parallel_allreduce",
         action="store_false", default=True,
         help="describe an older Megatron-LM: its column-parallel linears all-reduce the input gradient after "
              "the weight gradient instead of beside it (every Megatron-LM before NVIDIA/Megatron-LM cf7efd4, "
              "2021-08-30, e.g. v2.6)"),
)

FLAGS: dict[str, Flag] = {f.dest: f for f in _TABLE}
"""The table by ``dest``."""

MEGATRON_LM_ADDITIONS = tuple(f.dest for f in _TABLE if f.megatron_lm)
"""The flags ``megatron_lm.flags`` adds to Megatron-LM's parser (the others are Megatron-LM's own)."""


def option(dest: str) -> str:
    """The flag that fills ``dest``, as users spell it: the table's name (a front end's own flag:
    ``dest`` with dashes). For messages and command lines, so a name is written once."""
    return FLAGS[dest].name if dest in FLAGS else "--" + dest.replace("_", "-")


def add_flag(group, dest: str, *aliases: str, note: str = "", required: bool = False) -> argparse.Action:
    """Add the table's flag ``dest`` to ``group`` (a parser or argument group); ``aliases``: other
    spellings it also takes, ``note``: appended to its help for this front end."""
    flag = FLAGS[dest]
    kw = flag.kwargs()
    if note:
        kw["help"] = f"{kw['help']}; {note}" if kw.get("help") else note
    if required:
        kw["required"] = True
    return group.add_argument(flag.name, *aliases, **kw)


def add_flags(group, dests: Iterable[str]) -> None:
    """Add each of the table's flags ``dests`` to ``group``, in that order."""
    for dest in dests:
        add_flag(group, dest)


class Renamed(argparse.Action):
    """A flag that was renamed: one line naming the new one (argparse's exit 2), not a silent alias."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


class Refused(argparse.Action):
    """A flag the table refuses (``Flag.refusal``): one line naming the fix (argparse's exit 2),
    hidden from ``--help``."""

    def __init__(self, option_strings, dest, why: str, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.why}")


class RecordsGiven:
    """Parser mixin: the namespace's ``given`` holds the ``dest`` of every flag the command line
    gave (``given_dests``), so a front end can tell a flag given at its default from one absent."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        ns, extras = super().parse_known_args(args, namespace)
        ns.given = given_dests(self, args)
        return ns, extras


def given_in(ns: argparse.Namespace) -> set[str] | None:
    """The flags a ``RecordsGiven`` parser recorded as given in ``ns``; None for a namespace from
    elsewhere (built by hand, or by another parser)."""
    from megatron_oases.run_config import options_present

    return options_present(ns, ("given",)).get("given")


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The ``dest`` of every flag ``argv`` gives, even at its default value: where a given flag
    wins over another source (``plan --model``'s file) and its absence must be told from its
    default. ``argv`` must already parse."""
    saved = [(a, a.default, a.required) for a in parser._actions]
    try:
        for a, _, _ in saved:
            a.default, a.required = argparse.SUPPRESS, False
        ns, _ = argparse.ArgumentParser.parse_known_args(parser, argv)  # not a subclass's hook
    finally:
        for a, default, required in saved:
            a.default, a.required = default, required
    return set(vars(ns))


def filled_recompute_num_layers(cfg, stage_layers: int | None, error: type[Exception] = ValueError) -> int | None:
    """Megatron's pairing of the recompute flags, one home for the trainer, ``plan`` and ``sim``:
    ``--recompute-method`` / ``--recompute-num-layers`` need ``--recompute-granularity full``,
    which needs a method; the layers must be >= 1 and default to 1 (uniform) or the stage's
    ``stage_layers`` (block; None where the caller does not know the stage). Returns the filled
    ``--recompute-num-layers`` (None without full recompute); ``error``: the caller's one-line
    error class. ``cfg``: a ``RunConfig`` or a front end's namespace (the same three fields)."""
    gran, meth, num = (option(d) for d in ("recompute_granularity", "recompute_method", "recompute_num_layers"))
    if cfg.recompute_granularity != "full":
        if cfg.recompute_method is not None or cfg.recompute_num_layers is not None:
            raise error(f"{meth} / {num} need {gran} full")
        return None
    if cfg.recompute_method is None:
        raise error(f"{gran} full needs {meth} uniform|block")
    n = cfg.recompute_num_layers
    if n is not None and n < 1:
        raise error(f"{num} must be >= 1 (got {n})")
    if n is None:
        return 1 if cfg.recompute_method == "uniform" else stage_layers
    return n
