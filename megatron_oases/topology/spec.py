"""Typed, validated description of a cluster's interconnect hierarchy.

One format serves the emulator, ATP's hierarchical communication matrix, the planner and the
simulator, so every consumer reads the same numbers. Objects are frozen so a loaded topology can
be shared and hashed; every check lives in ``__post_init__`` so hand-built objects are as safe as
loaded ones. Units: bandwidths in GB/s (1e9 bytes/s), latencies in microseconds.

Every bandwidth is **one direction**: what a unit sends while it receives as much at once. A ring
all-reduce does both on every link, so its time per rank is 2(n-1)/n x S / that bandwidth, as
NCCL's bus bandwidth is defined (nccl-tests' busbw is measured against this number, which is why
``nccl_efficiency`` is busbw / link rate). Data sheets give NVLink both ways: an A100's 600 GB/s
NVLink3 is 300 here, a V100's 300 GB/s NVLink2 150, an RTX 3090's 112.5 GB/s bridge 56.25
(``tests/test_topology_directions.py`` pins every shipped NVLink figure to its one-way value).
NICs (200 Gb/s HDR = 25 GB/s) are already one way. A calibrated all-reduce is another quantity,
ATP's algorithm bandwidth (``AllReduceCalibration``).
"""
from __future__ import annotations

import dataclasses

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any

SCOPES = ("intra_node", "inter_node")


class TopologyError(ValueError):
    """A topology file or object is unusable; the message is one line naming file, field and fix."""

    def __init__(self, problem: str, *, field: str = "", source: str = ""):
        self.problem, self.field, self.source = problem, field, source
        where = f"topology {source}: " if source else "topology: "
        super().__init__(where + (f"{field} " if field else "") + problem)

    def within(self, prefix: str = "", source: str | None = None) -> "TopologyError":
        """The same error seen from an enclosing field (``levels[1]``) or file."""
        name = self.field
        if prefix:
            name = prefix + ("" if not name or name.startswith("[") else ".") + name
        return TopologyError(self.problem, field=name, source=self.source if source is None else source)


def _fail(field_name: str, problem: str) -> None:
    raise TopologyError(problem, field=field_name)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(name: str, v: Any) -> None:
    if not _is_number(v):
        _fail(name, f"must be a number (got {v!r})")
    if v <= 0:
        _fail(name, f"must be > 0 (got {v!r})")


