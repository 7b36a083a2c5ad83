"""Megatron's ``dist_checkpointing`` (torch_dist) in our ranks: on CPU, inside spawned ranks,
and with parameters that are empty on some ranks.

Used by ``megatron_oases.checkpoint``; nothing here changes the format (files and metadata are
Megatron's own): the save strategy and Megatron-LM's ``rng_state`` object are here too.
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


MAIN_PARAMS = "fp32_from_fp16_params"
"""Megatron's ``Float16OptimizerWithFloat16Params`` (the plain optimizer in bf16 / fp16): its fp32
main parameters in the sharded state, one list per param group."""


def main_params_by_position(optimizer_state: dict) -> None:
    """Key the plain mixed-precision optimizer's main parameters by position (``{group: {index:
    tensor}}``) in the sharded state a load takes.

    ``dist_checkpointing.load`` takes the local objects out of the state, loads the rest and
    merges the two back; a list keeps no positions there, so a group holding both (on a 3-D rank
    off the cube diagonal its empty vectors are local, ``keep_empty_params_local``) failed:
    ``Cannot merge two lists with different lengths``. Dicts keep the positions;
    ``main_params_as_lists`` turns the loaded state back for Megatron's ``load_state_dict``."""
    for state in _holding_main_params(optimizer_state).values():
        state[MAIN_PARAMS] = {i: dict(enumerate(group)) for i, group in
                              enumerate(state[MAIN_PARAMS])}


def main_params_as_lists(loaded: dict, sharded: dict) -> None:
    """The loaded main parameters as Megatron's lists again, each group as long as in ``sharded``
    (the state ``main_params_by_position`` keyed; a load drops an empty group)."""
    for where, state in _holding_main_params(sharded).items():
        into = loaded if where is None else loaded[where]
        got = into.get(MAIN_PARAMS, {})
        into[MAIN_PARAMS] = [[got[i][j] for j in range(len(group))]
                             for i, group in state[MAIN_PARAMS].items()]


def _holding_main_params(state: dict) -> dict:
    """The optimizer states with ``MAIN_PARAMS``: ``{None: state}`` for one optimizer, ``{index:
    state}`` for a ChainedOptimizer's (its sharded state is keyed by optimizer index)."""
    if MAIN_PARAMS in state:
        return {None: state}
    return {k: sub for k, sub in state.items() if isinstance(sub, dict) and MAIN_PARAMS in sub}


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
    checkpoint's common state carries the step in its ``param_groups`` (with MoE, one state per
    chained optimizer, dense and expert: ``{0: ..., 1: ...}``, read alike).
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    dist_opts = [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
                 if isinstance(o, DistributedOptimizer)]
    if HAVE_APEX_OR_TE or not dist_opts:
        return
    chained = [loaded] if "optimizer" in loaded else [v for v in loaded.values() if isinstance(v, dict)]
    steps = {g["step"] for state in chained
             for g in state.get("optimizer", {}).get("param_groups", []) if "step" in g}
    if len(steps) != 1:
        return
    (step,) = steps
    for opt in dist_opts:
        for state in opt.optimizer.state.values():
            state["step"] = torch.tensor(float(step), dtype=torch.float32)


