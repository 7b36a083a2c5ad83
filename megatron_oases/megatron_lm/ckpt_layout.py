"""How a Megatron-LM torch_dist checkpoint keys its decoder layers, read before any process group.

Megatron-Core saves the layers of a stage stacked on one key with a layer axis
(``decoder.layers.mlp.linear_fc1.weight``), or, with ``hetereogenous_dist_checkpoint``, under one
key per layer (``decoder.layers.0.mlp.linear_fc1.weight``). ``--oases-plan`` runs need the
per-layer keys (their layers' shards differ in shape; ``model_provider``), so a plan run and a run
without a plan cannot load each other's checkpoints: Megatron-LM would fail inside
``dist_checkpointing.load`` after start-up with a traceback per rank. ``check_layer_keys`` says
so in one line at parse time instead, from the checkpoint's ``.metadata`` (torch's
distributed-checkpoint index, read without loading any tensor).
"""
from __future__ import annotations

import os

from megatron_oases.checkpoint import TRACKER, iteration_dir
from megatron_oases.errors import ConfigError

PER_LAYER, STACKED = "per-layer", "stacked"


def loaded_checkpoint_dir(load: str, ckpt_step: int | None) -> str | None:
    """The directory Megatron-LM loads from ``--load`` (``--ckpt-step``, else the tracker's
    iteration or ``release``); None when nothing is saved there yet."""
    if ckpt_step is not None:
        return iteration_dir(load, ckpt_step)
    try:
        with open(os.path.join(load, TRACKER), encoding="utf-8") as f:
            saved = f.read().strip()
    except OSError:
        return None
    if saved == "release":
        return os.path.join(load, "release")
    return iteration_dir(load, int(saved)) if saved.isdigit() else None


def layer_keys(ckpt_dir: str) -> str | None:
    """``PER_LAYER`` or ``STACKED`` for the decoder layers of the torch_dist checkpoint in
    ``ckpt_dir``; None for another format (no ``.metadata``) or no decoder layer in it."""
    if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    names = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    after = [k[len("decoder.layers."):] for k in names if k.startswith("decoder.layers.")]
    if not after:
        return None
    return PER_LAYER if any(rest.split(".", 1)[0].isdigit() for rest in after) else STACKED


def check_layer_keys(load: str, ckpt_step: int | None, per_layer_run: bool) -> None:
    """``ConfigError`` when the checkpoint ``--load`` names keys its layers the other way from
    what this run (``per_layer_run``: an ``--oases-plan`` run) saves and loads."""
    ckpt = loaded_checkpoint_dir(load, ckpt_step)
    found = None if ckpt is None else layer_keys(ckpt)
    if found is None or (found == PER_LAYER) == per_layer_run:
        return
    if per_layer_run:
        raise ConfigError(f"--load {load}: {ckpt} stacks the decoder layers on one key per "
                          f"parameter (a run without --oases-plan saved it); an --oases-plan run "
                          f"keys them per layer (its layers' shards differ in shape) and cannot "
                          f"load it: start the plan run without --load, or resume with the run "
                          f"that saved it")
    raise ConfigError(f"--load {load}: {ckpt} keys the decoder layers per layer (an --oases-plan "
                      f"run saved it); a run without --oases-plan loads stacked layers only: "
                      f"resume with that run's --oases-plan, or start without --load")
