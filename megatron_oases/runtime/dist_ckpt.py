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
    modules loaded when it is installed; the checkpoint strategies load later, so they get it
    here (the torch_dist saver allocates a flag on ``torch.cuda.current_device()``).
    """
    import torch
    from megatron.core import dist_checkpointing as dcp
    from megatron.core.dist_checkpointing.strategies import (  # noqa: F401 - loaded for the proxy
        async_utils, filesystem_async, state_dict_saver, torch as torch_strategy)

    from megatron_oases.runtime.cpu_compat import cpu_compat_installed

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
