"""Megatron-LM checkpoints for the reference trainer: ``--save/--save-interval/--load``.

Layout as Megatron-LM: ``DIR/iter_0000003/`` written by Megatron's ``dist_checkpointing``
(torch_dist) and ``DIR/latest_checkpointed_iteration.txt``. The state is Megatron's
``sharded_state_dict`` of the model chunks and the optimizer, so any layout, backend or schedule
can load any other's checkpoint of the same model; plus the iteration, the run's flags and the
per-rank RNG states (Megatron-LM's ``rng_state`` ShardedObject). The distributed optimizer's
state is saved in Megatron's ``fully_reshardable`` format by default, which any layout loads,
with or without the distributed optimizer; its ``dp_reshardable`` format
(``--no-dist-ckpt-optim-fully-reshardable``) loads only into the same layout, and a load that
cannot work is refused before start-up.

A save is atomic: every rank writes into ``DIR/iter_N.tmp-TOKEN``; only after a barrier (all
shards and the metadata are on disk) does rank 0 rename it to ``iter_N`` and then replace the
latest file (tmp file + ``os.replace``). A crash before that leaves the previous checkpoint as
the one that loads; ``*.tmp-*`` directories are never read. ``--load`` checks the latest file,
the directory, ``metadata.json``, ``.metadata``, every shard file it names and the common state
(``common.pt`` up to megatron-core 0.18, an object inside the shard files from 0.19) and, with
``integrity.json`` (written by the save, last), every file's checksum before any process group
exists, and refuses a damaged checkpoint in one line (``runtime/ckpt_manifest.py``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings

from megatron_oases.errors import ConfigError, range_refusal
from megatron_oases.output_paths import check_output_root
from megatron_oases.run_config import DEFAULTS, RunConfig

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
CRASH_ENV = "MEGATRON_OASES_TEST_CRASH_IN_SAVE"
"""Test-only: ``"RANK:ITERATION"`` makes that rank ``os._exit`` inside that save, after its shards
and the metadata were written and before the rename (the crash the atomic save must survive)."""
PAUSE_ENV = "MEGATRON_OASES_TEST_PAUSE_IN_SAVE"
"""Test-only: ``"FROM_ITERATION:SECONDS"`` makes every rank sleep at the same point of each save
of that iteration or later (shards written, nothing published), so a test can signal the run
mid-save (tests/test_preemption.py)."""
# Flags that shape the parameters: a checkpoint loads only into the same model.
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "max_position_embeddings", "normalization", "untie_embeddings_and_output_weights",
               "position_embedding_type", "swiglu", "group_query_attention", "num_query_groups",
               "add_bias_linear", "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq")
_LATER_MODEL_FLAGS = {"position_embedding_type": "learned_absolute", "swiglu": False,
                      "group_query_attention": False, "num_query_groups": None,
                      "add_bias_linear": True, "qk_layernorm": False, "num_experts": None,
                      "moe_ffn_hidden_size": None, "moe_layer_freq": 1}
"""Model flags added after checkpoint_version 3.0 files were first written: a checkpoint without
them was saved with these values."""
# Flags of the layout: RNG states are per (PP, TP, DP) rank and reload only into the same one.
LAYOUT_FLAGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage", "tp_backend", "atp_mesh",
                "oases_layer_degrees", "expert_model_parallel_size")
_LATER_LAYOUT_FLAGS = {"expert_model_parallel_size": 1}
"""Layout flags added after checkpoints were first written: one saved without them had these."""
_TORCH_READER_NOTES = ("torch.distributed is disabled, unavailable or uninitialized",
                       "The argument order of load has been changed")
"""torch's notes when the common state is read (``no_dist``, before any process group, and from
0.19 inside Megatron's load too): nothing for the user to act on."""
_TORCH_DEPRECATIONS = ("`load_state_dict` is deprecated", "Please use DTensor instead",
                       "`torch.distributed.all_gather_into_tensor` is deprecated")


