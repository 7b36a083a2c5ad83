"""What the Oases executor costs when there is nothing to overlap (issue 22's overhead benchmark).

Per model size, on plain local ranks (no emulated link: communication is not what is measured):

  TP=1   stock       Megatron's layers, full recompute
         oases       ``--schedule oases`` (at TP 1 the layers run as stock ones: no collective
                     to overlap, so no executor)
  TP=2   stock       stock layers, every TP collective of the layers removed
                     (``--oases-skip-tp-collectives``: Megatron's linears communicate nothing)
         stock-half  the same with half the micro-batch and twice the micro-batches (the same
                     samples): what running a micro-batch as two half-size batches costs stock
         oases       the Oases executor, its collectives removed the same way

The TP=2 overhead splits into ``split`` (stock-half over stock: half-size GEMMs and attention,
twice the per-micro-batch work of the head and the schedule -- the Oases executor splits only the
layers, so this slightly overstates its share) and ``executor`` (oases over stock-half: the tape
walk, one autograd call per local step and sub-batch instead of one per layer, leaf tensors,
dropout-mask slicing). The autograd calls are counted from the tape and priced with a
micro-benchmark of one ``torch.autograd.grad`` call on this machine. Variants run in rounds
(ABC ABC ...), each run holding the machine-wide benchmark lock; a run's time is the median of
its steps after warm-up, and the table reports the fastest run of each variant: on a shared
2-core machine interference only adds time, so the minimum over rounds is the estimate least
disturbed by it (every round's time is in the JSON).

    python scripts/bench_oases_overhead.py --hidden 256 512 1024 --out results/oases_overhead
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time


from benchmarks.harness import (RECOMPUTE, TRAINER, bench_lock, launch_ranks, loadavg,
                                  print_table, step_stats)

SKIP = ["--oases-skip-tp-collectives"]
VARIANTS = {  # name -> (TP, extra flags, micro-batch divisor)
    ("tp1", "stock"): (1, ["--schedule", "default"], 1),
    ("tp1", "oases"): (1, ["--schedule", "oases"], 1),
    ("tp2", "stock"): (2, ["--schedule", "default"] + SKIP, 1),
    ("tp2", "stock-half"): (2, ["--schedule", "default"] + SKIP, 2),
    ("tp2", "oases"): (2, ["--schedule", "oases"] + SKIP, 1),
}
LOCAL_STEPS_PER_LAYER = 5
"""The Megatron layer's tape: ln1, attention, bda_ln2, mlp, bda (``schedules/oases/tape.py``)."""


def trainer_flags(a, hidden: int, tp: int, divisor: int) -> list[str]:
    mb = a.micro_batch // divisor
    return ["--tensor-model-parallel-size", str(tp), "--num-layers", str(a.layers),
            "--hidden-size", str(hidden), "--num-attention-heads", str(max(hidden // 64, 2)),
            "--seq-length", str(a.seq), "--micro-batch-size", str(mb),
            "--global-batch-size", str(a.micro_batch * a.micro_batches),
            "--vocab-size", str(a.vocab), "--train-iters", str(a.iters),
            "--no-tp-invariant-init", "--dist-timeout", "300"] + RECOMPUTE


def run_variant(a, hidden: int, key, workdir: str, rnd: int) -> dict:
    tp, extra, divisor = VARIANTS[key]
    log = os.path.join(workdir, f"h{hidden}-{key[0]}-{key[1]}-r{rnd}.jsonl")
    cmd = TRAINER + trainer_flags(a, hidden, tp, divisor) + extra + ["--log-json", log]
    with bench_lock():
        launch_ranks(cmd, tp, timeout=a.timeout)
    return step_stats(log, a.warmup)


def autograd_call_us(reps: int = 2000) -> float:
    """Median microseconds of one ``torch.autograd.grad`` call on a two-op graph of tiny tensors:
    the fixed cost the executor pays per local step and sub-batch."""
    import torch

    x = torch.randn(4, 4)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            leaf = x.detach().requires_grad_()
            y = (leaf * 2).sum()
            torch.autograd.grad([y], [leaf])
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def causes(a, hidden: int, by: dict, call_us: float) -> dict:
    """The per-cause split of one size's overhead (percent of the matching stock step)."""
    pct = lambda x, y: 100.0 * (x / y - 1.0)  # noqa: E731
    stock, half, oases = by["tp2", "stock"], by["tp2", "stock-half"], by["tp2", "oases"]
    m = a.micro_batches
    extra_calls = a.layers * m * (2 * LOCAL_STEPS_PER_LAYER - 1)  # vs one checkpoint backward per layer
    calls_ms = extra_calls * call_us / 1e3
    return {"hidden": hidden,
            "tp1_oases_pct": pct(by["tp1", "oases"], by["tp1", "stock"]),
            "tp2_total_pct": pct(oases, stock),
            "split_pct": pct(half, stock),
            "executor_pct": 100.0 * (oases - half) / stock,
            "extra_autograd_calls": extra_calls,
            "autograd_calls_pct": 100.0 * calls_ms / stock,
            "executor_rest_pct": 100.0 * (oases - half - calls_ms) / stock}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024],
                   help="model sizes (heads = hidden / 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="repeat every variant this many times")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/oases_overhead")
    a = p.parse_args(argv)
    if a.micro_batch % 4:
        p.error(f"--micro-batch must be a multiple of 4 (stock-half halves it and Oases halves that "
                f"again); got {a.micro_batch}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows, summary = [], []
    call_us = autograd_call_us()
    print(f"one torch.autograd.grad call on a tiny graph: {call_us:.1f} us (load {loadavg()})")
    with tempfile.TemporaryDirectory() as work:
        for hidden in a.hidden:
            runs: dict = {k: [] for k in VARIANTS}
            for rnd in range(a.rounds):
                for key in VARIANTS:
                    runs[key].append(run_variant(a, hidden, key, work, rnd))
                    print(f"  h={hidden} {key[0]} {key[1]:10s} round {rnd}: "
                          f"{runs[key][-1]['step_ms']:8.1f} ms", flush=True)
            by = {k: min(r["step_ms"] for r in v) for k, v in runs.items()}
            for (tp, name), ms in by.items():
                base = by[tp, "stock"]
                rows.append({"hidden": hidden, "tp": tp, "variant": name, "step_ms": ms,
                             "vs_stock": ms / base,
                             "rounds_ms": [round(r["step_ms"], 1) for r in runs[tp, name]],
                             "loss": runs[tp, name][-1]["loss"]})
            summary.append(causes(a, hidden, by, call_us))
    print(f"\n{a.layers} layers, seq {a.seq}, micro-batch {a.micro_batch} x {a.micro_batches}, "
          f"full recompute, fastest of {a.rounds} rounds of the median of {a.iters - a.warmup} steps "
          f"(load {loadavg()})")
    print_table(rows, ["hidden", "tp", "variant", "step_ms", "vs_stock"])
    print("\noverhead by cause, percent of the stock step at the same TP (tp2: collectives removed)")
    cols = ["hidden", "tp1_oases_pct", "tp2_total_pct", "split_pct", "executor_pct",
            "extra_autograd_calls", "autograd_calls_pct", "executor_rest_pct"]
    print_table(summary, cols)
    with open(a.out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["hidden", "tp", "variant", "step_ms", "vs_stock"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(a.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"config": vars(a), "autograd_call_us": call_us, "rows": rows,
                   "causes": summary, "loadavg": loadavg()}, f, indent=1)
    print(f"wrote {a.out}.csv and {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
