"""Planner against measurement: per-layer TP plans run by the trainer on the emulated interconnect.

The topology is a scaled-down version of the paper's Appendix B cluster: 2 nodes x 2 ranks, with a
faster link inside a node than between nodes. The TP group is all 4 ranks (T = 4), so a degree-2
layer talks inside a node, a degree-4 layer across nodes, and a degree-1 layer not at all (but
holds 4x the weights of degree 4). For a set of per-layer plans this script

1. prices every plan with the planner's cost model (Eq. 3-6) from a profile of exactly the
   events it prices, measured by the simulator's emulated profiler on the same topology with all
   ranks busy (so compute carries the run's CPU contention and collectives the links' real
   cost; ``--pricing links`` instead measures compute on one thread and prices collectives from
   the link rates). The replica gradient all-reduce is charged as exposed (``--grad-sync``),
   because the runtime issues it after backward;
2. runs each plan with ``megatron-oases train --schedule oases --oases-plan`` (or the stock
   schedule, ``--schedule stock``) on the emulated cluster, in ``--repeats`` rounds over all
   plans, and takes the median step time;
3. reports the Spearman rank correlation of predicted against measured times (the paper's
   Appendix C reports 0.84-0.88), and the planner's choice under a memory budget against uniform
   TP = 4 (throughput without and with the plan), with plan and solve times.

Prints a table, writes CSV and JSON. Needs root for the emulation (``--no-emulate`` runs plain
local ranks: a smoke test, not a measurement). Timed runs hold ``/tmp/oases_bench.lock``.

    python scripts/bench_plan_runtime.py --out results/plan_runtime
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time


from megatron_oases.describe.split import sub_batches_at
from benchmarks.harness import (RECOMPUTE, TRAINER, add_model_args, bench_lock, fmt,
                                  launch_ranks, loadavg, model_flags, print_table, step_stats,
                                  two_level_topology_yaml, write_topology)

SCHEDULES = {"stock": ["--schedule", "default"] + RECOMPUTE, "oases": ["--schedule", "oases"] + RECOMPUTE}
def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def plan_model(a):
    from megatron_oases.plan.graph import PlanModel
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser
    from megatron_oases.sim.frontends.predict import run_core_attention
    from megatron_oases.vocab import padded_vocab_size

    targs = run_config(build_parser().parse_args(model_flags(a, a.tp)))
    return PlanModel(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                     seq_length=a.seq, micro_batch_size=a.micro_batch, tp=a.tp,
                     padded_vocab_size=padded_vocab_size(targs), dtype="fp32", recompute=True,
                     sub_batches=sub_batches_at(a.tp, oases=a.schedule == "oases"),
                     core_attention=run_core_attention(targs))  # what the measured runs run


def profiled_pricer(a, m, topo, workdir: str):
    """Measure every event the cost model prices into a profile DB; returns (path, how).

    ``emulated`` (default when emulating): compute and collectives measured by the simulator's
    emulated profiler on the run's own topology, with all 4 ranks busy at once, as in the run.
    ``links``: compute measured here on one thread, times ranks / cores when the ranks outnumber
    the cores; collectives priced from the topology's link rates."""
    from megatron_oases.plan.cost_model import build_cost_model
    from megatron_oases.plan.pricing import DevicePricer

    probe = DevicePricer(topology=topo, model=m)
    build_cost_model(m, topology=topo, global_batch_size=a.micro_batch * a.micro_batches, pricer=probe,
                     granularity="layer", grad_sync=True)
    path = os.path.join(workdir, "profile.json")
    if a.pricing == "emulated":
        from megatron_oases.sim.calibrate.emulated_profile import profile_emulated
        from megatron_oases.sim.core.strategy import Strategy

        with bench_lock():
            db = profile_emulated(probe.events, topo, Strategy(tp=a.tp, num_microbatches=a.micro_batches),
                                  reps=a.profile_reps)
        db.save(path)
        return path, "compute and collectives measured on the emulated cluster, all ranks busy"
    from megatron_oases.sim.calibrate.profiler import ProfileSettings, profile_events

    compute = {k: e for k, e in probe.events.items() if e.kind == "compute"}
    with bench_lock():
        db = profile_events(compute, topo, ProfileSettings(nproc=1, device="cpu", threads=1,
                                                           warmup=2, reps=a.profile_reps))
    factor = max(1.0, a.tp / (os.cpu_count() or 1))
    db = dataclasses.replace(db, events_ms={k: v * factor for k, v in db.events_ms.items()})
    db.save(path)
    return path, f"compute measured on one thread x {factor:g} (ranks / cores), collectives from link rates"