def _int_at_least(name: str, v: Any, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        _fail(name, f"must be an integer (got {v!r})")
    if v < low:
        _fail(name, f"must be >= {low} (got {v!r})")


def _text(name: str, v: Any, *, optional: bool) -> None:
    if v is None and optional:
        return
    if not isinstance(v, str) or (not optional and not v.strip()):
        _fail(name, f"must be a non-empty string (got {v!r})")


@dataclass(kw_only=True, frozen=True)
class Level:
    """One level of the hierarchy: ``size`` units of the level below joined by one kind of link."""

    name: str
    """Label of the link kind (``nvlink``, ``pcie``, ``ib``); unique within a topology."""
    size: int
    """How many units of the level below are grouped here (at level 0 the units are devices)."""
    scope: str
    """``intra_node`` or ``inter_node``: whether these links stay inside one machine."""
    p2p_bandwidth_GBps: float
    """Aggregate bandwidth between two units of this level, GB/s each way (ATP's P2P matrix entry;
    one direction, as every bandwidth here: see the module docstring)."""
    group_bandwidth_GBps: float
    """Aggregate bandwidth of one unit to all other units of this level, GB/s each way (ATP's
    group BW)."""
    latency_us: float = 0.0
    """One-way latency of a message crossing this level, microseconds."""
    p2p_matrix_GBps: tuple[tuple[float, ...], ...] | None = None
    """Optional ``size x size`` per-pair bandwidths overriding the uniform p2p value (0 on the
    diagonal; 0 off the diagonal means no direct link, e.g. non-neighbours on a torus ring)."""
    nccl_efficiency: float | None = None
    """Optional fraction of this level's link bandwidth NCCL achieves (measured nccl-tests bus
    bandwidth over the link rate); the analytical device model prices collectives and P2P
    crossing the level at ``bandwidth x nccl_efficiency``. None: 1 (the link rate)."""

    def __post_init__(self) -> None:
        _text("name", self.name, optional=False)
        _int_at_least("size", self.size, 1)
        if self.scope not in SCOPES:
            _fail("scope", f"must be one of {', '.join(SCOPES)} (got {self.scope!r})")
        _positive("p2p_bandwidth_GBps", self.p2p_bandwidth_GBps)
        _positive("group_bandwidth_GBps", self.group_bandwidth_GBps)
        if self.group_bandwidth_GBps < self.p2p_bandwidth_GBps:
            _fail("group_bandwidth_GBps", f"must be >= p2p_bandwidth_GBps "
                  f"({self.group_bandwidth_GBps!r} < {self.p2p_bandwidth_GBps!r}): a unit reaches all peers at least as fast as one")
        if not _is_number(self.latency_us) or self.latency_us < 0:
            _fail("latency_us", f"must be a number >= 0 (got {self.latency_us!r})")
        if self.nccl_efficiency is not None and (not _is_number(self.nccl_efficiency)
                                                 or not 0 < self.nccl_efficiency <= 1):
            _fail("nccl_efficiency", f"must be a number in (0, 1] (got {self.nccl_efficiency!r})")
        if self.p2p_matrix_GBps is not None:
            object.__setattr__(self, "p2p_matrix_GBps", self._checked_matrix(self.p2p_matrix_GBps))

    def _checked_matrix(self, m: Any) -> tuple[tuple[float, ...], ...]:
        name, n = "p2p_matrix_GBps", self.size
        if not isinstance(m, (list, tuple)) or len(m) != n or any(not isinstance(r, (list, tuple)) or len(r) != n for r in m):
            _fail(name, f"must be a {n}x{n} list of rows (size is {n})")
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                if not _is_number(v) or v < 0:
                    _fail(f"{name}[{i}][{j}]", f"must be a number >= 0 (got {v!r})")
                if i == j and v != 0:
                    _fail(f"{name}[{i}][{j}]", f"must be 0 on the diagonal (got {v!r})")
        return tuple(tuple(float(v) for v in row) for row in m)


@dataclass(kw_only=True, frozen=True)
class AllReduceCalibration:
    """A measured all-reduce bandwidth for one rank group, which beats the matrix estimate."""

    bandwidth_GBps: float
    """Measured all-reduce algorithm bandwidth of the group (ATP's B in Eq. 2: bytes / time), GB/s.
    Convert nccl-tests "busbw" with plan.atp_mesh.calibration_from_measurements(kind="bus")."""
    ranks: tuple[int, ...] | None = None
    """Explicit member ranks; give either this or ``group_size`` (+ ``stride``)."""
    group_size: int | None = None
    """Number of ranks in every group of this shape (any start rank)."""
    stride: int = 1
    """Distance between consecutive members when ``group_size`` is used."""

    def __post_init__(self) -> None:
        _positive("bandwidth_GBps", self.bandwidth_GBps)
        if (self.ranks is None) == (self.group_size is None):
            _fail("ranks", "give exactly one of 'ranks' or 'group_size' (+ 'stride')")
        if self.ranks is not None:
            if not isinstance(self.ranks, (list, tuple)) or len(self.ranks) < 2:
                _fail("ranks", f"must be a list of >= 2 ranks (got {self.ranks!r})")
            for i, r in enumerate(self.ranks):
                _int_at_least(f"ranks[{i}]", r, 0)
            if len(set(self.ranks)) != len(self.ranks):
                _fail("ranks", f"must not repeat a rank (got {list(self.ranks)})")
            object.__setattr__(self, "ranks", tuple(self.ranks))
        else:
            _int_at_least("group_size", self.group_size, 2)
        _int_at_least("stride", self.stride, 1)

    def matches(self, ranks: list[int] | tuple[int, ...]) -> bool:
        """Whether this entry describes the group ``ranks`` (order ignored)."""
        rs = sorted(ranks)
        if self.ranks is not None:
            return rs == sorted(self.ranks)
        return len(rs) == self.group_size and all(b - a == self.stride for a, b in zip(rs, rs[1:]))


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """Measurements that override the model where it is known to be wrong (ATP's IC1 case)."""

    allreduce_GBps: tuple[AllReduceCalibration, ...] = ()
    """Measured all-reduce bandwidths, first match wins."""

    def __post_init__(self) -> None:
        if not isinstance(self.allreduce_GBps, (list, tuple)):
            _fail("allreduce_GBps", "must be a list of {ranks|group_size, stride, bandwidth_GBps}")
        object.__setattr__(self, "allreduce_GBps", tuple(self.allreduce_GBps))


@dataclass(kw_only=True, frozen=True)
class Topology:
    """A cluster: levels innermost first; rank r sits at ``(r // prod(sizes[:i])) % sizes[i]``."""

    name: str
    """Short identifier, used in logs and to pick a shipped example."""
    levels: tuple[Level, ...]
    """The hierarchy, innermost (fastest-varying rank coordinate) first."""
    description: str | None = None
    """Free text for humans."""
    device: str | None = None
    """GPU model name (``a100-80gb``) for a simulator's device model."""
    calibration: Calibration | None = None
    """Optional measured bandwidths overriding the matrix."""

    def __post_init__(self) -> None:
        _text("name", self.name, optional=False)
        _text("description", self.description, optional=True)
        _text("device", self.device, optional=True)
        if not isinstance(self.levels, (list, tuple)) or not self.levels:
            _fail("levels", "must be a non-empty list of levels (innermost first)")
        object.__setattr__(self, "levels", tuple(self.levels))
        for i, lv in enumerate(self.levels):
            if not isinstance(lv, Level):
                _fail(f"levels[{i}]", f"must be a Level (got {type(lv).__name__})")
            if lv.name in [x.name for x in self.levels[:i]]:
                _fail(f"levels[{i}].name", f"{lv.name!r} is used by an earlier level; names must be unique")
            if lv.scope == "intra_node" and i and self.levels[i - 1].scope == "inter_node":
                _fail(f"levels[{i}].scope", "intra_node levels must all come before inter_node ones")
        for i, c in enumerate(self.calibration.allreduce_GBps if self.calibration else ()):
            bad = [r for r in (c.ranks or ()) if r >= self.world_size]
            if bad or (c.group_size and (c.group_size - 1) * c.stride >= self.world_size):
                _fail(f"calibration.allreduce_GBps[{i}]", f"names ranks beyond world size {self.world_size}")

    # ---- sizes and rank placement -------------------------------------------------------------
    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(lv.size for lv in self.levels)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def intra_node_levels(self) -> tuple[Level, ...]:
        return tuple(lv for lv in self.levels if lv.scope == "intra_node")

    @property
    def inter_node_levels(self) -> tuple[Level, ...]:
        return tuple(lv for lv in self.levels if lv.scope == "inter_node")

    @property
    def ranks_per_node(self) -> int:
        return math.prod(lv.size for lv in self.intra_node_levels)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def with_nodes(self, nodes: int) -> "Topology":
        """This cluster with ``nodes`` nodes: its one inter-node level resized (the node itself,
        its links and the inter-node link kind stay as described). Calibrations name ranks of the
        described cluster, so a topology with calibrations is not resized."""
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise TopologyError(f"--nodes must be a positive integer (got {nodes!r})")
        inter = [i for i, lv in enumerate(self.levels) if lv.scope == "inter_node"]
        if nodes == self.num_nodes:
            return self
        if len(inter) != 1:
            raise TopologyError(f"--nodes needs a topology with exactly one inter_node level; "
                                f"{self.name!r} has {len(inter)}")
        if self.calibration is not None:
            raise TopologyError(f"--nodes cannot resize {self.name!r}: its calibration names ranks "
                                f"of the described {self.num_nodes}-node cluster")
        levels = list(self.levels)
        if levels[inter[0]].p2p_matrix_GBps is not None:
            raise TopologyError(f"--nodes cannot resize {self.name!r}: its inter-node level has a "
                                f"per-pair bandwidth matrix")
        levels[inter[0]] = dataclasses.replace(levels[inter[0]], size=nodes)
        return dataclasses.replace(self, name=f"{self.name}x{nodes}", levels=tuple(levels))

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} outside 0..{self.world_size - 1} of topology {self.name!r}")

    def coords(self, rank: int) -> tuple[int, ...]:
        """Rank's coordinate at every level (level 0 varies fastest, as Megatron's TP ranks)."""
        self._check_rank(rank)
        out, stride = [], 1
        for s in self.sizes:
            out.append((rank // stride) % s)
            stride *= s
        return tuple(out)

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        k = self.ranks_per_node
        return list(range(node * k, (node + 1) * k))

    def level_between(self, a: int, b: int) -> int:
        """Index of the outermost level at which ranks differ (the link they must cross); -1 if a == b."""
        ca, cb = self.coords(a), self.coords(b)
        diff = [i for i in range(len(ca)) if ca[i] != cb[i]]
        return diff[-1] if diff else -1

    def is_intra_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def p2p_bandwidth(self, a: int, b: int) -> float:
        """GB/s between two ranks: the crossing level's matrix entry or uniform p2p (inf if a == b)."""
        i = self.level_between(a, b)
        if i < 0:
            return math.inf
        lv = self.levels[i]
        if lv.p2p_matrix_GBps is None:
            return lv.p2p_bandwidth_GBps
        return lv.p2p_matrix_GBps[self.coords(a)[i]][self.coords(b)[i]]

    def link_latency(self, a: int, b: int) -> float:
        """Microseconds for a message between two ranks (the crossing level's latency; 0 if a == b)."""
        i = self.level_between(a, b)
        return 0.0 if i < 0 else self.levels[i].latency_us

    def calibrated_allreduce(self, ranks: list[int] | tuple[int, ...]) -> float | None:
        """Measured all-reduce GB/s for this rank group, or None when the matrix must be used."""
        for c in self.calibration.allreduce_GBps if self.calibration else ():
            if c.matches(ranks):
                return c.bandwidth_GBps
        return None

    def check_world_size(self, n: int, flag: str | None = None) -> None:
        """Fail early when a launcher's world size disagrees with the description (``flag``: what
        set it, by default the trainer's ``--nproc-per-node``)."""
        if flag is None:
            from megatron_oases.flags import option

            flag = option("nproc_per_node")
        if n != self.world_size:
            raise TopologyError(f"describes {self.world_size} ranks ({' x '.join(map(str, self.sizes))}) "
                                f"but {flag}={n}; set {flag}={self.world_size} or pick another topology",
                                source=self.name)

    # ---- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data in the YAML layout (None fields dropped), so ``from_dict(to_dict())`` round-trips."""
        def conv(obj: Any) -> Any:
            if hasattr(obj, "__dataclass_fields__"):
                return {f.name: conv(getattr(obj, f.name)) for f in fields(obj) if getattr(obj, f.name) is not None}
            if isinstance(obj, tuple):
                return [conv(x) for x in obj]
            return obj
        return conv(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> "Topology":
        """Build from parsed YAML; any problem becomes one TopologyError naming ``source`` and field."""
        try:
            d = _mapping(data, "", cls)
            levels = d.get("levels")
            if isinstance(levels, list):
                d["levels"] = [_build(Level, lv, f"levels[{i}]") for i, lv in enumerate(levels)]
            cal = d.get("calibration")
            if cal is not None:
                c = _mapping(cal, "calibration", Calibration)
                entries = c.get("allreduce_GBps", [])
                if isinstance(entries, list):
                    c["allreduce_GBps"] = [_build(AllReduceCalibration, e, f"calibration.allreduce_GBps[{i}]")
                                           for i, e in enumerate(entries)]
                d["calibration"] = _build(Calibration, c, "calibration")
            return _build(cls, d, "")
        except TopologyError as e:
            raise e.within(source=source) from None


def _mapping(data: Any, where: str, cls: type) -> dict[str, Any]:
    """Copy of a YAML mapping after rejecting unknown and missing keys (with the allowed ones named)."""
    if not isinstance(data, dict):
        _fail(where or "top level", f"must be a mapping (got {type(data).__name__})")
    allowed = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    for k in data:
        if k not in allowed:
            _fail(f"{where}.{k}" if where else str(k), f"is not a known field; allowed: {', '.join(allowed)}")
    for k in required:
        if k not in data:
            _fail(f"{where}.{k}" if where else k, "is required but missing")
    return dict(data)


def _build(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, cls):
        return data
    d = data if isinstance(data, dict) and where == "" else _mapping(data, where, cls)
    if cls is Level and isinstance(d.get("p2p_matrix_GBps"), list):
        d["p2p_matrix_GBps"] = [tuple(r) if isinstance(r, list) else r for r in d["p2p_matrix_GBps"]]
    try:
        return cls(**d)
    except TopologyError as e:
        raise e.within(where) from None
    except TypeError as e:  # defensive: should be caught by _mapping first
        _fail(where or "top level", str(e))

