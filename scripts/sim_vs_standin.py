"""The simulator against the one-GPU overlap benchmark: for each ``overlap_standin*.json`` that
``scripts/bench_gpu_overlap.py`` wrote, simulate the same run (its trainer flags at its TP size,
each schedule, forward + backward only) with the analytical device model of the card it ran on,
on the one-level topology of the benchmark's link, and print measured beside simulated: compute
only, the priced stand-ins against the simulator's communication, the step with ``sleep``
stand-ins (the SM-free link the simulator assumes) and the exposed communication (that step less
compute only).

    python scripts/sim_vs_standin.py examples/gpu/h100-2026-11-27/call1/overlap_standin*.json \\
        --out /tmp/sim_vs_standin.json

The stand-ins and the simulator price each collective with the same ``DeviceModel.collective_ms``
on the same link, so their communication totals agree by construction (the test checks it);
what the comparison tests is the simulator's compute model and its overlap of the two. A card
the device model's table lacks (a CPU run: gpu_check.sh's test) is priced as an H100 SXM, so
only the plumbing means anything there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.standin.summary import parse_overlap_files


def compare(path: str) -> list[dict]:
    """One row per schedule of the benchmark's JSON ``path``."""
    from benchmarks.standin.standins import Link, link_topology
    from megatron_oases.pricing.device_model import gpu_of_device_name
    from megatron_oases.sim.frontends.predict import analytical_train_step
    from megatron_oases.train_args import build_parser

    with open(path, encoding="utf-8") as f:
        bench = json.load(f)
    tp, flags = bench["tp"], list(bench["trainer_flags"])
    gpu = gpu_of_device_name(bench["device"]) or "h100-sxm"
    topo = link_topology(Link(GBps=bench["link"]["GBps"], latency_us=bench["link"]["latency_us"]), tp, gpu)
    rows = []
    for schedule, m in bench["schedules"].items():
        args = build_parser().parse_args(flags + ["--tensor-model-parallel-size", str(tp), "--nproc-per-node", str(tp),
                                                  "--schedule", schedule])
        r = analytical_train_step(args, topology=topo, world_size=tp, forward_backward_only=True)
        st = r.stages[0]
        sleep = m.get("sleep", {}).get("with_standins", {}).get("ms")
        compute = m["compute"]["ms"]
        rows.append({
            "file": os.path.basename(path), "path": path, "schedule": schedule, "recompute": m["recompute"],
            "cuda_device_max_connections": bench.get("cuda_device_max_connections"), "gpu": gpu,
            "link_GBps": bench["link"]["GBps"],
            "compute_ms": compute, "sim_compute_ms": st.compute_ms,
            "standins_priced_ms": m.get("sleep", {}).get("priced_ms"), "sim_comm_ms": st.comm_ms,
            "sleep_step_ms": sleep, "sim_step_ms": r.iteration_ms,
            "exposed_ms": None if sleep is None else sleep - compute, "sim_exposed_ms": st.exposed_comm_ms,
        })
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per benchmark file, stock's ``sleep`` step over Oases' (the speedup), measured and simulated,
    and the simulated one's error against the measured one."""
    out = []
    for f in dict.fromkeys(r["path"] for r in rows):
        by = {r["schedule"]: r for r in rows if r["path"] == f}
        st, oa = by.get("default"), by.get("oases")
        if not st or not oa or not st["sleep_step_ms"] or not oa["sleep_step_ms"]:
            continue
        meas, sim = st["sleep_step_ms"] / oa["sleep_step_ms"], st["sim_step_ms"] / oa["sim_step_ms"]
        out.append({"file": f, "recompute": oa["recompute"], "measured": meas, "simulated": sim,
                    "error_pct": 100 * (sim / meas - 1)})
    return out


def notes(path: str) -> list[str]:
    """The device model's lines on what it borrows or fits for this benchmark's card and stack."""
    from megatron_oases.pricing.device_model import device_model, gpu_of_device_name
    from megatron_oases.pricing.stack import LOCAL
    from benchmarks.standin.standins import Link, link_topology

    with open(path, encoding="utf-8") as f:
        bench = json.load(f)
    gpu = gpu_of_device_name(bench["device"]) or "h100-sxm"
    dm = device_model(link_topology(Link(GBps=1.0, latency_us=1.0), bench["tp"], gpu), stack=LOCAL)
    return dm.pricing_notes()


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = parse_overlap_files(p, argv, out_help="write the rows as JSON here", out_required=False)
    rows = [row for f in a.files for row in compare(f)]
    cols = ("file", "schedule", "recompute", "cuda_device_max_connections", "compute_ms", "sim_compute_ms",
            "standins_priced_ms", "sim_comm_ms", "sleep_step_ms", "sim_step_ms", "exposed_ms", "sim_exposed_ms")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(_fmt(row[c]) for c in cols))
    for r in ratios(rows):
        print(f"{r['file']} ({r['recompute']}): stock / Oases measured {r['measured']:.3f}x, "
              f"simulated {r['simulated']:.3f}x ({r['error_pct']:+.1f}%)")
    for line in dict.fromkeys(n for f in a.files for n in notes(f)):
        print(line)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
