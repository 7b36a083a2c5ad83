"""The overlap benchmark's runs as one list of records a user reads at a glance.

One record per stand-in kind of each ``scripts/bench_gpu_overlap.py --out`` file: the stock and
Oases steps with that kind, the step with TP communication switched off (stand-ins of zero
duration, ``comm_disabled``) and max(compute, communication). The benchmark prints them as its
bound table; ``gpu_check.sh``'s ``overlap-summary`` step collects its runs' records into
``overlap_summary.json``:

    python -m benchmarks.standin.summary OVERLAP_JSON... --out overlap_summary.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

FIELDS = ("model", "kind", "recompute", "link_GBps", "stock_ms", "oases_ms", "comm_disabled_ms",
          "oases_comm_disabled_ms", "max_compute_comm_ms")
"""A record's keys, in order."""


def records(bench: dict) -> list[dict]:
    """One record per stand-in kind of a benchmark run with both schedules (none without).

    ``comm_disabled_ms`` is stock's step with communication switched off, the bound a user
    understands; ``oases_comm_disabled_ms`` the Oases step's (its split's cost shows beside it);
    ``max_compute_comm_ms`` max(Oases' comm-disabled step, its stand-ins alone), the step of a
    perfect overlap of Oases' own work."""
    sch = bench["schedules"]
    if not {"default", "oases"} <= set(sch):
        return []
    stock, oases = sch["default"], sch["oases"]
    out = []
    for kind in bench["kinds"]:
        out.append({
            "model": bench.get("label") or f"tp{bench['tp']}" + (f"ep{bench['ep']}" if bench.get("ep", 1) > 1 else ""),
            "kind": kind,
            "recompute": stock["recompute"].split(" ")[0], "link_GBps": bench["link"]["GBps"],
            "stock_ms": stock[kind]["with_standins"]["ms"], "oases_ms": oases[kind]["with_standins"]["ms"],
            "comm_disabled_ms": stock["comm_disabled"]["ms"],
            "oases_comm_disabled_ms": oases["comm_disabled"]["ms"],
            "max_compute_comm_ms": max(oases["comm_disabled"]["ms"], oases[kind]["standins_only"]["ms"]),
        })
    return out


def table_rows(recs: list[dict]) -> list[dict]:
    """The records as the benchmark's printed bound table."""
    return [{"model": r["model"], "stand-in": r["kind"], "recompute": r["recompute"], "link GB/s": r["link_GBps"],
             "stock ms": r["stock_ms"], "Oases ms": r["oases_ms"], "comm-disabled ms": r["comm_disabled_ms"],
             "Oases comm-disabled ms": r["oases_comm_disabled_ms"],
             "max(compute, comm) ms": r["max_compute_comm_ms"], "stock / Oases": r["stock_ms"] / r["oases_ms"],
             "Oases / comm-disabled": r["oases_ms"] / r["comm_disabled_ms"]} for r in recs]


TABLE_COLUMNS = ("model", "stand-in", "recompute", "link GB/s", "stock ms", "Oases ms", "comm-disabled ms",
                 "Oases comm-disabled ms", "max(compute, comm) ms", "stock / Oases", "Oases / comm-disabled")


def parse_overlap_files(p, argv: list[str] | None, *, out_help: str, out_required: bool):
    """``OVERLAP_JSON ... --out F`` of the scripts that read the benchmark's JSON files (this one,
    ``scripts/sim_vs_standin.py``): each file exists and ``--out`` is writable, or one line."""
    from megatron_oases.errors import ConfigError
    from megatron_oases.output_paths import check_output_file

    p.add_argument("files", nargs="+", metavar="OVERLAP_JSON", help="bench_gpu_overlap.py --out files")
    p.add_argument("--out", required=out_required, default=None, help=out_help)
    a = p.parse_args(argv)
    missing = [f for f in a.files if not os.path.isfile(f)]
    if missing:
        p.error(f"OVERLAP_JSON {missing[0]} is not a file; give the --out files of scripts/bench_gpu_overlap.py")
    try:
        check_output_file("--out", a.out)
    except ConfigError as e:
        p.error(str(e))
    return a


def main(argv: list[str] | None = None) -> int:
    from megatron_oases.errors import OneLineErrorParser

    p = OneLineErrorParser(prog="benchmarks.standin.summary", description=__doc__.split("\n\n")[0])
    a = parse_overlap_files(p, argv, out_help="write the records here (a JSON list)", out_required=True)
    recs = []
    for path in a.files:
        with open(path, encoding="utf-8") as f:
            recs += records(json.load(f))
    recs.sort(key=lambda r: (r["model"], r["recompute"] != "none", r["link_GBps"]))  # kinds keep their order
    from benchmarks.harness import print_table

    if recs:
        print_table(table_rows(recs), list(TABLE_COLUMNS))
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
