"""The 3-D tensor-parallel cube: one TP group of P = p^3 ranks seen as a p x p x p cube.

Bian et al. 2021 ("Maximizing Parallelism in Distributed Training for Huge Neural Networks")
index a rank by (i, j, l) along the x, y, z directions. A *direction group* is the line of p ranks
that differ only in one coordinate; every 3-D collective runs on one such line.

Rank mapping (``Cube.order``, fastest-varying direction first; default ``"zxy"``)::

    tp_index = c[order[0]] + p * c[order[1]] + p^2 * c[order[2]]      c = {x: i, y: j, z: l}

Why z first: with the block entry in direction y (the paper's default), z is the direction of the
wide activations inside each block (the 4h MLP and 3h QKV outputs are reduce-scattered and their
gradients all-gathered in z), so per layer it moves 36 M h / p^2 elements (M = tokens per
micro-batch) against 36 h^2 / p^2 for x (weights) and 12 M h / p^2 for y. When M >= h, the usual
training regime, z is the busiest direction and consecutive ranks (one node, NVLink) carry it.
Pick ``order="xzy"`` when M < h.

Also here: a broadcast / reduce-to-root pair on a direction group (used by the diagonal vector
parameters, Alg. 7-8), which ``collectives.py`` does not have.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_oases.describe.cube_3d import cube_root
from megatron_oases.parallel import collectives
from megatron_oases.errors import ConfigError
from megatron_oases.runtime.device import new_group

DIRECTIONS = ("x", "y", "z")
_AXIS = {"x": 0, "y": 1, "z": 2}


def other_dir(direction: str) -> str:
    """The activation direction exchange of §3.2: y <-> z (x always belongs to the weights)."""
    if direction not in ("y", "z"):
        raise ValueError(f"activation direction must be 'y' or 'z' (got {direction!r})")
    return "z" if direction == "y" else "y"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cube:
    """Validated cube shape and the tp_index <-> (i, j, l) mapping; no process groups needed."""

    tp_size: int
    """``--tensor-model-parallel-size``; must be p^3."""
    order: str = "zxy"
    """Directions from fastest- to slowest-varying tp index; the first one stays inside a node."""

    def __post_init__(self):
        if cube_root(self.tp_size) is None:  # describe.cube_3d: the one test of a cube
            raise ConfigError(
                f"3-D tensor parallelism needs --tensor-model-parallel-size = p^3 (8, 27, 64, ...); "
                f"got {self.tp_size}")
        if sorted(self.order) != list(DIRECTIONS):
            raise ConfigError(f"cube order must be a permutation of 'xyz' (got {self.order!r})")

    @property
    def p(self) -> int:
        return cube_root(self.tp_size)

    def coord(self, tp_index: int) -> tuple[int, int, int]:
        """(i, j, l) of the rank at ``tp_index`` within the TP group."""
        if not 0 <= tp_index < self.tp_size:
            raise ValueError(f"tp index {tp_index} outside the cube of {self.tp_size} ranks")
        c = [0, 0, 0]
        for d in self.order:
            tp_index, c[_AXIS[d]] = divmod(tp_index, self.p)
        return tuple(c)

    def index(self, coord: Sequence[int]) -> int:
        """Inverse of ``coord``."""
        out, scale = 0, 1
        for d in self.order:
            out += coord[_AXIS[d]] * scale
            scale *= self.p
        return out

    def line(self, direction: str, coord: Sequence[int]) -> list[int]:
        """tp indices of the direction group through ``coord``, in coordinate order."""
        axis, c = _AXIS[direction], list(coord)
        out = []
        for k in range(self.p):
            c[axis] = k
            out.append(self.index(c))
        return out

    def lines(self, direction: str) -> list[list[int]]:
        """All p^2 direction groups of one direction, in a fixed order (same on every rank)."""
        return [self.line(direction, self.coord(t)) for t in range(self.tp_size)
                if self.coord(t)[_AXIS[direction]] == 0]


@dataclasses.dataclass(frozen=True)
class CubeGroups:
    """This rank's three direction groups and its coordinate; what every 3-D layer is given."""

    x: object
    y: object
    z: object
    coord: tuple[int, int, int]
    """(i, j, l) of this rank."""
    cube: Cube

    @property
    def p(self) -> int:
        return self.cube.p

    def group(self, direction: str):
        return getattr(self, direction)

    def pos(self, direction: str) -> int:
        """This rank's coordinate along ``direction`` (= its rank inside that direction group)."""
        return self.coord[_AXIS[direction]]


def build_cube_groups(tp_ranks: Sequence, p: int, *, order: str = "zxy") -> CubeGroups:
    """Create the x, y, z groups of every TP group; return this rank's ``CubeGroups``.

    ``tp_ranks`` is the list of all TP groups (lists of ascending global ranks), or one such list.
    Every rank must call this with the same arguments: ``new_group`` is collective over the world.
    """
    tp_groups = [list(tp_ranks)] if tp_ranks and isinstance(tp_ranks[0], int) else \
        [list(g) for g in tp_ranks]
    for g in tp_groups:
        cube = Cube(tp_size=len(g), order=order)
        if cube.p != p:
            raise ConfigError(f"3-D tensor parallelism with p = {p} needs --tensor-model-parallel-size "
                              f"{p ** 3}; the TP group has {len(g)} ranks")
        if g != sorted(set(g)):
            raise ConfigError(f"TP group ranks must be distinct and ascending (got {g})")
    me = dist.get_rank()
    mine: dict[str, object] = {}
    coord = None
    for g in tp_groups:
        for d in DIRECTIONS:
            for line in cube.lines(d):
                members = [g[t] for t in line]
                pg = new_group(members)
                if me in members:
                    mine[d] = pg
                    coord = cube.coord(g.index(me))
    if coord is None:
        raise ValueError(f"rank {me} is in none of the TP groups {tp_groups}")
    return CubeGroups(mine["x"], mine["y"], mine["z"], coord, cube)


def broadcast_(tensor: torch.Tensor, src_pos: int, group) -> torch.Tensor:
    """In-place broadcast from group rank ``src_pos`` (counted as ``broadcast``)."""
    collectives.record_collective("broadcast", tensor, group)
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src_pos), group=group)
    return tensor


def reduce_(tensor: torch.Tensor, dst_pos: int, group) -> torch.Tensor:
    """In-place sum onto group rank ``dst_pos`` (counted as ``reduce``); the backward of broadcast."""
    collectives.record_collective("reduce", tensor, group)
    if dist.get_world_size(group) > 1:
        dist.reduce(tensor, dst=dist.get_global_rank(group, dst_pos), group=group)
    return tensor


def cube_groups_from_tp_group(tp_group, *, order: str = "zxy") -> CubeGroups:
    """Cube groups over an explicit TP group (e.g. ``pg_collection.tp``); collective over the world
    (every rank learns all TP groups, then creates every direction group in the same order)."""
    from megatron_oases.parallel.mesh import all_tp_groups

    tp_groups = all_tp_groups(tp_group)
    return build_cube_groups(tp_groups, Cube(tp_size=len(tp_groups[0]), order=order).p, order=order)


def cube_groups_from_megatron(*, order: str = "zxy") -> CubeGroups:
    """Cube groups over Megatron's TP groups (after ``initialize_model_parallel``)."""
    from megatron.core import parallel_state

    return cube_groups_from_tp_group(parallel_state.get_tensor_model_parallel_group(), order=order)
