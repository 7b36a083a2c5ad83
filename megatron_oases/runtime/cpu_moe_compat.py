"""Megatron-Core's MoE token dispatcher on CPU + gloo (part of ``runtime.cpu_compat``).

The all-to-all dispatcher (``--moe-token-dispatcher-type alltoall``) counts the tokens each rank
sends and receives on the device, then copies the counts to the host as numpy arrays
(``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``) for ``all_to_all_single``'s split
sizes. That helper converts only a CUDA tensor; on CPU the counts stay tensors, which
``ProcessGroup.all_to_all_single`` does not take as split sizes (a TypeError). Inside the token
dispatcher module only, the helper is wrapped to give the numpy array it gives on a GPU. Gloo
itself runs the uneven all-to-all (alltoallv) on CPU.

With TP > 1 the dispatcher also gathers and reduce-scatters tokens over the TP group in uneven
pieces (``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split
sizes), which NCCL does and gloo refuses (its all-gather and reduce-scatter take equal pieces).
Those two, given split sizes, become one all-reduce of the whole tensor (each rank's piece in
place, zeros elsewhere; or the whole input, then the rank's piece): exact, since adding zeros is,
and summed in the same order as gloo's reduce-scatter. ``tests/test_moe_compat.py`` checks each
piece and that the upstream signatures they wrap are unchanged.
"""
from __future__ import annotations

import importlib

import torch

TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MAPPINGS = "megatron.core.tensor_parallel.mappings"


def _splits_as_numpy(maybe_move_tensor_to_cpu):
    """Upstream's helper, then ``as_numpy`` honoured for a tensor already on the CPU."""
    def wrapped(tensor, as_numpy=False, record_stream=False):
        tensor = maybe_move_tensor_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(tensor):
            tensor = tensor.numpy()
        return tensor

    wrapped.cpu_moe_compat, wrapped.upstream = True, maybe_move_tensor_to_cpu
    return wrapped


def _gather_uneven(input_, group, sizes: list[int]):
    """The uneven all-gather as one all-reduce: this rank's piece in place, zeros elsewhere."""
    start = sum(sizes[:group.rank()])
    output = input_.new_zeros((sum(sizes), *input_.shape[1:]))
    output[start:start + sizes[group.rank()]] = input_
    torch.distributed.all_reduce(output, group=group)
    return output


def _reduce_scatter_uneven(input_, group, sizes: list[int]):
    """The uneven reduce-scatter as one all-reduce of the whole input, then this rank's piece."""
    summed = input_.contiguous().clone()
    torch.distributed.all_reduce(summed, group=group)
    return torch.split(summed, sizes, dim=0)[group.rank()].contiguous()


def _when_uneven(uneven):
    """Megatron's ``(input_, group, split_sizes=None, use_global_buffer=False)`` collective, run
    by ``uneven`` when split sizes are given (upstream's own path otherwise)."""
    def wrap(collective):
        def wrapped(input_, group, split_sizes=None, use_global_buffer=False):
            if split_sizes is None or group.size() == 1:
                return collective(input_, group, split_sizes, use_global_buffer)
            return uneven(input_, group, [int(n) for n in split_sizes])

        wrapped.cpu_moe_compat, wrapped.upstream = True, collective
        return wrapped
    return wrap


WRAPPED = ((TOKEN_DISPATCHER, "maybe_move_tensor_to_cpu", _splits_as_numpy),
           (MAPPINGS, "_gather_along_first_dim", _when_uneven(_gather_uneven)),
           (MAPPINGS, "_reduce_scatter_along_first_dim", _when_uneven(_reduce_scatter_uneven)))
"""(module, function, wrapper): what the layer replaces, inside that module only."""


def install_cpu_moe_compat() -> None:
    """Wrap each of ``WRAPPED`` (idempotent; nothing to do where a module or function is absent)."""
    for modname, name, wrapper in WRAPPED:
        try:
            module = importlib.import_module(modname)
        except ImportError:
            continue
        fn = getattr(module, name, None)
        if fn is not None and not getattr(fn, "cpu_moe_compat", False):
            setattr(module, name, wrapper(fn))
