"""ATP 2-D meshes vs stock Megatron TP on emulated topologies, next to the mesh search's prediction.

For each topology (default: the 2-level ``emu-2x2``, 2 nodes x 2 ranks, fast intra / slow inter,
and the flat ``emu-flat4``), runs the reference trainer with TP = 4 inside an EmulatedCluster:

  stock            --tp-backend megatron (Megatron's 1-D TP)
  atp D1xD2 cK     --tp-backend atp --atp-mesh D1,D2 --atp-chunks K, every mesh of TP, every K

and prints the median step time after warm-up next to ``search_mesh``'s predicted T_comm and
ranking for the same topology and model (what ``megatron-oases mesh`` prints), marks the search's
pick and the measured-fastest mesh, and gives the best ATP mesh over stock. Also recorded per
variant: bytes each rank sends per step (the counting trainer of ``benchmarks.harness``: every
collective, Megatron's own included, through ``CommCounter``; groups of one excluded) and the
peak RSS per rank.

``--bw-scale F`` multiplies every bandwidth of the topology (written to a temporary YAML), so that
communication is comparable to compute on a slow box; the level structure and the intra/inter
ratio stay as shipped, and the search prices the same scaled file. Rank -> node: consecutive
ranks share a node (``node_of(r) = r // ranks_per_node``), and ATP's axis 2 (size d2) is the
consecutive-rank axis, so on emu-2x2 DeviceMesh(2,2) puts axis 2 inside the nodes and axis 1
across them.

    python scripts/bench_atp.py --out results/bench_atp
    python scripts/bench_atp.py --topologies emu-2x2 --chunks 1 2 --bw-scale 0.5

Needs root (network namespaces); ``--no-emulate`` runs plain local ranks (smoke test only).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile


from benchmarks import harness
from megatron_oases.run_config import DEFAULT_MIN_GAIN


# ---- launching -----------------------------------------------------------------------------------
# ---- the ATP benchmark ---------------------------------------------------------------------------
def model_flags(a) -> list[str]:
    return harness.model_flags(a, a.tp)


def bench_topology(a, topo_name: str, workdir: str) -> tuple[list[dict], dict]:
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.plan.atp_mesh import search_mesh
    from megatron_oases.plan.mesh_cli import format_choice

    topo_path = harness.scaled_topology(topo_name, a.bw_scale, workdir)
    shape = GPTShape(hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.heads,
                     micro_batch_size=a.micro_batch, seq_length=a.seq, dtype="fp32")
    choice = search_mesh(topo_path, a.tp, shape, min_gain=a.min_gain)
    print(format_choice(choice), flush=True)
    pred = {(c.d1, c.d2): (rank + 1, c.t_comm_s * 1e3) for rank, c in enumerate(choice.candidates)}
    pick = (choice.pick.d1, choice.pick.d2)
    variants = [("stock", None, None, ["--tp-backend", "megatron"])]
    for c in choice.candidates:  # in predicted order
        for k in a.chunks:
            variants.append((f"atp {c.d1}x{c.d2} c{k}", (c.d1, c.d2), k,
                             ["--tp-backend", "atp", "--atp-mesh", f"{c.d1},{c.d2}",
                              "--atp-chunks", str(k)]))
    rows = []
    for name, mesh, k, flags in variants:
        tag = f"{os.path.basename(topo_path)[:-5]}-{name.replace(' ', '_')}"
        r = harness.run_variant(a, a.tp, topo_path, workdir, tag, model_flags(a) + flags)
        row = {"topology": topo_name, "variant": name,
               "mesh": f"({mesh[0]},{mesh[1]})" if mesh else "-", "chunks": k,
               "pred_rank": pred[mesh][0] if mesh else None,
               # Eq. 2 is per micro-batch; a step runs micro_batches of them
               "pred_t_comm_ms": pred[mesh][1] * a.micro_batches if mesh else None,
               **r}
        rows.append(row)
        print(f"  {topo_name} {name:14s} {row['step_ms']:9.1f} ms  "
              f"{row.get('wire_MB_per_rank', 0):7.1f} MB/rank  ({row['wall_s']} s)", flush=True)
    stock = rows[0]["step_ms"]
    atp = [r for r in rows if r["mesh"] != "-"]
    best_by_mesh = {}
    for r in atp:
        if r["mesh"] not in best_by_mesh or r["step_ms"] < best_by_mesh[r["mesh"]]["step_ms"]:
            best_by_mesh[r["mesh"]] = r
    fastest = min(best_by_mesh.values(), key=lambda r: r["step_ms"])
    measured_order = sorted(best_by_mesh, key=lambda m: best_by_mesh[m]["step_ms"])
    pick_s = f"({pick[0]},{pick[1]})"
    for r in rows:
        r["vs_stock"] = r["step_ms"] / stock
        r["measured_rank"] = measured_order.index(r["mesh"]) + 1 if r["mesh"] != "-" else None
        marks = []
        if r["mesh"] == pick_s:
            marks.append("pick")
        if r is fastest:
            marks.append("fastest")
        r["mark"] = ",".join(marks)
    summary = {"topology": topo_name, "topology_file": os.path.basename(topo_path),
               "search_pick": pick_s, "search_argmin": f"({choice.candidates[0].d1},"
                                                      f"{choice.candidates[0].d2})",
               "measured_fastest_mesh": fastest["mesh"], "measured_fastest_variant": fastest["variant"],
               "pick_is_fastest": pick_s == fastest["mesh"],
               "predicted_order": [f"({c.d1},{c.d2})" for c in choice.candidates],
               "measured_order": measured_order,
               "stock_step_ms": stock, "best_atp_step_ms": fastest["step_ms"],
               "best_atp_over_stock": fastest["step_ms"] / stock,
               "pick_best_step_ms": best_by_mesh[pick_s]["step_ms"],
               "pick_over_stock": best_by_mesh[pick_s]["step_ms"] / stock}
    return rows, summary


COLS = ["topology", "variant", "chunks", "pred_t_comm_ms", "pred_rank", "step_ms", "measured_rank",
        "vs_stock", "wire_MB_per_rank", "peak_mem_mb_max_rank", "mark"]


_fmt = harness.fmt
print_table = harness.print_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topologies", nargs="+", default=["emu-2x2", "emu-flat4"],
                   help="shipped example names or YAML paths")
    p.add_argument("--bw-scale", type=float, default=1.0,
                   help="multiply every bandwidth of each topology by this (ratios kept)")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], choices=(1, 2, 4))
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                   help=f"search margin over (N,1) (default: the search's own, {DEFAULT_MIN_GAIN})")
    harness.add_model_args(p, hidden=512, heads=8, seq=128, iters=5, warmup=2)
    p.add_argument("--no-emulate", action="store_true", help="plain local ranks (smoke test)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="results/bench_atp")
    a = p.parse_args(argv)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows, summaries = [], []
    with tempfile.TemporaryDirectory() as work:
        for t in a.topologies:
            r, s = bench_topology(a, t, work)
            rows += r
            summaries.append(s)
    print(f"\nTP={a.tp}, hidden {a.hidden}, heads {a.heads}, layers {a.layers}, seq {a.seq}, "
          f"micro-batch {a.micro_batch} x {a.micro_batches}, fp32, bandwidths x {a.bw_scale:g}"
          f"{' (NOT emulated)' if a.no_emulate else ''}; step_ms = median after {a.warmup} "
          f"warm-up of {a.iters}; pred_t_comm_ms = Eq. 2 x {a.micro_batches} micro-batches")
    print_table(rows, COLS)
    print()
    for s in summaries:
        print(f"{s['topology']}: search pick {s['search_pick']} (raw argmin {s['search_argmin']}), "
              f"measured fastest {s['measured_fastest_mesh']} ({s['measured_fastest_variant']}) -> "
              f"{'AGREE' if s['pick_is_fastest'] else 'DIFFER'}; best ATP / stock = "
              f"{s['best_atp_over_stock']:.3f}; predicted order {' '.join(s['predicted_order'])}, "
              f"measured {' '.join(s['measured_order'])}")
    with open(a.out + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLS + ["mesh", "step_ms_min", "wire_MB_max_rank",
                                                 "collectives_per_rank", "peak_mem_mb", "loss",
                                                 "wall_s"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(a.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"config": vars(a), "summary": summaries, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}.csv and {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
