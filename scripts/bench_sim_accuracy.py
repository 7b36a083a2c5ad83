"""Accuracy of the simulator against the reference trainer on the emulated interconnect.

For each configuration (TP / PP / DP, stock and Oases schedule, a pipeline bubble, overlap):

  1. profile  every event the trainer run needs, on the run's own emulated cluster: as many
              profiling ranks as the run, the same thread settings, the same rate-limited links;
              collectives with every group that runs them at once in the trainer running them
              concurrently; compute with 1..PP stages' ranks busy at once (ranks outnumber the 2
              cores, so compute slows when ranks compute together: this measures that slow-down,
              and the simulator applies it by how many stages compute at each moment)
              (``sim.calibrate.emulated_profile``)
  2. measure  ``megatron-oases train`` on the same emulated cluster: median "elapsed time per
              iteration" after the warm-up iterations, over ``--runs`` launches; profiles and
              launches alternate (the box's speed drifts by several percent within an hour)
  3. predict  ``sim.frontends.predict.predict_train_step`` from that profile alone (with ``--profiles N``,
              N profiles combined by per-time median, ``ProfileDB.median_of``; the spread between
              them is printed)

Every profile and every trainer launch holds ``/tmp/oases_bench.lock`` (flock), so benchmarks of
other sessions do not overlap them; the load average is recorded next to each number. Prints
the table (config, predicted, measured, error), the median and max |error|, and writes
``<out>.csv`` and ``<out>.json``.

    python scripts/bench_sim_accuracy.py --out /tmp/sim_accuracy/acc
    python scripts/bench_sim_accuracy.py --configs tp2 pp2 --runs 1      # a subset
    python scripts/bench_sim_accuracy.py --configs tp2 --runs 0          # profile agreement only
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import harness
from benchmarks.harness import loadavg, step_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (trainer flags for the split / schedule, what it exercises)
CONFIGS = {
    "tp2": (["--tensor-model-parallel-size", "2"], "TP 2, stock: compute waits on every all-reduce"),
    "tp2-oases": (["--tensor-model-parallel-size", "2", "--schedule", "oases"],
                  "TP 2, Oases: sub-batch all-reduces overlap compute"),
    "pp2": (["--pipeline-model-parallel-size", "2"], "PP 2, 1F1B: pipeline bubble, P2P"),
    "dp2": (["--data-parallel-size", "2"], "DP 2: gradient all-reduce"),
    "tp2pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
               "TP 2 x PP 2: 4 ranks on 2 cores, bubble + contention that varies with the schedule"),
    "tp2dp2": (["--tensor-model-parallel-size", "2", "--data-parallel-size", "2"],
               "TP 2 x DP 2: 4 ranks on 2 cores, TP intra-node, DP across nodes"),
    "tp2pp2-oases": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--schedule", "oases"], "TP 2 x PP 2, Oases"),
    "dp2pp2": (["--data-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
               "DP 2 x PP 2: P2P and DP across nodes"),
    "tp2dp2-oases": (["--tensor-model-parallel-size", "2", "--data-parallel-size", "2",
                      "--schedule", "oases"], "TP 2 x DP 2, Oases: sub-batch overlap, then the DP all-reduce"),
    "pp2-vp2": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                "PP 2 interleaved: 2 virtual stages of 1 layer per rank"),
    "atp12": (["--tensor-model-parallel-size", "2", "--tp-backend", "atp", "--atp-mesh", "1,2"],
              "ATP mesh 1x2: hidden states split in 2, row-first linears"),
    "atp12-oases": (["--tensor-model-parallel-size", "2", "--tp-backend", "atp", "--atp-mesh", "1,2",
                     "--schedule", "oases"], "Oases over ATP 1x2"),
    "3d": (["--tensor-model-parallel-size", "8", "--tp-backend", "3d"],
           "3-D cube p = 2: 8 ranks on 2 cores, all-gathers and reduce-scatters on lines of 2"),
}
DEFAULT_CONFIGS = ["tp2", "tp2-oases", "pp2", "dp2", "tp2pp2", "tp2dp2", "tp2pp2-oases"]


def runnable_now(samples: int = 10, dt: float = 0.1) -> float:
    """Mean number of runnable tasks besides this one over ``samples x dt`` seconds (/proc/loadavg's
    4th field counts the reader itself)."""
    vals = []
    for _ in range(samples):
        try:
            vals.append(int(open("/proc/loadavg", encoding="utf-8").read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return 0.0
        time.sleep(dt)
    return sum(vals) / len(vals)


def wait_quiet(max_runnable: float, max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until other processes leave the cores mostly idle; returns the
    last runnable-task reading. Other sessions' unit tests do not take the benchmark lock."""
    end = time.time() + max_wait_s
    r = runnable_now()
    while r > max_runnable and time.time() < end:
        time.sleep(2.0)
        r = runnable_now()
    return r


