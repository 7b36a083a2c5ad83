#!/usr/bin/env python3
"""The README's picture, drawn from the measured JSON of the H100 run (docs/gpu.md), never typed in.

    python scripts/readme_chart.py [--run examples/gpu/h100-2026-11-26] [--out docs/img/h100_oases.svg]

Left: the one-GPU overlap benchmark (``scripts/bench_gpu_overlap.py --tp 2``, ``overlap_standin.json``):
forward + backward of rank 0 of a TP-2 model, stock against the Oases schedule, with no collectives,
with SM-free stand-ins (``sleep``) and with stand-ins that take the SMs and HBM (``copy``).
Right: model-FLOPs utilisation of the trainer at TP 1 (``scripts/gpu_compare.py``,
``compare_main.json``), stock against Oases under the fused (SDPA) and Megatron's local attention.

The SVG keeps its text as text (``svg.fonttype: none``) and carries no date, so regenerating it from
the same JSON with the same matplotlib gives the same file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUN = os.path.join(ROOT, "examples", "gpu", "h100-2026-11-26")
OUT = os.path.join(ROOT, "docs", "img", "h100_oases.svg")

SCHEDULES = (("default", "stock Megatron"), ("oases", "Oases schedule"))
STEP_ROWS = (("compute", "no collectives"), ("sleep", "SM-free stand-ins"), ("copy", "SM-taking stand-ins"))
MFU_RUNS = (("auto", "fused attention (SDPA)"), ("local", "Megatron's local attention"))
COLORS = {"default": "#9e9e9e", "oases": "#1f77b4"}


def chart_data(run: str = RUN) -> dict:
    """The numbers the chart draws, read from the run's JSON: step ms per (row, schedule), MFU per
    (attention, schedule), stock / Oases per stand-in kind, and the run's device and link."""
    with open(os.path.join(run, "overlap_standin.json")) as f:
        overlap = json.load(f)
    with open(os.path.join(run, "compare_main.json")) as f:
        compare = json.load(f)
    steps = {}
    for sched, _ in SCHEDULES:
        s = overlap["schedules"][sched]
        steps[("compute", sched)] = s["compute"]["ms"]
        for kind in ("sleep", "copy"):
            steps[(kind, sched)] = s[kind]["with_standins"]["ms"]
    mfu = {(attn, sched): compare["runs"][f"mfu-{sched}-{attn}"]["mfu"]
           for attn, _ in MFU_RUNS for sched, _ in SCHEDULES}
    return {"device": overlap["device"], "tp": overlap["tp"], "link": overlap["link"],
            "steps": steps, "mfu": mfu, "speedup": dict(overlap["stock_over_oases"]),
            "peak_tflops": compare["peak_tflops"]}


def write_svg(data: dict, path: str) -> None:
    """Two panels side by side, as an SVG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "megatron_oases-readme",
                         "font.size": 9})
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.3), width_ratios=(1.6, 1.0))
    h = 0.38
    for j, (sched, label) in enumerate(SCHEDULES):
        ys = [i + (j - 0.5) * h for i in range(len(STEP_ROWS))]
        vals = [data["steps"][(row, sched)] for row, _ in STEP_ROWS]
        left.barh(ys, vals, h, color=COLORS[sched], label=label)
        for y, v in zip(ys, vals):
            left.text(v + 2, y, f"{v:.1f} ms", va="center", fontsize=8)
    left.set_yticks(range(len(STEP_ROWS)),
                    [name + _speedup_note(data["speedup"].get(row)) for row, name in STEP_ROWS])
    left.invert_yaxis()
    left.set_xlim(0, max(data["steps"].values()) * 1.2)
    left.set_xlabel("forward + backward step, ms (lower is better)")
    left.set_title(f"TP {data['tp']} on one {_card(data['device'])}, collectives as priced stand-ins "
                   f"({data['link']['GBps']:.1f} GB/s)", fontsize=9)
    for side in ("top", "right"):
        left.spines[side].set_visible(False)

    w = 0.38
    for j, (sched, label) in enumerate(SCHEDULES):
        xs = [i + (j - 0.5) * w for i in range(len(MFU_RUNS))]
        vals = [100 * data["mfu"][(attn, sched)] for attn, _ in MFU_RUNS]
        right.bar(xs, vals, w, color=COLORS[sched], label=label)
        for x, v in zip(xs, vals):
            right.text(x, v + 1, f"{v:.1f}%", ha="center", fontsize=8)
    right.set_xticks(range(len(MFU_RUNS)), [name.replace(" (", "\n(").replace("local ", "local\n")
                                            for _, name in MFU_RUNS])
    right.set_ylim(0, 60)
    right.set_ylabel(f"% of {data['peak_tflops']:.0f} TFLOP/s bf16 (higher is better)")
    right.set_title("TP 1 model-FLOPs utilisation", fontsize=9)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, frameon=False, fontsize=8)
    for side in ("top", "right"):
        right.spines[side].set_visible(False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def _speedup_note(x: float | None) -> str:
    """The second line of a step row's label: stock / Oases."""
    if x is None:
        return ""
    return f"\nOases {x:.2f}x " + ("faster" if x >= 1 else "(slower)")


def _card(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'."""
    return next((w for w in device.split() if w[:1] in "HABLV" and w[1:].isdigit()), device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="readme_chart.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=RUN, help="folder of the GPU run's JSON (default: %(default)s)")
    p.add_argument("--out", default=OUT, help="SVG to write (default: %(default)s)")
    args = p.parse_args(argv)
    write_svg(chart_data(args.run), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
