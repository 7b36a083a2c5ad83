"""Process groups for per-layer TP degrees (``--oases-plan``), and the batch reshard between them.

The TP group has ``T`` ranks. A layer of degree ``t`` (a power of two dividing ``T``) runs on a
*sub-group* of ``t`` consecutive TP ranks; the ``T / t`` sub-groups are *replicas* and replica
``r = tp_rank // t`` takes batch slice ``r`` of the micro-batch. Megatron's hidden states between
layers are replicated over the TP group, so they are "degree ``T``": one slice, the whole batch.

Moving hidden states from degree ``a`` to degree ``b`` needs, per rank, only ranks that agree on
``tp_rank // max(a, b)`` (same larger slice) and on ``tp_rank % min(a, b)`` (same position in the
smaller sub-group): ``max / min`` ranks whose smaller slices tile the larger one in order. Going to
a smaller degree keeps this rank's piece (backward: all-gather the gradient); going to a larger
one all-gathers the pieces (backward: keep this rank's piece, since the gradient of replicated
hidden states is replicated too). These are the AllGather-forward-or-backward edges the planner
prices (Oases Eq. 4). The same groups with ``max = T`` are the replica groups over which the
parameter gradients of a degree-``t`` layer are summed.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from megatron_oases.describe.plan_degrees import degree_refusal
from megatron_oases.errors import ConfigError


def reshard_group_ranks(tp_ranks: Sequence[int], small: int, large: int) -> list[list[int]]:
    """The groups (global ranks) that move one TP group's hidden states between degrees
    ``small`` and ``large``: TP indices with equal ``i // large`` and ``i % small``."""
    tp = len(tp_ranks)
    if not (0 < small <= large and tp % large == 0 and large % small == 0):
        raise ValueError(f"degrees {small} and {large} must divide each other and {tp}")
    out = []
    for base in range(0, tp, large):
        for off in range(small):
            out.append([tp_ranks[base + off + k * small] for k in range(large // small)])
    return out


def sub_group_ranks(tp_ranks: Sequence[int], degree: int) -> list[list[int]]:
    """The ``T / degree`` sub-groups of one TP group: ``degree`` consecutive TP indices each."""
    return [list(tp_ranks[i:i + degree]) for i in range(0, len(tp_ranks), degree)]


@dataclasses.dataclass(frozen=True)
class DegreeGroups:
    """This rank's groups for the degrees of a plan."""

    tp_size: int
    tp_index: int
    """This rank's index in its TP group."""
    sub: dict
    """degree -> this rank's TP sub-group of that size (``T`` -> Megatron's TP group)."""
    reshard: dict
    """(small, large) degrees -> this rank's reshard group (``large / small`` ranks)."""

    def replica_group(self, degree: int):
        """Ranks holding the same shard of a degree-``degree`` layer (None when ``degree = T``)."""
        return None if degree == self.tp_size else self.reshard[(degree, self.tp_size)]

    def replica_index(self, degree: int) -> int:
        """Which batch slice (replica) this rank computes at ``degree``."""
        return self.tp_index // degree


def _check_ascending(ranks: Sequence[int]) -> None:
    # new_group orders members by global rank; the batch-slice order assumes TP order agrees.
    if list(ranks) != sorted(ranks):
        raise ConfigError(f"--oases-plan needs TP groups whose global ranks ascend in TP order "
                          f"(got {list(ranks)}); use Megatron's default rank order")


def build_degree_groups(tp_groups: Sequence[Sequence[int]], degrees: Iterable[int],
                        rank: int | None = None, tp_group=None) -> DegreeGroups:
    """Create the sub-groups and reshard groups of every TP group; return this rank's.

    Collective over the world: every rank calls it with the same ``tp_groups`` (all TP groups,
    global ranks in TP order) and ``degrees``. ``tp_group``, if given, is reused as the degree-T
    sub-group instead of creating a copy."""
    import torch.distributed as dist

    from megatron_oases.runtime.device import new_group

    rank = dist.get_rank() if rank is None else rank
    tp = len(tp_groups[0])
    wanted = sorted(set(degrees) | {tp})
    for d in wanted:
        if degree_refusal(d, tp):  # describe.plan_degrees
            raise ConfigError(f"--oases-plan: {degree_refusal(d, tp)}")
    sub, reshard, tp_index = {}, {}, None
    for ranks in tp_groups:
        _check_ascending(ranks)
        if rank in ranks:
            tp_index = list(ranks).index(rank)
        for d in wanted:
            if d == tp and tp_group is not None:
                if rank in ranks:
                    sub[d] = tp_group
                continue
            for members in sub_group_ranks(ranks, d):
                g = new_group(members)
                if rank in members:
                    sub[d] = g
        for i, small in enumerate(wanted):
            for large in wanted[i + 1:]:
                for members in reshard_group_ranks(ranks, small, large):
                    g = new_group(members)
                    if rank in members:
                        reshard[(small, large)] = g
    if tp_index is None:
        raise ValueError(f"rank {rank} is in none of the TP groups {list(map(list, tp_groups))}")
    return DegreeGroups(tp_size=tp, tp_index=tp_index, sub=sub, reshard=reshard)


def degree_groups_from_megatron(degrees: Iterable[int]) -> DegreeGroups:
    """Degree groups over Megatron's TP groups (after ``initialize_model_parallel``)."""
    from megatron.core import parallel_state

    from megatron_oases.parallel.mesh import all_tp_groups

    tp_group = parallel_state.get_tensor_model_parallel_group()
    return build_degree_groups(all_tp_groups(tp_group), degrees, tp_group=tp_group)


def reshard_batch(x, groups: DegreeGroups, src: int, dst: int, *, batch_dim: int = 1):
    """Hidden states ``[s, b, h]`` laid out for degree ``src`` -> laid out for degree ``dst``."""
    from megatron_oases.parallel.collectives import gather_dim, split_dim

    if src == dst:
        return x
    if dst < src:
        return split_dim(x, batch_dim, groups.reshard[(dst, src)])
    return gather_dim(x, batch_dim, groups.reshard[(src, dst)])


def narrow_batch_mask(mask, groups: DegreeGroups, degree: int, full_batch: int):
    """The attention mask of this rank's batch slice at ``degree`` (masks without a per-sample
    batch axis are shared and returned as they are)."""
    if mask is None or mask.dim() == 0 or degree == groups.tp_size or full_batch == 1:
        return mask
    if mask.shape[0] != full_batch:
        return mask
    n = groups.tp_size // degree
    return mask.chunk(n, dim=0)[groups.replica_index(degree)]