@contextlib.contextmanager
def bench_lock():
    """``harness.bench_lock``, saying when it had to wait."""
    with harness.bench_lock() as waited:
        if waited > 1:
            print(f"    (waited {waited:.0f} s for {harness.BENCH_LOCK})", flush=True)
        yield


def topology_yaml(world: int, a) -> str:
    """Two ranks: one emulated node. Four: 2 nodes x 2 ranks (TP inside a node, DP / PP across).
    Eight (the 3-D cube): one node."""
    if world == 2:
        return harness.topology_yaml("acc-flat2", "bench_sim_accuracy, 1 node x 2 ranks",
                                          [("lo", 2, "intra_node", a.intra_GBps, 20)])
    if world == 4:
        # 4 ranks share 2 cores: compute is ~2x slower, so the links are too (comm ~ compute)
        return harness.two_level_topology_yaml("acc-2x2", "bench_sim_accuracy, 2 nodes x 2 ranks",
                                                    a.intra_GBps / 2, a.inter_GBps)
    if world == 8:
        # 8 ranks share 2 cores: compute is ~4x slower, so the links are too
        return harness.topology_yaml("acc-flat8", "bench_sim_accuracy, 1 node x 8 ranks",
                                   [("lo", 8, "intra_node", a.intra_GBps / 4, 20)])
    raise SystemExit(f"no topology for {world} ranks")


def train_flags(a, split: list[str], topo_path: str) -> list[str]:
    dp = int(split[split.index("--data-parallel-size") + 1]) if "--data-parallel-size" in split else 1
    split = [x for i, x in enumerate(split) if x != "--data-parallel-size"
             and (i == 0 or split[i - 1] != "--data-parallel-size")]
    return split + ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
                    "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
                    "--micro-batch-size", str(a.micro_batch),
                    "--global-batch-size", str(a.micro_batch * a.micro_batches * dp),
                    "--vocab-size", str(a.vocab), "--train-iters", str(a.iters), "--device", "cpu",
                    "--no-tp-invariant-init", "--dist-timeout", "300", "--topology", topo_path]


def world_of(split: list[str]) -> int:
    w = 1
    for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--data-parallel-size"):
        if f in split:
            w *= int(split[split.index(f) + 1])
    return w


def measure(flags: list[str], topo, a, log: str) -> dict:
    """One trainer launch on the emulated cluster; the median step after the warm-up."""
    from megatron_oases.topology.emulate import EmulatedCluster

    pre = ["nice", "-n", str(a.nice)] if a.nice else []
    cmd = pre + [sys.executable, "-m", "megatron_oases.train"] + flags + ["--log-json", log]
    with bench_lock():
        busy = wait_quiet(a.max_runnable, a.max_wait)
        load = f"{loadavg()} (runnable {busy:.1f})"
        t0 = time.time()
        with EmulatedCluster(topo) as cluster:
            res = cluster.launch(cmd, timeout=a.timeout, cwd=ROOT)
    if not res.ok:
        raise RuntimeError("trainer failed:\n" + "\n".join(o[-2000:] for o in res.outputs))
    st = step_stats(log, a.warmup)
    return {**st, "loadavg": load, "wall_s": round(time.time() - t0, 1)}


