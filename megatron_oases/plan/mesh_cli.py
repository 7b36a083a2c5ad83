"""``megatron-oases mesh``: print ATP's predicted TP all-reduce time for every 2-D mesh and the pick.

A table rather than just the answer, because a user deciding on a mesh wants to see how close the
runner-up is and which bandwidth (B1 or B2) limits it. Bad input is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from megatron_oases.describe.shapes import GPTShape
from megatron_oases.flags import add_flag, add_flags, option
from megatron_oases.plan.atp_mesh import MeshChoice, MeshError, search_mesh
from megatron_oases.run_config import (DEFAULTS, RunConfig, check_gqa_flags, filled_ffn_hidden_size,
                                       mesh_search_shape, run_config)

PROG = "megatron-oases mesh"


class _UsageError(Exception):
    """argparse's complaint, turned into our one-line error instead of usage + exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    """Megatron-LM's flag names with ``megatron-oases train``'s defaults, from the flag table
    (``megatron_oases.flags``), so the same flags price the same layer as the trainer's
    ``--atp-mesh auto``; ``--tp``, ``--hidden`` and ``--layers`` are the older short names, kept
    as aliases."""
    p = _Parser(prog=PROG, allow_abbrev=False, description="Search ATP's 2-D device meshes DeviceMesh(d1, d2) for a TP "
                "group on a topology (ATP paper Eq. 3-4 bandwidths, the layer's collectives from its description); "
                "axis 2 is the consecutive, innermost ranks. Flags and defaults are megatron-oases train's.")
    add_flag(p, "topology", required=True)
    add_flag(p, "tensor_model_parallel_size", "--tp", note="N = d1 x d2")
    add_flag(p, "pipeline_model_parallel_size", note="the search prices one stage's --num-layers / PP layers")
    add_flag(p, "num_layers", "--layers")
    add_flag(p, "hidden_size", "--hidden")
    add_flags(p, ("ffn_hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "swiglu",
                  "group_query_attention", "num_query_groups", "normalization", "add_bias_linear",
                  "position_embedding_type", "rotary_percent", "qk_layernorm"))
    add_flag(p, "bf16", note="2-byte activations (neither --bf16 nor --fp16: fp32, as megatron-oases train)")
    add_flag(p, "fp16")
    add_flag(p, "fp32")  # refused, as by every front end (flags.py)
    p.add_argument("--bytes-per-element", type=int, choices=(2, 4), default=None,
                   help="the element size instead of --bf16 / --fp16 (2 or 4)")
    p.add_argument("--min-gain", type=float, default=DEFAULTS.atp_min_gain,
                   help="relative saving a 2-D mesh needs over Megatron's (N,1) to be picked "
                        f"(default {DEFAULTS.atp_min_gain})")
    p.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT ('-' = stdout)")
    return p


def _gbps(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:.4g}"


def format_choice(choice: MeshChoice, shape: str = "") -> str:
    """The human table: one row per mesh, fastest first, then the pick and why."""
    head = f"ATP mesh search: topology {choice.topology}{shape}, tp={choice.tp}, {model_summary(choice.model)}"
    cols = ("mesh", "", "B1' GB/s", "B2' GB/s", "B1 GB/s", "B2 GB/s", "T_comm ms", "")
    rows = [cols]
    for c in choice.candidates:
        mark = " ".join(x for x in ("<- pick" if c is choice.pick else "",
                                    "(Megatron 1-D)" if c.d2 == 1 else "") if x)
        b1 = _gbps(c.axis1.alg_GBps) + ("*" if c.axis1.calibrated else "")
        b2 = _gbps(c.axis2.alg_GBps) + ("*" if c.axis2.calibrated else "")
        rows.append((f"({c.d1},{c.d2})", c.label, _gbps(c.axis1.bus_GBps), _gbps(c.axis2.bus_GBps),
                     b1, b2, f"{c.t_comm_s * 1e3:.3f}", mark))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""] + ["  ".join(v.ljust(w) if i < 2 or i == 7 else v.rjust(w)
                                    for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    if any(c.axis1.calibrated or c.axis2.calibrated for c in choice.candidates):
        lines.append("* measured all-reduce bandwidth from the topology's calibration")
        axes = [a for c in choice.candidates for a in (c.axis1, c.axis2) if a.size > 1]
        if not all(a.calibrated for a in axes):
            lines.append("warning: the calibration covers only some mesh axes; the others use the "
                         "matrix estimate, which the calibration exists to correct, so the pick may "
                         "be optimistic: measure the remaining groups "
                         "(plan.atp_mesh.measurement_plan) before trusting it")
    lines += ["", f"pick: {pick_summary(choice)}"]
    return "\n".join(lines)


def model_summary(m: GPTShape) -> str:
    """The priced layer in one phrase (the table's head, ``--atp-mesh auto``'s line)."""
    v = m.variant
    extra = ", ".join(x for x in (f"{m.num_query_groups} query groups" if v.query_groups else "",
                                  "SwiGLU" if v.gated else "", v.normalization if v.normalization != "LayerNorm" else "")
                      if x)
    return (f"h={m.hidden_size} ffn={m.ffn_hidden_size} heads={m.num_attention_heads}"
            f"{f' ({extra})' if extra else ''} "
            f"L={m.num_layers} b={m.micro_batch_size} s={m.seq_length}, {m.bytes_per_element} B/element")


def pick_summary(choice: MeshChoice) -> str:
    """One line: the picked mesh, its predicted T_comm and how it compares with Megatron's (N,1)
    (also what ``megatron-oases train --atp-mesh auto`` prints)."""
    p, meg = choice.pick, choice.megatron
    line = f"DeviceMesh({p.d1},{p.d2}) ({p.label}), predicted T_comm {p.t_comm_s * 1e3:.3f} ms"
    if meg is not None and p is not meg and meg.t_comm_s > 0:
        line += f", {100 * (1 - p.t_comm_s / meg.t_comm_s):.1f}% below Megatron's DeviceMesh({meg.d1},1)"
    elif meg is not None and p is meg and choice.candidates[0] is not meg:
        best = choice.candidates[0]
        line += (f"; ({best.d1},{best.d2}) is only {100 * (1 - best.t_comm_s / meg.t_comm_s):.1f}% "
                 f"faster, under --min-gain {choice.min_gain:g}")
    return line


def run_shape(args: argparse.Namespace) -> tuple[RunConfig, GPTShape]:
    """The run's config from the flags and the shape ``--atp-mesh auto`` would price for it
    (``run_config.mesh_search_shape``); ``MeshError`` naming the flag on bad input."""
    for dest, value in (("tensor_model_parallel_size", args.tensor_model_parallel_size),
                        ("pipeline_model_parallel_size", args.pipeline_model_parallel_size)):
        if value <= 0:
            raise MeshError(f"{option(dest)} must be > 0 (got {value})")
    if args.bf16 and args.fp16:
        raise MeshError("--bf16 and --fp16 are exclusive; pick one")
    if args.bytes_per_element is not None and (args.bf16 or args.fp16):
        raise MeshError("--bytes-per-element and --bf16 / --fp16 both set the element size; give one")
    if not 0 <= args.min_gain < 1:
        raise MeshError(f"--min-gain must be in [0, 1) (got {args.min_gain})")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size <= 0:
        raise MeshError(f"--ffn-hidden-size must be > 0 (got {args.ffn_hidden_size})")
    cfg = run_config(args)  # this command's flags are the trainer's: one reading of them
    if args.bytes_per_element is not None:
        cfg = dataclasses.replace(cfg, bf16=args.bytes_per_element == 2)
    check_gqa_flags(cfg, MeshError)
    cfg = dataclasses.replace(cfg, ffn_hidden_size=filled_ffn_hidden_size(cfg, MeshError))
    pp = cfg.pipeline_model_parallel_size
    if cfg.num_layers > 0 and cfg.num_layers % pp:
        raise MeshError(f"--num-layers {cfg.num_layers} is not divisible by --pipeline-model-parallel-size {pp} "
                        "(the search prices one stage's layers)")
    return cfg, mesh_search_shape(cfg, pp)


def mesh_main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-oases mesh``; returns the exit status (2 on bad input)."""
    from megatron_oases.describe.ops import ModelingError
    from megatron_oases.errors import ConfigError
    from megatron_oases.output_paths import check_output_file
    from megatron_oases.topology import TopologyError, load_topology

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        cfg, model = run_shape(args)
        check_output_file("--json", args.json)  # before the table, not after it
        topo = load_topology(args.topology)
        choice = search_mesh(topo, cfg.tensor_model_parallel_size, model, min_gain=args.min_gain)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, MeshError, ModelingError, TopologyError, ConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    shape = f" ({' x '.join(map(str, topo.sizes))}, {topo.world_size} ranks)"
    print(format_choice(choice, shape))
    if args.json is not None:
        text = json.dumps(choice.to_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
            except OSError as e:
                print(f"{PROG}: error: cannot write --json {args.json}: {e.strerror}", file=sys.stderr)
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(mesh_main())
