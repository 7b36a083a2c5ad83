"""The plan ``megatron-oases plan`` prints: the model and the launch it was made for, the
per-block table, the predicted time and memory against uniform TP, the compact notation, the
solver and the pricing's sources (from the plan file's dict, so a written plan prints the same)."""
from __future__ import annotations

from typing import Any

from ..flags import option
from .plan_file import whole_model_backend

MiB, GiB = float(1 << 20), float(1 << 30)


def format_plan(data: dict[str, Any], *, table: bool = True) -> str:
    inp, pred, m = data["inputs"], data["predicted"], data["inputs"]["model"]
    lines = [f"Oases plan: {m['num_layers']} layers, h {m['hidden_size']}, {m['num_attention_heads']} heads, "
             f"s {m['seq_length']}, ffn {m['ffn_hidden_size']}, {m['dtype']}, micro-batch {m['micro_batch_size']}; "
             f"global batch {inp['global_batch_size']} = DP {inp['data_parallel_size']} x "
             f"{inp['num_microbatches']} micro-batches; TP group {data['tensor_model_parallel_size']} on "
             f"{inp['topology']} ({inp['pricing']['gpu']}, {inp['memory_gb']:g} GiB)",
             f"made for: world {data['world_size']} = TP {data['tensor_model_parallel_size']} x "
             + (f"PP {pp} x " if (pp := data.get("pipeline_model_parallel_size", 1)) > 1 else "")
             + f"DP {data['data_parallel_size']}" + (" (the topology's ranks; pass --nproc-per-node / --nnodes or "
                                                "--data-parallel-size for another launch)"
                                                if inp.get("world_from") == "topology" else "")
             + f", --micro-batch-size {data['micro_batch_size']}, --schedule {data['schedule']}"]
    if table:
        cols = ("block", "layer", "kind", "strategy", "time ms", "node ms", "edge ms", "grad ms", "memory MiB")
        rows = [cols] + [(str(b["block"]), str(b["layer"]), b["kind"], b["strategy"], f"{b['time_ms']:.2f}",
                          f"{b['node_ms']:.2f}", f"{b['edge_in_ms']:.2f}", f"{b['grad_sync_ms']:.2f}",
                          f"{b['memory_bytes'] / MiB:.0f}") for b in pred["blocks"]]
        w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines += [""] + ["  ".join(v.ljust(w[i]) if i == 2 else v.rjust(w[i]) for i, v in enumerate(r)) for r in rows]
    lines.append("")
    line = (f"predicted iteration (transformer blocks): {pred['iteration_ms']:.2f} ms, "
            f"memory {pred['memory_gib']:.2f} GiB")
    if pred["uniform_tp_iteration_ms"]:
        line += (f"; uniform TP {data['tensor_model_parallel_size']}: {pred['uniform_tp_iteration_ms']:.2f} ms "
                 f"({pred['uniform_tp_iteration_ms'] / pred['iteration_ms']:.3f}x), "
                 f"{pred['uniform_tp_memory_gib']:.2f} GiB")
    lines.append(line)
    backend = whole_model_backend(data)
    if backend is not None and option("atp_mesh") in backend:
        lines.append(f"plan: every block on ATP mesh {backend[option('atp_mesh')].replace(',', 'x')} "
                     "(the whole TP group)")
    elif backend is not None:
        lines.append("plan: every block on the 3-D cube (the whole TP group)")
    lines.append(f"plan (per block, attention/mlp alternating): {data['compact']}")
    if data.get("compact_layers"):
        lines.append(f"plan (per layer, as the paper's Table 6): {data['compact_layers']}")
    s = data["solver"]
    lines.append(f"solver: {s['name']} {s['status'].lower()}, {s['solve_ms']:.1f} ms "
                 f"(+ {s['build_ms']:.1f} ms model build)")
    pr = inp["pricing"]
    if "profile" in pr:
        lines.append(f"pricing: {pr['events_from_profile']} events from {pr['profile']}, "
                     f"{pr['events_analytical']} analytical")
    return "\n".join(lines)