def run_config(name: str, a, work: str) -> dict:
    from megatron_oases.pricing.device_model import ProfileDB
    from megatron_oases.sim.calibrate.emulated_profile import profile_emulated
    from megatron_oases.sim.core.events import build_stage_events, overlapped_keys, unique_events
    from megatron_oases.sim.frontends.predict import predict_train_step, sim_inputs_from_train_args
    from megatron_oases.topology import load_topology
    from megatron_oases.train_args import build_parser

    split, what = CONFIGS[name]
    world = world_of(split)
    topo_path = os.path.join(work, f"topo{world}.yaml")
    with open(topo_path, "w", encoding="utf-8") as f:
        f.write(topology_yaml(world, a))
    topo = load_topology(topo_path)
    flags = train_flags(a, split, topo_path)
    args = build_parser().parse_args(flags)
    model, strategy = sim_inputs_from_train_args(args, world)
    stages = build_stage_events(model, strategy, topo)
    events = unique_events(stages)
    print(f"[{name}] {what}; {strategy.label}, {strategy.num_microbatches} micro-batches, "
          f"{len(events)} events", flush=True)
    profiles, runs = [], []
    # profiles and trainer launches alternate: the box's speed drifts by several percent within an
    # hour, and alternating puts both sides of the comparison under the same drift
    for n in range(max(a.profiles, a.runs)):
        if n < a.profiles:
            t0 = time.time()
            with bench_lock():
                busy = wait_quiet(a.max_runnable, a.max_wait)
                prof_load = f"{loadavg()} (runnable {busy:.1f})"
                db = profile_emulated(events, topo, strategy, warmup=a.prof_warmup, reps=a.prof_reps, nice=a.nice,
                                      overlap=overlapped_keys(stages))
            db.save(os.path.join(a.out_dir, f"profile-{name}{'' if n == 0 else f'-{n}'}.json"))
            pred = predict_train_step(args, db, world_size=world, topology=topo).iteration_ms
            profiles.append((db, pred, prof_load))
            print(f"    profile {n}: {time.time() - t0:.0f} s (load {prof_load}), predicts {pred:.1f} ms", flush=True)
        if n < a.runs:
            r = measure(flags, topo, a, os.path.join(work, f"{name}-{n}.jsonl"))
            runs.append(r)
            print(f"    run {n}: median {r['step_ms']:.1f} ms, steps {r['steps_ms']} (load {r['loadavg']})",
                  flush=True)
    spread = profile_spread([db for db, _, _ in profiles])
    combined = ProfileDB.median_of([db for db, _, _ in profiles])  # every time's median over the profiles
    if len(profiles) > 1:
        combined.save(os.path.join(a.out_dir, f"profile-{name}-median.json"))
        print(f"    profiles agree: predictions {', '.join(f'{p:.1f}' for _, p, _ in profiles)} ms; largest event "
              f"spread {spread['max_pct']:.1f}% ({spread['max_key']}), median {spread['median_pct']:.1f}%", flush=True)
    preds = [p for _, p, _ in profiles]
    res = predict_train_step(args, combined, world_size=world, topology=topo)
    predicted = res.iteration_ms
    measured = statistics.median(s for r in runs for s in r["steps_ms"]) if runs else None
    err = 100.0 * (predicted - measured) / measured if runs else None
    row = {"config": name, "strategy": strategy.label, "ranks": world, "micro_batches": strategy.num_microbatches,
           "predicted_ms": round(predicted, 1), "predictions_ms": [round(p, 1) for p in preds],
           "measured_ms": round(measured, 1) if runs else None, "error_pct": round(err, 1) if runs else None,
           "bubble_pct": round(100 * res.bubble_fraction, 1), "exposed_comm_ms": round(res.exposed_comm_ms, 1),
           "profile_spread": spread, "profile_load": [ld for _, _, ld in profiles],
           "run_loads": [r["loadavg"] for r in runs], "steps_ms": [r["steps_ms"] for r in runs],
           "what": what}
    if not runs:
        return row
    print(f"    predicted {row['predicted_ms']} ms, measured {row['measured_ms']} ms, error {err:+.1f}%",
          flush=True)
    return row


