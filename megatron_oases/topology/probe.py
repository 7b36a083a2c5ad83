"""Per-rank probes run inside an emulated cluster: overlap of async gloo collectives with compute,
and point-to-point bandwidth between rank pairs. Rank 0 prints one ``OASES_PROBE {json}`` line.

They turn the emulator's promises (comm overlaps compute; intra-node is faster than inter-node)
into numbers, for the tests and for anyone checking a new machine:
``megatron-oases emulate --topology emu-2x2 -- python -m megatron_oases.topology.probe p2p``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

MARKER = "OASES_PROBE "


def _tx_bytes(dev: str) -> int:
    p = Path(f"/sys/class/net/{dev}/statistics/tx_bytes")
    return int(p.read_text()) if p.exists() else -1


def _matmul_fn(target_ms: float, n: int = 512):
    """A compute kernel calibrated to about ``target_ms`` on one thread."""
    a = torch.randn(n, n)
    a @ a
    t0 = time.perf_counter()
    for _ in range(3):
        a @ a
    per = (time.perf_counter() - t0) / 3
    reps = max(1, math.ceil(target_ms / 1e3 / per))
    def run():
        for _ in range(reps):
            a @ a
    return run


def overlap(args) -> dict:
    """Serial (compute then all_reduce) vs overlapped (async all_reduce beside compute), medians."""
    x = torch.ones(int(args.mbytes * 2**20) // 4)
    compute = _matmul_fn(args.compute_ms)
    dist.all_reduce(x)  # warm up connections and buffers
    comp, comm, serial, over = [], [], [], []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter(); compute(); t1 = time.perf_counter()
        dist.all_reduce(x); t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait(); t4 = time.perf_counter()
        comp.append(t1 - t0); comm.append(t2 - t1); serial.append(t2 - t0); over.append(t4 - t3)
    med = lambda v: round(statistics.median(v) * 1e3, 1)
    return {"mode": "overlap", "mbytes": args.mbytes, "compute_ms": med(comp), "comm_ms": med(comm),
            "serial_ms": med(serial), "overlapped_ms": med(over),
            "serial_all_ms": [round(v * 1e3, 1) for v in serial], "overlapped_all_ms": [round(v * 1e3, 1) for v in over]}


def p2p(args) -> dict:
    """GB/s of a send from a to b (timed on a until b's ack), best of ``repeats``, per pair."""
    rank = dist.get_rank()
    big, ack = torch.ones(int(args.mbytes * 2**20) // 4), torch.zeros(1)
    out = {}
    for pair in args.pairs.split(","):
        a, b = (int(v) for v in pair.split("-"))
        best, dev_bytes = math.inf, {}
        for _ in range(args.repeats + 1):  # first round warms the connection
            dist.barrier()
            before = {d: _tx_bytes(d) for d in ("lo", "emu0")}
            t0 = time.perf_counter()
            if rank == a:
                dist.send(big, b); dist.recv(ack, b)
                best = min(best, time.perf_counter() - t0)
                dev_bytes = {d: _tx_bytes(d) - before[d] for d in before}
            elif rank == b:
                dist.recv(big, a); dist.send(ack, a)
        res = torch.tensor([best if rank == a else 0.0, dev_bytes.get("lo", 0), dev_bytes.get("emu0", 0)],
                           dtype=torch.float64)
        dist.all_reduce(res)  # bring the sender's numbers to rank 0
        out[pair] = {"GBps": round(big.numel() * 4 / res[0].item() / 1e9, 4),
                     "lo_tx_MB": round(res[1].item() / 1e6, 2), "veth_tx_MB": round(res[2].item() / 1e6, 2)}
    return {"mode": "p2p", "mbytes": args.mbytes, "pairs": out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["overlap", "p2p"])
    p.add_argument("--mbytes", type=float, default=32, help="tensor size in MiB")
    p.add_argument("--compute-ms", type=float, default=90, help="overlap: matmul time to hide comm behind")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pairs", default="0-1", help="p2p: comma-separated src-dst rank pairs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one core per rank: the point is to leave cores to gloo's threads
    dist.init_process_group("gloo")
    try:
        result = overlap(args) if args.mode == "overlap" else p2p(args)
        if dist.get_rank() == 0:
            print(MARKER + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def parse_output(text: str) -> dict:
    """The JSON that rank 0 printed (for callers holding a LaunchResult's output)."""
    for line in reversed(text.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    raise ValueError("no probe result in output:\n" + text[-2000:])


if __name__ == "__main__":
    main()
