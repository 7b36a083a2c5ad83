"""ATP's 2-D mesh search: price every DeviceMesh(d1, d2) of a TP group on a topology (ATP §3.3-3.5).

Why a model and not a benchmark: the choice must be made before launch, for clusters we may not
have, so it reads only the topology description (the hierarchical communication matrix) and,
where the matrix is known to be wrong (ATP's PCIe IC1), measured all-reduce bandwidths.

Rank -> mesh mapping. The TP group is the first ``tp`` ranks of the topology (level 0 varies
fastest, as Megatron's TP ranks). Rank ``r`` sits at mesh coordinate ``(r // d2, r % d2)``: axis 2
(size d2) is the fastest-varying, so its groups are consecutive ranks on the innermost level,
and axis 1 groups are the ranks ``r0, r0 + d2, ...`` (stride d2). DeviceMesh(tp, 1) is Megatron's
own 1-D TP; ATP-k is DeviceMesh(tp / k, k) (paper §5.3).

What is priced. Each mesh's time is the collectives of ``describe``'s ATP layer
(``describe.atp_2d``: the layer the trainer runs and ``megatron-oases sim --tp-backend atp``
prices) for the run's model (FFN size, SwiGLU, GQA, normalization), each at its mesh axis's
bandwidth. The paper's Eq. 2 prices a fixed layer (widths 3h and 4h); it lives in
the tests (``tests/atp_eq2.py``), the oracle they hold this to at ffn = 4h.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from megatron_oases.describe.atp_2d import atp_layout
from megatron_oases.describe.atp_meshes import atp_mesh_refusal, atp_meshes
from megatron_oases.describe.backends import backend
from megatron_oases.describe.ops import Collective, ring_factor
from megatron_oases.describe.registry import layer_description
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.run_config import DEFAULT_MIN_GAIN
from megatron_oases.topology import AllReduceCalibration, Calibration, Topology

class MeshError(ValueError):
    """A mesh request that cannot be priced; the message is one line saying what to change."""


@dataclass(kw_only=True, frozen=True)
class AxisBandwidth:
    """Bandwidths of one mesh axis; ``size == 1`` means no communication (infinite bandwidth)."""

    size: int
    """Ranks per group on this axis (d1 or d2)."""
    stride: int
    """Rank distance between group members (d2 for axis 1, 1 for axis 2)."""
    bus_GBps: float
    """B': matrix estimate of Eq. 3 (P2P correction, shared by concurrent groups), slowest group."""
    alg_GBps: float
    """B: the bandwidth Eq. 2 divides by; Eq. 4 of B', or the calibrated value where measured."""
    calibrated: bool = False
    """Whether ``alg_GBps`` came from a measurement rather than the matrix."""


@dataclass(kw_only=True, frozen=True)
class MeshCost:
    """One candidate mesh with its predicted per-step TP all-reduce time."""

    d1: int
    """Mesh axis 1 size (outer, strided ranks)."""
    d2: int
    """Mesh axis 2 size (inner, consecutive ranks)."""
    axis1: AxisBandwidth
    """B1', B1."""
    axis2: AxisBandwidth
    """B2', B2."""
    wire_bytes: tuple[float, float]
    """Bytes each rank sends per micro-batch step on axis 1 and axis 2 (forward + backward, all
    layers of the stage): the layer description's collectives at the ring's factor."""
    t_comm_s: float
    """Seconds of TP communication per micro-batch step: each axis's ``wire_bytes`` at its bus
    bandwidth (Eq. 2's pricing, applied to the described layer)."""

    @property
    def label(self) -> str:
        return f"ATP-{self.d2}"

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isinf(x) else x
        axes = {f"axis{i}": {"size": a.size, "stride": a.stride, "bus_GBps": num(a.bus_GBps),
                             "alg_GBps": num(a.alg_GBps), "calibrated": a.calibrated,
                             "wire_bytes": self.wire_bytes[i - 1]}
                for i, a in ((1, self.axis1), (2, self.axis2))}
        return {"d1": self.d1, "d2": self.d2, "label": self.label, **axes,
                "t_comm_ms": self.t_comm_s * 1e3}


