"""Simulate one iteration of a 128-layer GPT on 3,072 GPUs and print the wall time + summary.

Run: python scripts/bench_sim_scale.py [--tp 8 --pp 8 --dp 48 --schedule oases --virtual-stages 2]
The default uses Megatron's distributed optimizer (without it the 128-layer model's Adam states do
not fit in 80 GB at TP 8 x PP 8, and the summary says so).
Bad splits (TP x PP x DP != GPUs, layers not divisible by PP) print one error line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


from megatron_oases.pricing.device_model import SimError, device_model
from megatron_oases.run_config import SCHEDULES
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import SimResult, simulate, summary_table
from megatron_oases.topology import Level, Topology


def cluster(gpus: int, per_node: int = 8) -> Topology:
    """DGX-H100-like nodes: NVSwitch inside, 8 x 400 Gb/s InfiniBand (400 GB/s) between."""
    if gpus % per_node:
        raise SimError(f"{gpus} GPUs are not a multiple of {per_node} per node")
    levels = [Level(name="nvswitch", size=per_node, scope="intra_node", p2p_bandwidth_GBps=900,
                    group_bandwidth_GBps=900, latency_us=2)]
    if gpus > per_node:
        levels.append(Level(name="ib", size=gpus // per_node, scope="inter_node", p2p_bandwidth_GBps=400,
                            group_bandwidth_GBps=400, latency_us=5))
    return Topology(name=f"h100x{gpus}", levels=tuple(levels), device="h100-sxm")


def run(*, gpus: int = 3072, layers: int = 128, tp: int = 8, pp: int = 8, dp: int = 48,
        microbatches: int = 32, schedule: str = "oases", pipeline_schedule: str = "1f1b", virtual_stages: int = 1,
        distributed_optimizer: bool = True, ddp_overlap: bool = False) -> tuple[SimResult, float]:
    """(result, seconds) for a GPT-175B-like model (h 12288, 96 heads, s 2048)."""
    t0 = time.perf_counter()
    model = GPTShape(num_layers=layers, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                     padded_vocab_size=51200, micro_batch_size=2, dtype="bf16")
    strategy = Strategy(tp=tp, pp=pp, dp=dp, num_microbatches=microbatches, pipeline_schedule=pipeline_schedule,
                        schedule=schedule, recompute=True, virtual_stages=virtual_stages,
                        distributed_optimizer=distributed_optimizer, overlap_grad_reduce=ddp_overlap,
                        overlap_param_gather=ddp_overlap and distributed_optimizer)
    r = simulate(model, strategy, device_model(cluster(gpus)))
    return r, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("gpus", 3072), ("layers", 128), ("tp", 8), ("pp", 8), ("dp", 48), ("microbatches", 32),
                          ("virtual-stages", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--schedule", default="oases", choices=SCHEDULES, help="the TP executor (sim's --schedule)")
    p.add_argument("--pipeline-schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
    p.add_argument("--ddp-overlap", action="store_true",
                   help="--overlap-grad-reduce (and --overlap-param-gather with the distributed optimizer)")
    a = p.parse_args(argv)
    try:
        r, secs = run(gpus=a.gpus, layers=a.layers, tp=a.tp, pp=a.pp, dp=a.dp, microbatches=a.microbatches,
                      schedule=a.schedule, pipeline_schedule=a.pipeline_schedule, virtual_stages=a.virtual_stages,
                      distributed_optimizer=a.distributed_optimizer, ddp_overlap=a.ddp_overlap)
    except SimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"simulated {a.gpus} GPUs in {secs:.3f} s")
    print(summary_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
