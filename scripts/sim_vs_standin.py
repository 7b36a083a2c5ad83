"""The simulator against the one-GPU overlap benchmark: for each ``overlap_standin*.json`` that
``scripts/bench_gpu_overlap.py`` wrote, simulate the same run (its trainer flags at its TP size,
each schedule, forward + backward only) with the analytical device model of the card it ran on,
on the one-level topology of the benchmark's link, and print measured beside simulated: compute
only, the priced stand-ins against the simulator's communication, the step with ``sleep``
stand-ins (the SM-free link the simulator assumes) and the exposed communication (that step less
compute only).

    python scripts/sim_vs_standin.py examples/gpu/h100-2026-11-27/call1/overlap_standin*.json \\
        --out /tmp/sim_vs_standin.json

The stand-ins are priced with the simulator's ``DeviceModel.collective_ms`` on the benchmark's
link, but a ``sleep`` stand-in spins a calibrated number of SM cycles, so what it lasts is those
cycles over the clock it runs at (issue 49 item 2). The simulator gets the link as it ran:

* alone, at the clock of the benchmark's own ``standins_only`` measurement (each stand-in
  ``standins_only / priced`` of its price: 0.84-0.99 in the committed runs, whose calibrations
  ran at 1,651-1,946 MHz and whose idle stand-ins at about 1,975 MHz): the link's rate scaled;
* beside compute, at the card's clock under GEMM load (``DeviceModel.collective_beside_compute``
  = the stand-ins' clock alone, calibration clock / (standins_only / priced), over the loaded
  clock, read 5 s into the same session's trainer runs: ``summary*.txt`` beside the JSON, else
  the 2026-11-27 H100's, said so; about 1,975 / 1,642 = 1.20).

An MoE run (``bench_gpu_overlap.py --ep E``, ``benchmarks/standin/moe.py``) is simulated at its
TP x EP world with the same trainer flags (``measure.trainer_args``); the benchmark does not price
its DP (= EP) gradient reduction, so the simulator's (``grad_ms``, exposed after the last backward
without ``--overlap-grad-reduce``) comes off its step, comm and exposed time.

The simulator also gets the Oases executor's program as it ran (``sim.core.tape``): runs whose
``issued`` list holds a head collective of the whole micro-batch predate the head's split and the
one ``main_grad`` add. What the comparison then tests is the simulator's compute model and its overlap. A card
the device model's table lacks (a CPU run: gpu_check.sh's test) is priced as an H100 SXM, so
only the plumbing means anything there.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

from benchmarks.standin.summary import parse_overlap_files


BORROWED_CLOCKS = "examples/gpu/h100-2026-11-27/call1/summary.txt"
"""Where a run without its own loaded-clock readings takes them (the H100 of 2026-11-27)."""


def loaded_clock_mhz(path: str) -> tuple[float, str, bool]:
    """The SM clock under GEMM load (MHz) for the benchmark JSON ``path``, where it was read and
    whether it was borrowed: the mean of the ``(settled 5s): N MHz`` lines of the ``summary*.txt``
    in its directory or the one above (``gpu_check.sh`` writes the JSON under ``json/``), else
    ``BORROWED_CLOCKS``'s."""
    here = os.path.dirname(os.path.abspath(path))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = sorted(glob.glob(os.path.join(here, "summary*.txt")) + glob.glob(os.path.join(here, "..", "summary*.txt")))
    for borrowed, where in enumerate((own, [os.path.join(repo, BORROWED_CLOCKS)])):
        mhz = [float(x) for f in where if os.path.exists(f)
               for x in re.findall(r"\(settled[^)]*\): (\d+) MHz", open(f, encoding="utf-8").read())]
        if mhz:
            return statistics.fmean(mhz), os.path.relpath(where[0], repo), bool(borrowed)
    raise SystemExit(f"{path}: no loaded-clock reading beside it nor in {BORROWED_CLOCKS}")


