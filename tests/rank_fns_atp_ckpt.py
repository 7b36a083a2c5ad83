"""Rank functions for the ATP checkpoint-resharding tests (importable by the forkserver children).

Each function runs the reference trainer's own pieces (``train.setup`` / ``train.train_step`` with
a Namespace from ``train_args.build_parser``) and saves or loads model and optimizer state with
``megatron.core.dist_checkpointing`` (torch_dist format, any TP layout can load any other).
"""
from __future__ import annotations

# Tiny GPT: hidden 64, 2 layers, seq 16; global batch 4 in micro-batches of 2 on 4 ranks. The
# vocabulary pads to 256 at TP 1, 2 and 4 (Megatron pads to a multiple of 32 x TP): a TP-dependent
# padded vocabulary would change the softmax, not just the layout.
MODEL_ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "16", "--vocab-size", "256", "--make-vocab-size-divisible-by", "32",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
              "--device", "cpu", "--dist-timeout", "120"]


def layout_argv(layout: str) -> list[str]:
    """Flags of a TP layout name: ``atp2x2`` (ATP DeviceMesh(2, 2), TP 4) or ``megatron4``
    (stock Megatron TP 4); the data-parallel size is whatever the 4 ranks leave."""
    if layout.startswith("megatron"):
        return ["--tp-backend", "megatron", "--tensor-model-parallel-size", layout[len("megatron"):]]
    d1, d2 = (int(v) for v in layout.removeprefix("atp").split("x"))
    return ["--tp-backend", "atp", "--atp-mesh", f"{d1},{d2}",
            "--tensor-model-parallel-size", str(d1 * d2)]


def _trainer(layout: str):
    # Imported before ``setup`` installs the CPU compatibility layer, which then also gives these
    # modules its torch proxy (the torch_dist writer calls torch.cuda.synchronize()).
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401

    from megatron_oases.run_config import run_config

    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    return setup(run_config(build_parser().parse_args(MODEL_ARGV + layout_argv(layout))))


def _sharded_state(tr, *, with_optimizer: bool, is_loading: bool) -> dict:
    """``{"model": ..., "optimizer": ...}`` sharded state dict of the trainer's single chunk."""
    from megatron_oases.parallel.layout import _unwrap

    (chunk,) = tr.model
    model_sd = _unwrap(chunk).sharded_state_dict()
    out = {"model": model_sd}
    if with_optimizer:
        out["optimizer"] = tr.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return out


def _allow_child_processes() -> None:
    """Let Megatron's torch_dist writer run inside a harness rank.

    The writer forks one helper per file bucket and, once per process, starts a
    ``multiprocessing.Manager`` for its results queue. Harness ranks are daemons, which
    multiprocessing forbids to have children, and a Manager outlives a rank that the harness
    kills. A synchronous save runs the writer in this process, so a plain in-process queue does
    the Manager's job; the forked helpers are joined before ``save`` returns.
    """
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    multiprocessing.current_process()._config["daemon"] = False
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(tr, ckpt_dir: str, *, with_optimizer: bool = True) -> None:
    from megatron.core import dist_checkpointing

    _allow_child_processes()
    dist_checkpointing.save(_sharded_state(tr, with_optimizer=with_optimizer, is_loading=False),
                            ckpt_dir)


def load_checkpoint(tr, ckpt_dir: str, *, with_optimizer: bool = True) -> None:
    from megatron.core import dist_checkpointing

    from megatron_oases.parallel.layout import _unwrap

    loaded = dist_checkpointing.load(
        _sharded_state(tr, with_optimizer=with_optimizer, is_loading=True), ckpt_dir)
    (chunk,) = tr.model
    _unwrap(chunk).load_state_dict(loaded["model"])
    if with_optimizer:
        tr.optimizer.load_state_dict(loaded["optimizer"])


def train_save_continue(layout: str, ckpt_dir: str, save_after: int, total: int) -> list:
    """Train ``save_after`` steps, save, then keep training to ``total``: the losses after the save
    (what a loaded checkpoint must reproduce)."""
    from megatron_oases.train import train_step

    tr = _trainer(layout)
    for it in range(1, save_after + 1):
        train_step(tr, it)
    save_checkpoint(tr, ckpt_dir)
    return [train_step(tr, it)["loss"] for it in range(save_after + 1, total + 1)]


def load_continue(layout: str, ckpt_dir: str, save_after: int, total: int,
                  with_optimizer: bool = True) -> list:
    """Build ``layout`` from scratch, load the checkpoint, train steps ``save_after + 1 .. total``."""
    from megatron_oases.train import train_step

    tr = _trainer(layout)
    load_checkpoint(tr, ckpt_dir, with_optimizer=with_optimizer)
    return [train_step(tr, it)["loss"] for it in range(save_after + 1, total + 1)]
