"""Our flags on Megatron-LM's parser (``extra_args_provider``) and their validation.

``extra_args_provider(parser)`` adds the ``megatron_oases`` group (``--tp-backend``, ``--atp-mesh``,
``--atp-chunks``, ``--topology``, ``--schedule``, ``--oases-plan``) and the ``oases`` group of
``schedules.oases.options``: the entries of the flag table (``megatron_oases.flags``) that
Megatron-LM's parser lacks, declared there once for every front end, so help texts and defaults
live in one place; none of Megatron-LM's own flags (``--tensor-model-parallel-size`` ...) is
redefined.

Validation runs when the parser has parsed (Megatron-LM's ``parse_args`` calls
``parser.parse_args()``; the provider makes that call also validate), so a bad launch stops
before ``initialize_megatron`` with one line on rank 0 and exit status 2. The checks are ours
(``ParallelDims`` and the trainer's ``train_args.validate_backend_config``: ATP, 3-D, Oases and
plan checks) applied to the ``RunConfig`` of Megatron-LM's namespace (``trainer_view``). The
hook reads the namespace once (``run_config``) and writes our normalised values back onto it in
one place (``keep_on_megatron_args``): Megatron-LM hands its namespace, not our config, to the
model provider.

A stock run (``--tp-backend megatron --schedule default``, no ``--oases-plan``) keeps
Megatron-LM's own validation of sizes; only our flags are checked then (``--topology``, a stray
``--atp-mesh`` or Oases switch).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable

from megatron_oases.describe.backends import backend
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.dims import ParallelDims
from megatron_oases.run_config import RunConfig, megatron_ffn_hidden_size, mesh_search_shape, run_config
from megatron_oases.flags import option

def add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags to ``parser`` (Megatron-LM's, or any parser without them); returns it: the
    flag table's entries Megatron-LM lacks (``flags.MEGATRON_LM_ADDITIONS``), the Oases switches
    in their own group."""
    from megatron_oases.flags import MEGATRON_LM_ADDITIONS, add_flags as add_table_flags
    from megatron_oases.schedules.oases.options import OASES_FLAGS, add_oases_args

    group = parser.add_argument_group(
        "megatron_oases", "tensor-parallel backends, schedules and planning (docs/megatron_lm.md)")
    add_table_flags(group, [dest for dest in MEGATRON_LM_ADDITIONS if dest not in OASES_FLAGS])
    add_oases_args(parser)
    return parser


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


_EARLY_SHARED = ("tensor_model_parallel_size", "micro_batch_size", "num_experts", "expert_model_parallel_size")
"""Megatron-LM flags ``early_refusal`` reads, as the flag table declares them (Megatron-LM's
names); read only when given, since Megatron-LM's defaults are Megatron-LM's."""


def early_refusal(argv: list[str]) -> str | None:
    """The one-line refusal of what our flags decide alone, or None; no torch, no Megatron.

    Importing them takes 20-30 s on a loaded machine before Megatron-LM's parser answers, so the
    entry asks this first: argparse's errors for our flags (a bad choice or number), a stray
    ``--atp-mesh`` / ``--atp-chunks``, ``--atp-mesh`` against a given
    ``--tensor-model-parallel-size``, and ``--schedule oases`` against a given
    ``--micro-batch-size``. The rules are the trainer's (``train_args``, ``describe``); Megatron-LM's
    parse checks them again with everything else."""
    from megatron_oases.describe.ops import ModelingError
    from megatron_oases.describe.split import oases_splits, split_refusal
    from megatron_oases.flags import FLAGS
    from megatron_oases.train_args import validate_layout

    parser = add_flags(_RaisingParser(add_help=False, allow_abbrev=False))
    for dest in _EARLY_SHARED:
        parser.add_argument(FLAGS[dest].name, dest=dest, type=FLAGS[dest].type,
                            default=None)  # None: not given
    try:
        ns, _ = parser.parse_known_args(argv)
        tp, micro = ns.tensor_model_parallel_size, ns.micro_batch_size
        validate_layout(run_config(ns), None)  # a stray --atp-mesh / --atp-chunks; before the dims
        if ns.atp_mesh not in (None, "auto") and tp is not None:
            backend(ns.tp_backend).parse_layout(ns.atp_mesh, tp)  # the record's words (describe.backends)
        # only where the micro-batch is split (describe.split.oases_splits; Megatron-LM's TP and EP default 1)
        ep = (ns.expert_model_parallel_size or 1) if ns.num_experts else 1
        if oases_splits(tp or 1, oases=ns.schedule == "oases", expert_parallel=ep) and micro is not None \
                and split_refusal(micro):
            return split_refusal(micro)
    except (ConfigError, ModelingError) as exc:
        return str(exc)
    return None


