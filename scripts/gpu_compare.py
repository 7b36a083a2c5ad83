"""The compare step of scripts/gpu_check.sh: every trainer run's losses, step times and model-FLOPs
utilisation, and the loss differences between runs that must train alike.

Reads ``run-<name>.json`` (the trainer's ``--log-json`` lines) in the folder given. MFU is the
trainer's model TFLOP/s per rank (Megatron-LM's formula, ``megatron_oases.flops``), median over
iterations 3 and later, over the card's dense bf16 peak: the data-sheet figure of the device
model's GPU (``pricing.device_model.GPUS``; an H200 has the H100 SXM's SM array and clocks, so
the same 989 TFLOP/s). Prints a table and writes ``<folder>/compare.json``.

    python scripts/gpu_compare.py /tmp/gpu_check/json
"""
from __future__ import annotations

import json
import os
import statistics
import sys


from megatron_oases.errors import ConfigError, OneLineErrorParser  # noqa: E402
from megatron_oases.output_paths import check_output_file  # noqa: E402

PAIRS = (
    # the issue-34 model (TP 1, hidden 4096, sequence 4096, bf16): Oases against stock under the
    # same attention backend, and the fused attention against Megatron's local one
    ("mfu-oases-auto", "mfu-default-auto"), ("mfu-oases-local", "mfu-default-local"),
    ("mfu-default-auto", "mfu-default-local"), ("mfu-oases-auto", "mfu-oases-local"),
    # the small runs of the first GPU check
    ("tp1-oases", "tp1-stock"), ("tp1-stock-cpu", "tp1-stock"), ("tp1-oases-bf16", "tp1-stock-bf16"),
    ("tp2-stock", "tp1-stock"), ("tp2-oases", "tp2-stock"), ("tp2-oases-sp", "tp2-stock"),
    ("tp4-stock", "tp1-stock"), ("tp4-atp22", "tp4-stock"), ("tp8-3d", "tp1-stock"),
)


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of the card the runs used, from the device model's table."""
    from megatron_oases.pricing.device_model import gpu_of_device_name, gpu_spec

    gpu = gpu_of_device_name(device_name)
    return gpu_spec(gpu).tensor_tflops if gpu else None


def load_runs(folder: str) -> dict[str, list[dict]]:
    runs = {}
    for f in sorted(os.listdir(folder)):
        if f.startswith("run-") and f.endswith(".json"):
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                runs[f[4:-5]] = [json.loads(line) for line in fh if line.strip()]
    return runs


def steady(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records[2:] if key in r] or [r[key] for r in records if key in r]
    return statistics.median(vals) if vals else None


def build_parser() -> OneLineErrorParser:
    p = OneLineErrorParser(
        prog="gpu_compare.py", description=__doc__.split("\n\n")[0],
        epilog="Reads FOLDER/run-<name>.json (the trainer's --log-json lines, e.g. scripts/gpu_check.sh's "
               "$OUT/json); prints one row per run and the loss differences of the pairs that must "
               "train alike, and writes FOLDER/compare.json.")
    p.add_argument("folder", metavar="FOLDER", help="folder holding the runs' run-<name>.json logs")
    p.add_argument("device", metavar="DEVICE", nargs="?", default="",
                   help="the card's name as torch reports it, for its peak (default: this machine's "
                        "first CUDA device, else cpu: no MFU)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    folder, device = a.folder, a.device
    if not os.path.isdir(folder):
        p.error(f"FOLDER {folder} is not a directory; give the folder of the run-<name>.json logs")
    try:
        check_output_file("FOLDER", os.path.join(folder, "compare.json"))
    except ConfigError as e:
        p.error(str(e))
    if not device:
        try:
            import torch
            device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 - the table is still worth printing
            device = "unknown"
    peak = peak_tflops(device)
    runs = load_runs(folder)
    out = {"device": device, "peak_tflops": peak, "runs": {}, "pairs": {}}
    print(f"device {device}, dense bf16 peak {peak} TFLOP/s")
    print(f"{'run':22s} {'step ms':>9s} {'host %':>6s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak MB':>8s}  losses")
    for name, rs in runs.items():
        if not rs:
            print(f"{name:22s} (no iterations logged)")
            continue
        step, tf = steady(rs, "step_ms"), steady(rs, "tflops_per_rank")
        if step is None:  # a log without timings (an older trainer's): losses only
            print(f"{name:22s} (no step times logged) {[round(r['lm_loss'], 5) for r in rs]}")
            out["runs"][name] = {"losses": [r["lm_loss"] for r in rs]}
            continue
        mem = max((r.get("peak_mem_mb") or 0) for r in rs)
        mfu = tf / peak if (tf is not None and peak) else None
        # the host's share of forward-backward (near 100% on a GPU: the step is host-bound)
        fb, host = steady(rs, "forward_backward_ms"), steady(rs, "forward_backward_host_ms")
        host_share = host / fb if (fb and host is not None) else None
        out["runs"][name] = {"step_ms": step, "tflops_per_rank": tf, "mfu": mfu, "peak_mem_mb": mem,
                             "forward_backward_ms": fb, "forward_backward_host_ms": host,
                             "losses": [r["lm_loss"] for r in rs]}
        mfu_s = f"{100 * mfu:5.1f}%" if mfu is not None else "   n/a"
        host_s = f"{100 * host_share:5.1f}%" if host_share is not None else "   n/a"
        print(f"{name:22s} {step:9.1f} {host_s:>6s} {tf or 0:8.1f} {mfu_s:>6s} {mem:8.0f}  "
              f"{[round(r['lm_loss'], 5) for r in rs]}")
    for a, b in PAIRS:
        if runs.get(a) and runs.get(b):
            diff = max(abs(x["lm_loss"] - y["lm_loss"]) / abs(y["lm_loss"])
                       for x, y in zip(runs[a], runs[b]))
            times = out["runs"][b].get("step_ms"), out["runs"][a].get("step_ms")
            ratio = times[0] / times[1] if None not in times else None
            out["pairs"][f"{a} vs {b}"] = {"max_rel_loss_diff": diff, "speedup": ratio}
            print(f"{a} vs {b}: max relative loss difference {diff:.2e}, "
                  + (f"speed {ratio:.3f}x" if ratio is not None else "no step times"))
    with open(os.path.join(folder, "compare.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