def optimizer_state_from_other_kind(optimizer, state: dict, saved_args: dict):
    """Let the optimizer load a checkpoint of the other kind: the plain (non-distributed)
    optimizer's state into the distributed optimizer, or the distributed optimizer's
    ``fully_reshardable`` state into the plain one. Returns the function that turns the loaded
    ``optimizer`` entry into what this optimizer's ``load_state_dict`` takes.

    Both formats key Adam's moments by the model's sharded tensors
    (``optimizer.state.exp_avg.<param key>``), so the moments load as they are. They differ in:

    - the fp32 main parameters: ``optimizer.state.param.<key>`` in the distributed format,
      ``optimizer.state.fp32_param.<key>`` for the plain mixed-precision optimizer, and nothing
      for a plain fp32 optimizer, whose main parameters are the model weights (the model load
      fills them; the distributed optimizer then takes them from the model parameters);
    - the step and the hyperparameters, which are common state: per ``param_group`` in the
      distributed format (``optimizer.param_groups[i].step``), ``state.common_step`` in the plain
      one. The loaded ``param_groups`` are the checkpoint's; they are paired with this
      optimizer's groups by Megatron's ``param_group_identifier_keys``, as its own loads do.

    ``state`` is the sharded state dict about to be loaded; its optimizer keys are rewritten here.
    """
    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject,
                                                          ShardedTensor, ShardedTensorFactory)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) != 1:
        raise RuntimeError(f"--load: converting between the plain and the distributed optimizer's "
                           f"checkpoint needs one optimizer, this run chains {len(opts)}; add "
                           "--no-load-optim")
    (opt,) = opts
    to_distributed = isinstance(opt, DistributedOptimizer)
    saved_mixed = bool(saved_args.get("bf16") or saved_args.get("fp16"))
    model_data = {}

    def collect(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)):
            model_data[x.key] = x.data
        return x

    for name, sub in state.items():
        if name.startswith("model"):
            dict_list_map_inplace(collect, sub)
    main, fp32 = "optimizer.state.param.", "optimizer.state.fp32_param."

    def rekey(x):
        if not isinstance(x, (ShardedTensor, ShardedTensorFactory)):
            return x
        if to_distributed and x.key.startswith(main):
            if not saved_mixed:  # the model weights are the main parameters
                return LocalNonpersistentObject(model_data[x.key[len(main):]])
            x.key = fp32 + x.key[len(main):]
        elif not to_distributed and x.key.startswith(fp32):
            x.key = main + x.key[len(fp32):]
        return x

    dict_list_map_inplace(rekey, state["optimizer"])
    own = opt.state_dict()

    def ident(group):
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)

    def convert(loaded: dict) -> dict:
        if to_distributed:  # from the plain optimizer's state
            inner = loaded["optimizer"] if saved_mixed else loaded
            step = inner["state"]["common_step"]
            groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
            for g in groups:
                g["step"] = float(step)
            out = {"optimizer": {"param_groups": groups}, "param_state": loaded["param_state"],
                   "param_state_sharding_type": "fully_reshardable"}
        else:  # from the distributed optimizer's fully_reshardable state
            saved_groups = {ident(g): g for g in loaded["optimizer"]["param_groups"]}
            (step,) = {g["step"] for g in saved_groups.values()}
            mine = own["optimizer"] if "optimizer" in own else own
            groups = [{**{k: v for k, v in saved_groups.get(ident(g), g).items()
                          if k not in ("params", "step")}, "params": g["params"]}
                      for g in mine["param_groups"]]
            moments = loaded["optimizer"]["state"] if "optimizer" in own else loaded["state"]
            inner = {"state": {**{i: dict(s) for i, s in moments.items() if i != "common_step"},
                               "common_step": torch.tensor(float(step), dtype=torch.float32)},
                     "param_groups": groups}
            out = {"optimizer": inner, "fp32_from_fp16_params": loaded["fp32_from_fp16_params"]} \
                if "optimizer" in own else inner
        if "grad_scaler" in own:
            out["grad_scaler"] = loaded.get("grad_scaler") or own["grad_scaler"]
        return out

    return convert


@contextlib.contextmanager
def adam_step_out_of_the_way(optimizer):
    """Let Megatron's distributed optimizer load ``fully_reshardable`` state into
    ``torch.optim.Adam``.

    Without Apex or Transformer Engine the inner Adam keeps a ``step`` tensor in each parameter's
    state, and ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies into every
    tensor of that state from the loaded tensors, which never hold ``step`` (it is common state):
    ``KeyError: 'step'`` on megatron-core 0.16.1 and 0.19.2. The step is taken out of the state
    around each call and put back; ``restore_adam_steps`` then sets it from the checkpoint. GPU
    runs with Apex / TE keep no such tensor and are left alone.
    """
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    opts = [] if HAVE_APEX_OR_TE else [
        o for o in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(o, DistributedOptimizer)]

    def wrap(opt):
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            state = opt.optimizer.state[main_param]
            step = state.pop("step", None)
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step
        return set_states

    for opt in opts:
        opt._set_main_param_and_optimizer_states = wrap(opt)
    try:
        yield
    finally:
        for opt in opts:
            del opt._set_main_param_and_optimizer_states


