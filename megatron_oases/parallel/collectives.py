"""Collectives as tiny autograd functions on an explicit group, with byte accounting.

Every TP backend (Megatron 1-D, ATP mesh axes, 3-D cube directions) builds its layers from these
pairs; each docstring states the forward / backward pair. Each call is recorded by the active
``CommCounter`` (kind, group size, payload bytes, ring bytes per rank), which tests use to check
a backend's traffic against its paper's formula and the simulator uses as ground truth.

| function                  | forward                 | backward                |
|---------------------------|-------------------------|-------------------------|
| copy_to_group             | identity                | all-reduce              |
| reduce_from_group         | all-reduce              | identity                |
| all_gather_dim            | all-gather along dim    | reduce-scatter along dim|
| reduce_scatter_dim        | reduce-scatter along dim| all-gather along dim    |
| split_dim                 | keep own chunk of dim   | all-gather along dim    |
| gather_dim                | all-gather along dim    | keep own chunk of dim   |

MoE's token exchange (all-to-all, uneven gathers and reduce-scatters) is in
``collectives_uneven.py``, counted by the same ``CommCounter``.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megatron_oases.describe.ops import ring_factor


@dataclasses.dataclass(frozen=True)
class CommRecord:
    kind: str
    """all_reduce | all_gather | reduce_scatter (| broadcast | reduce, recorded by the 3-D vector ops)."""
    group_size: int
    payload_bytes: int
    """Bytes of the full logical tensor (all-reduce input, all-gather output, reduce-scatter input)."""
    wire_bytes_per_rank: float
    """Bytes each rank sends with a ring algorithm: 2(n-1)/n S for all-reduce, (n-1)/n S otherwise
    (for broadcast / reduce that is the per-rank average of a pipelined chain): ``describe.ops.ring_factor``."""
    tag: str = ""


class CommCounter:
    """Records collectives issued while active (``with CommCounter() as c: ...``); nestable."""

    _active: list["CommCounter"] = []

    def __init__(self):
        self.records: list[CommRecord] = []
        self.blocked_s = 0.0
        """Seconds spent inside collective calls and in ``wait()`` on their handles, counted
        only for calls ``watch_torch_distributed(timed=True)`` sees."""

    def __enter__(self):
        CommCounter._active.append(self)
        return self

    def __exit__(self, *exc):
        CommCounter._active.remove(self)

    def total(self, kind: str | None = None, field: str = "wire_bytes_per_rank") -> float:
        return sum(getattr(r, field) for r in self.records if kind is None or r.kind == kind)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def by_kind(self, min_group_size: int = 1) -> dict[str, dict]:
        """``{kind: {"calls": n, "wire_bytes": bytes}}`` over the records on groups of at least
        ``min_group_size`` ranks."""
        out: dict[str, dict] = {}
        for r in (r for r in self.records if r.group_size >= min_group_size):
            k = out.setdefault(r.kind, {"calls": 0, "wire_bytes": 0.0})
            k["calls"] += 1
            k["wire_bytes"] += r.wire_bytes_per_rank
        return out


_TAG: list[str] = []


@contextlib.contextmanager
def comm_tag(tag: str):
    """Label the collectives issued inside (e.g. ``"recompute"``) in the counters' records."""
    _TAG.append(tag)
    try:
        yield
    finally:
        _TAG.pop()


def record_collective(kind: str, payload: torch.Tensor, group) -> None:
    """Count a collective issued outside this module (e.g. a broadcast) in the active counters."""
    if not CommCounter._active:
        return
    _record(kind, dist.get_world_size(group), payload.numel() * payload.element_size())


def _record(kind: str, n: int, size: int) -> None:
    rec = CommRecord(kind, n, size, ring_factor(kind, n) * size, _TAG[-1] if _TAG else "")
    for counter in CommCounter._active:
        counter.records.append(rec)
    if n > 1:
        _RECORDED_NEXT[0] = True  # the torch.distributed call that follows is this record's


# ---- Megatron's own collectives: torch.distributed calls not issued through this module --------
_RECORDED_NEXT = [False]
_WATCHED = {
    # torch.distributed function: (kind, index of the tensor argument, tensor or list of them)
    "all_reduce": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, False),
    "_all_gather_base": ("all_gather", 0, False),
    "all_gather": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 1, False),
    "_reduce_scatter_base": ("reduce_scatter", 1, False),
    "reduce_scatter": ("reduce_scatter", 1, True),
    "broadcast": ("broadcast", 0, False),
    "reduce": ("reduce", 0, False),
    "all_to_all_single": ("all_to_all", 1, False),
}
_WATCH = {"installed": False, "timed": False, "depth": 0}


