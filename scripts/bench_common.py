"""Pieces the benchmark scripts share: model flags of the reference trainer, step statistics
from its --log-json lines, the printed table, a counter of torch.distributed calls, the
machine-wide benchmark lock, and topology YAML for the emulated interconnect."""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import statistics
import time

BENCH_LOCK = "/tmp/oases_bench.lock"
"""Every timed run holds this lock, so benchmarks on the 2-core machine never overlap
(shell: ``flock /tmp/oases_bench.lock <cmd>``)."""


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
        return " ".join(open("/proc/loadavg", encoding="utf-8").read().split()[:3])
    except OSError:
        return ""


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


def write_topology(workdir: str, name: str, text: str) -> str:
    """Write ``text`` to ``workdir/name.yaml``; returns the path."""
    import os

    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def two_level_topology_yaml(name: str, description: str, intra_GBps: float, inter_GBps: float,
                            device: str | None = None) -> str:
    """2 nodes x 2 ranks: ``lo`` inside a node, ``veth`` between nodes."""
    return topology_yaml(name, description, [("lo", 2, "intra_node", intra_GBps, 20),
                                             ("veth", 2, "inter_node", inter_GBps, 50)], device)


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


def step_stats(log_path: str, warmup: int) -> dict:
    """Median step time after ``warmup`` iterations, plus the last record's memory and loss."""
    recs = [json.loads(line) for line in open(log_path, encoding="utf-8")]
    steps = [r["step_ms"] for r in recs[warmup:]] or [r["step_ms"] for r in recs]
    last = recs[-1]
    return {"step_ms": statistics.median(steps), "step_ms_min": min(steps),
            "steps_ms": [round(s, 1) for s in steps], "peak_mem_mb": last["peak_mem_mb"],
            "oases_saved_mb": last.get("oases_saved_mb"), "loss": last["lm_loss"]}


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_table(rows: list[dict], cols: list[str]) -> None:
    w = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(f"{c:>{w[c]}s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{fmt(r.get(c)):>{w[c]}s}" for c in cols))


COUNTED_COLLECTIVES = {
    # name: (index of the tensor argument, "t" tensor | "list" of tensors, ring factor kind)
    "all_reduce": (0, "t", "ar"),
    "all_gather_into_tensor": (0, "t", "ag"),
    "_all_gather_base": (0, "t", "ag"),
    "all_gather": (0, "list", "ag"),
    "reduce_scatter_tensor": (1, "t", "ag"),
    "_reduce_scatter_base": (1, "t", "ag"),
    "reduce_scatter": (1, "list", "ag"),
    "broadcast": (0, "t", "ag"),
    "reduce": (0, "t", "ag"),
    "all_to_all_single": (1, "t", "ag"),
}


class _TimedWork:
    """An async handle whose ``wait()`` counts as time blocked in communication."""

    def __init__(self, work, state: dict):
        self._work, self._state = work, state

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if self._state["on"]:
                self._state["comm"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def count_dist_calls(state: dict, *, timed: bool = False) -> None:
    """Wrap ``torch.distributed``'s collectives (including Megatron's own calls) so that, while
    ``state["on"]``, each outermost call on more than one rank adds to ``state``: ``wire`` bytes
    per rank (all-reduce 2 (n-1)/n x size, the others (n-1)/n x the full size, as
    ``CommCounter``), ``payload``, ``calls``, ``kinds[name] = [calls, wire]`` and, with ``timed``,
    ``comm`` seconds blocked (the call, plus ``wait()`` on its async handle). Apply it before
    Megatron is imported: it binds ``all_gather_into_tensor`` at import time."""
    import inspect

    import torch.distributed as dist

    for key, value in (("on", False), ("depth", 0), ("wire", 0.0), ("payload", 0.0),
                       ("calls", 0), ("comm", 0.0), ("kinds", {})):
        state.setdefault(key, value)

    def wrap(name, orig, idx, how, fk):
        sig = inspect.signature(orig)

        def counted(*args, **kwargs):
            if not state["on"] or state["depth"]:
                return orig(*args, **kwargs)
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
                n = dist.get_world_size(bound.get("group"))
                t = args[idx] if len(args) > idx else list(bound.values())[idx]
                size = sum(x.numel() * x.element_size() for x in (t if how == "list" else [t]))
            except Exception:  # noqa: BLE001 - counting must never break training
                n, size = 1, 0
            if n <= 1:
                return orig(*args, **kwargs)
            wire = (2.0 * (n - 1) / n if fk == "ar" else (n - 1) / n) * size
            state["wire"] += wire
            state["payload"] += size
            state["calls"] += 1
            k = state["kinds"].setdefault(name, [0, 0.0])
            k[0] += 1
            k[1] += wire
            state["depth"] += 1
            t0 = time.perf_counter()
            try:
                out = orig(*args, **kwargs)
            finally:
                state["comm"] += time.perf_counter() - t0
                state["depth"] -= 1
            return _TimedWork(out, state) if timed and out is not None and kwargs.get("async_op") else out

        counted.__name__ = name
        return counted

    for name, (idx, how, fk) in COUNTED_COLLECTIVES.items():
        orig = getattr(dist, name, None)
        if orig is not None:
            setattr(dist, name, wrap(name, orig, idx, how, fk))
