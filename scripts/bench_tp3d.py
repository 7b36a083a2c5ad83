"""3-D TP vs stock Megatron TP vs the best ATP mesh, 8 ranks on an emulated interconnect.

Runs the reference trainer with TP = 8 inside an EmulatedCluster for

  stock   --tp-backend megatron (1-D TP over 8 ranks)
  3d      --tp-backend 3d (cube p = 2; micro-batch a multiple of p^2 = 4)
  atp     --tp-backend atp --atp-mesh <search pick> (``search_mesh`` on the same topology/model),
          plus Eq. 2's raw argmin when the search's 10% margin kept (8,1) over it

and reports per variant: median step time after warm-up, bytes each rank sends per step
(*measured*: every ``torch.distributed`` collective of a training step counted on every rank,
the counting trainer of ``benchmarks.harness``; groups of one excluded), the bytes the docs' formulas *predict* for
the transformer layers alone (docs/tp3d.md, docs/atp_mesh.md Eq. 2), and peak RSS per rank.

Default topology: one emulated node of 8 ranks (flat), ``--link-GBps`` per rank (the node's lo
is limited to 8 x that). ``--topology NAME|FILE`` uses another one (e.g. ``emu-2x4``), with
``--bw-scale`` applied to its bandwidths.

    python scripts/bench_tp3d.py --out results/bench_tp3d
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile


from benchmarks import harness
from benchmarks.harness import predicted_layer_mb  # (the layers' wire bytes, one formula)
from megatron_oases.run_config import DEFAULT_MIN_GAIN


def flat_topology(world: int, link_GBps: float, workdir: str) -> str:
    name = f"bench-flat{world}"
    return harness.write_topology(workdir, name, harness.flat_topology_yaml(name, world, link_GBps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default=None, help="NAME|FILE (default: a flat 8-rank node)")
    p.add_argument("--link-GBps", type=float, default=0.05, help="per-rank rate of the flat node")
    p.add_argument("--bw-scale", type=float, default=1.0, help="with --topology: scale bandwidths")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["stock", "3d", "atp"],
                   choices=["stock", "3d", "atp"])
    p.add_argument("--atp-chunks", type=int, default=1, choices=(1, 2, 4))
    p.add_argument("--no-argmin", action="store_true",
                   help="do not also run Eq. 2's raw argmin mesh when min_gain overrules it")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                   help=f"ATP search margin (default {DEFAULT_MIN_GAIN})")
    harness.add_model_args(p, hidden=256, heads=8, seq=64, iters=4, warmup=1)
    p.add_argument("--no-emulate", action="store_true", help="plain local ranks (smoke test)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="results/bench_tp3d")
    a = p.parse_args(argv)
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.plan.atp_mesh import search_mesh
    from megatron_oases.plan.mesh_cli import format_choice

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        topo = (harness.scaled_topology(a.topology, a.bw_scale, work) if a.topology
                else flat_topology(a.tp, a.link_GBps, work))
        choice = search_mesh(topo, a.tp, GPTShape(hidden_size=a.hidden, num_layers=a.layers,
                                                  num_attention_heads=a.heads, micro_batch_size=a.micro_batch,
                                                  seq_length=a.seq, dtype="fp32"), min_gain=a.min_gain)
        print(format_choice(choice), flush=True)
        mesh = (choice.pick.d1, choice.pick.d2)
        argmin = (choice.candidates[0].d1, choice.candidates[0].d2)
        variants = list(a.variants)
        if "atp" in variants and argmin != mesh and not a.no_argmin:
            variants.append("atp-argmin")  # the raw Eq. 2 argmin, which min_gain overruled
        meshes = {"atp": mesh, "atp-argmin": argmin}
        for v in variants:
            m = meshes.get(v)
            flags = (["--tp-backend", "atp", "--atp-mesh", f"{m[0]},{m[1]}", "--atp-chunks",
                      str(a.atp_chunks)] if m else ["--tp-backend", "megatron" if v == "stock" else v])
            r = harness.run_variant(a, a.tp, topo, work, f"tp3d-{v}",
                                      harness.model_flags(a, a.tp) + flags)
            label = (f"atp ({m[0]},{m[1]}) c{a.atp_chunks}" + (" pick" if v == "atp" else " argmin")
                     if m else v)
            row = {"variant": label,
                   "pred_layer_MB_per_rank": predicted_layer_mb(
                       a.tp, flags[1], m, seq=a.seq, micro_batch=a.micro_batch, hidden=a.hidden,
                       heads=a.heads, layers=a.layers, micro_batches=a.micro_batches), **r}
            rows.append(row)
            print(f"  {label:16s} {row['step_ms']:9.1f} ms  {row.get('wire_MB_per_rank', 0):7.2f} "
                  f"MB/rank  ({row['wall_s']} s)", flush=True)
        topo_name = os.path.basename(topo)[:-5]
    stock = next((r["step_ms"] for r in rows if r["variant"] == "stock"), None)
    for r in rows:
        r["vs_stock"] = r["step_ms"] / stock if stock else None
    cols = ["variant", "step_ms", "vs_stock", "wire_MB_per_rank", "wire_MB_max_rank",
            "collectives_per_rank", "pred_layer_MB_per_rank", "peak_mem_mb_max_rank",
            "peak_mem_mb_min_rank"]
    print(f"\n{topo_name}{' (NOT emulated)' if a.no_emulate else ''}: TP={a.tp}, hidden {a.hidden}, "
          f"heads {a.heads}, layers {a.layers}, seq {a.seq}, micro-batch {a.micro_batch} x "
          f"{a.micro_batches}, fp32; step_ms = median after {a.warmup} warm-up of {a.iters}; "
          f"wire_MB measured per rank per step (all collectives), pred_layer_MB = formulas, "
          f"transformer layers only; peak_mem = peak RSS per rank")
    harness.print_table(rows, cols)
    with open(a.out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols + ["step_ms_min", "peak_mem_mb", "loss", "wall_s"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(a.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"config": vars(a), "topology": topo_name, "atp_search_pick": list(mesh),
                   "atp_search_argmin": list(argmin),
                   "rows": rows}, f, indent=1)
    print(f"wrote {a.out}.csv and {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