# How the optimizer state of a checkpoint is laid out: the plain (non-distributed) optimizer's,
# or one of the distributed optimizer's ``distrib_optim_sharding_type``s.
PLAIN = "plain"
FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"
_FORMAT_NAMES = {PLAIN: "the plain (non-distributed) optimizer's",
                 FULLY_RESHARDABLE: "the distributed optimizer's fully reshardable",
                 DP_RESHARDABLE: "the distributed optimizer's dp_reshardable"}


class CheckpointError(ConfigError):
    """A damaged, partial or mismatching checkpoint: one line naming the file or flag."""


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing (Megatron-LM's flags; docs/checkpoints.md)")
    g.add_argument("--save", metavar="DIR",
                   help="write checkpoints to DIR/iter_NNNNNNN (and at the end of training)")
    g.add_argument("--save-interval", type=int, metavar="N",
                   help="also save every N iterations")
    g.add_argument("--load", metavar="DIR",
                   help="resume from the checkpoint DIR/latest_checkpointed_iteration.txt names")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load the model only; the optimizer starts fresh")
    g.add_argument("--no-load-rng", action="store_true", help="keep this run's RNG seeds")
    g.add_argument("--ckpt-step", type=int, metavar="N",
                   help="load iteration N of --load instead of the latest")
    g.add_argument("--verify-integrity", action=argparse.BooleanOptionalAction,
                   default=DEFAULTS.verify_integrity,
                   help="write integrity.json (Megatron's: SHA-256 of each file) as the last "
                        "step of --save and check it before --load starts anything (default "
                        "here). The check reads the whole checkpoint once before start-up, about "
                        "1 GB/s per core; --no-verify-integrity skips both (for huge checkpoints)")
    g.add_argument("--ckpt-format", default=DEFAULTS.ckpt_format, metavar="FORMAT",
                   help="torch_dist (the only format)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="with --use-distributed-optimizer and --save: save the optimizer state in "
                        "Megatron's fully reshardable format (the default here: it resumes at any "
                        "DP/TP/PP size, backend and schedule, and with or without the distributed "
                        "optimizer); --no-dist-ckpt-optim-fully-reshardable saves Megatron-LM's "
                        "default dp_reshardable format instead (faster to save, but it resumes "
                        "only into the same layout with --use-distributed-optimizer)")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def validate_checkpoint_config(cfg: RunConfig, world_size: int) -> None:
    """Checkpoint flags, and the checkpoint ``--load`` names, before any process group
    (``world_size``: the ranks this run will have, as ``train_args.validate_config`` has it)."""
    if cfg.ckpt_format != "torch_dist":
        raise ConfigError(f"--ckpt-format {cfg.ckpt_format}: only torch_dist (Megatron "
                          "dist_checkpointing, reshardable) is supported; drop the flag")
    if cfg.save_interval is not None:
        if cfg.save is None:
            raise ConfigError("--save-interval needs --save DIR")
        if cfg.save_interval < 1:
            raise ConfigError(f"--save-interval must be >= 1 (got {cfg.save_interval})")
    check_output_root("--save", cfg.save)
    if cfg.dist_ckpt_optim_fully_reshardable is not None:
        flag = ("--" if cfg.dist_ckpt_optim_fully_reshardable else "--no-") + \
            "dist-ckpt-optim-fully-reshardable"
        if not cfg.use_distributed_optimizer or cfg.save is None:
            raise ConfigError(f"{flag} chooses how --save writes the distributed optimizer's "
                              "state: it needs --use-distributed-optimizer and --save DIR; drop it")
    if cfg.ckpt_step is not None and cfg.load is None:
        raise ConfigError("--ckpt-step needs --load DIR")
    for flag, given in (("--no-load-optim", cfg.no_load_optim), ("--no-load-rng", cfg.no_load_rng)):
        if given and cfg.load is None:
            raise ConfigError(f"{flag} chooses what --load restores and has no effect without it; "
                              f"drop it or add --load DIR")
    if not cfg.verify_integrity and cfg.save is None and cfg.load is None:
        raise ConfigError("--no-verify-integrity skips the checksums of --save and --load and has no "
                          "effect without either; drop it")
    if cfg.load is not None:
        found = find_checkpoint(cfg.load, missing_ok=auto_resume(cfg), step=cfg.ckpt_step)
        if found is not None:
            if cfg.verify_integrity and not _process_group():  # verified once, by the launcher
                _verify_integrity(cfg.load, *found)
            if found[0] >= cfg.train_iters and not auto_resume(cfg):
                # (--save naming the same directory: a requeued job that has finished; it exits 0)
                raise ConfigError(f"--train-iters {cfg.train_iters}: the checkpoint {found[1]} is at "
                                  f"iteration {found[0]}, so nothing would train; raise --train-iters "
                                  f"above {found[0]} or load an earlier --ckpt-step")
            state = read_common_state(found[1])
            check_same_model(dict(state["args"]), cfg, found[1])
            if not cfg.no_load_optim:
                check_optimizer_loads(state, cfg, found[1], world_size)


def auto_resume(cfg) -> bool:
    """``--save DIR --load DIR`` with nothing in DIR yet is Megatron-LM's resume-if-present."""
    return cfg.save is not None and os.path.abspath(cfg.save) == os.path.abspath(cfg.load)


def missing_step(root: str, step: int) -> str | None:
    """Why ``--ckpt-step step`` cannot load from ``root`` (a negative step, or its iteration
    directory is not there), or None."""
    saved = ', '.join(map(str, saved_iterations(root))) or 'none'
    if step < 0:  # iteration_dir would name iter_-000001
        return f"{range_refusal('--ckpt-step', step, 0)}: give an iteration saved in {root} ({saved})"
    path = iteration_dir(root, step)
    if os.path.isdir(path):
        return None
    return f"--ckpt-step {step}: {path} is missing (saved in {root}: {saved})"


def find_checkpoint(root: str, *, missing_ok: bool = False,
                    step: int | None = None) -> tuple[int, str] | None:
    """``(iteration, directory)`` of the checkpoint ``root``'s latest file names (or of iteration
    ``step``), checked for completeness; None when ``root`` holds no checkpoint and ``missing_ok``."""
    if step is not None:
        path = iteration_dir(root, step)
        if missing_step(root, step):
            raise CheckpointError(missing_step(root, step))
        check_checkpoint_files(path, f"--ckpt-step {step}")
        return step, path
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        done = saved_iterations(root)
        if missing_ok and not done:
            return None  # nothing saved yet (temporary directories of killed saves do not count)
        raise CheckpointError(f"--load {root}: no {tracker}" + (
            f" (but {os.path.basename(iteration_dir(root, done[0]))} is there: write its "
            "iteration into it)" if done else ""))
    try:
        with open(tracker, encoding="utf-8") as f:
            iteration = int(f.read().strip())
    except (OSError, UnicodeDecodeError, ValueError):
        raise CheckpointError(f"--load: {tracker} is unreadable or not an iteration number") from None
    path = iteration_dir(root, iteration)
    check_checkpoint_files(path, tracker)
    return iteration, path


def saved_iterations(root: str) -> list[int]:
    """The iterations saved in ``root``, latest first (not the ``.tmp-``/``.old-`` directories of
    interrupted saves)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((int(d[5:]) for d in names if d.startswith("iter_") and d[5:].isdigit()),
                  reverse=True)


def _process_group() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _verify_integrity(root: str, iteration: int, path: str) -> None:
    """Each file of the checkpoint against its ``integrity.json`` (``runtime/ckpt_manifest.py``),
    before any process group; a checkpoint without one (saved before megatron-oases wrote it, by
    Megatron-LM without ``--verify-integrity``, or with ``--no-verify-integrity``) loads with a
    note. Run by the launcher only: its ranks meet a checkpoint already verified."""
    from megatron_oases.runtime import ckpt_manifest

    if not ckpt_manifest.has_manifest(path):
        if os.environ.get("RANK", "0") == "0":
            print(f" --load: {path} has no {ckpt_manifest.MANIFEST} (saved without checksums): "
                  "its files are not verified", flush=True)
        return
    bad = ckpt_manifest.first_mismatch(path)
    if bad is None:
        return
    older = ", ".join(str(i) for i in saved_iterations(root) if i < iteration)
    fix = f" or load an older iteration with --ckpt-step N (saved here: {older})" if older \
        else " (no older iteration is saved here)"
    if bad[0].endswith(ckpt_manifest.MANIFEST):
        fix += ", or load it unverified with --no-verify-integrity"
    raise CheckpointError(f"--load {root}: {bad[0]} {bad[1]}; restore it from a copy of the "
                          f"checkpoint{',' if older else ''}{fix}")


def check_checkpoint_files(path: str, tracker: str = "") -> None:
    """Every file a torch_dist checkpoint needs is there and long enough (no process group)."""
    import json

    if not os.path.isdir(path):
        raise CheckpointError(f"--load: {path} is missing ({tracker} points at it)")
    config = os.path.join(path, "metadata.json")
    try:
        with open(config, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"--load: {config} is missing or corrupt") from None
    if backend != "torch_dist":
        raise CheckpointError(f"--load: {config} says format {backend!r}; only torch_dist loads")
    from torch.distributed.checkpoint import FileSystemReader

    dot_metadata = os.path.join(path, ".metadata")
    try:
        metadata = FileSystemReader(path).read_metadata()
        extents = {}
        for info in metadata.storage_data.values():
            end = info.offset + info.length
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    except Exception:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"--load: {dot_metadata} is missing or corrupt") from None
    common_state_location(path, metadata)
    for name, end in sorted(extents.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"--load: shard file {shard} is missing")
        if os.path.getsize(shard) < end:
            raise CheckpointError(f"--load: shard file {shard} is truncated "
                                  f"({os.path.getsize(shard)} of {end} bytes)")


def common_state_location(path: str, metadata=None) -> str:
    """Where the checkpoint in ``path`` keeps its common state (iteration, flags): its
    ``common.pt`` (written up to megatron-core 0.18), or the torch_dist ``common_state`` object
    (0.19 on: ``mcore_compat.common_state_in_torch_dist``), named by the shard file holding it.
    Refuses, in one line, a checkpoint with neither and a 0.19 one on an older megatron-core."""
    from megatron_oases import mcore_compat

    common = os.path.join(path, mcore_compat.COMMON_PT)
    if os.path.isfile(common):
        return common
    if metadata is None:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(path).read_metadata()
    if mcore_compat.COMMON_STATE_ITEM not in metadata.state_dict_metadata:
        raise CheckpointError(f"--load: {common} is missing (and {path}/.metadata has no "
                              f"{mcore_compat.COMMON_STATE_ITEM} item)")
    if not mcore_compat.common_state_in_torch_dist():
        from megatron.core.package_info import __version__

        raise CheckpointError(
            f"--load: {path} was saved by megatron-core 0.19 or newer (its common state is inside "
            f"the torch_dist files, there is no {mcore_compat.COMMON_PT}); this run has "
            f"megatron-core {__version__}: install megatron-core 0.19 or newer to load it")
    shards = {i.relative_path for k, i in metadata.storage_data.items()
              if k.fqn == mcore_compat.COMMON_STATE_ITEM}
    return os.path.join(path, min(shards)) + f" ({mcore_compat.COMMON_STATE_ITEM})"


def read_saved_args(path: str) -> dict:
    """The flags the checkpoint was saved with (``args`` of its common state, which is
    ``common.pt`` or, from megatron-core 0.19, an object in the torch_dist files)."""
    return dict(read_common_state(path)["args"])


def read_common_state(path: str) -> dict:
    """The checkpoint's common state (iteration, ``args``, Megatron's ``content_metadata``...),
    refused in one line when it is missing or corrupt."""
    from torch.distributed.checkpoint import CheckpointException

    from megatron_oases import mcore_compat

    where = common_state_location(path)
    try:
        with warnings.catch_warnings():
            for message in _TORCH_READER_NOTES:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            state = mcore_compat.load_common_state(path)
        state["args"] = dict(state["args"])  # a common state without flags is not ours
        return state
    # Unpickling errors have many types; torch's reader wraps them in CheckpointException,
    # a BaseException.
    except (Exception, CheckpointException):  # noqa: BLE001
        raise CheckpointError(f"--load: {where} is corrupt or was not written by "
                              "megatron-oases train") from None


def check_same_model(saved: dict, cfg, path: str) -> None:
    from megatron_oases.vocab import padded_vocab_size

    run = cfg.as_dict()
    for name in MODEL_FLAGS:
        theirs = saved.get(name, _LATER_MODEL_FLAGS.get(name))
        if theirs != run[name]:
            flag = "--disable-bias-linear (add_bias_linear)" if name == "add_bias_linear" \
                else "--" + name.replace("_", "-")
            raise CheckpointError(f"--load: {path} was saved with {flag} {theirs}, this "
                                  f"run has {run[name]}; use the checkpoint's model flags")
    ours = padded_vocab_size(cfg)
    theirs = padded_vocab_size(argparse.Namespace(**saved))
    if ours != theirs:
        raise CheckpointError(
            f"--load: {path} has a vocabulary padded to {theirs}, this run pads to {ours} "
            "(--vocab-size rounded up as megatron_oases.vocab.padded_vocab_size does); set "
            "--vocab-size / --make-vocab-size-divisible-by so both pad alike")


def saved_optimizer_format(state: dict) -> str:
    """How the checkpoint's optimizer state is laid out: ``plain``, or the distributed optimizer's
    ``distrib_optim_sharding_type`` that Megatron's ``content_metadata`` records. Checkpoints of
    the distributed optimizer without that metadata were saved dp_reshardable (before
    ``--dist-ckpt-optim-fully-reshardable``)."""
    if not dict(state["args"]).get("use_distributed_optimizer"):
        return PLAIN
    return (state.get("content_metadata") or {}).get("distrib_optim_sharding_type", DP_RESHARDABLE)


def _optimizer_layout(flags: dict) -> tuple:
    """What Megatron's dp_reshardable state depends on: the ranks' parameter buckets, which
    follow the layout and the DDP bucketing (``--overlap-grad-reduce``)."""
    return _layout(flags) + (("overlap_grad_reduce", bool(flags.get("overlap_grad_reduce"))),)


def check_optimizer_loads(state: dict, cfg, path: str, world_size: int) -> None:
    """Refuse, before start-up, an optimizer state this run cannot load.

    The plain optimizer's state and the distributed optimizer's ``fully_reshardable`` state are
    both keyed by the model's sharded tensors (``optimizer.state.exp_avg.<param>``), so either
    loads into any layout, with or without the distributed optimizer. ``dp_reshardable`` state
    is one flat tensor per parameter bucket of each data-parallel group: it loads only into the
    same layout with the distributed optimizer (Megatron-LM refuses it at another TP/PP size
    too)."""
    fmt = saved_optimizer_format(state)
    if fmt != DP_RESHARDABLE:
        return
    saved = dict(state["args"])
    run = dict(_plain_flags(cfg, world_size))
    if cfg.use_distributed_optimizer and _optimizer_layout(saved) == _optimizer_layout(run):
        return

    def describe(flags, distributed):
        tp = flags.get("tensor_model_parallel_size") or 1
        pp = flags.get("pipeline_model_parallel_size") or 1
        words = [f"TP{tp} PP{pp} DP{(flags.get('world_size') or 1) // (tp * pp)}"]
        words += [f"{k}={flags[k]}" for k in ("tp_backend", "atp_mesh", "oases_layer_degrees",
                                              "num_layers_per_virtual_pipeline_stage",
                                              "overlap_grad_reduce") if flags.get(k)]
        return ("distributed" if distributed else "plain") + " optimizer, " + " ".join(words)

    raise CheckpointError(
        f"--load {path}: its optimizer state is in {_FORMAT_NAMES[fmt]} format "
        f"({describe(saved, True)}), which loads only into that same layout with "
        "--use-distributed-optimizer; this run is "
        f"{describe(run, cfg.use_distributed_optimizer)}. "
        "Add --no-load-optim to load the model only (the optimizer starts fresh), or resume in the "
        "saved layout and save again with --dist-ckpt-optim-fully-reshardable")


def should_save(cfg, iteration: int) -> bool:
    return cfg.save is not None and (
        iteration == cfg.train_iters
        or (cfg.save_interval is not None and iteration % cfg.save_interval == 0))


def _plain_flags(cfg, world_size: int | None = None) -> dict:
    """The run's flags as plain values (the common state is read with ``weights_only``)."""
    import torch.distributed as dist

    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)

    out = {k: plain(v) for k, v in sorted(cfg.as_dict().items())}
    out["world_size"] = dist.get_world_size() if world_size is None else world_size
    return out


