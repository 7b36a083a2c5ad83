"""The reference trainer's host work outside the layer events, measured (``describe.ops.LOOP_EVENTS``).

A profile times each event on its own; the trainer's forward-backward also runs Megatron's
schedule, the loss function, DDP's gradient hooks and autograd's bookkeeping between them. Where
the events are small (a host-bound model, on CPU or a fast GPU) that is a large share of the step
(a 4-layer, hidden-64 model on CPU: 11.4 ms per micro-batch against 7.1 ms of events). It is
measured here as what the trainer's forward-backward of one micro-batch, on one rank at TP 1,
takes beyond its events, at 1 and 2 layers: the difference is the part per layer, the rest the
part per micro-batch. Neither run is the one predicted, so a prediction at L layers tests the
split. The frontend (``sim.frontends.predict.profile_train_args``) runs the two and prices their
events; this module holds the runs' flags, the trainer's timing and the split. Under validation:
``sim --predict`` prints the step with and without it (docs/sim.md).
"""
from __future__ import annotations

import argparse
import gc

LAYERS = (1, 2)
"""The two layer counts measured."""

_SINGLE_RANK_GROUPS = ("launch", "parallelism", "oases", "data", "validation", "logging", "checkpointing",
                       "preemption")
"""The trainer's flag groups (first word of the title) reset to their defaults for the one-rank
runs: a TP-1, PP-1, DP-1 stock run of the same model, batch and precision."""


def single_rank_args(args: argparse.Namespace, layers: int) -> argparse.Namespace:
    """``args`` as a one-rank, one-micro-batch run of ``layers`` layers (same shapes, precision,
    attention and recompute), on the same device."""
    from ...train_args import build_parser

    parser = build_parser()
    out = argparse.Namespace(**vars(args))
    for group in parser._action_groups:
        if group.title.split(" ")[0] in _SINGLE_RANK_GROUPS:
            for action in group._group_actions:
                setattr(out, action.dest, action.default)
    out.device, out.num_layers, out.global_batch_size = args.device, layers, args.micro_batch_size
    if args.recompute_granularity == "full":  # a whole number of recompute groups at 1 or 2 layers
        out.recompute_num_layers = 1 if args.recompute_method == "uniform" else min(
            args.recompute_num_layers or 1, layers)
    return out


def forward_backward_ms(cfg, warmup: int, reps: int, threads: int | None) -> float:
    """Median milliseconds of the trainer's forward-backward of one micro-batch (``cfg``: a
    one-rank ``RunConfig``), timed as the profiler times an event (``profiler.time_ms``)."""
    import torch
    from megatron.core import parallel_state as ps

    from ... import train as T
    from ...runtime import detect_runtime
    from .layer_workloads import single_rank_world
    from .profiler import time_ms

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    tr = None
    try:
        with single_rank_world(detect_runtime(cfg.device).device.type):
            try:
                tr = T.setup(cfg)
                batches = tr.data.train_batches(1)
                return time_ms(lambda: T.forward_backward(tr, batches), warmup=warmup, reps=reps,
                               device=tr.runtime.device)
            finally:
                rt = tr.runtime if tr is not None else None
                tr = None
                ps.destroy_model_parallel()
                gc.collect()
                if rt is not None and rt.is_cuda:
                    torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(old)


def split(runs: dict[int, dict[str, float]]) -> tuple[float, float]:
    """(ms per micro-batch, ms per layer), in ``describe.ops.LOOP_EVENTS``' order, from ``{layers: {"trainer_ms", "events_ms"}}`` at two
    layer counts: the trainer's time beyond its events, as a line in the layer count (each part
    at least 0). Both 0 where either run took less than its events: the trainer then issued its
    host work while the device was busy, which events timed one at a time cannot (on one H100,
    hidden 512: 5.5 ms of trainer against 7.8 ms of events at 1 layer, 8.5 against 10.4 at 2), so
    its difference from them is no host cost and the line through two such residues is noise."""
    (l1, r1), (l2, r2) = ((n, r["trainer_ms"] - r["events_ms"]) for n, r in sorted(runs.items()))
    if min(r1, r2) < 0:
        return 0.0, 0.0
    layer = max(0.0, (r2 - r1) / (l2 - l1))
    return max(0.0, r1 - l1 * layer), layer
