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


def _join_reduced_shards(model_chunks) -> None:
    """Before the optimizer step: put each parameter's whole reduced gradient into its
    ``main_grad``. The distributed optimizer's reduce-scatter leaves only this rank's shard of
    each bucket reduced (the rest is the rank's own unreduced sum); the shards are summed over
    the bucket's DP group, so ``gather_global(what="grad")`` reads what the optimizer steps on
    (each rank's own shard is unchanged)."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in model_chunks:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if not group.ddp_config.use_distributed_optimizer:
                continue  # main_grad is already all-reduced
            size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                joined = torch.zeros_like(bucket.grad_data)
                shard_buffer(joined, size)[rank].copy_(shard_buffer(bucket.grad_data, size)[rank])
                dist.all_reduce(joined, group=group.intra_distributed_optimizer_instance_group)
                bucket.grad_data.copy_(joined)


def reduced_grads_and_params(argv: list[str]) -> dict:
    """Train step by step; per iteration the loss (last rank) and, on rank 0, every parameter's
    reduced gradient as the optimizer steps on it (fp32 ``main_grad``, after DP and sequence-
    parallel reductions, before the step; the distributed optimizer's shards joined), and the
    final parameters. Every Adam parameter group carries ``--adam-eps`` (checked: the flag takes
    effect)."""
    import os

    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    tr = setup(run_config(args))
    if args.optimizer == "adam":
        for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
            for group in opt.optimizer.param_groups:
                assert group["eps"] == args.adam_eps, (group["eps"], args.adam_eps)
    grads, step = [], tr.optimizer.step

    def gathered_then_step():
        _join_reduced_shards(tr.model)
        grads.append(gather_global(tr.model, what="grad"))
        return step()

    tr.optimizer.step = gathered_then_step
    losses = [train_step(tr, it)["loss"] for it in range(1, args.train_iters + 1)]
    params = gather_global(tr.model, what="param")
    rank0 = int(os.environ["RANK"]) == 0
    return {"losses": losses, "grads": grads if rank0 else None, "params": params if rank0 else None}