def _layout(flags: dict) -> tuple:
    return tuple((k, flags.get(k, _LATER_LAYOUT_FLAGS.get(k))) for k in LAYOUT_FLAGS)


def _rank0() -> bool:
    return __import__("torch.distributed").distributed.get_rank() == 0


def _content_metadata(tr, saved_format: str | None = None) -> dict:
    """Megatron's ``sharded_state_dict`` metadata, which ``save`` also records in the checkpoint
    (``content_metadata``, as Megatron-LM does).

    Per-layer keys (Megatron's ``non_homogeneous_layers``): a per-block plan gives layers
    different TP degrees, so their shards cannot stack on one key with a layer axis; every
    layout uses the same keys, so checkpoints stay interchangeable. No ChainedOptimizer prefix:
    the optimizer keys then depend on the parameters only, not on the optimizer grouping. The
    distributed optimizer saves ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``,
    the default) or ``dp_reshardable``, and loads the format the checkpoint names; from a plain
    optimizer's checkpoint it loads through ``fully_reshardable``, whose tensors carry the same
    keys."""
    metadata = {"non_homogeneous_layers": True, "chained_optim_avoid_prefix": True}
    if tr.cfg.use_distributed_optimizer:
        if saved_format is None:  # saving
            fully = tr.cfg.dist_ckpt_optim_fully_reshardable is not False
            metadata["distrib_optim_sharding_type"] = FULLY_RESHARDABLE if fully else DP_RESHARDABLE
        else:
            metadata["distrib_optim_sharding_type"] = \
                FULLY_RESHARDABLE if saved_format == PLAIN else saved_format
    return metadata


