"""Oases vs stock over an MoE model whose expert-parallel group crosses the emulated slow link
(issue 51 item 4; the MoE twin of ``scripts/bench_oases.py``).

Two emulated nodes of one rank each, joined by a rate-limited veth: TP 1, EP 2 (the two ranks),
so every all-to-all of the alltoall dispatcher crosses the slow level (DP 2: the non-expert
gradients are all-reduced across it too, once a step, in every variant). The model: Megatron-Core's
``MoELayer`` in every layer, ``--num-experts`` experts, top-k routing, the alltoall dispatcher,
dropless, the aux loss on. Variants, each the median step time after the warm-up:

  stock     --schedule default, full recompute (Megatron's)
  oases     --schedule oases, full recompute (the executor's fine-grained recompute), same layout
  compute   oases on plain local ranks, no rate limit (its all-to-alls then cost what loopback
            gloo costs: the compute-only time, measured; the DP reduction is in it too)
  comm      the Oases step's MoE collectives alone, back to back on the emulated link: every
            collective ``describe.moe`` states for one MoE layer under the Oases executor (the token
            counts' gather, the dispatch all-to-alls of the tokens and their probabilities, the
            combine, forward and backward), on one sub-batch, times the sub-batches, the layers and
            the micro-batches

  grad      the step's DP gradient all-reduce alone on the emulated link (the non-expert
            gradients, fp32: ``sim``'s event for this model and layout), which neither schedule
            overlaps (Megatron's DDP reduces after the backward)

The perfect-overlap bound is max(compute, comm) + grad (the dense benchmark's max(compute, comm)
plus the reduction neither schedule hides; compute holds that reduction at loopback speed too, a
few ms). Prints a table, writes CSV and JSON. Needs root (network namespaces);
``--no-emulate`` runs everything on plain local ranks (a smoke test, not a measurement).

    python scripts/bench_oases_moe.py --link-GBps 0.02 --out results/bench_oases_moe
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.harness import (RECOMPUTE, add_model_args, launch_ranks, loadavg, model_flags, print_table,
                                step_stats, topology_yaml, write_results, write_topology)
from megatron_oases.describe.moe import MOE_AXES, moe_shape
from megatron_oases.describe.registry import layer_description
from megatron_oases.describe.split import sub_batch_sizes

EP = 2
"""Expert-parallel ranks, one per emulated node (TP 1): the EP group is the world."""
SCHEDULES = {"stock": ["--schedule", "default"] + RECOMPUTE, "oases": ["--schedule", "oases"] + RECOMPUTE}
VARIANTS = ("stock", "oases", "compute")
"""Trainer runs; ``compute`` is ``oases`` without the rate limit. The ``comm`` and ``grad`` rows always run."""


def moe_flags(a) -> list[str]:
    """The MoE flags of the benchmark's model (Megatron-LM's names)."""
    return ["--num-experts", str(a.experts), "--moe-router-topk", str(a.topk),
            "--moe-ffn-hidden-size", str(a.moe_ffn), "--moe-token-dispatcher-type", "alltoall",
            "--moe-aux-loss-coeff", str(a.aux_loss_coeff), "--expert-model-parallel-size", str(EP),
            "--disable-bias-linear"]


def trainer_flags(a) -> list[str]:
    """The model at TP 1 over ``EP`` data-parallel ranks: each rank runs ``--micro-batches``
    micro-batches of ``--micro-batch`` a step (the global batch counts both replicas)."""
    flags = model_flags(a, 1)
    flags[flags.index("--global-batch-size") + 1] = str(a.micro_batch * a.micro_batches * EP)
    return flags + moe_flags(a)


def two_node_yaml(link_GBps: float) -> str:
    """Two emulated nodes of one rank each; the nodes' link (``veth``) is ``link_GBps`` a node."""
    return topology_yaml("bench-moe-2x1", "2 nodes x 1 rank, EP across the rate-limited link",
                         [("lo", 1, "intra_node", 10.0, 20), ("veth", EP, "inter_node", link_GBps, 50)])


