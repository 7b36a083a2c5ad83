"""Flags of the Oases schedule, their validation, and the typed options the executor reads.

One place for the flags so the reference trainer and the Megatron-LM ``extra_args_provider`` add
the same ones. Validation runs before any process group exists; each error names the flag.

How Oases relates to Megatron's recompute flags:

* ``--recompute-granularity full`` (method ``uniform``): every layer of the stage is recomputed
  in backward. With ``--oases-fine-grained-recompute`` (default) the outputs of the forward
  all-reduces are saved as recompute boundaries, so recomputation issues no collective; with
  ``--no-oases-fine-grained-recompute`` only each layer's input is saved (Megatron's full
  recompute) and the recompute pass repeats the forward all-reduces.
* no recompute: the autograd graph of each sub-batch is kept, nothing is recomputed.
* ``--sequence-parallel`` (``--tp-backend megatron``): the overlapped collectives are the
  sequence all-gathers and reduce-scatters; fine-grained recompute saves their outputs.
* ``--recompute-granularity selective`` and ``--recompute-method block`` are refused: Oases
  replaces Megatron's recompute with its own per-layer form.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron_oases.describe.backends import BACKENDS, backend
from megatron_oases.describe.split import SUB_BATCHES, oases_splits, split_refusal, unsplit_refusal
from megatron_oases.errors import ConfigError
from megatron_oases.parallel.dims import ParallelDims
from megatron_oases.run_config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class OasesOptions:
    """What the Oases executor does for one model chunk."""

    recompute: bool
    """Recompute every layer in backward (from ``--recompute-granularity full``)."""
    fine_grained_recompute: bool = True
    """Save the forward collectives' outputs so recomputation issues no collective (§3.2)."""
    cross_pass: bool = True
    """Interleave one sub-batch's recompute with the other's backward across layers (§3.1);
    off: a barrier between the recompute and the backward pass of every layer."""
    sub_batches: int = SUB_BATCHES
    """Sub-batches of the Oases split this runner cuts its batch into (``describe.split``:
    ``sub_batches_at`` its degree)."""
    skip_collectives: bool = False
    """Benchmark only: launch no TP collective (wrong results), for the compute-only time of
    the perfect-overlap bound."""


def add_oases_args(parser: argparse.ArgumentParser) -> None:
    """The ``oases`` argument group (Table 3's ablation switches), for the trainer and Megatron-LM."""
    from megatron_oases.flags import add_flags

    g = parser.add_argument_group(
        "oases", f"Oases schedule (--schedule oases): {SUB_BATCHES} sub-batches per micro-batch, "
                 "fine-grained recompute, cross-pass recompute/backward overlap")
    add_flags(g, OASES_FLAGS)


OASES_FLAGS = ("oases_cross_pass", "oases_fine_grained_recompute", "oases_skip_tp_collectives")
"""The ``oases`` group's flags (declared in ``megatron_oases.flags``)."""


def validate_oases_config(cfg: RunConfig, dims: ParallelDims) -> None:
    """Refuse combinations the Oases schedule does not support, naming the flag."""
    off = [f"--no-oases-{name}" for name, on in (("cross-pass", cfg.oases_cross_pass),
                                                  ("fine-grained-recompute", cfg.oases_fine_grained_recompute))
           if not on]
    if cfg.schedule != "oases" and off:
        raise ConfigError(f"{off[0]} switches part of the Oases executor and has no effect with the "
                          f"default schedule; drop it or add --schedule oases")
    if not cfg.oases_fine_grained_recompute and cfg.recompute_granularity != "full":
        raise ConfigError("--no-oases-fine-grained-recompute chooses how Oases recomputes and has no "
                          "effect without --recompute-granularity full; drop it or add "
                          "--recompute-granularity full --recompute-method uniform")
    if not _splits(cfg, oases=True) and (off or cfg.oases_skip_tp_collectives):
        raise ConfigError(unsplit_refusal(off[0] if off else "--oases-skip-tp-collectives"))
    if cfg.schedule != "oases":
        if cfg.oases_skip_tp_collectives and (not backend(cfg.tp_backend).megatron_modules or cfg.sequence_parallel):
            raise ConfigError("--oases-skip-tp-collectives with the default schedule needs "
                              "--tp-backend megatron without --sequence-parallel (the Megatron "
                              "linears' switch would drop the sequence gathers and shrink the "
                              "compute); drop the flag or use --schedule oases")
        return
    if not backend(cfg.tp_backend).oases_tape:
        taped = " or ".join(name for name, b in BACKENDS.items() if b.oases_tape)
        raise ConfigError(f"--schedule oases does not support --tp-backend {cfg.tp_backend} "
                          f"yet (its layers are not described as tapes); use --tp-backend "
                          f"{taped} with it")
    if cfg.atp_chunks > 1:  # validation refuses it without --tp-backend atp (train_args.validate_layout)
        raise ConfigError(f"--atp-chunks {cfg.atp_chunks} cannot be combined with --schedule "
                          f"oases: Oases overlaps the ATP collectives with the other sub-batch "
                          f"instead; use --atp-chunks 1 with it")
    if oases_runs(cfg) and split_refusal(cfg.micro_batch_size):  # at TP 1 (dense) nothing splits
        raise ConfigError(split_refusal(cfg.micro_batch_size))
    if cfg.sequence_parallel and not backend(cfg.tp_backend).sequence_parallel:
        raise ConfigError(f"--schedule oases runs --sequence-parallel on --tp-backend megatron "
                          f"only, not {cfg.tp_backend}; drop --sequence-parallel")
    if cfg.selective_recompute:
        raise ConfigError(f"{cfg.selective_recompute_flag} cannot be combined with --schedule "
                          f"oases (Oases recomputes whole layers); use --recompute-granularity "
                          f"full or no recompute")
    if cfg.recompute_granularity == "full" and cfg.recompute_method != "uniform":
        raise ConfigError("--schedule oases recomputes every layer: use --recompute-method "
                          "uniform (block recomputes only some layers)")
    if cfg.recompute_granularity == "full" and cfg.recompute_num_layers not in (None, 1) \
            and oases_runs(cfg):
        raise ConfigError(f"--recompute-num-layers {cfg.recompute_num_layers} has no effect with "
                          f"--schedule oases, which recomputes layer by layer; use "
                          f"--recompute-num-layers 1 or drop it")


def oases_runs(cfg: RunConfig) -> bool:
    """Whether the Oases executor runs the layers: ``--schedule oases`` where the split happens
    for the whole TP group (``describe.split.oases_splits``, the rule ``sim`` and ``plan`` read
    too): TP > 1, or MoE layers over ``--expert-model-parallel-size`` > 1 (their all-to-alls to
    overlap). Otherwise, at TP 1, the layers run as stock ones (Megatron's own recompute
    included)."""
    return _splits(cfg, oases=cfg.schedule == "oases")


def _splits(cfg: RunConfig, *, oases: bool) -> bool:
    """``describe.split.oases_splits`` at the run's TP size and, for a model with MoE layers,
    its expert-parallel size."""
    return oases_splits(cfg.tensor_model_parallel_size, oases=oases,
                        expert_parallel=cfg.expert_model_parallel_size if cfg.num_experts else 1)


def oases_options_of(cfg: RunConfig) -> OasesOptions:
    """The executor's options for the run's flags."""
    return OasesOptions(recompute=cfg.recompute_granularity == "full",
                        fine_grained_recompute=cfg.oases_fine_grained_recompute,
                        cross_pass=cfg.oases_cross_pass,
                        skip_collectives=cfg.oases_skip_tp_collectives)