def _sharded_state(tr, iteration: int, *, optimizer: bool, rng: bool, is_loading: bool,
                   metadata: dict) -> dict:
    """Megatron-LM's checkpoint dict: ``model`` (or ``model0``, ``model1``.. per virtual stage),
    ``optimizer``, ``rng_state``, ``iteration``, ``args``, ``checkpoint_version``, and
    Megatron-LM's ``consumed_valid_samples`` (in its ``args`` there; ours are the flags)."""
    from megatron.core import parallel_state as ps

    from megatron_oases.parallel.layout import _unwrap

    state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "args": _plain_flags(tr.cfg), "consumed_valid_samples": tr.consumed_valid_samples}
    for i, chunk in enumerate(tr.model):
        key = "model" if len(tr.model) == 1 else f"model{i}"
        state[key] = _unwrap(chunk).sharded_state_dict(metadata=metadata)
    if optimizer:
        from megatron_oases.runtime.dist_ckpt import init_torch_adam_state, keep_empty_params_local

        keep_empty_params_local(state)
        if is_loading:
            init_torch_adam_state(tr.optimizer)
        else:
            adam_state_before_first_step(tr.optimizer)
        state["optimizer"] = tr.optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                             metadata=metadata)
        if is_loading:
            from megatron_oases.runtime.dist_ckpt import main_params_by_position

            main_params_by_position(state["optimizer"])
    if rng:
        from megatron_oases.runtime.dist_ckpt import rng_state

        state["rng_state"] = rng_state(ps.get_data_parallel_group(with_context_parallel=True))
    return state


