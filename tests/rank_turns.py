"""Several command lines in one spawned rank group, each on process groups of its own.

Spawning ranks and warming a rank up (its first model build and forward) cost more than these
tiny models, so several tests run their command lines one after another in one group. Each
turn tears down Megatron's model-parallel state and destroys the torch process groups it made:
``destroy_model_parallel`` only drops Megatron's references, torch keeps every group registered
(a gloo group keeps its threads and connections), and the groups left behind make later
collectives and the rank's final ``destroy_process_group`` slower, more than linearly (measured
on 2 cores: 8 command lines at TP 2 left 161 groups whose teardown took 1.4 s; five 8-rank
command lines trained in 27.6 s, 17.2 s with their groups released).
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def groups_released():
    """Tear down Megatron's model-parallel state and destroy every process group made inside.

    Every rank destroys the same groups (a local call) once all have left the body (a barrier,
    skipped when the body raised: the run then fails at once); the default group stays."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    before = set(c10d._world.pg_map) if dist.is_initialized() else set()
    try:
        yield
        if dist.is_initialized():
            dist.barrier()
    finally:
        ps.destroy_model_parallel()
        for group in [g for g in c10d._world.pg_map if g not in before and g is not c10d._world.default_pg]:
            dist.destroy_process_group(group)


def each_in_turn(fn, argvs: list) -> list:
    """``fn(argv)`` of each argv in turn, each on process groups of its own (every setup seeds
    itself, so order does not matter)."""
    out = []
    for argv in argvs:
        with groups_released():
            out.append(fn(argv))
    return out