def make_extra_args_provider(*others: Callable | None, stock_model: bool = True,
                             prog: str | None = None, on_cpu: bool = False) -> Callable:
    """An ``extra_args_provider`` that runs ``others`` (e.g. Megatron-LM's ModelOpt args) and then
    adds our flags, and makes the parser validate them after parsing. ``stock_model=False``: no
    Megatron-LM model provider (no checkout), so stock runs are our ``megatron`` build and are
    validated as such. ``prog``: the command errors and usage name, where argparse's default
    (the script's file name) is not what the user ran (``python -m ...``). ``on_cpu``: the CPU
    training layer is installed (``hooks.install_cpu_layer``); CUDA-only flags are refused."""

    def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if prog is not None:
            parser.prog = prog
        for other in others:
            if other is not None:
                parser = other(parser)
        add_flags(parser)
        from megatron_oases.mcore_compat import repair_help_strings

        repair_help_strings(parser)  # Megatron's own, where a release broke one (--help)
        return validating(parser, stock_model=stock_model, on_cpu=on_cpu)

    return extra_args_provider


extra_args_provider = make_extra_args_provider()
"""``pretrain(..., extra_args_provider=extra_args_provider)``: our flags, validated at parse."""


def validating(parser: argparse.ArgumentParser, *, stock_model: bool = True,
               on_cpu: bool = False) -> argparse.ArgumentParser:
    """Make ``parser.parse_args()`` / ``parse_known_args()`` also run ``validate_megatron_args``.

    argparse has no post-parse hook, so the parser's class becomes a subclass of its own whose
    ``parse_known_args`` (which ``parse_args`` calls) validates. A ConfigError, and argparse's own
    errors (an unknown flag, a bad value), print one line on rank 0 and exit with status 2 on
    every rank, before any process group exists.
    """
    base = type(parser)
    if getattr(base, "_oases_validating", False):
        return parser

    class _Validating(base):  # type: ignore[valid-type, misc]
        _oases_validating = True

        def parse_known_args(self, args=None, namespace=None):
            ns, extras = super().parse_known_args(args, namespace)
            try:
                cfg = validate_megatron_args(ns, defaults={a.dest: a.default for a in self._actions},
                                             stock_model=stock_model)
                keep_on_megatron_args(ns, cfg)
                if on_cpu:
                    check_cpu_run(cfg)
                announce(cfg, stock=stock_model and is_stock(cfg))
            except ConfigError as exc:
                self.error(str(exc))
            return ns, extras

        def error(self, message):  # argparse's own errors too (an unknown flag): once, not per rank
            if os.environ.get("RANK", "0") == "0":
                print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)

    _Validating.__name__ = _Validating.__qualname__ = f"OasesValidating{base.__name__}"
    parser.__class__ = _Validating
    return parser


_announced = False


def announce(cfg: RunConfig, stock: bool) -> None:
    """Once per process, on rank 0, when the parse has validated the run: ``specs.build_line``
    (the entries may parse twice). Here rather than in the model provider, which a stock run of a
    checkout on 0.19 never calls (``mcore_compat.run_pretrain``)."""
    global _announced
    if _announced or os.environ.get("RANK", "0") != "0":
        return
    _announced = True
    from megatron_oases.runtime.device import detect_runtime
    from megatron_oases.specs import build_line

    print(build_line(cfg, world=int(os.environ.get("WORLD_SIZE", "1")),
                     device=detect_runtime().device.type,  # the runtime layer's one choice
                     dist_backend=cfg.megatron_lm.distributed_backend, stock=stock), flush=True)


def check_cpu_run(cfg: RunConfig) -> None:
    """On CPU ranks: a flag that needs CUDA-only machinery, in one line
    (``runtime.cpu_training_compat.cpu_training_refusal``)."""
    from megatron_oases.runtime.cpu_training_compat import cpu_training_refusal

    refused = cpu_training_refusal(cfg.megatron_lm)
    if refused:
        raise ConfigError(refused)


