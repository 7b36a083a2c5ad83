"""Build ``megatron_oases/pricing/gemm_table.json``, the measured GEMM throughputs the device
model prices GEMMs from (issue 49 item 1), from our own device runs only:

* ``--trace FILE BENCH``: a one-GPU overlap benchmark's profiler trace (``bench_gpu_overlap.py``,
  ``traces/*.json.gz``) and the benchmark JSON it belongs to. The compute stream's GEMM kernels,
  in time order, are matched one to one with the GEMMs the layer description says the traced
  step runs, in the order the trainer issues them (forward: per layer each block per sub-batch;
  backward: the output layer's, then per layer each block's weight GEMMs last to first, input
  gradient before weight gradient); the kernel count must match exactly or the trace is refused.
  Each shape's time is the mean over its kernels (their total is the step's). Two GEMMs of equal FLOPs inside one block
  (an MLP's fc1 and fc2 backward) are told apart only by that order.
* ``--gemms FILE``: ``scripts/gpu_measure.py``'s ``gpu_gemms.json`` or ``gpu_check.sh``'s
  ``gemm`` step (``gpu_table.json``): shapes timed alone with ``torch.mm``.

    python scripts/gemm_table_build.py \\
        --trace examples/gpu/h100-2026-11-27/call1/traces/traces_default-sleep.json.gz \\
                examples/gpu/h100-2026-11-27/call1/overlap_standin.json \\
        --gemms examples/gpu/h200-2026-11-26/gpu_gemms.json --out megatron_oases/pricing/gemm_table.json

The committed table takes the stock trace only: the Oases traces of the same runs are what
``scripts/sim_vs_standin.py`` checks the simulator's split against, so their half-token GEMMs
would price the check with its own answer (issue 49 item 2). ``--trace`` still reads them.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import statistics
import sys

from megatron_oases.pricing.device_model import gpu_of_device_name
from megatron_oases.pricing.gemm_table import TABLE_FORMAT, is_gemm_kernel


def _trace_kernels(path: str) -> list[float]:
    """Durations (us) of the GEMM kernels on the stream that ran the most distinct kernels (the
    compute stream; a stand-in stream runs one kind), in time order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    names: dict[int, set] = {}
    for e in kernels:
        names.setdefault(e["args"]["stream"], set()).add(e["name"])
    stream = max(names, key=lambda s: len(names[s]))
    return [e["dur"] for e in sorted(kernels, key=lambda e: e["ts"])
            if e["args"]["stream"] == stream and is_gemm_kernel(e["name"])]


def _issue_order(bench: dict, schedule: str) -> list[tuple[int, int, int]]:
    """The (M, N, K) of every GEMM one step of the benchmark issues, in the trainer's order."""
    from megatron_oases.sim.core.events import build_stage_events
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.topology import Level, Topology
    from megatron_oases.train_args import build_parser

    tp = bench["tp"]
    args = build_parser().parse_args(list(bench["trainer_flags"]) + [
        "--tensor-model-parallel-size", str(tp), "--nproc-per-node", str(tp), "--schedule", schedule])
    model, strategy = sim_inputs_from_train_args(args, tp)
    strategy = dataclasses.replace(strategy, optimizer_step=False, loop_overhead=False)
    topo = Topology(name="flat", levels=(Level(name="link", size=tp, scope="intra_node", p2p_bandwidth_GBps=100.0,
                                               group_bandwidth_GBps=100.0, latency_us=5.0),))
    chunk = build_stage_events(model, strategy, topo)[0].chunks[0]
    order: list[tuple[int, int, int]] = []

    for segments, backward in ((chunk.forward_segments, False), (chunk.backward_segments, True)):
        for evs, chains in segments:  # a sub-batch chain runs each block once per sub-batch
            for e in evs:
                if e.kind != "compute" or not e.op.gemms:
                    continue
                gemms = e.op.gemms
                if backward:  # backward_gemms: (dgrad, wgrad) per forward GEMM; issued last GEMM first
                    pairs = [gemms[j:j + 2] for j in range(0, len(gemms), 2)]
                    gemms = tuple(g for p in reversed(pairs) for g in p)
                order.extend(list(gemms) * chains)
    return order * strategy.num_microbatches


def from_trace(trace: str, bench_path: str) -> list[dict]:
    """Table points of one traced benchmark step (its schedule from the trace's file name)."""
    with open(bench_path, encoding="utf-8") as f:
        bench = json.load(f)
    schedule = "oases" if "oases" in trace.rsplit("/", 1)[-1] else "default"
    durs = _trace_kernels(trace)
    order = _issue_order(bench, schedule)
    if len(durs) != len(order):
        raise SystemExit(f"{trace}: {len(durs)} GEMM kernels on the compute stream, the description issues "
                         f"{len(order)}; not matched")
    per: dict[tuple, list[float]] = {}
    for shape, us in zip(order, durs):
        per.setdefault(shape, []).append(us)
    gpu = gpu_of_device_name(bench["device"])
    src = (f"{trace} (kernel means in a {schedule} training step, {bench['device']}, torch {bench.get('torch')}, "
           "compute stream; matched to the description's GEMMs in issue order)")
    return [{"gpu": gpu, "dtype": "bf16", "m": m, "n": n, "k": k, "ms": round(statistics.fmean(v) / 1e3, 5),
             "kernels": len(v), "source": src} for (m, n, k), v in sorted(per.items())]


def from_gemms(path: str) -> list[dict]:
    """Table points of shapes timed alone (``gpu_gemms.json`` or the ``gemm`` step's JSON)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    meta = data.get("meta", {})
    shapes = (data.get("gemms") or data.get("table"))["shapes"]
    gpu = gpu_of_device_name(meta.get("device", ""))
    how = meta.get("method", "torch.mm alone, each repetition synchronised (scripts/gpu_measure.py)")
    src = f"{path} ({meta.get('device')}, torch {meta.get('torch')}: {how})"
    return [{"gpu": gpu, "dtype": s.get("dtype", "bf16"), "m": s["m"], "n": s["n"], "k": s["k"],
             "ms": s["measured_ms"], "kernels": 1, "source": src} for s in shapes]


def build(traces: list[tuple[str, str]], gemms: list[str]) -> dict:
    points = [p for t, b in traces for p in from_trace(t, b)] + [p for g in gemms for p in from_gemms(g)]
    missing = sorted({p["source"] for p in points if p["gpu"] is None})
    if missing:
        raise SystemExit(f"no card of the device model's table for: {missing[0]}")
    return {"format": TABLE_FORMAT, "points": points}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", nargs=2, action="append", default=[], metavar=("TRACE", "BENCH_JSON"))
    p.add_argument("--gemms", action="append", default=[], help="gpu_gemms.json or gpu_table.json")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    table = build([tuple(t) for t in a.trace], a.gemms)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"{a.out}: {len(table['points'])} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