def _moe_shape(a):
    """The benchmark's MoE flags as ``describe.moe.MoEShape``."""
    return moe_shape(num_experts=a.experts, moe_ffn_hidden_size=a.moe_ffn, ffn_hidden_size=4 * a.hidden,
                     moe_router_topk=a.topk, moe_layer_freq=1, moe_expert_capacity_factor=None,
                     moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                     moe_aux_loss_coeff=a.aux_loss_coeff)


def step_collectives(a) -> list[tuple[str, int]]:
    """(kind, payload bytes) of every MoE collective of one Oases training step, in issue order per
    layer: ``describe``'s MoE layer (``describe.moe``) on one sub-batch of the Oases split
    (``describe.split``), forward then backward, times the sub-batches, layers and micro-batches.
    At TP 1 all of them run on the EP group (the world); fp32."""
    moe = _moe_shape(a)
    subs = sub_batch_sizes(a.micro_batch)
    layer = layer_description(backend="megatron", layout=None, micro_batch=subs[0], seq=a.seq, hidden=a.hidden,
                              heads=a.heads, ffn=4 * a.hidden, tp=1, bytes_per_element=4, schedule="oases",
                              moe=moe, ep=EP)
    ops = [c for p in ("forward", "backward") for c in layer.collectives(p)]
    assert all(c.axis in MOE_AXES for c in ops), "at TP 1 every collective of the layer is an MoE one"
    return [(c.kind, c.payload_bytes) for c in ops] * (len(subs) * a.layers * a.micro_batches)


def grad_reduce_bytes(a, topo_path: str) -> int:
    """Bytes of the step's DP gradient all-reduce (the non-expert gradients in fp32; the experts'
    expert-data-parallel group is one rank here): ``sim``'s event for this model and layout."""
    from megatron_oases.describe.ops import LayerVariant
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.events import build_stage_events
    from megatron_oases.sim.core.strategy import Strategy
    from megatron_oases.topology import load_topology

    m = GPTShape(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, seq_length=a.seq,
                 micro_batch_size=a.micro_batch, ffn_hidden_size=4 * a.hidden, padded_vocab_size=a.vocab,
                 dtype="fp32", variant=LayerVariant(bias=False), moe=_moe_shape(a))  # --disable-bias-linear
    s = Strategy(tp=1, dp=EP, ep=EP, num_microbatches=a.micro_batches, recompute=True)
    (stage,) = build_stage_events(m, s, load_topology(topo_path))
    assert not stage.replica_allreduce, "the experts' gradients are reduced over one rank"
    return stage.grad_allreduce.nbytes


