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


def losses_and_params(n: int, argv: list[str]) -> dict:
    """``rank_fns_oases.train_losses_and_grads`` on ``n`` ranks: the losses (last rank) and the
    final global parameters (rank 0), for runs whose gathered gradients are only shards (the
    distributed optimizer reduce-scatters them)."""
    from megatron_oases.runtime.spawn import run_on_ranks

    from tests.rank_fns_oases import train_losses_and_grads

    out = run_on_ranks(train_losses_and_grads, n, args=(argv,), timeout_s=240)
    return {"losses": out[-1]["losses"], "params": out[0]["params"]}


def logged_moe_losses(cfg) -> list[float | None]:
    """``train.run`` for the validated ``cfg``: each iteration's logged ``load_balancing_loss``."""
    from megatron_oases.train import run

    _, records = run(cfg)
    return [r.get("load_balancing_loss") for r in records]
