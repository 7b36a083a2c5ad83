#!/usr/bin/env python3
"""Speedup of each run over the stock baseline, from training logs: a table, a CSV, a PNG chart.

    python scripts/compare.py RESULTS_DIR [--csv OUT.csv] [--png OUT.png]
    python scripts/compare.py stock=a.log atp=b.jsonl oases=c.log [--baseline stock]

Reads two log formats, line by line (a file may mix them):

* ``megatron-oases train --log-json FILE``: one JSON object per iteration with ``step_ms``
  (and ``tflops_per_rank``, ``tokens_per_s``);
* Megatron-LM's stdout (and the reference trainer's): lines with
  ``elapsed time per iteration (ms): X`` (and ``throughput per GPU (TFLOP/s/GPU): Y``).

A directory argument takes every ``*.log`` / ``*.jsonl`` below it; a file's case is
its parent directory relative to the argument (``RESULTS/h4096/oases.log``: case ``h4096``,
variant ``oases``), so one results directory of the SLURM scripts (docs/megatron_lm.md) gives
one row per run with speedups against the variant named ``--baseline`` (default ``stock``) of
the same case. The first ``--skip-first`` iterations (default 1: warm-up) are left out. A run
without any iteration line (it crashed, or is still queued) is listed as such and charted as 0.
Only the standard library is needed; the PNG needs matplotlib and is skipped with a note without.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

PROG = "compare.py"
LOG_SUFFIXES = (".log", ".jsonl")
"""What a directory argument picks up (any file can be named explicitly)."""
_STEP = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)")
_TFLOPS = re.compile(r"(?:throughput per GPU \(TFLOP/s/GPU\)|TFLOP/s per rank):\s*([0-9.eE+-]+)")
_TOKENS = re.compile(r"tokens/s:\s*([0-9.eE+-]+)")


@dataclass
class Run:
    """One training run: its iterations' step times (ms) and, where logged, TFLOP/s and tokens/s."""

    case: str
    variant: str
    path: str
    step_ms: list[float] = field(default_factory=list)
    tflops: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)

    def kept(self, values: list[float], skip: int) -> list[float]:
        # Keep at least the last value when a short run has no more than `skip` iterations.
        return values[skip:] if len(values) > skip else values[-1:]


def parse_log(text: str) -> tuple[list[float], list[float], list[float]]:
    """(step ms, TFLOP/s, tokens/s) per logged iteration, in order."""
    steps, tflops, tokens = [], [], []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{"):
            try:
                rec = json.loads(s)
            except json.JSONDecodeError:
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("step_ms"), (int, float)):
                steps.append(float(rec["step_ms"]))
                if isinstance(rec.get("tflops_per_rank"), (int, float)):
                    tflops.append(float(rec["tflops_per_rank"]))
                if isinstance(rec.get("tokens_per_s"), (int, float)):
                    tokens.append(float(rec["tokens_per_s"]))
                continue
        m = _STEP.search(line)
        if m:
            steps.append(float(m.group(1)))
            if (t := _TFLOPS.search(line)):
                tflops.append(float(t.group(1)))
            if (k := _TOKENS.search(line)):
                tokens.append(float(k.group(1)))
    return steps, tflops, tokens


def collect(specs: list[str]) -> list[Run]:
    """Runs from ``FILE``, ``LABEL=FILE`` or ``DIRECTORY`` arguments."""
    runs = []
    for spec in specs:
        label, path = "", Path(spec)
        if "=" in spec and not path.exists():
            label, _, rest = spec.partition("=")
            path = Path(rest)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES)
            if not files:
                raise SystemExit(f"{PROG}: error: no *.log / *.jsonl files under {path}")
            for f in files:
                rel = f.parent.relative_to(path)
                runs.append(_read(f, case="" if str(rel) == "." else str(rel), variant=f.stem))
        elif path.is_file():
            runs.append(_read(path, case="", variant=label or path.stem))
        else:
            raise SystemExit(f"{PROG}: error: {path} is neither a log file nor a directory")
    return runs


def _read(path: Path, *, case: str, variant: str) -> Run:
    steps, tflops, tokens = parse_log(path.read_text(encoding="utf-8", errors="replace"))
    return Run(case=case, variant=variant, path=str(path), step_ms=steps, tflops=tflops,
               tokens_per_s=tokens)


