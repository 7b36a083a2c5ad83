"""What the benchmark scripts share (scripts/bench_*.py): the machine-wide benchmark lock, load
averages, topology YAML for the emulated interconnect, the reference trainer's model flags, rank
launch (emulated cluster or local processes), step statistics from ``--log-json``, the printed
table, and a counting trainer that records every collective of each step with ``CommCounter``.

The counting trainer runs per rank as
``python -m benchmarks.harness --stats-out PREFIX [--timed] -- <trainer flags>`` and writes
``PREFIX.rank<R>.json``; ``rank_stats`` reads those files back.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import statistics
import subprocess
import sys
import time

BENCH_LOCK = "/tmp/oases_bench.lock"
"""Every timed run holds this lock, so benchmarks on the 2-core machine never overlap
(shell: ``flock /tmp/oases_bench.lock <cmd>``)."""

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def bench_lock(path: str = BENCH_LOCK):
    """Hold the machine-wide benchmark lock; yields the seconds spent waiting for it."""
    with open(path, "a") as f:
        t0 = time.time()
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.time() - t0
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, recorded next to every timing."""
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return ""


# ---- topologies for the emulated interconnect ----------------------------------------------------
def topology_yaml(name: str, description: str, levels, device: str | None = None) -> str:
    """A topology YAML for the emulator; ``levels`` are (name, size, scope, GB/s per rank,
    latency us) from the innermost out."""
    out = [f"name: {name}", f"description: {description}"] + ([f"device: {device}"] if device else [])
    out.append("levels:")
    for lname, size, scope, gbps, lat in levels:
        out.append(f"  - {{name: {lname}, size: {size}, scope: {scope}, p2p_bandwidth_GBps: {gbps}, "
                   f"group_bandwidth_GBps: {gbps}, latency_us: {lat}}}")
    return "\n".join(out) + "\n"


def flat_topology_yaml(name: str, world: int, link_GBps: float) -> str:
    """One emulated node of ``world`` ranks whose loopback is rate-limited to ``link_GBps`` per rank."""
    return topology_yaml(name, f"one node, {world} ranks, rate-limited loopback",
                         [("lo", world, "intra_node", link_GBps, 20)])


def two_level_topology_yaml(name: str, description: str, intra_GBps: float, inter_GBps: float,
                            device: str | None = None) -> str:
    """2 nodes x 2 ranks: ``lo`` inside a node, ``veth`` between nodes."""
    return topology_yaml(name, description, [("lo", 2, "intra_node", intra_GBps, 20),
                                             ("veth", 2, "inter_node", inter_GBps, 50)], device)


def write_topology(workdir: str, name: str, text: str) -> str:
    """Write ``text`` to ``workdir/name.yaml``; returns the path."""
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


# ---- the reference trainer's flags -----------------------------------------------------------------
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
"""Megatron's full recompute of every layer, the baseline the Oases benchmarks compare with."""


def add_model_args(p: argparse.ArgumentParser, *, hidden: int, heads: int, seq: int,
                   iters: int, warmup: int, layers: int = 2) -> None:
    """The model/batch flags every benchmark takes (defaults per benchmark)."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--warmup", type=int, default=warmup)


def model_flags(a, tp: int) -> list[str]:
    """Trainer flags for ``add_model_args``'s values at TP size ``tp``."""
    return ["--tensor-model-parallel-size", str(tp), "--num-layers", str(a.layers),
            "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * a.micro_batches),
            "--vocab-size", str(a.vocab), "--train-iters", str(a.iters),
            "--no-tp-invariant-init", "--dist-timeout", "300"]


TRAINER = [sys.executable, "-m", "megatron_oases.train"]
"""The reference trainer as a per-rank command."""


def counting_trainer(stats_out: str, *, timed: bool = False) -> list[str]:
    """The counting trainer as a per-rank command (append ``--`` and the trainer flags)."""
    return [sys.executable, "-m", "benchmarks.harness", "--stats-out", stats_out,
            *(["--timed"] if timed else [])]


