"""``megatron-oases mesh``: print ATP's predicted TP all-reduce time for every 2-D mesh and the pick.

A table rather than just the answer, because a user deciding on a mesh wants to see how close the
runner-up is and which bandwidth (B1 or B2) limits it. Bad input is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from megatron_oases.describe.shapes import GPTShape, dtype_of
from megatron_oases.plan.atp_mesh import DEFAULT_MIN_GAIN, MeshChoice, MeshError, search_mesh

PROG = "megatron-oases mesh"


class _UsageError(Exception):
    """argparse's complaint, turned into our one-line error instead of usage + exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False, description="Search ATP's 2-D device meshes DeviceMesh(d1, d2) for a TP "
                "group on a topology (ATP paper Eq. 2-4); axis 2 is the consecutive, innermost ranks.")
    p.add_argument("--topology", required=True, help="topology YAML path or shipped example name")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size N = d1 * d2")
    p.add_argument("--hidden", type=int, required=True, help="hidden size h")
    p.add_argument("--layers", type=int, required=True, help="transformer layers L")
    p.add_argument("--micro-batch-size", type=int, required=True, help="micro-batch size b")
    p.add_argument("--seq-length", type=int, required=True, help="sequence length s")
    p.add_argument("--bytes-per-element", type=int, choices=(2, 4), default=2, help="activation bytes: 2 (bf16, default) or 4 (fp32)")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                   help="relative saving a 2-D mesh needs over Megatron's (N,1) to be picked "
                        f"(default {DEFAULT_MIN_GAIN})")
    p.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT ('-' = stdout)")
    return p


def _gbps(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:.4g}"


def format_choice(choice: MeshChoice, shape: str = "") -> str:
    """The human table: one row per mesh, fastest first, then the pick and why."""
    m = choice.model
    head = (f"ATP mesh search: topology {choice.topology}{shape}, tp={choice.tp}, h={m.hidden_size} "
            f"L={m.num_layers} b={m.micro_batch_size} s={m.seq_length}, {m.bytes_per_element} B/element")
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


def mesh_main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-oases mesh``; returns the exit status (2 on bad input)."""
    from megatron_oases.errors import ConfigError
    from megatron_oases.output_paths import check_output_file
    from megatron_oases.topology import TopologyError, load_topology

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        for flag, value in (("--tp", args.tp), ("--hidden", args.hidden), ("--layers", args.layers),
                            ("--micro-batch-size", args.micro_batch_size),
                            ("--seq-length", args.seq_length),
                            ("--bytes-per-element", args.bytes_per_element)):
            if value <= 0:
                raise MeshError(f"{flag} must be > 0 (got {value})")
        if not 0 <= args.min_gain < 1:
            raise MeshError(f"--min-gain must be in [0, 1) (got {args.min_gain})")
        check_output_file("--json", args.json)  # before the table, not after it
        # Eq. 2 reads no head count: one head keeps the shape valid for any --hidden
        model = GPTShape(hidden_size=args.hidden, num_layers=args.layers, micro_batch_size=args.micro_batch_size,
                         seq_length=args.seq_length, num_attention_heads=1,
                         dtype=dtype_of(args.bytes_per_element, MeshError))
        topo = load_topology(args.topology)
        choice = search_mesh(topo, args.tp, model, min_gain=args.min_gain)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, MeshError, TopologyError, ConfigError) as e:
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