def adam_state_before_first_step(optimizer) -> None:
    """Before a save, give each parameter of torch's Adam without a state the one Adam's first
    step creates (step 0, zero moments).

    Until a step is taken (``--fp16``: while the loss scaler skips every step) Adam has no
    state: a save then wrote no moments, which a load asks for (``KeyError: optimizer.state.
    exp_avg...``), and the distributed optimizer's save stopped on the missing step. Same values
    as Adam's own lazy start, so the run and a resume of it go on alike. Optimizers of Apex / TE
    (no ``torch.optim.Adam``) are left alone."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW too
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                state.setdefault("step", torch.tensor(0.0))
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def zero_adam_step_back(loaded) -> None:
    """Megatron saves the plain optimizer's Adam step (``common_step``) only when it is not 0, and
    torch's Adam refuses moments without one: a checkpoint saved before the first step (see
    ``adam_state_before_first_step``) gets its step 0 back before the load."""
    import torch

    if not isinstance(loaded, dict):
        return
    moments = loaded.get("state")
    if (isinstance(moments, dict) and "param_groups" in loaded and "common_step" not in moments
            and any(isinstance(v, dict) and "exp_avg" in v for v in moments.values())):
        moments["common_step"] = torch.tensor(0.0)
    for value in loaded.values():
        zero_adam_step_back(value)


def saved_valid_samples(common: dict, iteration: int) -> int:
    """The checkpoint's ``consumed_valid_samples`` (where validation goes on); for one saved
    before it was recorded, the validations its flags had made by ``iteration``."""
    if "consumed_valid_samples" in common:
        return int(common["consumed_valid_samples"])
    from types import SimpleNamespace

    from megatron_oases.datasets import validations_through

    saved = SimpleNamespace(**{k: common["args"].get(k) for k in (
        "eval_interval", "eval_iters", "train_iters", "global_batch_size")})
    return validations_through(saved, iteration) * (saved.eval_iters or 0) * \
        (saved.global_batch_size or 0)


def save_checkpoint(tr, iteration: int) -> str:
    """Save into ``--save``/iter_N atomically (see module docstring); returns that directory."""
    import torch.distributed as dist

    from megatron_oases.runtime import ckpt_manifest
    from megatron_oases.runtime.dist_ckpt import (dist_checkpointing,
                                                  fully_parallel_save_strategy, writer_in_this_rank)

    root = os.path.abspath(tr.cfg.save)
    final = iteration_dir(root, iteration)
    token = [f"{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(token, src=0)
    tmp = f"{final}.tmp-{token[0]}"
    if _rank0():
        print(f" saving checkpoint at iteration {iteration} to {root}", flush=True)
        os.makedirs(tmp)
    dist.barrier()
    metadata = _content_metadata(tr)
    state = _sharded_state(tr, iteration, optimizer=True, rng=True, is_loading=False,
                           metadata=metadata)
    with writer_in_this_rank():
        dist_checkpointing().save(state, tmp, fully_parallel_save_strategy(),
                                  content_metadata=metadata)
    _maybe_crash(iteration)
    dist.barrier()  # every rank's shards, the common state and the metadata are written
    if tr.cfg.verify_integrity:  # last: a save that stops before it publishes nothing
        ckpt_manifest.write_manifest(tmp)
    if _rank0():
        _publish(tmp, final, root, iteration, token[0])
    dist.barrier()
    return final


def _maybe_crash(iteration: int) -> None:
    import torch.distributed as dist

    since, _, pause = os.environ.get(PAUSE_ENV, "").partition(":")
    if pause and iteration >= int(since):
        print(f"{PAUSE_ENV}: pausing {pause} s inside the save of iteration {iteration}",
              file=sys.stderr, flush=True)
        time.sleep(float(pause))
    if os.environ.get(CRASH_ENV) == f"{dist.get_rank()}:{iteration}":
        print(f"{CRASH_ENV}: rank exits during the save of iteration {iteration}",
              file=sys.stderr, flush=True)
        os._exit(17)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _publish(tmp: str, final: str, root: str, iteration: int, token: str) -> None:
    """Rank 0, after every rank finished: rename into place, then replace the latest file."""
    for base, _, files in os.walk(tmp):
        for name in files:
            _fsync(os.path.join(base, name))
    _fsync(tmp)
    old = f"{final}.old-{token}" if os.path.exists(final) else None
    if old:  # saving an iteration again (e.g. after resuming)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(root)
    tracker_tmp = os.path.join(root, f"{TRACKER}.tmp-{token}")
    with open(tracker_tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _fsync(root)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(tr) -> int:
    """Load ``--load`` into the trainer; returns the iteration to continue after (0: none)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_oases.parallel.layout import _unwrap
    from megatron_oases.runtime.dist_ckpt import dist_checkpointing

    cfg = tr.cfg
    found = find_checkpoint(cfg.load, missing_ok=auto_resume(cfg), step=cfg.ckpt_step)
    if found is None:
        if _rank0():
            print(f" no checkpoint in {cfg.load} yet; starting from iteration 0", flush=True)
        return 0
    iteration, path = found
    common = read_common_state(path)
    saved = dict(common["args"])
    check_same_model(saved, cfg, path)
    saved_format = saved_optimizer_format(common)
    if not cfg.no_load_optim:
        check_optimizer_loads(common, cfg, path, dist.get_world_size())
    same_layout = _layout(saved) == _layout(_plain_flags(cfg))
    load_optim = not cfg.no_load_optim
    load_rng = not cfg.no_load_rng and same_layout
    if _rank0() and not cfg.no_load_rng and not same_layout:
        other = ", ".join(f"{k}={v}" for k, v in _layout(saved) if v is not None)
        print(f" {path} was saved with another layout ({other}); its RNG states are per rank "
              "and are not loaded", flush=True)
    metadata = _content_metadata(tr, saved_format)
    state = _sharded_state(tr, iteration, optimizer=load_optim, rng=load_rng, is_loading=True,
                           metadata=metadata)
    crossing = load_optim and (saved_format == PLAIN) == bool(cfg.use_distributed_optimizer)
    if crossing:
        from megatron_oases.runtime.dist_ckpt import optimizer_state_from_other_kind

        convert = optimizer_state_from_other_kind(tr.optimizer, state, saved)
    with warnings.catch_warnings():  # torch's deprecation notes on Megatron's reader calls
        for message in _TORCH_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        for message in _TORCH_READER_NOTES:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        loaded = dist_checkpointing().load(state, path)
    for i, chunk in enumerate(tr.model):
        _unwrap(chunk).load_state_dict(loaded["model" if len(tr.model) == 1 else f"model{i}"])
    if load_optim:
        import torch

        from megatron_oases.runtime.dist_ckpt import main_params_as_lists, restore_adam_steps

        main_params_as_lists(loaded["optimizer"], state["optimizer"])
        if crossing:
            loaded["optimizer"] = convert(loaded["optimizer"])

        from megatron_oases.runtime.dist_ckpt import adam_step_out_of_the_way

        zero_adam_step_back(loaded["optimizer"])
        # the distributed optimizer copies into its (grad-requiring) main params
        with torch.no_grad(), adam_step_out_of_the_way(tr.optimizer):
            tr.optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_steps(tr.optimizer, loaded["optimizer"])
    elif cfg.bf16 or cfg.fp16:
        tr.optimizer.reload_model_params()  # fp32 main params follow the loaded weights
    if load_rng:
        from megatron_oases.runtime.dist_ckpt import set_rng_state

        set_rng_state(loaded["rng_state"], ps.get_data_parallel_rank(with_context_parallel=True))
    tr.consumed_valid_samples = saved_valid_samples(common, iteration)
    dist.barrier()
    if _rank0():
        print(f" loaded checkpoint from {os.path.abspath(cfg.load)} at iteration {iteration}"
              + ("" if load_optim else " (model only: --no-load-optim)"), flush=True)
    return iteration