def summarise(runs: list[Run], *, baseline: str, skip_first: int) -> list[dict]:
    """One row per run: mean/median/std step ms, TFLOP/s, tokens/s, speedup over the baseline."""
    rows = []
    for r in runs:
        steps = r.kept(r.step_ms, skip_first)
        row = {"case": r.case, "variant": r.variant, "file": r.path, "iterations": len(steps),
               "step_ms_mean": statistics.fmean(steps) if steps else math.nan,
               "step_ms_median": statistics.median(steps) if steps else math.nan,
               "step_ms_std": statistics.pstdev(steps) if len(steps) > 1 else 0.0 if steps else math.nan,
               "tflops": _mean(r.kept(r.tflops, skip_first)),
               "tokens_per_s": _mean(r.kept(r.tokens_per_s, skip_first)),
               "baseline": "", "speedup": math.nan}
        rows.append(row)
    ordered = []
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        group.sort(key=lambda r: r["variant"] != baseline)  # baseline first, others as given
        base = group[0] if group[0]["variant"] == baseline else None
        for r in group:
            if base is not None and r["iterations"] and base["iterations"]:
                r["baseline"] = base["variant"]
                r["speedup"] = base["step_ms_mean"] / r["step_ms_mean"]
        ordered += group
    return ordered


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(rows: list[dict], baseline: str) -> str:
    head = ["case", "variant", "iters", "step ms", "+-", "TFLOP/s", "tokens/s", f"vs {baseline}"]
    body = [[r["case"] or "-", r["variant"], str(r["iterations"]) if r["iterations"] else "no data",
             _fmt(r["step_ms_mean"], ".1f"), _fmt(r["step_ms_std"], ".1f"), _fmt(r["tflops"], ".3g"),
             _fmt(r["tokens_per_s"], ".0f"),
             _fmt(r["speedup"], ".3f") + ("x" if not math.isnan(r["speedup"]) else "")]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    missing = sorted({r["case"] or "-" for r in rows if not r["baseline"]})
    if missing:
        out.append(f"(no '{baseline}' run with data for case(s): {', '.join(missing)}; "
                   f"choose one with --baseline)")
    return "\n".join(out)


def write_csv(rows: list[dict], path: str) -> None:
    cols = ["case", "variant", "iterations", "step_ms_mean", "step_ms_median", "step_ms_std",
            "tflops", "tokens_per_s", "speedup", "baseline", "file"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v)
                        for k, v in r.items()})


def write_png(rows: list[dict], path: str, baseline: str, title: str | None) -> bool:
    """Grouped bars of speedup per case; False (and a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{PROG}: note: matplotlib is not installed; skipped {path} "
              f"(pip install matplotlib for the chart)", file=sys.stderr)
        return False
    cases = list(dict.fromkeys(r["case"] or "-" for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cases) * max(len(variants), 2) / 2), 4))
    for i, v in enumerate(variants):
        ys = []
        for c in cases:
            r = next((r for r in rows if (r["case"] or "-") == c and r["variant"] == v), None)
            ys.append(0.0 if r is None or math.isnan(r["speedup"]) else r["speedup"])
        xs = [k + (i - (len(variants) - 1) / 2) * width for k in range(len(cases))]
        ax.bar(xs, ys, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel(f"speedup over {baseline} (step time)")
    ax.set_title(title or "speedup over the stock baseline")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="log file, LABEL=FILE, or a results directory (<case>/<variant>.log)")
    p.add_argument("--baseline", default="stock", help="variant the speedups are relative to")
    p.add_argument("--skip-first", type=int, default=1, metavar="N",
                   help="leave out the first N logged iterations of each run (warm-up)")
    p.add_argument("--csv", metavar="OUT", help="write the table as CSV")
    p.add_argument("--png", metavar="OUT", help="write a bar chart of the speedups (matplotlib)")
    p.add_argument("--title", default=None, help="chart title")
    args = p.parse_args(argv)
    if args.skip_first < 0:
        p.error(f"--skip-first must be >= 0 (got {args.skip_first})")
    rows = summarise(collect(args.runs), baseline=args.baseline, skip_first=args.skip_first)
    print(format_table(rows, args.baseline))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.png and write_png(rows, args.png, args.baseline, args.title):
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