def keep_on_megatron_args(args: argparse.Namespace, cfg: RunConfig) -> None:
    """Write the values our validation normalised onto Megatron-LM's namespace: the one place
    that edits it. Megatron-LM hands its namespace (``get_args()``), not our ``RunConfig``, to
    the model provider, which must find there the resolved ``--atp-mesh`` (``auto`` is searched
    once, here) and ``--oases-plan``'s block degrees. ``ffn_hidden_size`` is left to Megatron-LM's
    own ``validate_args``, which fills it in the same way."""
    args.atp_mesh = cfg.atp_mesh
    args.oases_layer_degrees = cfg.oases_layer_degrees


def is_stock(cfg: RunConfig) -> bool:
    """Stock Megatron-LM model and schedule: none of our backends or schedules selected."""
    return backend(cfg.tp_backend).megatron_modules and cfg.schedule == "default" and cfg.oases_plan is None


def _virtual_stages(cfg: RunConfig) -> int | None:
    vp = cfg.megatron_lm.num_virtual_stages_per_pipeline_rank
    per = cfg.num_layers_per_virtual_pipeline_stage
    if vp is None and per is not None and cfg.pipeline_model_parallel_size > 0:
        from megatron_oases.train_args import virtual_stages_of

        vp = virtual_stages_of(per, cfg.num_layers, cfg.pipeline_model_parallel_size)
    return vp if vp and vp > 1 else None


