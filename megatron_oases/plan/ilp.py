"""The planner's ILP (Oases Eq. 5-6) on a chain of blocks, solved with PuLP.

Eq. 5: minimise  sum_v c_v^T s_v  +  sum_(u,v) s_u^T R_uv s_v  over one-hot s_v.
The edge products are linearised the usual way (Alpa): a continuous e_uv[a, b] >= 0 per pair of
strategies with the marginals  sum_b e_uv[a, b] = s_u[a],  sum_a e_uv[a, b] = s_v[b];  with
one-hot s this forces e_uv = s_u s_v^T (and on a chain the LP relaxation is already tight).
Eq. 6: resident bytes (parameters + optimizer state, saved tensors) summed over blocks, plus the
largest backward working set (one block runs backward at a time):
    const + sum_v m_v^T s_v + sum_(u,v) <W_uv, e_uv> + z <= M,    z >= p_v^T s_v  for every v.
``W_uv`` (``PlanProblem.edge_mem``) is what a change of strategy keeps (the Oases executor's
reshard output); it is linearised exactly with the same product variables e_uv as the edge time
(not bounded), so the ILP and the chain DP solve the same problem.
``ties`` groups blocks that must share one strategy (one degree per TransformerLayer).

Nothing here knows what a block or a strategy is: the arrays come from ``cost_model``.
``chain_dp`` solves the same problem exactly without an LP; ``solve`` picks between them.
"""
from __future__ import annotations

import itertools
import math
import time
import warnings

import numpy as np

from .chain_dp import solve_chain
from .graph import PlanError
from .problem import GiB, MemoryInfeasible, PlanProblem, Solution, evaluate, min_memory  # noqa: F401

def brute_force(p: PlanProblem) -> tuple[float, tuple[int, ...]]:
    """Optimal (objective, assignment) by enumerating every assignment (small problems only)."""
    groups = p.groups
    k = p.node.shape[1]
    if k ** len(groups) > 2_000_000:
        raise ValueError(f"{k}^{len(groups)} assignments is too many to enumerate")
    combos = np.array(list(itertools.product(range(k), repeat=len(groups))), dtype=int)
    a = np.zeros((len(combos), p.node.shape[0]), dtype=int)
    for j, g in enumerate(groups):
        a[:, g] = combos[:, [j]]
    n = p.node.shape[0]
    t = p.node[np.arange(n), a].sum(axis=1)
    if n > 1:
        t = t + p.edge[np.arange(n - 1), a[:, :-1], a[:, 1:]].sum(axis=1)
    if p.budget is not None:
        m = p.mem_const + p.mem[np.arange(n), a].sum(axis=1) + p.peak[np.arange(n), a].max(axis=1)
        if n > 1:
            m = m + p.edge_mem[np.arange(n - 1), a[:, :-1], a[:, 1:]].sum(axis=1)
        t = np.where(m <= p.budget * (1 + 1e-12), t, np.inf)
    i = int(np.argmin(t))
    return float(t[i]), tuple(int(x) for x in a[i])


def _solver(name: str, time_limit: float | None):
    """PuLP solver for ``cbc``, ``highs`` or ``ilp`` (HiGHS when installed, else CBC)."""
    import pulp

    if name in ("highs", "ilp"):
        for cls in ("HiGHS", "HiGHS_CMD"):
            try:
                s = getattr(pulp, cls)(msg=False, timeLimit=time_limit)
                if s.available():
                    return s, "highs"
            except Exception:  # noqa: BLE001 - an unusable optional solver is skipped
                pass
        if name == "highs":
            raise PlanError("--solver highs: HiGHS is not installed (pip install highspy); use --solver cbc")
    with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC for 4.0; still the default
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, gapRel=0.0, timeLimit=time_limit), "cbc"


def check_memory(p: PlanProblem) -> None:
    """Raise ``MemoryInfeasible`` naming --memory-gb when no assignment fits the budget."""
    if p.budget is None:
        return
    need, _ = min_memory(p)
    if need > p.budget:
        raise MemoryInfeasible(
            f"--memory-gb {p.budget / GiB:.2f} is too small: the least memory any plan needs is "
            f"{need / GiB:.2f} GiB per device ({p.mem_const / GiB:.2f} GiB embeddings/logits); "
            f"raise --memory-gb to {math.ceil(need / GiB * 100) / 100:.2f} or use a larger TP / smaller "
            "--micro-batch-size", min_bytes=need, budget=p.budget)


SOLVERS = ("auto", "dp", "ilp", "cbc", "highs")