@dataclass(kw_only=True, frozen=True)
class MeshChoice:
    """Every candidate, fastest first (ties toward Megatron's (N, 1)), and the pick."""

    topology: str
    """Topology name."""
    tp: int
    """TP group size N = d1 * d2."""
    model: GPTShape
    """The model the times were computed for (``num_layers``: the layers of one pipeline stage)."""
    candidates: tuple[MeshCost, ...]
    """All priced meshes, sorted by (T_comm, d2)."""
    pick: MeshCost
    """The chosen mesh (see ``min_gain``)."""
    min_gain: float
    """Relative T_comm saving a 2-D mesh needs over (N, 1) to be picked instead of it."""

    @property
    def megatron(self) -> MeshCost | None:
        return next((c for c in self.candidates if c.d2 == 1), None)

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        model = {"hidden": m.hidden_size, "layers": m.num_layers, "micro_batch": m.micro_batch_size,
                 "seq_length": m.seq_length, "bytes_per_element": m.bytes_per_element,
                 "heads": m.num_attention_heads, "ffn": m.ffn_hidden_size,
                 "query_groups": m.num_query_groups, "swiglu": m.variant.gated,
                 "normalization": m.variant.normalization}  # what the layer description reads
        return {"topology": self.topology, "tp": self.tp, "model": model,
                "min_gain": self.min_gain, "pick": self.pick.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates]}


# ---- search space and rank groups --------------------------------------------------------------
def enumerate_meshes(n: int) -> list[tuple[int, int]]:
    """All (d1, d2) with d1 * d2 == n, Megatron's (n, 1) first: the baseline a 2-D mesh must beat
    (``describe.atp_meshes.atp_meshes`` with ``with_1d=True``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise MeshError(f"tp must be a positive integer (got {n!r})")
    return list(atp_meshes(n, with_1d=True))


def valid_tp_sizes(topology: Topology) -> list[int]:
    """TP sizes whose first-N-ranks group fills whole units of every level it spans."""
    out, below = set(), 1
    for lv in topology.levels:
        out.update(below * a for a in range(1, lv.size + 1) if lv.size % a == 0)
        below *= lv.size
    return sorted(out)


def check_tp(topology: Topology, tp: int) -> None:
    """Reject a TP size the topology cannot host as aligned groups, naming the sizes it can."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        raise MeshError(f"tp must be a positive integer (got {tp!r})")
    shape = " x ".join(map(str, topology.sizes))
    if tp > topology.world_size:
        raise MeshError(f"tp={tp} exceeds the {topology.world_size} ranks of topology "
                        f"{topology.name!r} ({shape}); use at most {topology.world_size}")
    valid = valid_tp_sizes(topology)
    if tp not in valid:
        raise MeshError(f"tp={tp} does not match the levels of topology {topology.name!r} ({shape}): "
                        f"a TP group must fill whole units of each level; use one of {valid}")


def axis_groups(tp: int, d1: int, d2: int, axis: int) -> list[list[int]]:
    """Rank groups that all-reduce together on mesh ``axis`` (1 or 2) of DeviceMesh(d1, d2)."""
    refused = atp_mesh_refusal((d1, d2), tp)
    if refused or axis not in (1, 2):
        raise MeshError(refused or f"DeviceMesh({d1},{d2}) has mesh axes 1 and 2, not {axis}")
    if axis == 2:
        return [list(range(i * d2, (i + 1) * d2)) for i in range(d1)]
    return [list(range(j, tp, d2)) for j in range(d2)]


# ---- Eq. 3 and Eq. 4 ---------------------------------------------------------------------------
def _link_sum(topology: Topology, level: int, unit: int, peers: Iterable[int]) -> float:
    """P2P correction: what one unit can push to the group's other units at this level."""
    lv = topology.levels[level]
    m = lv.p2p_matrix_GBps
    total = sum((m[unit][v] if m is not None else lv.p2p_bandwidth_GBps) for v in peers if v != unit)
    return total if total > 0 else lv.p2p_bandwidth_GBps  # no direct link: relayed over the level