def trainer_view(cfg: RunConfig, world_size: int | None = None,
                 ) -> tuple[RunConfig, ParallelDims]:
    """The config of a Megatron-LM run as the reference trainer's validation sees it, and the
    validated degrees: ``ffn_hidden_size`` filled in as Megatron-LM will (a trainer flag
    Megatron-LM lacks has the trainer's default already, ``run_config``). ``world_size``
    defaults to WORLD_SIZE, as Megatron-LM's ``parse_args`` reads it.
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for dest, value in (("num_layers", cfg.num_layers), ("hidden_size", cfg.hidden_size),
                        ("num_attention_heads", cfg.num_attention_heads),
                        ("micro_batch_size", cfg.micro_batch_size)):
        if value is None:
            raise ConfigError(f"{option(dest)} is required")
    view = dataclasses.replace(cfg, sequence_parallel=bool(cfg.sequence_parallel))
    cp = cfg.megatron_lm.context_parallel_size or 1
    if world_size % cp:
        raise ConfigError(f"world size {world_size} is not divisible by --context-parallel-size {cp}")
    vp = _virtual_stages(cfg)
    pp = cfg.pipeline_model_parallel_size
    # Uneven pipeline splits are Megatron-LM's to check; ParallelDims wants equal stages.
    layers = pp * (vp or 1) if cfg.megatron_lm.uneven_pipeline else cfg.num_layers
    if cfg.ffn_hidden_size is None:  # Megatron-LM's default, set later by it
        view = dataclasses.replace(
            view, ffn_hidden_size=megatron_ffn_hidden_size(cfg.hidden_size, cfg.swiglu))
    dims = ParallelDims(world_size=world_size // cp, tp=cfg.tensor_model_parallel_size, pp=pp,
                        vp=vp, num_layers=layers, hidden_size=cfg.hidden_size,
                        num_attention_heads=cfg.num_attention_heads,
                        ffn_hidden_size=view.ffn_hidden_size)
    if cfg.global_batch_size is not None:
        dims.check_batch(cfg.micro_batch_size, cfg.global_batch_size)
    elif cfg.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size must be >= 1 (got {cfg.micro_batch_size})")
    return view, dims


def validate_megatron_args(args: argparse.Namespace, world_size: int | None = None,
                           defaults: dict | None = None, stock_model: bool = True) -> RunConfig:
    """Check our flags against Megatron-LM's args (TP size, sequence parallel, recompute, ...);
    returns the run's ``RunConfig`` as validated (``atp_mesh`` as ``(d1, d2)``, ``auto`` resolved
    from ``--topology``; ``oases_layer_degrees``; ``ffn_hidden_size`` as Megatron-LM fills it).
    ``args`` is read, never edited (``keep_on_megatron_args`` does that, at the hook).

    Raises ``ConfigError`` (one line naming the flag). ``defaults``:
    the parser's defaults (dest -> value), which tell a refused option that was set
    (``options.refusal``); None: Megatron-LM's own parser's, where it imports.
    ``stock_model=False``: no Megatron-LM model provider, so a stock run is our ``megatron``
    build (``options.builds_of``) and is checked like our other builds.
    """
    from megatron_oases.megatron_lm.options import refusal
    from megatron_oases.train_args import check_topology, validate_backend_config

    cfg = run_config(args)  # Megatron-LM's namespace, read once
    if cfg.topology is not None:
        check_topology(cfg.topology)
    check_checkpoint_paths(cfg)
    check_data_split(cfg)
    if is_stock(cfg) and stock_model:
        try:
            view, dims = trainer_view(cfg, world_size)
        except ConfigError:
            return cfg  # sizes of a stock run are Megatron-LM's to check, in its own words
        # stray --atp-mesh, --oases-* without --schedule oases; the MoE flags are Megatron-LM's
        return validate_backend_config(view, dims, ours=False)
    what = _build_named(cfg)
    # Megatron-LM's own options our builds refuse, read by name (RunConfig does not carry them)
    refused = refusal(args, cfg, megatron_lm_defaults() if defaults is None else defaults, what)
    if refused:
        raise ConfigError(refused)
    _check_non_stock(cfg, what)
    view, dims = trainer_view(cfg, world_size)
    if view.atp_mesh == "auto" and backend(cfg.tp_backend).layout_flag:
        view = dataclasses.replace(view, atp_mesh=resolve_auto_mesh(view, dims))
    view = validate_backend_config(view, dims)
    if cfg.recompute_granularity == "full" and cfg.recompute_num_layers is None:
        # Megatron-LM's TransformerConfig asks for it only after the process groups are up
        raise ConfigError("--recompute-granularity full needs --recompute-num-layers (Megatron-LM "
                          "asks for it): add --recompute-num-layers 1 with --recompute-method uniform")
    return view


def megatron_lm_defaults() -> dict:
    """Megatron-LM's parser defaults (dest -> default); {} where ``megatron.training`` does not
    import (then ``options.refusal`` counts a truthy option as set)."""
    global _MEGATRON_DEFAULTS
    if _MEGATRON_DEFAULTS is None:
        try:
            from megatron.training.arguments import add_megatron_arguments
        except ImportError:
            return {}
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        _MEGATRON_DEFAULTS = {a.dest: a.default for a in parser._actions}
    return _MEGATRON_DEFAULTS


_MEGATRON_DEFAULTS: dict | None = None


def _build_named(cfg: RunConfig) -> str:
    """The flag that makes this run one of our builds, as the refusals name it."""
    return (f"--tp-backend {cfg.tp_backend}" if not backend(cfg.tp_backend).megatron_modules
            else f"--schedule {cfg.schedule}" if cfg.schedule != "default"
            else option("oases_plan") if cfg.oases_plan is not None
            else "--tp-backend megatron without a Megatron-LM checkout (our megatron spec)")


def check_data_split(cfg: RunConfig) -> None:
    """``--data-path`` with ``--split`` (default 969,30,1) of any run through the entry: a split
    that rounds to no documents of a small corpus would hang Megatron-LM's dataset build at 100%
    CPU; refused in one line by the reference trainer's rule (``datasets``)."""
    if cfg.data_path and not cfg.mock_data:
        from megatron_oases.datasets import check_split_documents

        check_split_documents(cfg.data_path, cfg.split)


def check_checkpoint_paths(cfg: RunConfig) -> None:
    """``--save`` / ``--load`` / ``--ckpt-step`` of any run through the entry, before any process
    group: Megatron-LM would assert without a message (``--save`` without ``--save-interval``),
    fail at the first save (an unwritable ``--save``) or after start-up (a missing
    ``--ckpt-step``), or train from scratch on a mistyped ``--load``. A ``--load`` naming the
    ``--save`` directory keeps Megatron-LM's resume-when-present; object-store paths
    (``msc://...``) are left to Megatron. A checkpoint whose layer keys this run cannot load
    (``--oases-plan`` against a stock run's, ``ckpt_layout``) is refused too."""
    import os

    from megatron_oases.checkpoint import auto_resume, missing_step
    from megatron_oases.megatron_lm.ckpt_layout import check_layer_keys
    from megatron_oases.output_paths import check_output_root

    if cfg.save is not None:
        if "://" not in cfg.save:  # an object store (msc://) is Megatron's to reach
            check_output_root("--save", cfg.save)
        if cfg.save_interval is None or cfg.save_interval < 1:
            raise ConfigError(f"--save needs --save-interval N >= 1 (got {cfg.save_interval}): "
                              f"Megatron-LM saves every N iterations and at the end")
    if cfg.load is None or "://" in cfg.load:
        return
    if not os.path.isdir(cfg.load):
        if auto_resume(cfg):
            return
        raise ConfigError(f"--load {cfg.load}: no such directory (Megatron-LM would train from "
                          f"scratch); fix the path, or give --save the same directory to resume "
                          f"only when a checkpoint is there")
    if cfg.ckpt_step is not None and missing_step(cfg.load, cfg.ckpt_step):
        raise ConfigError(missing_step(cfg.load, cfg.ckpt_step))
    check_layer_keys(cfg.load, cfg.ckpt_step, per_layer_run=cfg.oases_plan is not None)