@dataclasses.dataclass(frozen=True)
class WatchedCall:
    """One watched ``torch.distributed`` collective on a group of 2+ ranks, as a replacement
    (``replace_watched_collectives``) sees it."""

    kind: str
    """all_reduce | all_gather | reduce_scatter | broadcast | reduce | all_to_all."""
    group: object
    """The call's process group (None: the world)."""
    group_size: int
    payload_bytes: int
    """As ``CommRecord.payload_bytes``."""
    tensors: tuple
    """Every tensor argument of the call (a replacement that runs elsewhere keeps them alive)."""
    async_op: bool


_REPLACE: list = []


@contextlib.contextmanager
def replace_watched_collectives(fn):
    """Benchmark only: while active, every collective ``watch_torch_distributed`` sees on a group
    of 2+ ranks runs ``fn(WatchedCall)`` instead, and the call returns what ``fn`` returns (a work
    handle for ``async_op``, else None); counters still record it. The one-GPU overlap benchmark
    (``benchmarks.standin``) puts stand-ins of known duration there, for Megatron's own
    collectives and ours alike. Needs ``watch_torch_distributed`` installed."""
    if not _WATCH["installed"]:
        raise RuntimeError("replace_watched_collectives needs watch_torch_distributed() installed "
                           "first (before Megatron is imported)")
    _REPLACE.append(fn)
    try:
        yield
    finally:
        _REPLACE.remove(fn)


