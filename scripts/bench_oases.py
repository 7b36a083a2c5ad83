"""Oases schedule vs stock Megatron TP on the emulated interconnect (the paper's Table 3 shape).

For each TP size, runs the reference trainer in one emulated node whose link is rate-limited so
TP communication takes about as long as compute, and measures the median step time of:

  stock        --schedule default, full recompute (Megatron's)
  oases        --schedule oases, all switches on
  no-cross     --no-oases-cross-pass
  no-fine      --no-oases-fine-grained-recompute
  both-off     both switches off
  compute      Oases with every TP collective skipped (compute-only time; wrong losses)
  comm         the step's TP all-reduces alone, back to back, same sizes (communication-only)
  stock-sp     stock with --sequence-parallel (all-gathers / reduce-scatters in the linears)
  oases-sp     Oases with --sequence-parallel (the sub-batches overlap them)
  compute-sp   oases-sp with every TP collective skipped
  comm-sp      (run with any -sp variant) the step's sequence all-gathers and reduce-scatters
               alone, back to back, same sizes

The perfect-overlap bound is max(compute, comm) (max(compute-sp, comm-sp) for the -sp variants).
The comm rows also measure interference: the same collectives beside a second thread that
multiplies a layer-sized GEMM without pause (``comm_slowdown``: their time then over alone;
``gemm_slowdown``: the GEMM's time per call beside them over alone). On cores shared with
gloo's threads both exceed 1, and max(compute, comm) is not reachable.
Prints a table, writes CSV and JSON. ``peak_mem_mb`` is the process's peak RSS on CPU (the
weights, the optimizer and the Python runtime included); ``oases_saved_mb`` what the Oases
executor kept between forward and backward for one micro-batch.
``--llama`` trains a Llama-style model instead of GPT-2's layers: RoPE, SwiGLU (Megatron-LM's
FFN size), grouped-query attention (``--num-query-groups``, default heads / 4), RMSNorm, no
bias, untied embeddings, QK-norm.
Needs root (network namespaces); ``--no-emulate`` runs the same on plain local ranks (no
bandwidth limit: a smoke test, not a measurement).

    python scripts/bench_oases.py --tp 2 4 --hidden 1024 --link-GBps 0.25 --out results/oases
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


from benchmarks.harness import (RECOMPUTE, add_model_args, flat_topology_yaml, fmt,
                                launch_ranks, model_flags, step_stats, write_results)
from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.describe.split import sub_batch_sizes

VARIANTS = {
    "stock": ["--schedule", "default"] + RECOMPUTE,
    "oases": ["--schedule", "oases"] + RECOMPUTE,
    "no-cross": ["--schedule", "oases", "--no-oases-cross-pass"] + RECOMPUTE,
    "no-fine": ["--schedule", "oases", "--no-oases-fine-grained-recompute"] + RECOMPUTE,
    "both-off": ["--schedule", "oases", "--no-oases-cross-pass",
                 "--no-oases-fine-grained-recompute"] + RECOMPUTE,
    "compute": ["--schedule", "oases", "--oases-skip-tp-collectives"] + RECOMPUTE,
    "stock-sp": ["--schedule", "default", "--sequence-parallel"] + RECOMPUTE,
    "oases-sp": ["--schedule", "oases", "--sequence-parallel"] + RECOMPUTE,
    "compute-sp": ["--schedule", "oases", "--sequence-parallel",
                   "--oases-skip-tp-collectives"] + RECOMPUTE,
}
DEFAULT_VARIANTS = ["stock", "oases", "no-cross", "no-fine", "both-off", "compute"]


def llama_flags(a) -> list[str]:
    """The trainer flags of ``--llama`` (none without it)."""
    if not a.llama:
        return []
    groups = a.num_query_groups or max(a.heads // 4, 1)
    return ["--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
            "--num-query-groups", str(groups), "--normalization", "RMSNorm",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--qk-layernorm"]


def run_ranks(cmd: list[str], tp: int, a, topo_path: str | None) -> None:
    """Run ``cmd`` on ``tp`` ranks, emulated (``topo_path``) or local; raise with the output tail."""
    launch_ranks(cmd, tp, topology=topo_path, timeout=a.timeout)


def comm_only_main(argv: list[str]) -> None:
    """Rank program: the TP collectives of one Oases training step, back to back: all-reduces,
    or with ``--sequence-parallel`` alternating all-gathers and reduce-scatters of the
    sub-batch's full-sequence activation (``--elements``)."""
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    for f in ("--elements", "--count", "--repeats"):
        p.add_argument(f, type=int)
    p.add_argument("--out")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--hidden", type=int, default=0,
                   help="also measure the interference with a GEMM of this hidden size")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    x = torch.ones(a.elements)
    chunk = torch.ones(a.elements // n)

    def one(k: int) -> None:
        if not a.sequence_parallel:
            dist.all_reduce(x)
        elif k % 2:
            dist.reduce_scatter_tensor(chunk, x)
        else:
            dist.all_gather_into_tensor(x, chunk)

    one(0)
    one(1)
    times = []
    for _ in range(a.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for k in range(a.count):
            one(k)
        times.append((time.perf_counter() - t0) * 1e3)
    result = {"comm_ms": statistics.median(times)}
    if a.hidden:
        result.update(_interference(one, a, result["comm_ms"]))
    if dist.get_rank() == 0:
        json.dump(result, open(a.out, "w"))
    dist.destroy_process_group()


def _interference(one, a, comm_ms: float) -> dict:
    """Measured interference of communication and compute on one rank: the same collectives
    run back to back while a second thread multiplies ``[tokens, h] x [h, h]`` matrices (a
    layer's GEMM) without pause. Returns the collectives' time then (``comm_busy_ms``), the
    GEMM's time per call alone and beside them, and both slowdowns."""
    import threading

    import torch
    import torch.distributed as dist

    x = torch.randn(a.elements // a.hidden, a.hidden)
    w = torch.randn(a.hidden, a.hidden)

    def gemms(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            torch.matmul(x, w)
        return (time.perf_counter() - t0) * 1e3 / k

    gemms(5)
    alone = statistics.median(gemms(20) for _ in range(3))
    stop, done = threading.Event(), []

    def busy() -> None:
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            torch.matmul(x, w)
            n += 1
        done.append(((time.perf_counter() - t0) * 1e3, n))

    dist.barrier()
    thread = threading.Thread(target=busy)
    thread.start()
    t0 = time.perf_counter()
    for k in range(a.count):
        one(k)
    busy_ms = (time.perf_counter() - t0) * 1e3
    stop.set()
    thread.join()
    gemm_busy = done[0][0] / max(done[0][1], 1)
    return {"comm_busy_ms": busy_ms, "comm_slowdown": busy_ms / comm_ms, "gemm_ms": alone,
            "gemm_busy_ms": gemm_busy, "gemm_slowdown": gemm_busy / alone}


def step_collectives(a, tp: int, *, sequence_parallel: bool) -> tuple[int, int]:
    """(elements each, count) of the TP collectives of the layers in one Oases training step:
    ``describe``'s Megatron 1-D layer under the Oases tape (it keeps the all-gathered inputs, so
    its backward gathers no input again) on one sub-batch (``describe.split``), times the
    sub-batches, the layers and the micro-batches. Each moves one sub-batch's full-sequence
    ``[s, b, h]`` activation: 4 all-reduces a layer and sub-batch, or under sequence parallelism
    4 all-gathers and 4 reduce-scatters (``comm_only_main`` alternates them)."""
    subs = sub_batch_sizes(a.micro_batch)
    layer = megatron_1d_gpt_layer(micro_batch=subs[0], seq=a.seq, hidden=a.hidden, heads=a.heads,
                                  ffn=4 * a.hidden, tp=tp, bytes_per_element=1,
                                  sequence_parallel=sequence_parallel, keeps_gathered_input=True)
    ops = layer.collectives("forward") + layer.collectives("backward")
    sizes = {c.payload_bytes for c in ops}
    assert len(sizes) == 1, f"the layer's collectives move different sizes: {sorted(sizes)}"
    return sizes.pop(), len(ops) * len(subs) * a.layers * a.micro_batches


def bench_tp(a, tp: int, workdir: str) -> list[dict]:
    topo = None
    if not a.no_emulate:
        topo = os.path.join(workdir, f"bench-flat{tp}.yaml")
        with open(topo, "w", encoding="utf-8") as f:
            f.write(flat_topology_yaml(f"bench-flat{tp}", tp, a.link_GBps))
    rows = []
    for name in a.variants:
        log = os.path.join(workdir, f"tp{tp}-{name}.jsonl")
        cmd = [sys.executable, "-m", "megatron_oases.train"] + model_flags(a, tp) + llama_flags(a) + \
            VARIANTS[name] + ["--log-json", log]
        t0 = time.time()
        run_ranks(cmd, tp, a, topo)
        row = {"tp": tp, "variant": name, **step_stats(log, a.warmup),
               "wall_s": round(time.time() - t0, 1)}
        rows.append(row)
        print(f"  tp={tp} {name:9s} {row['step_ms']:9.1f} ms", flush=True)
    # Communication alone: the Oases step's TP collectives (step_collectives), back to back.
    kinds = [("comm", [])] if any(not v.endswith("-sp") for v in a.variants) else []
    kinds += [("comm-sp", ["--sequence-parallel"])] if any(v.endswith("-sp") for v in a.variants) else []
    for name, extra in kinds:
        elements, count = step_collectives(a, tp, sequence_parallel=bool(extra))
        out = os.path.join(workdir, f"tp{tp}-{name}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--comm-only", "--elements",
               str(elements), "--count", str(count), "--repeats", str(a.iters),
               "--out", out, "--hidden", str(a.hidden)] + extra
        if topo is None:
            from megatron_oases.runtime.spawn import run_on_ranks

            run_on_ranks(_comm_only_spawned, tp, args=(cmd[3:],), timeout_s=a.timeout)
        else:
            run_ranks(cmd, tp, a, topo)
        got = json.load(open(out))
        rows.append({"tp": tp, "variant": name, "step_ms": got["comm_ms"],
                     **{k: v for k, v in got.items() if k != "comm_ms"}})
        print(f"  tp={tp} {name:9s} {rows[-1]['step_ms']:9.1f} ms; beside a GEMM loop "
              f"{got['comm_busy_ms']:.1f} ms (x{got['comm_slowdown']:.2f}), the GEMM "
              f"x{got['gemm_slowdown']:.2f}", flush=True)
    return rows


def _comm_only_spawned(argv):
    comm_only_main(argv)


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for tp in sorted({r["tp"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["tp"] == tp}
        ms = lambda v: by[v]["step_ms"] if v in by else None  # noqa: E731
        bounds = {sp: max(ms("compute" + sp), ms("comm" + sp)) if ms("compute" + sp) and ms("comm" + sp)
                  else None for sp in ("", "-sp")}
        for name, r in by.items():
            r = dict(r)
            sp = "-sp" if name.endswith("-sp") else ""
            r["speedup_vs_stock"] = ms("stock") / r["step_ms"] if ms("stock") else None
            r["speedup_vs_stock_sp"] = ms("stock-sp") / r["step_ms"] if ms("stock-sp") else None
            r["over_bound"] = r["step_ms"] / bounds[sp] if bounds[sp] else None
            out.append(r)
    return out


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--comm-only"]:
        comm_only_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    add_model_args(p, hidden=1024, heads=16, seq=128, iters=5, warmup=2)
    p.add_argument("--link-GBps", type=float, default=0.25,
                   help="per-rank bandwidth in the emulated node, GB/s (the shared loopback is "
                        "limited to TP x this)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                   help=f"default: {' '.join(DEFAULT_VARIANTS)}; the -sp ones add sequence "
                        f"parallelism")
    p.add_argument("--llama", action="store_true",
                   help="a Llama-style model (RoPE, SwiGLU, GQA, RMSNorm, no bias, QK-norm)")
    p.add_argument("--num-query-groups", type=int, default=None, help="--llama: default heads / 4")
    p.add_argument("--no-emulate", action="store_true", help="plain local ranks (smoke test)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/bench_oases")
    a = p.parse_args(argv)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for tp in a.tp:
            rows += bench_tp(a, tp, work)
    rows = summarize(rows)
    cols = ["tp", "variant", "step_ms", "speedup_vs_stock", "speedup_vs_stock_sp", "over_bound", "peak_mem_mb",
            "oases_saved_mb", "loss", "comm_slowdown", "gemm_slowdown"]
    print(f"\n{'Llama-style, ' if a.llama else ''}hidden {a.hidden}, layers {a.layers}, seq {a.seq}, micro-batch {a.micro_batch} x "
          f"{a.micro_batches}, link {a.link_GBps} GB/s{' (NOT emulated)' if a.no_emulate else ''}")
    print(" | ".join(f"{c:>15s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{fmt(r.get(c)):>15s}" for c in cols))
    write_results(a.out, rows, cols + ["step_ms_min", "wall_s", "comm_busy_ms", "gemm_ms", "gemm_busy_ms"],
                  {"config": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
