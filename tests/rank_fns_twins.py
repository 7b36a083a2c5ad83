"""Rank functions for the CPU twins of GPU behaviour (tests/gpu_twins.py)."""
from __future__ import annotations

import contextlib
import os


def train_under_twins(argv: list[str], twins: tuple[str, ...] = ()):
    """Train step by step under the named twins ("nan", "guard", "fusion"); losses (last rank),
    global gradients per iteration (rank 0) and how often the fused wgrad kernel ran."""
    import sys

    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser
    from tests import gpu_twins

    if "fusion" in twins:
        gpu_twins.install_fake_gradient_accumulation_fusion()
        argv = argv + ["--gradient-accumulation-fusion"]
    args = build_parser().parse_args(argv)
    tr = setup(run_config(args))
    losses, grads = [], []
    with contextlib.ExitStack() as stack:
        if "nan" in twins:
            stack.enter_context(gpu_twins.nan_until_wait())
        if "guard" in twins:
            stack.enter_context(gpu_twins.sync_guard())
        for it in range(1, args.train_iters + 1):
            losses.append(train_step(tr, it)["loss"])
            assert gpu_twins.in_flight() == 0, "an async collective was never waited on"
            grads.append(gather_global(tr.model, what="grad"))
    fake = sys.modules.get("fused_weight_gradient_mlp_cuda")
    return {"losses": losses, "grads": grads if int(os.environ["RANK"]) == 0 else None,
            "fused_calls": getattr(fake, "calls", 0)}