class _TimedWork:
    """An async handle whose ``wait()`` counts as time blocked in communication."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        import time

        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            for counter in CommCounter._active:
                counter.blocked_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def watch_torch_distributed(*, timed: bool = False) -> None:
    """Make the active ``CommCounter``s also record collectives issued straight through
    ``torch.distributed`` (Megatron's TP all-reduces, DDP's gradient reductions, its
    embedding-group sums), so a benchmark counts a stock run's traffic the same way as ours.
    Calls on one-rank groups are not recorded; calls this module records are not recorded twice.
    With ``timed``, the time spent in each call and in ``wait()`` on its handle adds to the
    counters' ``blocked_s``. Install it once per process, before Megatron is imported (Megatron
    binds some collectives at import time); later calls only switch timing on."""
    import inspect
    import time

    _WATCH["timed"] = _WATCH["timed"] or timed
    if _WATCH["installed"]:
        return
    _WATCH["installed"] = True

    def wrap(name, orig, kind, idx, many):
        sig = inspect.signature(orig)

        def watched(*args, **kwargs):
            ours, _RECORDED_NEXT[0] = _RECORDED_NEXT[0], False
            if not (CommCounter._active or _REPLACE) or _WATCH["depth"]:
                return orig(*args, **kwargs)
            call = None
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
                group = bound.get("group")
                t = bound[list(sig.parameters)[idx]]
                n = dist.get_world_size(group)
                if n > 1:
                    size = sum(x.numel() * x.element_size() for x in (t if many else [t]))
                    tensors = tuple(x for v in bound.values()
                                    for x in (v if isinstance(v, (list, tuple)) else [v])
                                    if isinstance(x, torch.Tensor))
                    call = WatchedCall(kind, group, n, size, tensors, bool(bound.get("async_op")))
                    if not ours:
                        _record(kind, n, size)
                        _RECORDED_NEXT[0] = False
            except Exception:  # noqa: BLE001 - counting must never break training
                if _REPLACE:
                    raise
            if _REPLACE and call is not None:
                return _REPLACE[-1](call)
            _WATCH["depth"] += 1  # a collective calling another is one call
            t0 = time.perf_counter()
            try:
                out = orig(*args, **kwargs)
            finally:
                _WATCH["depth"] -= 1
                if _WATCH["timed"]:
                    for counter in CommCounter._active:
                        counter.blocked_s += time.perf_counter() - t0
            timed_handle = _WATCH["timed"] and out is not None and kwargs.get("async_op")
            return _TimedWork(out) if timed_handle else out

        watched.__name__ = name
        watched.__wrapped__ = orig
        return watched

    for name, (kind, idx, many) in _WATCHED.items():
        orig = getattr(dist, name, None)
        if orig is not None:
            setattr(dist, name, wrap(name, orig, kind, idx, many))


def all_reduce(x: torch.Tensor, group, async_op: bool = False):
    """In-place sum over ``group`` (counted); returns the work handle when ``async_op``."""
    record_collective("all_reduce", x, group)
    if dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(x, group=group, async_op=async_op)


def all_gather_into(x: torch.Tensor, dim: int, group, async_op: bool = False):
    """All-gather ``x`` along ``dim``; returns (output, work-or-None). Output is filled on wait."""
    n = dist.get_world_size(group)
    if n == 1:
        return x, None
    x = x.contiguous()
    shape = list(x.shape)
    shape[0] *= n
    moved = x.movedim(dim, 0).contiguous() if dim != 0 else x
    flat = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    record_collective("all_gather", flat, group)
    work = dist.all_gather_into_tensor(flat, moved, group=group, async_op=async_op)
    out = flat if dim == 0 else _LazyMove(flat, dim)
    return out, work


class _LazyMove:
    """An all-gather (or reduce-scatter) result along a non-leading dim: ``.get()`` after the wait moves the dim back."""

    def __init__(self, flat, dim):
        self.flat, self.dim = flat, dim

    def get(self) -> torch.Tensor:
        return self.flat.movedim(0, self.dim).contiguous()


def _materialize(out):
    return out.get() if isinstance(out, _LazyMove) else out


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    out, _ = all_gather_into(x, dim, group)
    return _materialize(out)


def reduce_scatter_into(x: torch.Tensor, dim: int, group, async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's chunk of ``dim``; returns (output,
    work-or-None) like ``all_gather_into``: the output is filled on wait."""
    n = dist.get_world_size(group)
    if n == 1:
        return x, None
    if x.shape[dim] % n != 0:
        raise ValueError(f"reduce-scatter: dim {dim} of size {x.shape[dim]} not divisible by {n}")
    moved = x.movedim(dim, 0).contiguous()
    flat = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    record_collective("reduce_scatter", moved, group)
    work = dist.reduce_scatter_tensor(flat, moved, group=group, async_op=async_op)
    return (flat if dim == 0 else _LazyMove(flat, dim)), work


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    out, _ = reduce_scatter_into(x, dim, group)
    return _materialize(out)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} not divisible by {n}")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _dim_pair(name: str, forward_fn, backward_fn):
    """An autograd Function over (x, dim, group) whose backward is ``backward_fn`` of the grad."""

    class _Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group):
            ctx.dim, ctx.group = dim, group
            return forward_fn(x, dim, group)

        @staticmethod
        def backward(ctx, grad):
            return backward_fn(grad, ctx.dim, ctx.group), None, None

    _Pair.__name__ = _Pair.__qualname__ = name
    return _Pair


_AllGatherDim = _dim_pair("_AllGatherDim", _gather, _reduce_scatter)
_ReduceScatterDim = _dim_pair("_ReduceScatterDim", _reduce_scatter, _gather)
_SplitDim = _dim_pair("_SplitDim", _split, _gather)
_GatherDim = _dim_pair("_GatherDim", _gather, _split)


def copy_to_group(x, group):
    """Forward identity, backward all-reduce (Megatron's f): enter a region of partial gradients."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x, group):
    """Forward all-reduce, backward identity (Megatron's g): sum partial results."""
    return _ReduceFromGroup.apply(x, group)


def all_gather_dim(x, dim: int, group):
    """Forward all-gather along ``dim``, backward reduce-scatter (gradients are partial per rank)."""
    return _AllGatherDim.apply(x, dim, group)


def reduce_scatter_dim(x, dim: int, group):
    """Forward reduce-scatter along ``dim``, backward all-gather."""
    return _ReduceScatterDim.apply(x, dim, group)


def split_dim(x, dim: int, group):
    """Forward keep this rank's chunk of ``dim`` (input replicated), backward all-gather."""
    return _SplitDim.apply(x, dim, group)


def gather_dim(x, dim: int, group):
    """Forward all-gather along ``dim``, backward keep own chunk (output gradient replicated)."""
    return _GatherDim.apply(x, dim, group)
