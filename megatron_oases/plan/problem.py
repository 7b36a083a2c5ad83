"""The planner's problem as arrays (Oases Eq. 5-6 on a chain of blocks), an assignment's cost,
and the least memory any plan needs: what both solvers (``ilp``, ``chain_dp``) share."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .graph import PlanError

GiB = float(1 << 30)


class MemoryInfeasible(PlanError):
    """No plan fits the memory budget; ``min_bytes`` is the least memory any plan needs."""

    def __init__(self, message: str, *, min_bytes: float, budget: float):
        super().__init__(message)
        self.min_bytes, self.budget = min_bytes, budget


@dataclasses.dataclass(frozen=True)
class PlanProblem:
    node: np.ndarray
    """(N, K) cost of block v under strategy k (ms per iteration); inf = not allowed."""
    edge: np.ndarray
    """(N-1, K, K) cost between block v (strategy a) and block v+1 (strategy b), ms."""
    mem: np.ndarray
    """(N, K) resident bytes of block v (states + saved tensors of the micro-batches in flight)."""
    peak: np.ndarray
    """(N, K) transient bytes while block v runs its backward."""
    mem_const: float = 0.0
    """Bytes no strategy changes (embeddings, logits)."""
    budget: float | None = None
    """Device memory in bytes; None: no constraint."""
    ties: tuple[tuple[int, ...], ...] = ()
    """Groups of consecutive blocks that take the same strategy index."""
    edge_mem: np.ndarray | None = None
    """(N-1, K, K) resident bytes of the edge between block v (strategy a) and block v+1
    (strategy b), >= 0: what the runtime keeps because the strategy changes there (under the
    Oases executor the reshard's output, ``describe.planned.reshard_saved_bytes``); None: zeros."""

    def __post_init__(self) -> None:
        n, k = self.node.shape
        if self.edge_mem is None:
            object.__setattr__(self, "edge_mem", np.zeros_like(self.edge, dtype=float))
        if (self.edge.shape != (max(n - 1, 0), k, k) or self.edge_mem.shape != self.edge.shape
                or self.mem.shape != (n, k) or self.peak.shape != (n, k)):
            raise ValueError(f"inconsistent shapes: node {self.node.shape}, edge {self.edge.shape}, "
                             f"edge_mem {self.edge_mem.shape}, mem {self.mem.shape}, peak {self.peak.shape}")

    @property
    def groups(self) -> list[list[int]]:
        """Partition of the blocks into strategy groups (singletons where untied), in order."""
        rep = list(range(self.node.shape[0]))
        for g in self.ties:
            for v in g:
                rep[v] = g[0]
        out: dict[int, list[int]] = {}
        for v, r in enumerate(rep):
            out.setdefault(r, []).append(v)
        groups = list(out.values())
        for g in groups:
            if g != list(range(g[0], g[-1] + 1)):
                raise ValueError(f"tied blocks {g} are not consecutive")
        return sorted(groups)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Solution:
    assignment: tuple[int, ...]
    """BlockStrategy index per block (into ``CostModel.strategies``)."""
    time_ms: float
    memory_bytes: float
    solver: str
    status: str
    build_s: float = 0.0
    solve_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.build_s + self.solve_s


def evaluate(p: PlanProblem, assignment) -> tuple[float, float]:
    """(objective ms, memory bytes) of one assignment: the same sums the ILP encodes."""
    a = np.asarray(assignment, dtype=int)
    for g in p.ties:
        if len({int(a[v]) for v in g}) != 1:
            raise ValueError(f"assignment breaks the tie of blocks {g}")
    n = len(a)
    t = float(p.node[np.arange(n), a].sum())
    if n > 1:
        t += float(p.edge[np.arange(n - 1), a[:-1], a[1:]].sum())
    m = p.mem_const + float(p.mem[np.arange(n), a].sum()) + float(p.peak[np.arange(n), a].max())
    if n > 1:
        m += float(p.edge_mem[np.arange(n - 1), a[:-1], a[1:]].sum())
    return t, m


def min_memory(p: PlanProblem) -> tuple[float, tuple[int, ...]]:
    """The least memory any allowed assignment needs, and one such assignment (exact: for each
    candidate largest working set z, a shortest path over the groups of blocks whose nodes are
    their resident bytes at strategies with working set <= z and whose edges are the edge terms
    ``edge_mem``)."""
    groups = p.groups
    allowed = np.isfinite(p.node)
    k = p.node.shape[1]
    diag = np.arange(k)
    res = np.stack([p.mem[g].sum(axis=0) + sum(p.edge_mem[v, diag, diag] for v in g[:-1]) for g in groups])
    link = [p.edge_mem[g[-1]] for g in groups[:-1]]
    pk = np.stack([p.peak[g].max(axis=0) for g in groups])
    ok = np.stack([allowed[g].all(axis=0) for g in groups])
    best, best_a = math.inf, None
    for z in np.unique(pk[ok]):
        fits = ok & (pk <= z)
        if not fits.any(axis=1).all():
            continue
        r = np.where(fits, res, np.inf)
        cost, back = r[0], []
        for j in range(1, len(groups)):
            via = cost[:, None] + link[j - 1]
            back.append(via.argmin(axis=0))
            cost = via.min(axis=0) + r[j]
        pick = [int(cost.argmin())]
        for b in back[::-1]:
            pick.append(int(b[pick[-1]]))
        total = p.mem_const + float(cost.min()) + float(z)
        if total < best:
            best, best_a = total, pick[::-1]
    if best_a is None:
        raise PlanError("no block has an allowed strategy")
    return best, spread(p, groups, best_a)


def spread(p: PlanProblem, groups, picks) -> tuple[int, ...]:
    """One strategy index per block from one pick per group of blocks that share a strategy."""
    assign = [0] * p.node.shape[0]
    for g, k in zip(groups, picks):
        for v in g:
            assign[v] = int(k)
    return tuple(assign)
