"""Per-block TP degrees (``--oases-plan``): a layer's two blocks, and the reshard between degrees.

A block of degree ``d`` (a power of two dividing the TP size ``T``) runs as ``T / d`` replicas,
each on ``d`` consecutive TP ranks and on ``d / T`` of the micro-batch, its hidden states
replicated over its ``d`` ranks (``parallel/degree_groups.py`` is the runtime). The planner's cost
model and the simulator both read this module, so they agree on what a plan moves.
"""
from __future__ import annotations

import dataclasses

from .megatron_1d import CORE_ATTENTION_RECOMPUTE
from .ops import GPT2, Collective, LayerDescription, LayerVariant, Op
from .saved import block_saved_bytes, oases_kept_beyond_stock
from .split import oases_splits, sub_batches_at

MLP_FIRST, ATTENTION_FIRST_BWD = ("mlp.ag", "mlp"), ("attention.rs.bwd", CORE_ATTENTION_RECOMPUTE, "attention.bwd")
"""Megatron 1-D's ops where the MLP block starts (forward) and the attention block (backward):
under sequence parallelism the block's all-gather, else its compute segment (under selective
recompute the core attention's rerun first)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DegreeReshard:
    """Collectives (TP rank 0's side) moving hidden states between blocks of two degrees."""

    forward: Collective | None
    backward: Collective | None
    ranks: tuple[int, ...] = ()
    """TP indices of TP rank 0's reshard group (stride = the smaller degree)."""


def degree_reshard(src: int, dst: int, *, tp: int, micro_batch: int, seq: int, hidden: int,
                   bytes_per_element: int) -> DegreeReshard:
    """Replicas of ``src`` hold their share of the batch, replicated over their ``d`` ranks.
    Fewer replicas next (d_src < d_dst): forward all-gathers the batch over d_dst / d_src ranks
    (stride d_src), backward slices. More replicas next: forward slices, backward all-gathers the
    input gradient. Payload: the gathered [s, b_share, h] tensor of the micro-batch's share (the
    runtime reshards it whole, outside the Oases executor)."""
    if src == dst:
        return DegreeReshard(forward=None, backward=None)
    lo, hi = sorted((src, dst))
    ranks = tuple(range(0, hi, lo))
    share = micro_batch * hi / tp
    payload = round(share * seq * hidden * bytes_per_element)
    op = Collective(name="reshard.ag", kind="all_gather", axis="tp", group_size=len(ranks), payload_bytes=payload)
    if src < dst:
        return DegreeReshard(forward=op, backward=None, ranks=ranks)
    return DegreeReshard(forward=None, backward=op, ranks=ranks)


def reshard_shape(*, share: int, seq: int, hidden: int, degree: int, dtype: str) -> tuple[str, tuple]:
    """(shape, dims) naming a degree reshard's event: the ``share`` samples it moves at the larger
    ``degree`` (the runtime reshards a micro-batch's whole share at once, outside the Oases
    executor: ``schedules/oases/block._run_segments``). The simulator and the planner key it so."""
    return (f"b{share}s{seq}h{hidden}t{degree}_{dtype}",
            (("b", share), ("s", seq), ("h", hidden), ("t", degree), ("dtype", dtype)))


def split_at(ops: tuple[Op, ...], name: str | tuple[str, ...]) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """``ops`` before and from the op ``name`` (the first of ``name``'s names that is there)."""
    names = (name,) if isinstance(name, str) else name
    i = next(i for n in names for i, op in enumerate(ops) if op.name == n)
    return tuple(ops[:i]), tuple(ops[i:])


def megatron_blocks(desc: LayerDescription) -> dict[str, tuple[tuple[Op, ...], tuple[Op, ...]]]:
    """Megatron 1-D layer -> {"attention": (forward ops, backward ops), "mlp": ...}: each block's
    segment with the collectives after it (forward g; backward f of the block's input); under
    sequence parallelism also the all-gather before it (forward; backward its output gradient's)."""
    attn_f, mlp_f = split_at(desc.forward, MLP_FIRST)
    mlp_b, attn_b = split_at(desc.backward, ATTENTION_FIRST_BWD)
    return {"attention": (attn_f, attn_b), "mlp": (mlp_f, mlp_b)}


def planned_block_saved_bytes(kind: str, *, samples: int, degree: int, tp: int, seq: int, hidden: int, heads: int,
                              ffn: int, bytes_per_element: int, oases: bool, variant: LayerVariant = GPT2,
                              hidden_dropout: bool = False, attention_dropout: bool = False,
                              core_attention: str = "local", recompute_core_attention: bool = False,
                              expert_parallel: int = 1) -> float:
    """Bytes a planned block (``kind``: attention | mlp) of degree ``degree`` keeps for backward,
    without recompute, on its replica's ``samples``: Megatron's block inventory at that degree
    (``saved.block_saved_bytes``) and, under the Oases schedule (``oases``, TP > 1), its step
    boundary: half a layer's ``saved.oases_kept_beyond_stock``, at degree 1 too (that block runs
    in the executor, on one sub-batch). The planner's memory and the simulator's read it;
    ``tests/test_round_trip.py`` measures it. Where the degree changes under the Oases schedule
    the trainer also keeps the reshard's output: an edge's term, :func:`reshard_saved_bytes`.
    ``recompute_core_attention``: Megatron's selective recompute (no s^2 tensor kept).
    ``expert_parallel``: an MoE run's EP (``describe.split.oases_splits``: at TP 1 the executor
    runs its layers when EP > 1, so a dense block of it keeps the step boundary too)."""
    e = bytes_per_element
    kept = block_saved_bytes(kind, b=samples, s=seq, h=hidden, a=heads, f=ffn, t=degree, e=e,
                             hidden_dropout=hidden_dropout, attention_dropout=attention_dropout, variant=variant,
                             core_attention=core_attention, recompute_core_attention=recompute_core_attention)
    if oases_splits(tp, oases=oases, expert_parallel=expert_parallel):  # describe.split: dense TP 1 runs stock
        kept += oases_kept_beyond_stock(samples * seq * hidden * e, s=seq, h=hidden, a=heads, e=e, variant=variant,
                                        sub_batches=sub_batches_at(degree, oases=True, expert_parallel=expert_parallel),
                                        core_attention=core_attention, attention_dropout=attention_dropout) / 2
    return kept


def reshard_saved_bytes(src: int, dst: int, *, tp: int, micro_batch: int, seq: int, hidden: int,
                        bytes_per_element: int, oases: bool) -> float:
    """Bytes the trainer keeps for backward at an edge from a block of degree ``src`` into one of
    degree ``dst`` (a term of the pair, not of either block): under the Oases schedule each run of
    blocks at one degree is its own executor stage (``schedules/oases/block._run_segments``),
    which keeps its input, the reshard's output: ``dst``'s share ``[s, b dst / T, h]`` of the
    micro-batch. Without a change of degree the stage's input is the previous block's output,
    already in that block's inventory; the stock executor keeps no reshard output. A chunk's
    first block enters from the whole TP group (``src = tp``). Read by the planner's memory (an
    edge term of its problem) and the simulator's; ``tests/test_round_trip.py`` measures it."""
    if not oases or src == dst or tp == 1:
        return 0.0
    return micro_batch * dst / tp * seq * hidden * bytes_per_element