def profile_spread(dbs: list) -> dict:
    """How much repeated profiles of one configuration disagree: per event (max / min - 1) in
    percent over the profiles' all-busy times; the median and the largest, with its key."""
    if len(dbs) < 2:
        return {"median_pct": 0.0, "max_pct": 0.0, "max_key": None}
    pct = {k: 100.0 * (max(db.events_ms[k] for db in dbs) / min(db.events_ms[k] for db in dbs) - 1.0)
           for k in dbs[0].events_ms if all(db.events_ms.get(k, 0) > 0 for db in dbs)}
    key = max(pct, key=pct.get)
    return {"median_pct": round(statistics.median(pct.values()), 1), "max_pct": round(pct[key], 1), "max_key": key}


def error_summary(rows: list[dict]) -> dict:
    """Median and max |error| over the rows (percent)."""
    errs = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    return {"median_abs_error_pct": round(statistics.median(errs), 1) if errs else None,
            "max_abs_error_pct": round(max(errs), 1) if errs else None, "configs": len(errs)}


def format_table(rows: list[dict]) -> str:
    """Markdown table: config, strategy, predicted, measured, error."""
    lines = ["| config | strategy | ranks | predicted ms | measured ms | error % |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        meas = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        err = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f}"
        lines.append(f"| {r['config']} | {r['strategy']} | {r['ranks']} | {r['predicted_ms']:.1f} | {meas} | {err} |")
    s = error_summary(rows)
    lines.append(f"\nmedian |error| {s['median_abs_error_pct']}%, max |error| {s['max_abs_error_pct']}% "
                 f"over {s['configs']} configurations" if s["configs"] else "\nno configuration measured (--runs 0)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4, help="per DP replica (the PP bubble needs >= PP)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="iterations dropped from each run")
    p.add_argument("--runs", type=int, default=3,
                   help="trainer launches per configuration (0: profile and predict only)")
    p.add_argument("--prof-warmup", type=int, default=2)
    p.add_argument("--prof-reps", type=int, default=25)
    p.add_argument("--profiles", type=int, default=3,
                   help="profiles per configuration: the prediction uses every time's median over them "
                        "(ProfileDB.median_of), and the per-event spread between them is printed")
    p.add_argument("--intra-GBps", type=float, default=0.1,
                   help="per-rank intra-node rate with 2 ranks (halved with 4 ranks on the cores)")
    p.add_argument("--inter-GBps", type=float, default=0.1, help="per-node NIC rate with 4 ranks")
    p.add_argument("--max-runnable", type=float, default=1.0,
                   help="before each timed part wait until at most this many other tasks are runnable")
    p.add_argument("--max-wait", type=float, default=30, help="... but no longer than this (s)")
    p.add_argument("--nice", type=int, default=-10,
                   help="nice value of the profiling and trainer ranks (negative needs root): unrelated "
                        "processes on the box then perturb them less; 0 to leave it")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="/tmp/sim_accuracy/acc", help="prefix of the CSV / JSON / profiles")
    a = p.parse_args(argv)
    a.out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(a.out_dir, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sim_acc") as work:
        for name in a.configs:
            rows.append(run_config(name, a, work))
            with open(a.out + ".json", "w", encoding="utf-8") as f:  # partial results survive a crash
                json.dump({"config": {k: v for k, v in vars(a).items()}, "rows": rows,
                           "summary": error_summary(rows)}, f, indent=1)
    print(f"\nhidden {a.hidden}, heads {a.heads}, layers {a.layers}, seq {a.seq}, micro-batch "
          f"{a.micro_batch} x {a.micro_batches}, fp32, CPU, {os.cpu_count()} cores; links: "
          f"{a.intra_GBps} GB/s per rank (2 ranks), {a.intra_GBps / 2} intra + {a.inter_GBps} inter (4 ranks)")
    print(format_table(rows))
    cols = ["config", "strategy", "ranks", "micro_batches", "predicted_ms", "predictions_ms", "measured_ms", "error_pct",
            "bubble_pct", "exposed_comm_ms", "profile_load", "run_loads"]
    with open(a.out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {a.out}.csv and {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
