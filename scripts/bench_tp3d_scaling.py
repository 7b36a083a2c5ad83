"""Weak and strong scaling of 1-D Megatron TP, ATP 2-D meshes and 3-D TP on the emulated
interconnect: the 3-D paper's Tables 1 and 2 (Bian et al. 2021, §4.2) at the sizes a small box
can run.

    python scripts/bench_tp3d_scaling.py --study strong --out results/tp3d_scaling_strong
    python scripts/bench_tp3d_scaling.py --study weak   --out results/tp3d_scaling_weak

Rank counts P = 1, 2, 4, 8 (8 ranks is a cube of side p = 2; p = 3 would need 27 ranks):

  P=1  serial    TP=1 (no TP); run twice: with every core of the box (the time baseline) and
                 with one compute thread (the one-core work baseline, see "box" below)
  P=2  1d        --tp-backend megatron, TP=2
  P=4  1d, atp (2,2)
  P=8  1d, atp (4,2), atp (8,1), 3d (cube p=2)

strong  one model and batch for every P (default hidden 512, 8 heads, 2 layers, seq 64,
        micro-batch 8 x 2): speedup = t(serial) / t(P), efficiency = speedup / P.
weak    the problem grows with P as in the paper's Table 1 ("we mainly adjust the batch size and
        hidden size"): P = 4^a 2^c (c in {0, 1}) gets hidden h0 2^a and micro-batch b0 2^c, so the
        GEMM work per rank (tokens x h^2 / P) is constant and the weights per rank alternate between
        1 and 1/2 of the serial model's (default h0 256, b0 4: 256/4, 256/8, 512/4, 512/8).
        Efficiency = t(serial) / t(P) (ideal 1).

Every run is one trainer launch of P ranks in one emulated node (flat topology, ``--link-GBps``
per rank: the node's lo is limited to P x that, so every rank has the same link at every P; a
1-rank run has no collective and runs without namespaces). Per run the counting trainer
(``python -m benchmarks.harness --timed``) records, per rank and step: wire bytes of every
collective (``CommCounter``, Megatron's own calls included), the time the rank spent blocked in
collectives (the call, or ``wait()`` of an async handle), the process CPU time (all threads) and the parameter bytes it holds. Each timed
run holds an exclusive ``flock`` on ``--lock`` (other benchmarks on the box wait, and this one
waits for them) and records ``/proc/loadavg``; ``--repeats`` launches each point that many times
(points interleaved). A launch's step time is the median of its timed steps; a point's is the
best launch's (other processes on a shared box only add time), with ``spread`` = how much slower
the worst launch was, and the pooled median of all launches' steps in the CSV / JSON.

What a box with fewer cores than ranks can show (``box`` columns): total compute does not scale
past the core count, so besides the paper's speedup / efficiency the tables give the box's own
ideal, ``ideal_box_ms`` = (one-thread serial time of one rank's share of work) x P / min(P, cores),
and ``eff_box`` = ideal_box_ms / step_ms; plus ``cpu_ms_sum`` (CPU time of all ranks per step: the
work the cores must do, parallel overhead included) and the bytes per rank, which do not depend on
the box at all.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import sys
import tempfile
import time


from benchmarks import harness
from benchmarks.harness import predicted_layer_mb
from megatron_oases.describe.atp_meshes import atp_mesh_refusal
from megatron_oases.describe.cube_3d import cube_root

RANKS = (1, 2, 4, 8)


# ---- pure helpers (tests/test_bench_tp3d_scaling.py) --------------------------------------------
def weak_shape(P: int, h0: int, b0: int) -> tuple[int, int]:
    """(hidden, micro-batch) of the weak-scaling problem on P ranks: P = 4^a 2^c, c in {0, 1}
    -> (h0 2^a, b0 2^c). Tokens x h^2 grows as P (GEMM work per rank constant); h^2 grows as 4^a."""
    if P < 1 or P & (P - 1):
        raise ValueError(f"P must be a power of two (got {P})")
    k = P.bit_length() - 1
    return h0 * 2 ** (k // 2), b0 * 2 ** (k % 2)


def variants_for(P: int, meshes: dict[int, list[tuple[int, int]]], with_3d: bool = True
                 ) -> list[tuple[str, list[str], tuple[int, int] | None]]:
    """(label, trainer TP-backend flags, ATP mesh) for the runs at P ranks (P > 1)."""
    out = [("1d", ["--tp-backend", "megatron"], None)]
    for d1, d2 in meshes.get(P, []):
        refused = atp_mesh_refusal((d1, d2), P)  # describe.atp_meshes: ATP's rule, in the trainer's words
        if refused:
            raise ValueError(refused)
        out.append((f"atp ({d1},{d2})", ["--tp-backend", "atp", "--atp-mesh", f"{d1},{d2}"],
                    (d1, d2)))
    p = cube_root(P)  # describe.cube_3d: the one test of a cube
    if with_3d and p and p >= 2:
        out.append((f"3d p={p}", ["--tp-backend", "3d"], None))
    return out


def scaling_metrics(rows: list[dict], study: str, cores: int) -> None:
    """Add speedup / efficiency columns in place. Rows need ``P``, ``variant``, ``step_ms``;
    the baselines are the rows with variant ``serial`` (all cores) and ``serial 1thr``.

    t_serial is the faster of the two serial rows (the best the box does on one rank: under load,
    spinning OpenMP threads can make the all-cores run the slower one).
    strong: speedup = t_serial / t, eff = speedup / P; ideal_box = t_1thr / min(P, cores).
    weak:   eff = t_serial / t (the paper's weak efficiency, ideal 1);
            ideal_box = t_1thr x P / min(P, cores) (P times the work on min(P, cores) cores).
    eff_box = ideal_box / t. work_eff = cpu_ms_sum(serial 1thr) x (P if weak else 1) / cpu_ms_sum:
    the share of the CPU time that the one-core program would also spend."""
    serial = [r["step_ms"] for r in rows if r["variant"].startswith("serial") and r.get("step_ms")]
    t_serial = min(serial) if serial else None
    one = next((r for r in rows if r["variant"] == "serial 1thr"), None)
    for r in rows:
        P = r["P"]
        t = r.get("step_ms")
        if not t:
            continue
        if t_serial:
            if study == "strong":
                r["speedup"] = t_serial / t
                r["eff"] = r["speedup"] / P
            else:
                r["eff"] = t_serial / t
        if one:
            work = P if study == "weak" else 1
            r["ideal_box_ms"] = one["step_ms"] * work / min(P, cores)
            r["eff_box"] = r["ideal_box_ms"] / t
            if one.get("cpu_ms_sum") and r.get("cpu_ms_sum"):
                r["work_eff"] = one["cpu_ms_sum"] * work / r["cpu_ms_sum"]


def markdown_table(rows: list[dict], cols: list[str], headers: dict[str, str] | None = None) -> str:
    headers = headers or {}
    out = ["| " + " | ".join(headers.get(c, c) for c in cols) + " |",
           "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(harness.fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


# ---- launching ----------------------------------------------------------------------------------
def flat_topology(world: int, link_GBps: float, workdir: str) -> str:
    name = f"scaling-flat{world}"
    return harness.write_topology(workdir, name, harness.flat_topology_yaml(name, world, link_GBps))


def model_flags(a, P: int, hidden: int, micro_batch: int) -> list[str]:
    ns = argparse.Namespace(**{**vars(a), "hidden": hidden, "micro_batch": micro_batch})
    return harness.model_flags(ns, P)


def run_point(a, pt: dict, rep: int, workdir: str) -> dict:
    """One launch of a point; returns its per-run statistics."""
    P = pt["P"]
    topo = flat_topology(P, a.link_GBps, workdir)
    tag = f"{a.study}-P{P}-{pt['variant'].replace(' ', '_').replace('(', '').replace(')', '').replace(',', 'x').replace('=', '')}-r{rep}"
    log = os.path.join(workdir, tag + ".jsonl")
    stats = os.path.join(workdir, tag + ".stats")
    cmd = [*harness.counting_trainer(stats, timed=True), "--", "--topology", topo, *model_flags(a, P, pt["hidden"], pt["micro_batch"]), *pt["flags"],
           "--log-json", log]
    env = {"OMP_NUM_THREADS": "1"} if pt["variant"] == "serial 1thr" else {}
    with harness.bench_lock(a.lock) as waited:
        load0 = harness.loadavg()
        t0 = time.time()
        harness.launch_ranks(cmd, P, topology=None if a.no_emulate else topo, env=env, timeout=a.timeout)
        wall = time.time() - t0
        load1 = harness.loadavg()
    recs = [json.loads(line) for line in open(log, encoding="utf-8")]
    timed = [r["step_ms"] for r in recs[a.warmup:]] or [r["step_ms"] for r in recs]
    return {"steps_ms": timed, "loss": recs[-1]["lm_loss"], "wall_s": round(wall, 1),
            "lock_wait_s": round(waited, 1), "loadavg_before": load0, "loadavg_after": load1,
            **harness.rank_stats([f"{stats}.rank{r}.json" for r in range(P)], a.warmup)}


def points(a) -> list[dict]:
    meshes = {4: [(2, 2)], 8: [(4, 2), (8, 1)]}
    if a.atp_meshes is not None:
        meshes = {}
        for spec in a.atp_meshes:
            d1, d2 = (int(v) for v in spec.split(","))
            meshes.setdefault(d1 * d2, []).append((d1, d2))
    out = []
    for P in a.ranks:
        h, b = (a.hidden, a.micro_batch) if a.study == "strong" else weak_shape(P, a.hidden, a.micro_batch)
        if P == 1:
            vs = [("serial", ["--tp-backend", "megatron"], None),
                  ("serial 1thr", ["--tp-backend", "megatron"], None)]
        else:
            vs = variants_for(P, meshes, with_3d=not a.no_3d)
        for label, flags, mesh in vs:
            out.append({"P": P, "variant": label, "hidden": h, "micro_batch": b, "flags": flags,
                        "global_batch": b * a.micro_batches,
                        "pred_layer_MB": predicted_layer_mb(P, flags[1], mesh, seq=a.seq, micro_batch=b, hidden=h,
                                                            heads=a.heads, layers=a.layers,
                                                            micro_batches=a.micro_batches)})
    return out


COLS = ["P", "variant", "hidden", "global_batch", "step_ms", "spread", "ms_per_seq", "speedup", "eff",
        "ideal_box_ms", "eff_box", "comm_ms", "cpu_ms_rank", "cpu_ms_sum", "work_eff",
        "wire_MB_per_rank", "pred_layer_MB", "link_ms", "collectives_per_rank",
        "param_MB_max_rank", "peak_mem_mb_max_rank"]


METRICS = ("speedup", "eff", "ideal_box_ms", "eff_box", "work_eff")


PT_KEYS = ("P", "variant", "hidden", "micro_batch", "global_batch", "pred_layer_MB")


def aggregate(pt: dict, rs: list[dict], link_GBps: float) -> dict:
    """One table row from a point and its launches. Each launch's step time is the median of its
    timed steps; the row takes the launch with the smallest one (other processes on a shared box
    only ever add time) and its per-rank statistics. ``spread`` = (max - min) / min of the launch
    medians; ``step_ms_pooled`` = median over all timed steps of all launches."""
    meds = [statistics.median(r["steps_ms"]) for r in rs]
    best = rs[meds.index(min(meds))]
    step = min(meds)
    stats = {k: v for k, v in best.items()
             if isinstance(v, (int, float)) and k not in ("wall_s", "lock_wait_s", "loss")}
    return {**{k: pt[k] for k in PT_KEYS}, **stats, "step_ms": step,
            "step_ms_pooled": statistics.median([s for r in rs for s in r["steps_ms"]]),
            "spread": (max(meds) - step) / step if len(meds) > 1 else None,
            "run_medians_ms": [round(m, 1) for m in meds],
            "ms_per_seq": step / pt["global_batch"],
            "link_ms": stats.get("wire_MB_per_rank", 0) / link_GBps,
            "loss": best["loss"], "loadavg": [r["loadavg_before"] for r in rs],
            "loadavg_best": best["loadavg_before"], "kinds_rank0": best.get("kinds_rank0")}


def describe(cfg: dict, cores: int, started: str, done: str, loads: list[float]) -> str:
    study = cfg["study"]
    return (f"{study} scaling, {'NOT ' if cfg['no_emulate'] else ''}emulated flat node "
            f"{cfg['link_GBps']:g} GB/s per rank, {cores} cores; layers {cfg['layers']}, "
            f"heads {cfg['heads']}, seq {cfg['seq']}, {cfg['micro_batches']} micro-batches, "
            f"vocab {cfg['vocab']}, fp32; "
            + (f"hidden {cfg['hidden']}, micro-batch {cfg['micro_batch']}" if study == "strong" else
               f"hidden {cfg['hidden']} x 2^a, micro-batch {cfg['micro_batch']} x 2^c for P = 4^a 2^c")
            + f"; step = median of {cfg['iters'] - cfg['warmup']} steps after {cfg['warmup']} "
            f"warm-up, best of {cfg['repeats']} launches; {started} .. {done}; 1-min load average at the "
            f"start of the runs {min(loads):.2f}-{max(loads):.2f}")


def write_outputs(out: str, cfg: dict, cores: int, rows: list[dict], runs: dict,
                  started: str, done: str) -> None:
    for r in rows:
        for k in METRICS:
            r.pop(k, None)
    scaling_metrics(rows, cfg["study"], cores)
    loads = [float(r["loadavg_before"].split()[0]) for rs in runs.values() for r in rs]
    desc = describe(cfg, cores, started, done, loads)
    print("\n" + desc)
    harness.print_table(rows, COLS)
    with open(out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLS + ["micro_batch", "step_ms_pooled", "run_medians_ms",
                                                 "loadavg", "loadavg_best", "comm_ms_max_rank",
                                                 "cpu_ms_max_rank", "wire_MB_max_rank",
                                                 "param_MB_sum", "peak_mem_mb_min_rank", "loss"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump({"config": cfg, "cores": cores, "description": desc, "started": started,
                   "finished": done, "rows": rows, "runs": runs}, f, indent=1)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(desc + "\n\n" + markdown_table(rows, COLS) + "\n")
    print(f"wrote {out}.csv, {out}.json and {out}.md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--study", choices=["strong", "weak"])
    p.add_argument("--from-json", metavar="FILE",
                   help="recompute the metrics and tables of an earlier run's JSON (no runs)")
    p.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    p.add_argument("--atp-meshes", nargs="*", default=None, metavar="D1,D2",
                   help="ATP meshes to run (default 2,2 4,2 8,1)")
    p.add_argument("--no-3d", action="store_true")
    p.add_argument("--link-GBps", type=float, default=0.05, help="per-rank rate of the flat node")
    harness.add_model_args(p, hidden=512, heads=8, seq=64, iters=5, warmup=2)
    p.set_defaults(hidden=None, micro_batch=None)  # per study, below
    p.add_argument("--repeats", type=int, default=2, help="launches per point (interleaved)")
    p.add_argument("--lock", default=harness.BENCH_LOCK)
    p.add_argument("--no-emulate", action="store_true", help="plain local ranks (smoke test)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.from_json:
        d = json.load(open(a.from_json, encoding="utf-8"))
        rows = [aggregate(r, d["runs"][f"P={r['P']} {r['variant']}"], d["config"]["link_GBps"])
                for r in d["rows"]]
        write_outputs(a.out or a.from_json[:-5], d["config"], d["cores"], rows, d["runs"],
                      d["started"], d["finished"])
        return 0
    if a.study is None:
        p.error("--study strong|weak is required (or --from-json FILE)")
    if a.out is None:
        a.out = f"results/tp3d_scaling_{a.study}"
    # strong: the fixed problem; weak: (h0, b0) of the 1-rank problem (P=8 then equals strong's)
    dh, db = (512, 8) if a.study == "strong" else (256, 4)
    a.hidden = a.hidden or dh
    a.micro_batch = a.micro_batch or db
    cores = len(os.sched_getaffinity(0))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    pts = points(a)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    runs = {i: [] for i in range(len(pts))}
    with tempfile.TemporaryDirectory() as work:
        for rep in range(a.repeats):
            for i, pt in enumerate(pts):
                r = run_point(a, pt, rep, work)
                runs[i].append(r)
                print(f"  [{rep + 1}/{a.repeats}] P={pt['P']} {pt['variant']:12s} h={pt['hidden']} "
                      f"mb={pt['micro_batch']}: {statistics.median(r['steps_ms']):8.1f} ms "
                      f"{r.get('wire_MB_per_rank', 0):7.2f} MB/rank  (wall {r['wall_s']} s, "
                      f"lock wait {r['lock_wait_s']} s, load {r['loadavg_before']})", flush=True)
    rows = [aggregate(pt, runs[i], a.link_GBps) for i, pt in enumerate(pts)]
    done = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    write_outputs(a.out, vars(a), cores, rows,
                  {f"P={pt['P']} {pt['variant']}": runs[i] for i, pt in enumerate(pts)}, started, done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
