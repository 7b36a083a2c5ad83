"""Rank functions for the MoE tests (importable by the forkserver children)."""
from __future__ import annotations


def built_mlps(cfg) -> list[tuple[str, str | None, int]]:
    """The trainer's model for the validated ``cfg``: per decoder layer, its MLP's class, its
    experts' class and local expert count (None, 0 for a dense MLP)."""
    from megatron_oases.train import setup

    tr = setup(cfg)
    out = []
    for chunk in tr.model:
        for layer in chunk.module.decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            out.append((type(layer.mlp).__name__, type(experts).__name__ if experts else None,
                        len(experts.local_experts) if experts else 0))
    return out