def comm_only_main(argv: list[str]) -> None:
    """Rank program: the collectives of ``--plan`` (a JSON list of [kind, payload bytes]) back to
    back on the world group, ``--repeats`` times; rank 0 writes the median (ms) to ``--out``.
    An all-to-all sends and receives ``payload / world`` bytes to and from each rank (even
    routing); an all-gather's payload is its output."""
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    plan = [(kind, int(nbytes) // 4) for kind, nbytes in json.load(open(a.plan))]
    bufs = {(kind, el): (torch.ones(el // n * n), torch.empty(el // n * n)) for kind, el in plan}

    def one(kind: str, el: int) -> None:
        src, dst = bufs[kind, el]
        if kind == "all_to_all":
            dist.all_to_all_single(dst, src)
        elif kind == "all_reduce":
            dist.all_reduce(src)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(dst, src[:el // n])
        else:
            raise SystemExit(f"comm-only: no {kind} in an MoE step at TP 1")

    for kind, el in plan[:4]:  # warm up the connections
        one(kind, el)
    times = []
    for _ in range(a.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for kind, el in plan:
            one(kind, el)
        times.append((time.perf_counter() - t0) * 1e3)
    if dist.get_rank() == 0:
        json.dump({"comm_ms": statistics.median(times), "comm_ms_all": times}, open(a.out, "w"))
    dist.destroy_process_group()


def run_train(a, name: str, topo: str | None, workdir: str) -> dict:
    """One trainer launch of variant ``name`` (emulated on ``topo``, or plain local ranks)."""
    log = os.path.join(workdir, f"{name}.jsonl")
    schedule = SCHEDULES["oases" if name == "compute" else name]
    cmd = [sys.executable, "-m", "megatron_oases.train"] + trainer_flags(a) + schedule + ["--log-json", log]
    t0 = time.time()
    launch_ranks(cmd, EP, topology=topo, timeout=a.timeout)
    return {"variant": name, **step_stats(log, a.warmup), "wall_s": round(time.time() - t0, 1)}


def run_comm(a, name: str, colls: list[tuple[str, int]], topo: str | None, workdir: str) -> dict:
    """A communication-only row: ``colls`` (kind, payload bytes) alone, back to back."""
    plan, out = os.path.join(workdir, f"{name}-plan.json"), os.path.join(workdir, f"{name}.json")
    json.dump(colls, open(plan, "w"))
    cmd = [sys.executable, os.path.abspath(__file__), "--comm-only", "--plan", plan,
           "--repeats", str(a.iters), "--out", out]
    launch_ranks(cmd, EP, topology=topo, timeout=a.timeout)
    got = json.load(open(out))
    return {"variant": name, "step_ms": got["comm_ms"], "steps_ms": [round(t, 1) for t in got["comm_ms_all"]],
            "collectives": len(colls), "comm_MB": sum(b for _, b in colls) / 1e6}


def summarize(rows: list[dict]) -> list[dict]:
    """Each row with its speedup over stock and its ratio to max(compute, comm) + grad."""
    ms = {r["variant"]: r["step_ms"] for r in rows}
    bound = max(ms["compute"], ms["comm"]) + ms["grad"] if {"compute", "comm", "grad"} <= set(ms) else None
    return [{**r, "speedup_vs_stock": ms["stock"] / r["step_ms"] if "stock" in ms and r["variant"] in VARIANTS
             else None,
             "over_bound": r["step_ms"] / bound if bound else None, "bound_ms": bound} for r in rows]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, hidden=256, heads=8, seq=128, iters=6, warmup=2)
    p.add_argument("--experts", type=int, default=4, help="--num-experts")
    p.add_argument("--topk", type=int, default=2, help="--moe-router-topk")
    p.add_argument("--moe-ffn", type=int, default=1024, help="--moe-ffn-hidden-size")
    p.add_argument("--aux-loss-coeff", type=float, default=0.01, help="--moe-aux-loss-coeff")
    p.add_argument("--link-GBps", type=float, default=0.02,
                   help="each emulated node's link to the other (GB/s): the all-to-alls cross it")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="trainer runs (default: all); the comm and grad rows always run")
    p.add_argument("--no-emulate", action="store_true", help="plain local ranks (smoke test)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/bench_oases_moe")
    return p.parse_args(argv)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--comm-only"]:
        comm_only_main(sys.argv[2:])
        return 0
    a = parse_args(argv)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    load = loadavg()
    print(f"load average before: {load}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        topo = None if a.no_emulate else write_topology(work, "bench-moe-2x1", two_node_yaml(a.link_GBps))
        for name in a.variants:
            rows.append(run_train(a, name, None if name == "compute" else topo, work))
            print(f"  {name:8s} {rows[-1]['step_ms']:9.1f} ms", flush=True)
        grad = grad_reduce_bytes(a, topo or write_topology(work, "bench-moe-2x1", two_node_yaml(a.link_GBps)))
        for name, colls in (("comm", step_collectives(a)), ("grad", [("all_reduce", grad)])):
            rows.append(run_comm(a, name, colls, topo, work))
            print(f"  {name:8s} {rows[-1]['step_ms']:9.1f} ms ({rows[-1]['collectives']} collectives, "
                  f"{rows[-1]['comm_MB']:.1f} MB)", flush=True)
    rows = summarize(rows)
    print(f"\nMoE {a.experts} experts top-{a.topk} (alltoall, dropless, aux loss {a.aux_loss_coeff}), EP {EP} "
          f"across 2 nodes, hidden {a.hidden}, expert FFN {a.moe_ffn}, layers {a.layers}, seq {a.seq}, "
          f"micro-batch {a.micro_batch} x {a.micro_batches}, link {a.link_GBps} GB/s"
          f"{' (NOT emulated)' if a.no_emulate else ''}")
    cols = ["variant", "step_ms", "speedup_vs_stock", "over_bound", "peak_mem_mb", "oases_saved_mb", "loss"]
    print_table(rows, cols)
    write_results(a.out, rows, cols + ["bound_ms", "step_ms_min", "wall_s"], {"config": vars(a), "load_before": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
