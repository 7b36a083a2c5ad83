"""Megatron's ``dist_checkpointing`` (torch_dist) in our ranks: on CPU, inside spawned ranks,
and with parameters that are empty on some ranks.

Used by ``megatron_oases.checkpoint``; nothing here changes the format (files and metadata are
Megatron's own).
"""
from __future__ import annotations

import contextlib
import sys


def dist_checkpointing():
    """Megatron's ``dist_checkpointing``, with the CPU layer's ``torch`` proxy when it is active.

    ``cpu_compat`` gives the proxy (CUDA devices -> CPU, no-op synchronize) to the Megatron
    modules loaded when it is installed, the torch_dist writer's among them (its saver allocates
    a flag on ``torch.cuda.current_device()``; from 0.19 Megatron imports that module only at
    the first save, so ``cpu_compat`` imports it itself). Any ``dist_checkpointing`` module
    loaded after the layer (another strategy, a reader) gets the proxy here.
    """
    import torch
    from megatron.core import dist_checkpointing as dcp
    from megatron.core.dist_checkpointing.strategies import (  # noqa: F401 - loaded for the proxy
        async_utils, filesystem_async, state_dict_saver, torch as torch_strategy)

    from megatron_oases.mcore_compat import quiet_sync_save_deprecation
    from megatron_oases.runtime.cpu_compat import cpu_compat_installed

    quiet_sync_save_deprecation()
    if cpu_compat_installed():
        proxy = sys.modules["megatron.core.utils"].torch
        for name, module in list(sys.modules.items()):
            if name.startswith("megatron.core.dist_checkpointing") and \
                    getattr(module, "torch", None) is torch:
                module.torch = proxy
    return dcp


@contextlib.contextmanager
def writer_in_this_rank():
    """Let the torch_dist writer run in a rank started by ``runtime.spawn`` (a daemon process).

    The writer forks one helper per file bucket (joined before ``save`` returns), which
    multiprocessing forbids in daemonic processes, and collects results through a ``spawn``
    Manager queue, a server process that would outlive a killed rank. A synchronous save runs
    the collector in this process, so a plain queue does the same job.
    """
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    config = multiprocessing.current_process()._config
    had, daemon = "daemon" in config, config.get("daemon")
    config["daemon"] = False
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        if had:
            config["daemon"] = daemon
        else:
            config.pop("daemon", None)


def keep_empty_params_local(model_state: dict) -> None:
    """Empty parameters (a 3-D rank off the cube diagonal holds no part of a vector) are
    ``LocalNonpersistentObject``s in the model's sharded state dict: nothing to save. The
    optimizer tracks them too, and Megatron maps each optimizer state to the parameter's
    ShardedTensor or factory; a factory that builds the same local object keeps their (empty)
    Adam state out of the checkpoint as well."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject as Local
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    def swap(x):
        if isinstance(x, Local) and isinstance(x.obj, torch.nn.Parameter) and not x.obj.numel():
            return ShardedTensorFactory("local_empty_param", x.obj, _build_local, lambda t: t)
        return x

    dict_list_map_inplace(swap, model_state)


def _build_local(key, data, replica_id, flattened_range):
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    return LocalNonpersistentObject(data)


def init_torch_adam_state(optimizer) -> None:
    """Give every parameter of the distributed optimizer's inner ``torch.optim.Adam`` a zero state
    (``step``, moments) before a checkpoint load builds its sharded state dict.

    Without Apex or Transformer Engine, Megatron's ``DistributedOptimizer.state_dict`` reads
    ``step`` from each parameter's Adam state and asserts they agree
    (``distrib_optimizer.py``: ``assert len(steps) == 1``); before the first step the state is
    empty and the load stops there. The load then overwrites these values. GPU runs with Apex /
    TE take another branch and never get here.
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}


def restore_adam_steps(optimizer, loaded: dict) -> None:
    """After a distributed-optimizer load, give each parameter its own ``step`` tensor holding
    the checkpoint's step.

    Without Apex or TE, Megatron's distributed optimizer keeps ``torch.optim.Adam``, whose state
    holds a ``step`` per parameter; the load assigns one shared tensor (Adam increments steps in
    place, so it would advance once per parameter per iteration) and it came back as 0 here
    (the resume-parity test caught both: iteration 5 after a resume from 3 differed). The
    checkpoint's common state carries the step in its ``param_groups``.
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    dist_opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
                 if isinstance(o, DistributedOptimizer)]
    if HAVE_APEX_OR_TE or not dist_opts:
        return
    steps = {g["step"] for g in loaded.get("optimizer", {}).get("param_groups", []) if "step" in g}
    if len(steps) != 1:
        return
    (step,) = steps
    for opt in dist_opts:
        for state in opt.optimizer.state.values():
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
