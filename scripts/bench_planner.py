"""Planner benchmark: solve times (96 blocks x 4 strategies) and Table-6-style plans.

    python scripts/bench_planner.py [--topology pcie-3090-2node] [--csv bench_planner.csv] [--ilp-limit 20]

Part 1 sweeps the memory budget of a 48-layer model (96 blocks, degrees 1/2/4/8) from the least
memory any plan needs up to the uniform TP-2 plan's, and times the exact chain DP (the default
solver) and the PuLP ILP with CBC (HiGHS too when installed). CPU seconds include the solver
subprocess. Part 2 plans the three models of the paper's Table 6 (h 2048 / 24 layers / TP 4,
h 4096 / 16 / TP 4, h 8192 / 8 / TP 8; s 1024, 16 samples per TP group per iteration as in
Table 4) on a 24 GiB device, with and without the exposed gradient all-reduce.

All times are the cost model's predictions on the analytical device model, not measurements:
the runtime that executes a per-block plan is not built yet.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import resource
import sys
import time

from megatron_oases.plan.cost_model import build_cost_model
from megatron_oases.plan.graph import PlanModel
from megatron_oases.plan.ilp import evaluate, min_memory, solve
from megatron_oases.plan.plan_file import compact_notation
from megatron_oases.topology import load_topology

GiB = float(1 << 30)
TABLE6 = ((2048, 24, 32, 4, 4), (4096, 16, 64, 4, 4), (8192, 8, 128, 8, 8))  # h, L, heads, T, micro-batch


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def timed(problem, solver: str, limit: float | None):
    c0, w0 = _cpu(), time.perf_counter()
    try:
        sol = solve(problem, solver=solver, time_limit=None if solver in ("auto", "dp") else limit)
        err = ""
    except Exception as e:  # noqa: BLE001 - a timed-out ILP is reported, not fatal
        sol, err = None, str(e).splitlines()[0]
    return sol, time.perf_counter() - w0, _cpu() - c0, err


def bench_solve(topo, solvers, limit, rows):
    m = PlanModel(num_layers=48, hidden_size=4096, num_attention_heads=32, seq_length=1024, micro_batch_size=8, tp=8,
                  dtype="bf16")
    cm = build_cost_model(m, topology=topo, global_batch_size=2 * 8 * (topo.world_size // 8))  # 2 micro-batches
    n, k = cm.problem.node.shape
    lo, _ = min_memory(cm.problem)
    hi = evaluate(cm.problem, cm.uniform(2))[1]
    print(f"== solve time: {n} blocks x {k} strategies (h 4096, 48 layers, TP 8 on {topo.name}); "
          f"budget from {lo / GiB:.1f} to {hi / GiB:.1f} GiB ==")
    print(f"{'budget GiB':>10}  {'solver':>6}  {'wall ms':>9}  {'cpu ms':>9}  {'pred ms':>9}  plan")
    for frac in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, None):
        budget = None if frac is None else lo + frac * (hi - lo) + 1e-3 * GiB
        p = dataclasses.replace(cm.problem, budget=budget)
        for s in solvers:
            sol, wall, cpu, err = timed(p, s, limit)
            plan = compact_notation([cm.strategies[a].degree for a in sol.assignment]) if sol else err
            pred = f"{sol.time_ms:.1f}" if sol else "-"
            label = "none" if budget is None else f"{budget / GiB:.1f}"
            print(f"{label:>10}  {(sol.solver if sol else s):>6}  {wall * 1e3:9.1f}  {cpu * 1e3:9.1f}  "
                  f"{pred:>9}  {plan}")
            rows.append({"part": "solve", "model": "h4096-L48-T8", "blocks": n, "strategies": k, "budget_gib": label,
                         "solver": sol.solver if sol else s, "wall_ms": round(wall * 1e3, 2),
                         "cpu_ms": round(cpu * 1e3, 2), "predicted_ms": pred, "plan": plan})


def bench_table6(topo, solvers, limit, memory_gb, rows):
    print(f"\n== Table 6 models on {topo.name}, {memory_gb:g} GiB, s 1024, 16 samples per TP group per iteration ==")
    print(f"{'model':>14}  {'grad sync':>9}  {'gran.':>5}  {'uniform ms':>10}  {'planned ms':>10}  {'x':>6}  "
          f"{'GiB':>5}  {'dp ms':>6}  {'ilp ms':>7}  plan")
    for h, L, a, T, mb in TABLE6:
        dp = topo.world_size // T
        m = PlanModel(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=1024, micro_batch_size=mb, tp=T,
                      dtype="bf16")
        for grad in ("exposed", "none"):
            for gran in ("layer", "block"):
                cm = build_cost_model(m, topology=topo, global_batch_size=16 * dp, memory_gb=memory_gb,
                                      grad_sync=grad == "exposed", granularity=gran)
                uni_t, _ = evaluate(cm.problem, cm.uniform(T))
                res = {s: timed(cm.problem, s, limit) for s in solvers}
                sol = res["dp"][0]
                for s in solvers[1:]:
                    other = res[s][0]
                    if other is not None and abs(other.time_ms - sol.time_ms) > 1e-6 * sol.time_ms:
                        print(f"warning: {s} found {other.time_ms:.3f} ms, the DP {sol.time_ms:.3f} ms")
                degs = [cm.strategies[k].degree for k in sol.assignment]
                plan = compact_notation(degs[::2] if gran == "layer" else degs)
                ilp_ms = [f"{res[s][1] * 1e3:.0f}" if res[s][0] else "t/o" for s in solvers if s != "dp"]
                name = f"h{h}-L{L}-T{T}"
                print(f"{name:>14}  {grad:>9}  {gran:>5}  {uni_t:10.1f}  {sol.time_ms:10.1f}  "
                      f"{uni_t / sol.time_ms:6.3f}  "
                      f"{sol.memory_bytes / GiB:5.1f}  {res['dp'][1] * 1e3:6.1f}  {'/'.join(ilp_ms) or '-':>7}  {plan}")
                rows.append({"part": "table6", "model": name, "blocks": len(degs), "strategies": len(cm.strategies),
                             "budget_gib": memory_gb, "solver": "dp", "wall_ms": round(res["dp"][1] * 1e3, 2),
                             "cpu_ms": round(res["dp"][2] * 1e3, 2), "predicted_ms": round(sol.time_ms, 2),
                             "plan": plan, "granularity": gran, "grad_sync": grad,
                             "uniform_tp_ms": round(uni_t, 2), "ilp_wall_ms": "/".join(ilp_ms)})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="pcie-3090-2node")
    p.add_argument("--memory-gb", type=float, default=24.0)
    p.add_argument("--csv", default="bench_planner.csv")
    p.add_argument("--ilp-limit", type=float, default=20.0, help="time limit per ILP solve, s")
    p.add_argument("--no-ilp", action="store_true", help="time the DP only")
    a = p.parse_args(argv)
    topo = load_topology(a.topology)
    solvers = ["dp"] + ([] if a.no_ilp else ["cbc"])
    import importlib.util
    if not a.no_ilp and importlib.util.find_spec("highspy") is not None:
        solvers.append("highs")
    rows: list[dict] = []
    bench_solve(topo, solvers, a.ilp_limit, rows)
    bench_table6(topo, solvers, a.ilp_limit, a.memory_gb, rows)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k) if k in rows[-1] else 99)
    with open(a.csv, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {a.csv}. Predicted times (cost model on the analytical device model), not measured throughput.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