# ---- launching ---------------------------------------------------------------------------------------
def launch_ranks(cmd: list[str], world: int, *, topology=None, env: dict | None = None,
                 timeout: float = 1800, cwd: str = REPO_ROOT) -> None:
    """Run ``cmd`` once per rank: inside an ``EmulatedCluster`` of ``topology`` (a path or a
    ``Topology``: rate-limited links between network namespaces), or, with ``topology=None`` or one
    rank, as local processes with torchrun's environment variables. Raises with each rank's output
    tail when a rank fails."""
    env = dict(env or {})
    if topology is None or world == 1:
        from megatron_oases.topology.emulate import thread_env

        base = {**os.environ, **env}
        port = str(20000 + (os.getpid() * 7 + int(time.time())) % 20000)
        procs = [subprocess.Popen(cmd, env={**base, **thread_env(base, world), "RANK": str(r),
                                            "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                                  cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("\n".join(o[-3000:] for o in outs))
        return
    from megatron_oases.topology import load_topology
    from megatron_oases.topology.emulate import EmulatedCluster

    topo = load_topology(topology) if isinstance(topology, str) else topology
    topo.check_world_size(world, flag="world size")
    with EmulatedCluster(topo) as cluster:
        res = cluster.launch(cmd, env, timeout=timeout, cwd=cwd)
    if not res.ok:
        raise RuntimeError("\n".join(o[-3000:] for o in res.outputs))


# ---- statistics and tables ---------------------------------------------------------------------------
def step_stats(log_path: str, warmup: int) -> dict:
    """Median step time after ``warmup`` iterations, plus the last record's memory and loss."""
    with open(log_path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    steps = [r["step_ms"] for r in recs[warmup:]] or [r["step_ms"] for r in recs]
    last = recs[-1]
    return {"step_ms": statistics.median(steps), "step_ms_min": min(steps),
            "steps_ms": [round(s, 1) for s in steps], "peak_mem_mb": last["peak_mem_mb"],
            "oases_saved_mb": last.get("oases_saved_mb"), "loss": last["lm_loss"]}


def rank_stats(paths: list[str], warmup: int) -> dict:
    """What the counting trainer wrote per rank: medians over the steps after ``warmup``, then
    mean / max / sum over ranks (wire bytes per rank, collectives, blocked and CPU time,
    parameter bytes, peak memory) and rank 0's traffic by kind."""
    per = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            steps = json.load(f)["steps"]
        use = steps[warmup:] or steps
        med = lambda k: statistics.median(s[k] for s in use)  # noqa: E731
        per.append({"wire": med("wire_bytes"), "calls": med("calls"), "comm": med("comm_s"),
                    "cpu": med("cpu_s"), "params": steps[-1]["param_bytes"],
                    "mem": max(s["peak_mem_mb"] for s in steps), "kinds": use[-1]["kinds"]})
    if not per:
        return {}
    mean = lambda k: statistics.mean(r[k] for r in per)  # noqa: E731
    return {"wire_MB_per_rank": mean("wire") / 1e6, "wire_MB_max_rank": max(r["wire"] for r in per) / 1e6,
            "collectives_per_rank": mean("calls"), "comm_ms": mean("comm") * 1e3,
            "comm_ms_max_rank": max(r["comm"] for r in per) * 1e3,
            "cpu_ms_rank": mean("cpu") * 1e3, "cpu_ms_max_rank": max(r["cpu"] for r in per) * 1e3,
            "cpu_ms_sum": sum(r["cpu"] for r in per) * 1e3,
            "param_MB_max_rank": max(r["params"] for r in per) / 1e6,
            "param_MB_sum": sum(r["params"] for r in per) / 1e6,
            "peak_mem_mb_max_rank": max(r["mem"] for r in per),
            "peak_mem_mb_min_rank": min(r["mem"] for r in per),
            "kinds_rank0": per[0]["kinds"]}


def write_results(out: str, rows: list[dict], fields: list[str], doc: dict) -> None:
    """``out.csv`` (``fields`` of each row) and ``out.json`` (``doc`` with the rows), then say so."""
    import csv

    with open(out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump({**doc, "rows": rows}, f, indent=1)
    print(f"wrote {out}.csv and {out}.json")


def fmt(v) -> str:
    """A table cell: ``-`` for missing, 3 decimals below 10, 1 above."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_table(rows: list[dict], cols: list[str]) -> None:
    """Right-aligned columns ``cols`` of ``rows``."""
    w = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(f"{c:>{w[c]}s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{fmt(r.get(c)):>{w[c]}s}" for c in cols))


# ---- the counting trainer ----------------------------------------------------------------------------
def counted_train(argv: list[str]) -> int:
    """``--stats-out PREFIX [--timed] -- <trainer flags>``: the reference trainer on this rank with
    every collective of each training step recorded by a ``CommCounter`` (Megatron's own calls
    through ``watch_torch_distributed``; groups of one rank carry no traffic), with ``--timed`` the
    time blocked in them, and the step's process CPU time; writes ``PREFIX.rank<R>.json``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness")
    p.add_argument("--stats-out", required=True)
    p.add_argument("--timed", action="store_true")
    a, rest = p.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    from megatron_oases.parallel.collectives import CommCounter, watch_torch_distributed

    watch_torch_distributed(timed=a.timed)  # before Megatron is imported
    import megatron_oases.train as T

    steps = []
    train_step = T.train_step

    def counted_step(tr, it):
        c0, w0 = time.process_time(), time.perf_counter()
        with CommCounter() as c:
            out = train_step(tr, it)
        c1, w1 = time.process_time(), time.perf_counter()
        moved = [r for r in c.records if r.group_size > 1]
        steps.append({"iteration": it, "wire_bytes": sum(r.wire_bytes_per_rank for r in moved),
                      "payload_bytes": sum(r.payload_bytes for r in moved), "calls": len(moved),
                      "comm_s": c.blocked_s, "cpu_s": c1 - c0, "wall_s": w1 - w0,
                      "param_bytes": sum(q.numel() * q.element_size() for m in tr.model
                                         for q in m.parameters()),
                      "kinds": c.by_kind(min_group_size=2),
                      "peak_mem_mb": tr.runtime.max_memory_allocated() / 2**20})
        return out

    T.train_step = counted_step
    rc = T.main(rest)
    rank = os.environ.get("RANK", "0")
    with open(f"{a.stats_out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"rank": int(rank), "steps": steps}, f)
    return rc


if __name__ == "__main__":
    sys.exit(counted_train(sys.argv[1:]))


# ---- shared by the ATP and 3-D benchmarks (scripts/bench_atp.py, bench_tp3d.py, bench_tp3d_scaling.py)
def scaled_topology(name_or_path: str, scale: float, workdir: str) -> str:
    """Write a copy of the topology with every bandwidth times ``scale``; return its path."""
    import yaml

    from megatron_oases.topology import load_topology
    from megatron_oases.topology.loader import example_path

    path = name_or_path if os.path.isfile(name_or_path) else str(example_path(name_or_path))
    doc = yaml.safe_load(open(path, encoding="utf-8"))
    if scale != 1.0:
        for lvl in doc["levels"]:
            for k in ("p2p_bandwidth_GBps", "group_bandwidth_GBps"):
                lvl[k] = lvl[k] * scale
            if lvl.get("p2p_matrix_GBps"):
                lvl["p2p_matrix_GBps"] = [[v * scale for v in row] for row in lvl["p2p_matrix_GBps"]]
        for e in (doc.get("calibration") or {}).get("allreduce_GBps", []) or []:
            e["bandwidth_GBps"] = e["bandwidth_GBps"] * scale
        doc["name"] = f"{doc['name']}-x{scale:g}"
        doc["description"] = f"{doc.get('description', '')} (bandwidths x {scale:g})".strip()
    out = os.path.join(workdir, f"{doc['name']}.yaml")
    with open(out, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    load_topology(out)  # validate
    return out


def run_variant(a, world: int, topo_path: str, workdir: str, tag: str, flags: list[str]) -> dict:
    """One trainer run under the counting wrapper; returns step and byte statistics."""
    log = os.path.join(workdir, f"{tag}.jsonl")
    stats = os.path.join(workdir, f"{tag}.stats")
    cmd = counting_trainer(stats) + ["--", "--topology", topo_path] + flags + ["--log-json", log]
    t0 = time.time()
    launch_ranks(cmd, world, topology=None if a.no_emulate else topo_path, timeout=a.timeout)
    paths = sorted(glob.glob(stats + ".rank*.json"))
    return {**step_stats(log, a.warmup), **rank_stats(paths, a.warmup),
            "wall_s": round(time.time() - t0, 1)}


def predicted_layer_mb(P: int, backend: str, mesh, *, seq: int, micro_batch: int, hidden: int, heads: int,
                       layers: int, micro_batches: int, ffn: int | None = None, bpe: int = 4) -> float:
    """Wire MB per rank per step of the transformer layers alone (also ``bench_tp3d``'s
    prediction; fp32 by default): every collective of ``describe``'s layer for ``backend`` at
    TP ``P`` (``describe.registry.layer_description``: the layer the trainer builds, GPT-2's at
    ``ffn`` = 4h by default; ``mesh`` ATP's (d1, d2), else None), forward and backward, at its
    ring's wire bytes, times the layers and micro-batches. Leaves out the embedding, the output
    layer, the block edges into and out of a 3-D cube and the gradients' reduction. 0 on one
    rank."""
    from megatron_oases.describe.atp_2d import atp_layout
    from megatron_oases.describe.registry import layer_description

    if P == 1:
        return 0.0
    desc = layer_description(backend=backend, layout=None if mesh is None else atp_layout(*mesh), micro_batch=micro_batch, seq=seq, hidden=hidden,
                             heads=heads, ffn=ffn or 4 * hidden, tp=P, bytes_per_element=bpe)
    wire = sum(c.wire_bytes_per_rank for c in desc.collectives("forward") + desc.collectives("backward"))
    return wire * layers * micro_batches / 1e6
