"""ATP's 2-D device mesh inside a tensor-parallel group, and its per-axis process groups.

A TP group of ``d1 * d2`` ranks is laid out as ``DeviceMesh(d1, d2)`` (ATP paper §3.1). Rank
order: the rank at TP position ``r`` has mesh coordinate ``(i, j) = divmod(r, d2)``; axis 2 is the
fastest-varying one. So

* an **axis-2 group** (fixed ``i``, ``j = 0..d2-1``) is ``d2`` *consecutive* TP ranks: the
  innermost, fastest interconnect level (e.g. NVLink inside a node) serves axis 2;
* an **axis-1 group** (fixed ``j``, ``i = 0..d1-1``) strides by ``d2``: the slower level.

This matches the paper's Figure 4 (``Shard`` on the first mesh dim splits ranks [0,1] from [2,3])
and §3.5 (for DeviceMesh(8,2) on 4 nodes x 4 GPUs, B2 is the intra-node bandwidth).

``DeviceMesh`` is checked without any process group; ``build_mesh_groups`` creates the groups
for every TP group (``new_group`` is collective over the world, so every rank enumerates every
group in the same order) and returns only this rank's ``MeshGroups``. Nothing is cached here:
callers pass the groups to layers explicitly.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from megatron_oases.describe.atp_meshes import atp_mesh_refusal
from megatron_oases.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """``d1 x d2`` mesh over ``ranks`` (global ranks of one TP group, in TP order)."""

    d1: int
    """Size of mesh axis 1 (the slow, strided axis)."""
    d2: int
    """Size of mesh axis 2 (the fast axis: consecutive TP ranks)."""
    ranks: tuple[int, ...]
    """Global ranks of the TP group; ``ranks[i * d2 + j]`` sits at coordinate ``(i, j)``."""

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        tp = len(self.ranks)
        refused = atp_mesh_refusal((self.d1, self.d2), tp)
        if refused:
            raise ConfigError(refused)
        if len(set(self.ranks)) != tp:
            raise ConfigError(f"--atp-mesh {self.d1}x{self.d2}: TP group ranks {list(self.ranks)} "
                              "contain duplicates")

    @property
    def size(self) -> int:
        return self.d1 * self.d2

    def axis_size(self, axis: int) -> int:
        """Size of mesh axis 1 or 2."""
        if axis not in (1, 2):
            raise ValueError(f"mesh axis must be 1 or 2 (got {axis})")
        return self.d1 if axis == 1 else self.d2

    def coord(self, rank: int) -> tuple[int, int]:
        """Mesh coordinate ``(i, j)`` of a global rank of this TP group."""
        try:
            return divmod(self.ranks.index(rank), self.d2)
        except ValueError:
            raise ValueError(f"rank {rank} is not in this mesh's TP group {list(self.ranks)}") from None

    def axis1_ranks(self, j: int) -> list[int]:
        """Global ranks of the axis-1 group through column ``j`` (stride ``d2``)."""
        return [self.ranks[i * self.d2 + j] for i in range(self.d1)]

    def axis2_ranks(self, i: int) -> list[int]:
        """Global ranks of the axis-2 group through row ``i`` (consecutive)."""
        return [self.ranks[i * self.d2 + j] for j in range(self.d2)]


@dataclasses.dataclass(frozen=True)
class MeshGroups:
    """This rank's view of its mesh: the two axis groups it belongs to and its coordinate."""

    axis1_group: object
    """Process group of this rank's axis-1 line (size ``d1``)."""
    axis2_group: object
    """Process group of this rank's axis-2 line (size ``d2``)."""
    coord: tuple[int, int]
    """``(i, j)``: index along axis 1 and along axis 2."""
    mesh: DeviceMesh

    def group(self, axis: int):
        """The process group of mesh axis 1 or 2."""
        self.mesh.axis_size(axis)
        return self.axis1_group if axis == 1 else self.axis2_group

    def index(self, axis: int) -> int:
        """This rank's position along mesh axis 1 or 2."""
        self.mesh.axis_size(axis)
        return self.coord[axis - 1]


