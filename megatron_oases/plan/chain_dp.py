"""Exact solver of the planner's problem (Eq. 5-6) on a chain of blocks: a label-setting DP.

Why besides the ILP: on 96 blocks x 4 strategies with a memory budget that binds, CBC (and
HiGHS) take seconds to minutes on the literal Eq. 5-6 model: interior blocks are identical, so
the LP relaxation mixes two uniform plans (no switch, no resharding cost) and branch-and-bound
has to enumerate many symmetric placements of the switch to close that gap. The model graph is
a chain, so the problem is a resource-constrained shortest path, which this DP solves exactly:

* Peak term. The largest backward working set ``z`` takes one of the (few) distinct peak
  values; for each candidate ``z`` only strategies with peak <= z are allowed and the resident
  budget is ``budget - const - z`` (the best over all ``z`` is the optimum).
* Labels. For every block and strategy keep the Pareto set of (time so far, resident bytes so
  far) over all partial plans ending there; extend by one block (its node's bytes plus the edge's,
  ``PlanProblem.edge_mem``: what a change of strategy keeps, taken exactly), merge, drop
  dominated labels.
* Pruning (exact). A label is dropped if the cheapest completion of its memory (``suffix_mem``,
  the nodes' least bytes: a lower bound, the edge terms being >= 0) breaks the budget, or if its
  time plus the cheapest completion of its time (a backward Viterbi pass without the memory
  constraint) cannot beat the best plan found so far.

Ties (one strategy per TransformerLayer) are handled by running the DP on the groups.
"""
from __future__ import annotations

import math

import numpy as np

from .graph import PlanError
from .problem import PlanProblem, evaluate, min_memory, spread

_EPS = 1e-9
MAX_LABELS = 2_000_000


def _grouped(p: PlanProblem):
    """(node, edge, mem, edge_mem, peak, groups) of the problem with each tie group as one node."""
    groups = p.groups
    if all(len(g) == 1 for g in groups):
        return p.node, p.edge, p.mem, p.edge_mem, p.peak, groups
    k = p.node.shape[1]
    diag = np.arange(k)
    node = np.stack([p.node[g].sum(axis=0) + sum(p.edge[v, diag, diag] for v in g[:-1]) for g in groups])

    def links(a: np.ndarray) -> np.ndarray:
        return np.stack([a[g[-1]] for g in groups[:-1]]) if len(groups) > 1 else np.zeros((0, k, k))

    mem = np.stack([p.mem[g].sum(axis=0) + sum(p.edge_mem[v, diag, diag] for v in g[:-1]) for g in groups])
    peak = np.stack([p.peak[g].max(axis=0) for g in groups])
    return node, links(p.edge), mem, links(p.edge_mem), peak, groups


def _cost_to_go(node: np.ndarray, edge: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """H[v, k]: cheapest time of blocks v+1.. given block v takes k (memory ignored)."""
    n, k = node.shape
    h = np.zeros((n, k))
    for v in range(n - 2, -1, -1):
        nxt = np.where(allowed[v + 1], node[v + 1] + h[v + 1], np.inf)
        h[v] = (edge[v] + nxt[None, :]).min(axis=1)
    return h


def solve_chain(p: PlanProblem) -> tuple[float, tuple[int, ...], int]:
    """(optimal objective, assignment per block, labels created) of ``p``; ``PlanError`` if no
    assignment fits (call ``ilp.check_memory`` first for the error that names --memory-gb)."""
    node, edge, mem, edge_mem, peak, groups = _grouped(p)
    n, K = node.shape
    allowed0 = np.isfinite(node)
    best_t, best_a = math.inf, None
    if p.budget is not None:
        try:  # a feasible plan gives the first upper bound
            _, a0 = min_memory(p)
            t0, m0 = evaluate(p, a0)
            if m0 <= p.budget * (1 + 1e-12):
                best_t, best_a = t0, tuple(a0[g[0]] for g in groups)
        except PlanError:
            pass
        zs = np.unique(peak[allowed0])[::-1]
    else:
        zs = np.array([math.inf])
    labels_made = 0
    for z in zs:
        allowed = allowed0 & (peak <= z)
        if not allowed.any(axis=1).all():
            continue
        h = _cost_to_go(node, edge, allowed)
        start = np.where(allowed[0], node[0] + h[0], np.inf)
        if start.min() >= best_t - _EPS:
            continue  # even without the memory constraint this z cannot win
        if p.budget is None:
            cap, m_eff, e_eff = math.inf, np.zeros_like(mem), np.zeros_like(edge_mem)
        else:
            cap, m_eff, e_eff = p.budget - p.mem_const - z, mem, edge_mem
        mmin = np.where(allowed, m_eff, np.inf).min(axis=1)
        suffix = np.concatenate([np.cumsum(mmin[::-1])[::-1][1:], [0.0]])
        if mmin.sum() > cap + abs(cap) * 1e-12:
            continue
        lim = cap + abs(cap) * 1e-12 if math.isfinite(cap) else math.inf
        first = allowed[0] & (m_eff[0] + suffix[0] <= lim) & (node[0] + h[0] < best_t - _EPS)
        T = [np.array([node[0, k]]) if first[k] else np.empty(0) for k in range(K)]
        M = [np.array([m_eff[0, k]]) if first[k] else np.empty(0) for k in range(K)]
        back: list[list[np.ndarray]] = []
        for v in range(1, n):
            src = [a for a in range(K) if len(T[a])]
            if not src:
                break  # every partial plan was pruned: this z cannot beat the best plan
            nT, nM, nB = [], [], []
            for k in range(K):
                t = m = b = None
                if allowed[v, k]:
                    t = np.concatenate([T[a] + edge[v - 1, a, k] for a in src]) + node[v, k]
                    m = np.concatenate([M[a] + e_eff[v - 1, a, k] for a in src]) + m_eff[v, k]
                    b = np.concatenate([np.stack([np.full(len(T[a]), a), np.arange(len(T[a]))], 1) for a in src])
                    ok = (m + suffix[v] <= lim) & (t + h[v, k] < best_t - _EPS)
                    t, m, b = t[ok], m[ok], b[ok]
                    if len(t):
                        o = np.lexsort((t, m))
                        t, m, b = t[o], m[o], b[o]
                        keep = np.ones(len(t), bool)
                        keep[1:] = t[1:] < np.minimum.accumulate(t)[:-1] - _EPS
                        t, m, b = t[keep], m[keep], b[keep]
                if t is None or not len(t):
                    t, m, b = np.empty(0), np.empty(0), np.empty((0, 2), dtype=int)
                nT.append(t)
                nM.append(m)
                nB.append(b)
                labels_made += len(t)
            if labels_made > MAX_LABELS:
                raise PlanError(f"chain DP exceeded {MAX_LABELS} labels; use --solver cbc")
            T, M = nT, nM
            back.append(nB)
        for k in range(K):
            if len(T[k]) and T[k].min() < best_t - _EPS:
                i = int(T[k].argmin())
                best_t = float(T[k][i])
                a, kk, ii = [k], k, i
                for v in range(n - 1, 0, -1):
                    pk, pi = back[v - 1][kk][ii]
                    a.append(int(pk))
                    kk, ii = int(pk), int(pi)
                best_a = tuple(a[::-1])
    if best_a is None:
        raise PlanError("no assignment fits the memory budget")
    assign = spread(p, groups, best_a)
    return evaluate(p, assign)[0], assign, labels_made
