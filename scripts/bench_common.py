"""Pieces the benchmark scripts share: model flags of the reference trainer, step statistics
from its --log-json lines, and the printed table."""
from __future__ import annotations

import argparse
import json
import statistics

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
"""Megatron's full recompute of every layer, the baseline the Oases benchmarks compare with."""


def add_model_args(p: argparse.ArgumentParser, *, hidden: int, heads: int, seq: int,
                   iters: int, warmup: int, layers: int = 2) -> None:
    """The model/batch flags every benchmark takes (defaults per benchmark)."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--warmup", type=int, default=warmup)


def model_flags(a, tp: int) -> list[str]:
    """Trainer flags for ``add_model_args``'s values at TP size ``tp``."""
    return ["--tensor-model-parallel-size", str(tp), "--num-layers", str(a.layers),
            "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * a.micro_batches),
            "--vocab-size", str(a.vocab), "--train-iters", str(a.iters),
            "--no-tp-invariant-init", "--dist-timeout", "300"]


def step_stats(log_path: str, warmup: int) -> dict:
    """Median step time after ``warmup`` iterations, plus the last record's memory and loss."""
    recs = [json.loads(line) for line in open(log_path, encoding="utf-8")]
    steps = [r["step_ms"] for r in recs[warmup:]] or [r["step_ms"] for r in recs]
    last = recs[-1]
    return {"step_ms": statistics.median(steps), "step_ms_min": min(steps),
            "steps_ms": [round(s, 1) for s in steps], "peak_mem_mb": last["peak_mem_mb"],
            "oases_saved_mb": last.get("oases_saved_mb"), "loss": last["lm_loss"]}


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_table(rows: list[dict], cols: list[str]) -> None:
    w = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(f"{c:>{w[c]}s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{fmt(r.get(c)):>{w[c]}s}" for c in cols))
