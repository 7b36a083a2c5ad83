"""Bring the GPU's clocks out of idle before a profile, and read them under load (issue 35, item 4:
"after the clocks have settled (read them)"). The H100 run of 2026-11-26 read 345 MHz before some
profiles: the card was idle, so the first timed events ran while the clocks ramped.

    python scripts/gpu_settle.py --seconds 5 --label sim-h512-default

Reads ``nvidia-smi``'s SM / memory clocks, temperature and power as found, runs bf16 GEMMs for
``--seconds``, reads them again while the last ones are still queued, and prints one line for each
(``clocks <label>: ...``, ``clocks <label> (settled Ns): ...``; ``scripts/gpu_check.sh`` appends
them to summary.txt). Without CUDA it prints that it skipped.
"""
from __future__ import annotations

import argparse
import subprocess
import time

QUERY = "clocks.sm,clocks.mem,temperature.gpu,power.draw"


def torch_gpu_id() -> str | None:
    """``nvidia-smi -i``'s name (``GPU-<uuid>``) of the GPU torch loads (its current device), or
    None where torch gives no UUID. ``nvidia-smi`` ignores ``CUDA_VISIBLE_DEVICES`` and lists
    every GPU of the machine, so without it the line read was physical GPU 0's: on a node of
    several GPUs, another than the one loaded whenever ``CUDA_VISIBLE_DEVICES`` (a SLURM
    allocation, a shared node) starts elsewhere."""
    import uuid

    import torch

    try:
        raw = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid.bytes
        return f"GPU-{uuid.UUID(bytes=bytes(raw))}"
    except (AttributeError, ValueError, TypeError):
        return None


def read_clocks(gpu: str | None = None) -> str:
    """One line of ``nvidia-smi``'s clocks, temperature and power of ``gpu`` (an ``-i`` id; None or
    an id it does not know, e.g. a MIG instance's: the first GPU it lists), or its error text."""
    query = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"]
    done = subprocess.run(query + (["-i", gpu] if gpu else []), capture_output=True, text=True, check=False)
    if gpu and (done.returncode != 0 or not done.stdout.strip()):
        return read_clocks(None)
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="how long to load the GPU before the second read")
    p.add_argument("--label", default="", help="the name the line carries (the step that follows)")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"clocks {a.label}: no CUDA, not settled")
        return 0
    gpu = torch_gpu_id()
    print(f"clocks {a.label}: {read_clocks(gpu)}")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        for _ in range(8):
            x = (x @ x).clamp_(-1, 1)  # keep values finite; the work is the GEMM
        torch.cuda.synchronize()
    for _ in range(64):  # queued work still running while nvidia-smi reads the clocks
        x = (x @ x).clamp_(-1, 1)
    settled = read_clocks(gpu)
    torch.cuda.synchronize()
    print(f"clocks {a.label} (settled {a.seconds:g}s): {settled}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