def fully_parallel_save_strategy():
    """Megatron-LM's default save strategy (``--ckpt-fully-parallel-save``, on unless
    ``--no-ckpt-fully-parallel-save``): torch_dist, with the writing of tensors that several
    data-parallel ranks hold (the model weights; in the distributed optimizer's
    ``fully_reshardable`` format the gathered optimizer state too) spread over those ranks
    instead of all falling to DP rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)

    dist_checkpointing()  # the CPU layer's torch proxy for the modules just imported
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            ps.get_data_parallel_group(with_context_parallel=True))


def rng_state(dp_group):
    """Megatron-LM's ``rng_state`` ShardedObject: this (PP, TP) rank's states, one per DP rank
    (Python, NumPy, torch CPU, CUDA, Megatron's model-parallel tracker)."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    np_state = np.random.get_state()  # its key array as a tensor: objects load weights_only
    state = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state(),
             "np_rng_state": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                              *np_state[2:]),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    states = [None] * torch.distributed.get_world_size(dp_group)
    torch.distributed.all_gather_object(states, state, group=dp_group)
    return ShardedObject("rng_state", states, (ps.get_pipeline_model_parallel_world_size(),
                                               ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def set_rng_state(states: list, dp_rank: int) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    state = states[dp_rank] if len(states) > dp_rank else states[0]
    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["np_rng_state"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])


def with_torch_adam_state(load_checkpoint):
    """Megatron-LM's ``load_checkpoint(model, optimizer, ...)`` made to load the distributed
    optimizer's state into ``torch.optim.Adam`` (no Apex or TE: on CPU, or on a GPU without them),
    as the reference trainer's load does (``checkpoint.py``): a zero Adam state first
    (``init_torch_adam_state``), then the optimizer's ``load_state_dict`` without autograd and
    with the ``step`` tensors out of the way (``adam_step_out_of_the_way``), then each parameter's
    own step from the checkpoint (``restore_adam_steps``). Without it such a run cannot resume
    (``assert len(steps) == 1``). The entry (``megatron_lm.pretrain_gpt``) rebinds
    ``megatron.training.training.load_checkpoint`` with it."""
    import functools

    if getattr(load_checkpoint, "oases_torch_adam_state", False):
        return load_checkpoint

    @functools.wraps(load_checkpoint)
    def wrapped(model, optimizer, *args, **kwargs):
        if optimizer is None:
            return load_checkpoint(model, optimizer, *args, **kwargs)
        import torch

        init_torch_adam_state(optimizer)
        original = optimizer.load_state_dict

        def load_state_dict(state_dict):
            with torch.no_grad(), adam_step_out_of_the_way(optimizer):
                original(state_dict)
            restore_adam_steps(optimizer, state_dict)
        optimizer.load_state_dict = load_state_dict
        try:
            return load_checkpoint(model, optimizer, *args, **kwargs)
        finally:
            del optimizer.load_state_dict
    wrapped.oases_torch_adam_state = True
    return wrapped


def with_empty_params_local(checkpoint_fn, optimizer_index: int):
    """Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` (the optimizer is positional
    argument ``optimizer_index``) for a run whose ranks hold empty parameters (3-D): the
    optimizer's sharded state is built as the reference trainer's (``checkpoint.py``): empty
    parameters local (``keep_empty_params_local``; without it the optimizer finds no sharded
    tensor for them: ``KeyError`` on the ranks off the cube diagonal), the fp32 main parameters
    keyed by position for a load and turned back into lists before ``load_state_dict``. The entry
    (``megatron_lm.pretrain_gpt``) rebinds both functions of ``megatron.training.training``."""
    import functools

    @functools.wraps(checkpoint_fn)
    def wrapped(*args, **kwargs):
        optimizer = args[optimizer_index] if len(args) > optimizer_index \
            else kwargs.get("optimizer")
        if optimizer is None:
            return checkpoint_fn(*args, **kwargs)
        saved = {k: vars(optimizer)[k] for k in ("sharded_state_dict", "load_state_dict")
                 if k in vars(optimizer)}
        build, load, built = optimizer.sharded_state_dict, optimizer.load_state_dict, []

        def sharded_state_dict(model_state, *a, **kw):
            keep_empty_params_local(model_state)
            out = build(model_state, *a, **kw)
            if kw.get("is_loading", a[0] if a else False):
                main_params_by_position(out)
                built.append(out)
            return out

        def load_state_dict(state):
            if built:
                main_params_as_lists(state, built[-1])
            return load(state)
        optimizer.sharded_state_dict, optimizer.load_state_dict = sharded_state_dict, load_state_dict
        try:
            return checkpoint_fn(*args, **kwargs)
        finally:
            for k in ("sharded_state_dict", "load_state_dict"):
                if k in saved:
                    setattr(optimizer, k, saved[k])
                else:
                    delattr(optimizer, k)
    return wrapped