def group_bus_bandwidths(topology: Topology, groups: Sequence[Sequence[int]]) -> list[float]:
    """Eq. 3 for concurrent groups: per group, its slowest level crossing, in GB/s (inf: none).

    At every level a group crosses, each of its units can use min(group BW, sum of P2P links to
    the group's other units), and that is shared by all concurrent groups crossing through it.
    """
    out = [math.inf] * len(groups)
    below = 1
    for j, lv in enumerate(topology.levels):
        block = below * lv.size
        crossings: list[dict[int, set[int]]] = []
        users: dict[tuple[int, int], int] = defaultdict(int)
        for g in groups:
            by_block: dict[int, set[int]] = defaultdict(set)
            for r in g:
                by_block[r // block].add((r // below) % lv.size)
            cross = {b: us for b, us in by_block.items() if len(us) > 1}
            crossings.append(cross)
            for b, us in cross.items():
                for u in us:
                    users[(b, u)] += 1
        for gi, cross in enumerate(crossings):
            for b, us in cross.items():
                for u in us:
                    usable = min(lv.group_bandwidth_GBps, _link_sum(topology, j, u, us))
                    out[gi] = min(out[gi], usable / users[(b, u)])
        below = block
    return out


def rabenseifner_alg_bandwidth(bus_GBps: float, n: int) -> float:
    """Eq. 4: B = n / (2 (n - 1)) * B'; a group of one never communicates (inf).

    This is B' over ``describe.ops.ring_factor("all_reduce", n)``, written as the paper writes it:
    dividing by the factor rounds differently in the last place and would change the picker's
    published figures (``megatron-oases mesh --json``) by one ulp."""
    return math.inf if n <= 1 else n / (2 * (n - 1)) * bus_GBps


def axis_bandwidth(topology: Topology, tp: int, d1: int, d2: int, axis: int) -> AxisBandwidth:
    """B' and B of one mesh axis; a calibrated group's measured B replaces its matrix estimate."""
    size, stride = (d1, d2) if axis == 1 else (d2, 1)
    if size == 1:
        return AxisBandwidth(size=1, stride=stride, bus_GBps=math.inf, alg_GBps=math.inf)
    groups = axis_groups(tp, d1, d2, axis)
    bus = group_bus_bandwidths(topology, groups)
    algs, measured = [], False
    for g, b in zip(groups, bus):
        cal = topology.calibrated_allreduce(g)
        measured |= cal is not None
        algs.append(cal if cal is not None else rabenseifner_alg_bandwidth(b, size))
    return AxisBandwidth(size=size, stride=stride, bus_GBps=min(bus), alg_GBps=min(algs),
                         calibrated=measured)


# ---- the described layer, priced ---------------------------------------------------------------
def layer_collectives(model: GPTShape, d1: int, d2: int) -> tuple[Collective, ...]:
    """One layer's collectives, forward then backward, on DeviceMesh(d1, d2): ``describe``'s ATP
    layer for ``model``'s sizes and variant, as ``sim --tp-backend atp`` builds it (groups of one
    are left out there)."""
    layer = layer_description(backend="atp", layout=atp_layout(d1, d2), micro_batch=model.micro_batch_size,
                              seq=model.seq_length, hidden=model.hidden_size, heads=model.num_attention_heads,
                              ffn=model.ffn_hidden_size, tp=d1 * d2, bytes_per_element=model.bytes_per_element,
                              variant=model.variant)
    return tuple(layer.collectives("forward")) + tuple(layer.collectives("backward"))


def axis_wire_bytes(model: GPTShape, d1: int, d2: int) -> tuple[float, float]:
    """Bytes each rank sends on mesh axes 1 and 2 per micro-batch step: the layer's collectives
    (``layer_collectives``) at the ring's factor, times ``model.num_layers``."""
    sent = {"mesh1": 0.0, "mesh2": 0.0}
    for c in layer_collectives(model, d1, d2):
        sent[c.axis] += c.wire_bytes_per_rank
    return model.num_layers * sent["mesh1"], model.num_layers * sent["mesh2"]


def axis_seconds(wire_bytes: float, axis: AxisBandwidth) -> float:
    """Seconds to send ``wire_bytes`` on one axis: over its bus bandwidth B' = B x 2(n-1)/n (Eq. 4
    inverted, so a calibrated all-reduce B counts as measured); an all-reduce of S bytes then
    takes S / B, Eq. 2's term, and an all-gather half that."""
    if axis.size == 1 or wire_bytes == 0:
        return 0.0
    return wire_bytes / (axis.alg_GBps * ring_factor("all_reduce", axis.size) * 1e9)


def mesh_cost(topology: Topology, tp: int, d1: int, d2: int, model: GPTShape) -> MeshCost:
    """Price DeviceMesh(d1, d2) for the first ``tp`` ranks of ``topology``."""
    a1 = axis_bandwidth(topology, tp, d1, d2, 1)
    a2 = axis_bandwidth(topology, tp, d1, d2, 2)
    b1, b2 = axis_wire_bytes(model, d1, d2)
    return MeshCost(d1=d1, d2=d2, axis1=a1, axis2=a2, wire_bytes=(b1, b2),
                    t_comm_s=axis_seconds(b1, a1) + axis_seconds(b2, a2))


def model_refusal(model: GPTShape, tp: int) -> str:
    """Why ATP cannot split ``model`` over ``tp`` ranks ("" when it can): the backend record's check
    at Megatron's (tp, 1). After Megatron's TP split of the hidden size, heads and FFN passes, every
    mesh d1 x d2 = tp splits the model too (d1 and d2 divide tp), so one check covers them all."""
    return backend("atp").refusal(tp=tp, layout=atp_layout(tp, 1), hidden=model.hidden_size, heads=model.num_attention_heads,
                                  ffn=model.ffn_hidden_size, query_groups=model.variant.query_groups)


def search_mesh(topology: Topology | str, tp: int, model: GPTShape, *,
                min_gain: float = DEFAULT_MIN_GAIN,
                meshes: Sequence[tuple[int, int]] | None = None) -> MeshChoice:
    """Price all meshes (or ``meshes``) and pick the fastest, keeping (N, 1) unless beaten by min_gain.

    ``model.num_layers`` is the layers of one pipeline stage (``dataclasses.replace`` a whole
    model's shape with ``num_layers // PP``); the other sizes and the variant are the layer's
    (``layer_collectives``).

    The margin exists because the pricing (as Eq. 2) ignores latency and the 2-D meshes' larger
    number of collectives; the paper keeps (8, 1) on NVSwitch where Eq. 2 predicts (4, 2) only 7%
    faster.
    """
    from megatron_oases.topology import load_topology

    topo = load_topology(topology)
    check_tp(topo, tp)
    if not 0 <= min_gain < 1:
        raise MeshError(f"min_gain must be in [0, 1) (got {min_gain!r})")
    wanted = enumerate_meshes(tp) if meshes is None else [tuple(m) for m in meshes]
    if not wanted:
        raise MeshError(f"no mesh to price for tp={tp}")
    refused = next(filter(None, (atp_mesh_refusal(m, tp) for m in wanted)), "") or model_refusal(model, tp)
    if refused:
        raise MeshError(refused)
    costs = sorted((mesh_cost(topo, tp, d1, d2, model) for d1, d2 in wanted),
                   key=lambda c: (c.t_comm_s, c.d2))
    pick = costs[0]
    megatron = next((c for c in costs if c.d2 == 1), None)
    if megatron is not None and pick.t_comm_s >= (1 - min_gain) * megatron.t_comm_s:
        pick = megatron
    return MeshChoice(topology=topo.name, tp=tp, model=model, candidates=tuple(costs), pick=pick,
                      min_gain=min_gain)


# ---- calibration -------------------------------------------------------------------------------
def measurement_plan(tp: int) -> list[tuple[int, int]]:
    """(group_size, stride) of every axis group the search prices: what a quick benchmark measures."""
    plan = {(d1, d2) for d1, d2 in enumerate_meshes(tp) if d1 > 1}
    plan |= {(d2, 1) for _, d2 in enumerate_meshes(tp) if d2 > 1}
    return sorted(plan)


def calibration_from_measurements(measured: Mapping[tuple[int, int], float], *,
                                  kind: str = "alg") -> Calibration:
    """Turn ``{(group_size, stride): GB/s}`` into a Calibration holding algorithm bandwidths (B).

    ``kind="bus"`` takes nccl-tests style bus bandwidths (B') and applies Eq. 4, so the stored
    value is always what Eq. 2 divides by, as in the paper's IC1 numbers.
    """
    if kind not in ("alg", "bus"):
        raise MeshError(f"kind must be 'alg' or 'bus' (got {kind!r})")
    entries = []
    for key, gbps in sorted(measured.items()):
        if not (isinstance(key, tuple) and len(key) == 2):
            raise MeshError(f"measurement key {key!r} must be (group_size, stride)")
        size, stride = key
        value = rabenseifner_alg_bandwidth(gbps, size) if kind == "bus" else gbps
        entries.append(AllReduceCalibration(group_size=size, stride=stride, bandwidth_GBps=value))
    return Calibration(allreduce_GBps=tuple(entries))


def with_calibration(topology: Topology, calibration: Calibration) -> Topology:
    """A copy of ``topology`` whose new measurements win over any it already had (first match)."""
    old = topology.calibration.allreduce_GBps if topology.calibration else ()
    merged = Calibration(allreduce_GBps=tuple(calibration.allreduce_GBps) + tuple(old))
    return replace(topology, calibration=merged)
