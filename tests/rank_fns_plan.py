"""Rank functions for the per-layer TP degree (``--oases-plan``) tests."""
from __future__ import annotations

import os


def train_with_plan(argv: list[str]):
    """Train step by step; losses and grad norms (last rank), global gradients (rank 0), and
    per layer the number of weight elements this rank holds."""
    from megatron_oases.layers.planned_layer import PlannedTransformerLayer
    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    tr = setup(run_config(args))
    losses, norms, grads = [], [], []
    for it in range(1, args.train_iters + 1):
        out = train_step(tr, it)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
        grads.append(gather_global(tr.model, what="grad"))
    held = {}
    for chunk in tr.model:
        for m in chunk.modules():
            if isinstance(m, PlannedTransformerLayer):
                held[m.layer_number] = (m.tp_degree, sum(p.numel() for p in m.parameters()
                                                         if p.dim() == 2))
                held[f"mlp{m.layer_number}"] = (m.mlp_degree, sum(p.numel() for p in m.mlp.parameters()
                                                                  if p.dim() == 2))
    rank = int(os.environ["RANK"])
    return {"losses": losses, "norms": norms, "grads": grads if rank == 0 else None, "held": held}