def solve(p: PlanProblem, *, solver: str = "auto", time_limit: float | None = None) -> Solution:
    """Optimal strategy per block (Eq. 5) under the memory constraint (Eq. 6).

    ``ilp`` (HiGHS when installed, else CBC), ``cbc``, ``highs``: the ILP below through PuLP.
    ``dp``: the exact chain DP (``chain_dp``), the same optimum in milliseconds. ``auto``: the
    DP, because the model graph is a chain and CBC needs seconds when the memory budget binds
    (docs/planner.md). Either way an infeasible budget raises ``MemoryInfeasible`` first.
    """
    if solver not in SOLVERS:
        raise PlanError(f"--solver must be one of {', '.join(SOLVERS)} (got {solver!r})")
    if time_limit is not None and solver in ("auto", "dp"):
        raise PlanError(f"--time-limit bounds an ILP solver and has no effect with --solver {solver} (the exact "
                        f"chain DP, milliseconds); drop it or pass --solver ilp|cbc|highs")
    t0 = time.perf_counter()
    check_memory(p)
    if solver in ("auto", "dp"):

        t1 = time.perf_counter()
        t, assign, _ = solve_chain(p)
        t2 = time.perf_counter()
        return Solution(assignment=assign, time_ms=t, memory_bytes=evaluate(p, assign)[1], solver="dp",
                        status="Optimal", build_s=t1 - t0, solve_s=t2 - t1)
    return solve_ilp(p, solver=solver, time_limit=time_limit, _t0=t0)


def solve_ilp(p: PlanProblem, *, solver: str = "ilp", time_limit: float | None = None,
              _t0: float | None = None) -> Solution:
    """Eq. 5-6 as an ILP through PuLP (CBC, or HiGHS when installed and asked for)."""
    import pulp

    t0 = time.perf_counter() if _t0 is None else _t0
    if _t0 is None:
        check_memory(p)
    n, k = p.node.shape
    groups = p.groups
    gid = [0] * n
    for j, g in enumerate(groups):
        for v in g:
            gid[v] = j
    allowed = np.isfinite(p.node)
    prob = pulp.LpProblem("oases_plan", pulp.LpMinimize)
    var = getattr(prob, "add_variable", None) or pulp.LpVariable  # PuLP >= 3.3 / older
    x: list[dict[int, pulp.LpVariable]] = []
    obj: list[tuple[pulp.LpVariable, float]] = []
    edge_bytes: list[tuple[pulp.LpVariable, float]] = []  # (e_uv[a, b], W_uv[a, b]) for Eq. 6
    for j, g in enumerate(groups):
        ks = [a for a in range(k) if allowed[g, a].all()]
        if not ks:
            raise PlanError(f"blocks {g} have no allowed strategy")
        xs = {a: var(f"s_{j}_{a}", cat="Binary") for a in ks}
        x.append(xs)
        prob += pulp.lpSum(xs.values()) == 1, f"one_{j}"
        for a in ks:
            c = float(p.node[g, a].sum())
            c += sum(float(p.edge[v, a, a]) for v in g[:-1])  # edges inside a tied group
            obj.append((xs[a], c))
    for v in range(n - 1):
        gu, gv = gid[v], gid[v + 1]
        if gu == gv:
            continue
        xu, xv = x[gu], x[gv]
        e = {(a, b): var(f"e_{v}_{a}_{b}", lowBound=0) for a in xu for b in xv
             if math.isfinite(p.edge[v, a, b])}
        for a in xu:
            prob += pulp.lpSum(e[a, b] for b in xv if (a, b) in e) == xu[a], f"row_{v}_{a}"
        for b in xv:
            prob += pulp.lpSum(e[a, b] for a in xu if (a, b) in e) == xv[b], f"col_{v}_{b}"
        obj += [(var, float(p.edge[v, a, b])) for (a, b), var in e.items()]
        edge_bytes += [(var, float(p.edge_mem[v, a, b])) for (a, b), var in e.items() if p.edge_mem[v, a, b]]
    prob += _weighted_sum(obj)
    if p.budget is not None:
        z = var("z_peak", lowBound=0)
        scale = 1.0 / GiB  # keep coefficients near 1 for the solver
        seen = set()
        for v in range(n):
            row = tuple(float(p.peak[v, a]) for a in x[gid[v]])
            if (gid[v], row) in seen:
                continue
            seen.add((gid[v], row))
            prob += z >= pulp.lpSum(float(p.peak[v, a]) * scale * var for a, var in x[gid[v]].items()), f"peak_{v}"
        terms = [(var, (float(p.mem[groups[j], a].sum()) + sum(float(p.edge_mem[v, a, a]) for v in groups[j][:-1]))
                  * scale) for j, xs in enumerate(x) for a, var in xs.items()]
        terms += [(var, w * scale) for var, w in edge_bytes]
        prob += _weighted_sum(terms) + z <= (p.budget - p.mem_const) * scale, "memory"
    slv, slv_name = _solver(solver, time_limit)
    t1 = time.perf_counter()
    prob.solve(slv)
    t2 = time.perf_counter()
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        raise PlanError(f"the ILP solver ({slv_name}) returned {status}; try --solver cbc or raise --time-limit")
    assign = [0] * n
    for j, g in enumerate(groups):
        a = max(x[j], key=lambda a: x[j][a].value() or 0.0)
        for v in g:
            assign[v] = a
    t, m = evaluate(p, assign)
    return Solution(assignment=tuple(assign), time_ms=t, memory_bytes=m, solver=slv_name, status=status,
                    build_s=t1 - t0, solve_s=t2 - t1)


def _weighted_sum(terms):
    """sum(coef * var) for ``(var, coef)`` pairs, in a form every PuLP release builds (PuLP 4
    no longer takes a list of pairs in ``LpAffineExpression``)."""
    import pulp

    return pulp.lpSum(coef * var for var, coef in terms)
