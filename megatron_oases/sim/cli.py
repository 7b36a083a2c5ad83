"""``megatron-oases sim``: simulate one iteration and print the summary (the lead wires this in)."""
from __future__ import annotations

import argparse
import sys

from ..topology import TopologyError, load_topology
from .device_model import ProfileDB, SimError, device_model
from .events import ModelConfig, Strategy
from .timeline import simulate, summary_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-oases sim", description="Simulate one training iteration.")
    p.add_argument("--topology", required=True, help="YAML path or shipped example name")
    p.add_argument("--gpu", default=None, help="GPU model; default: the topology's device")
    p.add_argument("--profile", default=None, help="ProfileDB JSON of measured event times (ms)")
    for name in ("num-layers", "hidden-size", "num-attention-heads", "seq-length", "micro-batch-size"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=51200)
    p.add_argument("--ffn-hidden-size", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--overlap", default="none", choices=("none", "oases"))
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--fp32", action="store_true", help="4-byte elements, fp32 peak")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    p.add_argument("--png", default=None, help="write a timeline PNG here (needs matplotlib)")
    return p


def sim_main(argv: list[str] | None = None) -> int:
    """Exit 0 and print the summary; exit 2 with one ``error:`` line on bad input."""
    a = build_parser().parse_args(argv)
    try:
        e = 4 if a.fp32 else 2
        model = ModelConfig(num_layers=a.num_layers, hidden=a.hidden_size, heads=a.num_attention_heads,
                            seq=a.seq_length, vocab=a.vocab_size, micro_batch=a.micro_batch_size,
                            ffn=a.ffn_hidden_size, bytes_per_element=e)
        strategy = Strategy(tp=a.tp, pp=a.pp, dp=a.dp, num_microbatches=a.num_microbatches,
                            schedule=a.schedule, overlap=a.overlap, recompute=a.recompute)
        profile = ProfileDB.load(a.profile) if a.profile else None
        dm = device_model(load_topology(a.topology), gpu=a.gpu, profile=profile, bytes_per_element=e)
        r = simulate(model, strategy, dm)
    except (SimError, TopologyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary_table(r))
    if a.trace:
        from .trace import write_chrome_trace
        write_chrome_trace(r, a.trace)
        print(f"trace: {a.trace}")
    if a.png:
        from .trace import plot_timeline
        plot_timeline(r, a.png)
        print(f"timeline: {a.png}")
    return 0
