"""One process as rank 0 of a world of ``t`` ranks, on torch's fake process group.

Megatron's ``initialize_model_parallel(tensor_model_parallel_size=t)`` then builds real TP-t
shards on this one device, so the layers compute exactly rank 0's share of a TP-t model, and
every collective returns at once without touching its tensors: all-reduce results are the local
partial sums, all-gather outputs stay uninitialised. Values are therefore meaningless (losses
included); the benchmark avoids NaN-sensitive paths (no sequence parallelism by default, no
optimizer step unless asked) and times the work, not the numbers.
"""
from __future__ import annotations

import torch.distributed as dist


def init_fake_world(world_size: int) -> None:
    """Start the fake world (rank 0 of ``world_size``) unless a process group exists already.

    Every group is made on the fake backend: Megatron asks for gloo groups beside its NCCL ones
    (and the trainer's optimizer uses them on CPU), and the fake store cannot host gloo."""
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world_size:
            raise RuntimeError(f"a {dist.get_backend()} process group of {dist.get_world_size()} "
                               f"ranks exists; the benchmark needs its own fake world of {world_size}")
        return
    # torch's own fake backend (a testing module, present in every torch release we support)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    if not getattr(dist.new_group, "_fake_world", False):
        dist.new_group = _fake_groups(dist.new_group)


def _fake_groups(new_group):
    def fake_new_group(*args, **kwargs):
        kwargs.pop("backend", None)  # gloo / nccl: the fake store serves neither
        kwargs.pop("pg_options", None)  # NCCL communicator options
        return new_group(*args, **kwargs)

    fake_new_group._fake_world = True
    fake_new_group.__wrapped__ = new_group
    return fake_new_group