def compare(path: str) -> list[dict]:
    """One row per schedule of the benchmark's JSON ``path``."""
    from benchmarks.standin.measure import trainer_args
    from benchmarks.standin.standins import Link, link_topology
    from megatron_oases.pricing.device_model import gpu_of_device_name
    from megatron_oases.sim.core.tape import CURRENT, tape_of_issued
    from megatron_oases.sim.frontends.predict import analytical_train_step
    from megatron_oases.train_args import build_parser

    with open(path, encoding="utf-8") as f:
        bench = json.load(f)
    tp, ep, flags = bench["tp"], bench.get("ep", 1), list(bench["trainer_flags"])
    world = tp * ep
    gpu = gpu_of_device_name(bench["device"]) or "h100-sxm"
    cal_mhz = (bench.get("calibration") or {}).get("sleep_cycles_per_ms")
    loaded, clock_src, borrowed = loaded_clock_mhz(path) if cal_mhz else (None, None, False)
    rows = []
    for schedule, m in bench["schedules"].items():
        args = build_parser().parse_args(trainer_args(flags, tp, schedule, ep) + ["--nproc-per-node", str(world)])
        sl = m.get("sleep", {})
        alone = (sl["standins_only"]["ms"] / sl["priced_ms"]) if sl.get("standins_only") and sl.get("priced_ms") else 1.0
        link = Link(GBps=bench["link"]["GBps"] / alone, latency_us=bench["link"]["latency_us"] * alone)
        payload = args.micro_batch_size * args.seq_length * args.hidden_size * (2 if args.bf16 or args.fp16 else 4)
        tape = tape_of_issued(sl.get("issued", []), payload) if schedule == "oases" else CURRENT
        # alone a stand-in runs at the clock cal / alone (its price x alone, the link above); beside
        # the GEMMs at the loaded clock: that clock's ratio longer
        beside = cal_mhz / 1e3 / alone / loaded if cal_mhz else 1.0
        r = analytical_train_step(args, topology=link_topology(link, world, gpu), world_size=world,
                                  forward_backward_only=True, tape=tape, collective_beside_compute=beside)
        st = r.stages[0]
        alone_r = analytical_train_step(args, topology=link_topology(link, world, gpu), world_size=world,
                                        forward_backward_only=True, tape=tape)
        # An MoE run's DP (= EP) gradient reduction is not priced by the benchmark (a stand-in of
        # zero duration, benchmarks/standin/moe.py); the simulator's, exposed after the last
        # backward without --overlap-grad-reduce, comes off its step, comm and exposed time.
        grad, grad_alone = (r.grad_ms[0], alone_r.grad_ms[0]) if ep > 1 else (0.0, 0.0)
        sleep = sl.get("with_standins", {}).get("ms")
        compute = m["compute"]["ms"]
        rows.append({
            "file": os.path.basename(path), "path": path, "model": bench.get("label"), "tp": tp, "ep": ep,
            "schedule": schedule, "recompute": m["recompute"],
            "cuda_device_max_connections": bench.get("cuda_device_max_connections"), "gpu": gpu,
            "link_GBps": bench["link"]["GBps"], "standins_alone_over_priced": alone,
            "calibration_MHz": cal_mhz and cal_mhz / 1e3, "loaded_MHz": loaded, "loaded_clock_from": clock_src,
            "loaded_clock_borrowed": borrowed,
            "collective_beside_compute": beside, "tape": "current" if tape == CURRENT else "pre-split head, two adds",
            "compute_ms": compute, "sim_compute_ms": st.compute_ms,
            "standins_priced_ms": sl.get("priced_ms"), "standins_alone_ms": (sl.get("standins_only") or {}).get("ms"),
            "sim_comm_alone_ms": alone_r.stages[0].comm_ms - grad_alone, "sim_comm_ms": st.comm_ms - grad,
            "sleep_step_ms": sleep, "sim_step_ms": r.iteration_ms - grad,
            "exposed_ms": None if sleep is None else sleep - compute, "sim_exposed_ms": st.exposed_comm_ms - grad,
            "sim_dp_grad_ms_left_out": grad,
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
            "standins_priced_ms", "standins_alone_ms", "sim_comm_ms", "sleep_step_ms", "sim_step_ms", "exposed_ms",
            "sim_exposed_ms")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(_fmt(row[c]) for c in cols))
    for r in ratios(rows):
        print(f"{r['file']} ({r['recompute']}): stock / Oases measured {r['measured']:.3f}x, "
              f"simulated {r['simulated']:.3f}x ({r['error_pct']:+.1f}%)")
    for f in dict.fromkeys(r["path"] for r in rows):
        r = next(x for x in rows if x["path"] == f)
        if r["loaded_MHz"]:
            print(f"{f}: stand-ins alone at {r['standins_alone_over_priced']:.3f} of their price, beside compute "
                  f"x{r['collective_beside_compute']:.3f} (loaded clock {r['loaded_MHz']:.0f} MHz from "
                  f"{r['loaded_clock_from']}{', borrowed: none read in its session' if r['loaded_clock_borrowed'] else ''}); "
                  f"Oases tape: {next((x['tape'] for x in rows if x['path'] == f and x['schedule'] == 'oases'), '-')}")
    for line in dict.fromkeys(n for f in a.files for n in notes(f)):
        print(line)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