def cost_model(a, m, topo, profile_path, memory_gb=None):
    from megatron_oases.plan.cost_model import build_cost_model
    from megatron_oases.plan.pricing import DevicePricer

    # Collectives are not in the profile: they are priced from the topology's link rates.
    pricer = DevicePricer(topology=topo, model=m, profile_path=profile_path)
    cm = build_cost_model(m, topology=topo, global_batch_size=a.micro_batch * a.micro_batches,
                          pricer=pricer, granularity="layer", memory_gb=memory_gb,
                          grad_sync=a.grad_sync == "exposed")
    unmeasured = [k for k in pricer.missing if k.startswith("compute:")]
    if unmeasured:
        raise RuntimeError(f"compute events missing from the profile: {unmeasured[:3]}")
    return cm


def assignment(cm, layer_degrees) -> tuple[int, ...]:
    return tuple(cm.degrees.index(d) for d in layer_degrees for _ in range(2))


def write_plan(path: str, tp: int, layer_degrees) -> None:
    from megatron_oases.plan.plan_file import PLAN_FORMAT, write_plan as _write

    _write(path, {"format": PLAN_FORMAT, "tensor_model_parallel_size": tp,
                  "num_layers": len(layer_degrees),
                  "degrees": [d for d in layer_degrees for _ in range(2)]})