def _check_non_stock(cfg: RunConfig, what: str) -> None:
    """Megatron-LM features our backends / schedules do not build (``options``)."""
    mlm = cfg.megatron_lm
    if mlm.transformer_impl != "local":
        raise ConfigError(f"{what} builds torch layers, not Transformer Engine ones: pass "
                          f"--transformer-impl local (and run the stock baseline with "
                          f"--transformer-impl local too, for a comparison of TP schemes only)")
    _check_attention_backend(cfg, what)
    pos = cfg.position_embedding_type
    if pos not in ("learned_absolute", "rope", "none"):
        raise ConfigError(f"{what} builds GPTModel through megatron_oases.specs, which supports "
                          f"--position-embedding-type learned_absolute, rope or none; drop "
                          f"--position-embedding-type {pos}")
    if (mlm.context_parallel_size or 1) > 1:
        raise ConfigError(f"{what} does not support --context-parallel-size > 1 yet")
    if (cfg.schedule == "oases" and cfg.tp_backend == "atp"
            and mlm.overlap_param_gather):
        # The ATP tape calls the modules' parts, not the modules, so the DDP forward pre-hooks
        # that wait for each parameter's all-gather never fire: stale weights, silently.
        raise ConfigError("--schedule oases with --tp-backend atp does not run Megatron DDP's "
                          "forward pre-hooks, which --overlap-param-gather needs; drop "
                          "--overlap-param-gather")
    if cfg.schedule == "oases" and mlm.tp_comm_overlap:
        raise ConfigError("--schedule oases overlaps the TP collectives itself; drop "
                          "--tp-comm-overlap (Transformer Engine's userbuffer overlap)")


def _check_attention_backend(cfg: RunConfig, what: str) -> None:
    """``--attention-backend`` picks our builds' core attention (``layers/core_attention``).
    Megatron-LM's ``validate_args`` accepts ``local`` only with ``--spec local``: say so in one
    line before it asserts; and refuse a kernel the run cannot use (flash in fp32 on CUDA)."""
    import torch

    from megatron_oases.layers.core_attention import check_backend

    if cfg.attention_backend == "local" and cfg.megatron_lm.spec != ["local"]:
        raise ConfigError(f"{what} with --attention-backend local: Megatron-LM's validate_args "
                          f"accepts it only with --spec local (its local layer spec, which our "
                          f"builds use); add --spec local")
    check_backend(cfg.attention_backend, cuda=torch.cuda.is_available(), half=cfg.bf16 or cfg.fp16)


def resolve_auto_mesh(cfg: RunConfig, dims: ParallelDims) -> str:
    """``--atp-mesh auto``: ATP's mesh search on ``--topology`` for this model; returns "d1,d2"."""
    if cfg.topology is None:
        raise ConfigError("--atp-mesh auto needs --topology FILE (the cluster the mesh search "
                          "prices); or pass D1,D2 from `megatron-oases mesh`")
    from megatron_oases.describe.ops import ModelingError
    from megatron_oases.plan.atp_mesh import MeshError, search_mesh

    try:
        choice = search_mesh(cfg.topology, dims.tp, mesh_search_shape(cfg, dims.pp))
    except (MeshError, ModelingError) as exc:
        raise ConfigError(f"--atp-mesh auto: {exc}") from None
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron_oases: --atp-mesh auto picked {choice.pick.d1},{choice.pick.d2} on "
              f"{choice.topology} (predicted TP all-reduce {choice.pick.t_comm_s * 1e3:.2f} ms "
              f"per micro-batch step)", flush=True)
    return f"{choice.pick.d1},{choice.pick.d2}"