def build_mesh_groups(tp_groups: Sequence[Sequence[int]], d1: int, d2: int,
                      rank: int | None = None) -> MeshGroups:
    """Create the axis-1 and axis-2 groups of every TP group; return this rank's ``MeshGroups``.

    Must be called by every rank of the world with the same ``tp_groups`` (a list of all TP
    groups, each a list of global ranks in TP order): ``torch.distributed.new_group`` is
    collective, so all ranks create all groups in the same order.
    """
    import torch.distributed as dist

    from megatron_oases.runtime.device import new_group

    meshes = [DeviceMesh(d1, d2, tuple(ranks)) for ranks in tp_groups]  # validate before creating
    seen: set[int] = set()
    for mesh in meshes:
        if seen & set(mesh.ranks):
            raise ConfigError(f"--atp-mesh: TP groups overlap on ranks {sorted(seen & set(mesh.ranks))}")
        seen |= set(mesh.ranks)
    rank = dist.get_rank() if rank is None else rank
    mine = None
    for mesh in meshes:
        axis2 = [new_group(mesh.axis2_ranks(i)) for i in range(d1)]
        axis1 = [new_group(mesh.axis1_ranks(j)) for j in range(d2)]
        if rank in mesh.ranks:
            i, j = mesh.coord(rank)
            mine = MeshGroups(axis1_group=axis1[j], axis2_group=axis2[i], coord=(i, j), mesh=mesh)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the TP groups {[list(m.ranks) for m in meshes]}")
    return mine


def all_tp_groups(tp_group) -> list[list[int]]:
    """Every TP group's global ranks (TP order), learned by exchanging ``tp_group``'s ranks.

    Collective over the world; works for any Megatron rank order because it asks the groups
    themselves instead of re-deriving Megatron's layout.
    """
    import torch.distributed as dist

    mine = dist.get_process_group_ranks(tp_group)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    unique = {tuple(g) for g in everyone}
    return [list(g) for g in sorted(unique, key=min)]


def mesh_groups_from_tp_group(tp_group, d1: int, d2: int) -> MeshGroups:
    """Mesh groups over an explicit TP group (e.g. ``pg_collection.tp``); collective over the world."""
    return build_mesh_groups(all_tp_groups(tp_group), d1, d2)


def mesh_groups_from_megatron(d1: int, d2: int) -> MeshGroups:
    """Mesh groups over Megatron's TP groups (after ``initialize_model_parallel``)."""
    from megatron.core import parallel_state

    return mesh_groups_from_tp_group(parallel_state.get_tensor_model_parallel_group(), d1, d2)


def shard_index(global_shape: Sequence[int], mesh_layout: Sequence[int | None],
                coord: tuple[int, int], mesh: DeviceMesh) -> tuple[slice, ...]:
    """Slices of a global tensor held at ``coord`` when tensor dim ``k`` is split over mesh axis
    ``mesh_layout[k]`` (1, 2, or None = not split; contiguous equal chunks).

    One rule shared by initialisation (slice a full tensor) and gatherers (place a shard), so they
    cannot disagree. Axes that appear in no entry replicate the tensor.
    """
    if len(global_shape) != len(mesh_layout):
        raise ValueError(f"mesh_layout {tuple(mesh_layout)} does not match shape {tuple(global_shape)}")
    out = []
    for size, axis in zip(global_shape, mesh_layout):
        if axis is None:
            out.append(slice(0, size))
            continue
        n = mesh.axis_size(axis)
        if size % n != 0:
            raise ConfigError(f"a dim of size {size} is not divisible by --atp-mesh axis {axis} "
                              f"(size {n}) of {mesh.d1}x{mesh.d2}")
        step = size // n
        k = coord[axis - 1]
        out.append(slice(k * step, (k + 1) * step))
    return tuple(out)