def run_plan(a, layer_degrees, workdir: str, topo_path: str | None) -> dict:
    tag = "-".join(map(str, layer_degrees))
    plan = os.path.join(workdir, f"plan-{tag}.json")
    write_plan(plan, a.tp, layer_degrees)
    log = os.path.join(workdir, f"plan-{tag}.jsonl")
    flags = model_flags(a, a.tp) + SCHEDULES[a.schedule] + ["--oases-plan", plan, "--log-json", log]
    with bench_lock():
        load = loadavg().split()[0]
        launch_ranks(TRAINER + flags, a.tp, topology=topo_path, timeout=a.timeout)
    return {**step_stats(log, a.warmup), "loadavg_before": float(load)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, hidden=256, heads=8, seq=64, iters=6, warmup=2, layers=4)
    p.set_defaults(micro_batch=8)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="oases",
                   help="executor of the plans (the cost model uses 2 sub-batches for oases, 1 for stock)")
    p.add_argument("--intra-GBps", type=float, default=0.1)
    p.add_argument("--inter-GBps", type=float, default=0.025)
    p.add_argument("--plans", default="4444,2222,1111,2244,4422,1144,4411,1224,2121",
                   help="comma-separated per-layer plans, one digit per layer")
    p.add_argument("--budget", type=float, default=None,
                   help="planner memory budget in GiB (default: the uniform degree-2 plan's memory)")
    p.add_argument("--profile-reps", type=int, default=5)
    p.add_argument("--pricing", choices=("emulated", "links"), default=None,
                   help="how events are priced (default: emulated when emulating, else links)")
    p.add_argument("--grad-sync", choices=("exposed", "none"), default="exposed",
                   help="exposed (default): charge the replica gradient all-reduce, which the "
                        "runtime issues after backward (finalize_model_grads), unoverlapped")
    p.add_argument("--repeats", type=int, default=2, help="rounds over all plans (median of rounds)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-emulate", action="store_true")
    p.add_argument("--out", default="bench_plan_runtime")
    a = p.parse_args(argv)
    if a.pricing is None:
        a.pricing = "links" if a.no_emulate else "emulated"
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from megatron_oases.plan.ilp import evaluate, solve
    from megatron_oases.plan.plan_file import compact_notation
    from megatron_oases.topology import load_topology

    workdir = tempfile.mkdtemp(prefix="bench-plan-")
    topo_path = write_topology(workdir, "topology", two_level_topology_yaml(
        "bench-plan-2x2", "2 nodes x 2 ranks, fast intra / slow inter", a.intra_GBps,
        a.inter_GBps, device="rtx-3090"))
    topo = load_topology(topo_path)
    m = plan_model(a)
    t0 = time.perf_counter()
    profile, pricing = profiled_pricer(a, m, topo, workdir)
    profile_s = time.perf_counter() - t0
    cm = cost_model(a, m, topo, profile)
    plans = [tuple(int(c) for c in s) for s in a.plans.split(",")]
    uniform2 = evaluate(cm.problem, assignment(cm, (2,) * a.layers))[1]
    budget = a.budget if a.budget is not None else uniform2 / float(1 << 30)
    t0 = time.perf_counter()
    cmb = cost_model(a, m, topo, profile, memory_gb=budget)
    sol = solve(cmb.problem)
    plan_s = time.perf_counter() - t0
    chosen = tuple(cmb.strategies[k].degree for k in sol.assignment[::2])
    if chosen not in plans:
        plans.append(chosen)
    runs: dict = {layers: [] for layers in plans}
    for rep in range(a.repeats):  # rounds over all plans, so slow spells hit every plan alike
        for layers in plans:
            runs[layers].append(run_plan(a, layers, workdir, None if a.no_emulate else topo_path))
            print(f"  round {rep + 1}: plan {''.join(map(str, layers))} "
                  f"{runs[layers][-1]['step_ms']:8.1f} ms", flush=True)
    rows = []
    for layers in plans:
        pred_ms, mem = evaluate(cm.problem, assignment(cm, layers))
        meas = runs[layers]
        row = {"plan": "".join(map(str, layers)), "compact": compact_notation(layers),
               "predicted_ms": round(pred_ms, 1),
               "measured_ms": round(statistics.median(m["step_ms"] for m in meas), 1),
               "measured_min_ms": round(min(m["step_ms_min"] for m in meas), 1),
               "predicted_mem_mib": round(mem / 2**20, 1), "fits_budget": mem <= budget * (1 << 30),
               "planner_pick": layers == chosen, "loss": meas[-1]["loss"],
               "loadavg_before": max(m["loadavg_before"] for m in meas),
               "runs_ms": [round(m["step_ms"], 1) for m in meas]}
        rows.append(row)
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    base = next((r for r in rows if r["plan"] == str(a.tp) * a.layers), None)
    pick = next(r for r in rows if r["planner_pick"])
    summary = {
        "spearman": round(rho, 3), "plans": len(rows), "budget_gib": budget,
        "planner_pick": pick["compact"], "plan_s": round(plan_s, 3), "solve_s": round(sol.solve_s, 4),
        "profile_s": round(profile_s, 1), "pricing": pricing, "grad_sync": a.grad_sync,
        "uniform_tp_ms": base["measured_ms"] if base else None, "pick_ms": pick["measured_ms"],
        "speedup_vs_uniform_tp": round(base["measured_ms"] / pick["measured_ms"], 3) if base else None,
        "schedule": a.schedule, "emulated": not a.no_emulate, "intra_GBps": a.intra_GBps, "inter_GBps": a.inter_GBps,
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq,
                  "micro_batch": a.micro_batch, "micro_batches": a.micro_batches, "tp": a.tp},
    }
    cols = ["plan", "compact", "predicted_ms", "measured_ms", "measured_min_ms",
            "predicted_mem_mib", "fits_budget", "planner_pick", "loadavg_before", "runs_ms"]
    print_table(rows, cols)
    print(f"Spearman(predicted, measured) = {fmt(rho)} over {len(rows)} plans")
    print(f"planner pick under {budget:.4f} GiB: {pick['compact']} ({summary['pick_ms']} ms) vs uniform "
          f"TP {a.tp}: {summary['uniform_tp_ms']} ms -> {summary['speedup_vs_uniform_tp']}x; plan "
          f"{summary['plan_s']} s (solve {summary['solve_s']} s), profile {summary['profile_s']} s")
    with open(os.path.join(a.out, "plan_runtime.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols + ["loss"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(a.out, "plan_runtime.json"), "w", encoding="utf-8") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}/plan_runtime.csv and plan_runtime.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
