"""Freeing the step boundaries a kept graph's backward does not read.

Without recompute the executor keeps each local step's graph until backward as its leaves (the
step's inputs, detached) and roots (its outputs). Backward needs their autograd identity (the
roots' ``grad_fn``, the leaves' gradient accumulators, which hold the leaf tensors themselves)
but reads their values only where the graph saved them. ``release_unread`` points the others at
a one-element placeholder of their shape, so an all-reduce's output, a GEMM's partial sums or a
residual is freed once the later steps are done with it, as in a stock layer.

A tensor the graph saved can be the very object held here (autograd saves a leaf, or an output
another op of the step reads, as it is), so a tensor is released only when no saved tensor of
its graph shares its storage.
"""
from __future__ import annotations

import torch


class Placeholders:
    """One shared element per dtype and device; a placeholder is its zero-stride expansion, so
    released tensors keep their shape (autograd checks a root's shape against its gradient)."""

    def __init__(self):
        self._base: dict = {}

    def like(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.device)
        if key not in self._base:
            self._base[key] = torch.zeros((), dtype=t.dtype, device=t.device)
        return self._base[key].expand(t.shape)


def release_unread(leaves: dict, roots: dict, placeholders: Placeholders) -> None:
    """Point ``leaves`` and ``roots`` (name -> tensor) of one step's graph whose storage no saved
    tensor of that graph shares at a placeholder. Views are left as they are, and so are roots
    the graph did not make (no ``grad_fn``: a tensor the step passed through)."""
    made = [r for r in roots.values() if r.grad_fn is not None]  # others may be a caller's tensors
    read = graph_storages(made)
    for t in (*leaves.values(), *made):
        if t._base is None and t.untyped_storage().data_ptr() not in read:
            t.data = placeholders.like(t)


def graph_storages(roots) -> set[int]:
    """Storage pointers of the tensors the autograd graph behind ``roots`` keeps for backward:
    built-in nodes' ``_saved_*`` tensors, custom functions' ``saved_tensors`` and the tensors on
    their ``ctx``. The walk ends at the leaves (their ``AccumulateGrad`` saves nothing)."""
    found, nodes, seen, todo = set(), [], set(), [r.grad_fn for r in roots]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)  # alive until the walk ends, so no id is reused meanwhile
        held = [_saved(node, n) for n in dir(node) if n.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):  # a custom autograd.Function's ctx
            held += [node.saved_tensors, list(vars(node).values())]
        _add_storages(held, found)
        todo.extend(fn for fn, _ in node.next_functions)
    return found


def _saved(node, name: str):
    """A node's saved attribute; None where it cannot be read (a node outside the step whose
    graph a backward already freed)."""
    try:
        return getattr(node, name)
    except RuntimeError:
        return None


def _add_storages(obj, found: set[int]) -> None:
    """Add the storage pointers of the tensors in ``obj`` (nested lists, tuples, dicts)."""
    todo = [obj]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            found.add(obj.untyped_storage().data_ptr())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
