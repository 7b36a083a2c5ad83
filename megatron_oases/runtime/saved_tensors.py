"""What a forward pass keeps for its backward, measured: the storages autograd saved (through
``saved_tensors_hooks``) that are still alive when the forward ends, plus what custom autograd
functions keep on their ``ctx`` (the Oases executor's step state), parameters excluded.

The memory model states activation bytes per layer; this is the ground truth it is tested
against (tests/test_saved_bytes_budget.py) on whatever device runs.
"""
from __future__ import annotations

import weakref

import torch


class SavedTensorLedger:
    """Context manager around a forward: ``kept_bytes(output, params)`` after it.

    A storage counts once however many tensors view it; a storage freed before the forward
    ends (a graph the forward itself released) does not count."""

    def __init__(self):
        self._refs: list = []
        self._hooks = None

    def __enter__(self) -> "SavedTensorLedger":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._refs.append(weakref.ref(t))
        return t

    def kept_bytes(self, output: torch.Tensor, params) -> int:
        """Distinct live storages saved during the forward or held on the ``ctx`` of custom
        autograd nodes reachable from ``output``, minus the storages of ``params``."""
        tensors = [t for t in (r() for r in self._refs) if t is not None]
        tensors += _ctx_tensors(output)
        skip = {p.untyped_storage().data_ptr() for p in params}
        return storage_bytes(tensors, skip)


def storage_bytes(tensors, skip=frozenset()) -> int:
    """Bytes of the distinct storages of ``tensors`` (nested lists/tuples/dicts of them, or
    objects with a ``__dict__`` holding them), skipping the storages whose pointers are in
    ``skip``."""
    seen, total, todo, visited = set(skip), 0, [tensors], set()
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and id(obj) not in visited and not isinstance(obj, type):
            visited.add(id(obj))
            todo.extend(vars(obj).values())
    return total


CTX_STATE = ("state", "rng_states")
"""The ``ctx`` attributes that hold tensors beyond ``save_for_backward``: ``state`` (by convention
of our executors) and ``rng_states`` (Megatron's ``tensor_parallel.CheckpointFunction``: the CPU,
device and RNG-tracker generator states its recompute restores)."""


def _ctx_tensors(output: torch.Tensor) -> list:
    """What custom autograd functions reachable from ``output`` keep on their ``ctx`` beyond
    ``save_for_backward`` (the attributes ``CTX_STATE`` names)."""
    found, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found += [state for state in (getattr(node, name, None) for name in CTX_STATE) if state is not None]
        todo.extend(fn for fn, _ in node.next_functions)
    return found
