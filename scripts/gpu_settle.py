"""Bring the GPU's clocks out of idle before a profile, and read them under load (issue 35, item 4:
"after the clocks have settled (read them)"). The H100 run of 2026-11-26 read 345 MHz before some
profiles: the card was idle, so the first timed events ran while the clocks ramped.

    python scripts/gpu_settle.py --seconds 5 --label sim-h512-default

Runs bf16 GEMMs for ``--seconds``, reads ``nvidia-smi``'s SM / memory clocks, temperature and power
while the last ones are still queued, and prints one line ``clocks <label> (settled Ns): ...``
(``scripts/gpu_check.sh`` appends it to summary.txt). Without CUDA it prints that it skipped.
"""
from __future__ import annotations

import argparse
import subprocess
import time

QUERY = "clocks.sm,clocks.mem,temperature.gpu,power.draw"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="how long to load the GPU (0: just read the clocks)")
    p.add_argument("--label", default="", help="the name the line carries (the step that follows)")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"clocks {a.label}: no CUDA, not settled")
        return 0
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        for _ in range(8):
            x = (x @ x).clamp_(-1, 1)  # keep values finite; the work is the GEMM
        torch.cuda.synchronize()
    for _ in range(64):  # queued work still running while nvidia-smi reads the clocks
        x = (x @ x).clamp_(-1, 1)
    read = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)
    torch.cuda.synchronize()
    print(f"clocks {a.label} (settled {a.seconds:g}s): {read.stdout.strip().splitlines()[0] if read.stdout.strip() else read.stderr.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
