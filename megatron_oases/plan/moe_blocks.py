"""The planner's MoE blocks: an MoE layer's second block priced from ``describe.moe``.

An MoE layer (``--num-experts``, ``--moe-layer-freq``) is Megatron's attention block followed by
an MoE block in place of the MLP (``describe.moe.moe_block``: router, dispatch collectives, the
``E / EP`` local experts, combine). The planner's chain keeps two blocks per layer; an MoE layer's
second one has kind ``moe``. Its collectives run on the EP and TP x EP groups, placed as the
simulator places them (``describe.moe.moe_axis_ranks``: EP ranks at stride TP over data-parallel
replicas), its events carry the simulator's MoE key (``MoEShape.key``), its experts' gradients
are reduced and their optimizer states sharded over the expert-data-parallel group (DP / EP), and
it keeps what the dense MLP block keeps plus the MoE block's difference
(``describe.moe.moe_block_saved_delta``), as ``sim`` counts it.

What the planner offers for MoE is what the trainer runs (``megatron_oases.moe``): Megatron's
modules (the megatron family) at the uniform degree T (the trainer refuses ``--oases-plan`` with
MoE; at TP > 1 MoE needs ``--sequence-parallel``, which the planner prices at T only), under the
default executor or the Oases executor where it splits MoE layers (``PlanModel._check_moe``:
``describe.moe.moe_refusal``), whose block is its tape's steps (``describe.moe.moe_block(oases=True)``)
and keeps its boundaries (``describe.moe_oases``). EP is the launch's, not searched.
"""
from __future__ import annotations

from megatron_oases.describe.moe import (EXPERT_TENSORS_FROM, MOE_AXES, is_moe_op, moe_axis_ranks, moe_block,
                                         moe_block_joins, moe_block_param_tensors, moe_block_saved_delta)
from megatron_oases.describe.moe_oases import oases_moe_layer_kept_bytes
from megatron_oases.flags import option

from .memory import block_memory
from .model import PlanModel

MOE_KIND = "moe"
"""The kind of an MoE layer's second block (``graph.Block.kind``; its cost key)."""


def moe_plan_refusal(m: PlanModel, *, families: tuple[str, ...], degrees: tuple[int, ...] | None) -> str:
    """Why the planner cannot offer what was asked for an MoE model ("" when it can): the trainer
    runs MoE only with Megatron's modules at one TP degree for every block."""
    if m.moe is None:
        return ""
    other = [f for f in families if f != "megatron"]
    if other:
        return (f"{option('num_experts')}: --families {other[0]} does not run Megatron-Core's MoE layers (the "
                f"trainer runs them with --tp-backend megatron only); plan with --families megatron")
    if degrees and m.tp not in degrees:
        return (f"{option('num_experts')}: the trainer runs MoE at the uniform degree {m.tp} only (it refuses "
                f"--oases-plan with MoE); drop --degrees or include {m.tp}")
    return ""


def moe_ops(m: PlanModel, degree: int, samples: int):
    """(forward ops, backward ops) of the MoE block on ``samples`` samples at ``degree``
    (``describe.moe.moe_block``, the simulator's description; under the Oases executor its tape's
    steps)."""
    return moe_block(micro_batch=samples, seq=m.seq_length, hidden=m.hidden_size, moe=m.moe, tp=degree, ep=m.ep,
                     bytes_per_element=m.bytes_per_element, variant=m.variant, hidden_dropout=m.hidden_dropout > 0,
                     oases=m.sub_batches > 1)


def moe_joined_ops(m: PlanModel, forward: tuple) -> tuple:
    """The MoE block's ``forward`` ops (:func:`moe_ops`') up to where the Oases sub-batches join
    (``describe.moe.moe_block_joins``: after routing with the aux loss on), which both finish
    before either goes on; empty where they do not join."""
    joins = moe_block_joins(m.moe, oases=m.sub_batches > 1)
    return tuple(forward[:joins[-1] + 1]) if joins else ()


def moe_shape_of(m: PlanModel, name: str, shape: str, dims: tuple) -> tuple[str, tuple]:
    """(shape, dims) of op ``name``'s event: an MoE op's carry the MoE flags and EP, as ``sim``'s
    (``sim.core.events._op_event``)."""
    if m.moe is None or not is_moe_op(name):
        return shape, dims
    key = m.moe.key(m.ep)
    return shape + key, dims + (("moe", key),)


def moe_group_ranks(m: PlanModel, degree: int, axis: str) -> tuple[int, ...] | None:
    """TP rank 0's group on an MoE axis (EP, TP x EP: ``describe.moe.moe_axis_ranks``, where
    ``sim`` places them); None for another axis."""
    if axis not in MOE_AXES:
        return None
    return moe_axis_ranks(axis, tuple(range(degree)), tp=m.tp, ep=m.ep)


def moe_params(m: PlanModel, degree: int) -> tuple[int, int]:
    """(parameters, of which the experts') of the MoE block on one rank
    (``describe.moe.moe_block_param_tensors``)."""
    tensors = moe_block_param_tensors(h=m.hidden_size, moe=m.moe, t=degree, ep=m.ep, variant=m.variant)
    return sum(tensors), sum(tensors[EXPERT_TENSORS_FROM:])


def expert_dp_ranks(m: PlanModel, dp: int) -> tuple[int, ...]:
    """The expert-data-parallel group of rank 0: the DP replicas at EP position 0 (stride
    ``tp x ep``, the planner's rank order: TP, then data-parallel replicas)."""
    return tuple(m.tp * m.ep * k for k in range(dp // m.ep))


def moe_memory(m: PlanModel, saved: float, runtime: float) -> tuple[float, float]:
    """(saved bytes per micro-batch, backward working set) of the MoE block from the dense MLP
    block's: without recompute it keeps the MoE block's difference more
    (``describe.moe.moe_block_saved_delta``); under full recompute it keeps the layer's boundaries
    as the dense block does (under the Oases executor's fine-grained recompute the MoE layer's own:
    ``describe.moe_oases.oases_moe_layer_kept_bytes`` less the attention block's part), and the difference,
    where positive, is rerun into its backward working set (``sim.core.memory`` alike)."""
    delta = moe_block_saved_delta(b=m.micro_batch_size, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                                  f=m.ffn_hidden_size, moe=m.moe, t=m.tp, ep=m.ep, e=m.bytes_per_element,
                                  variant=m.variant, hidden_dropout=m.hidden_dropout > 0,
                                  sequence_parallel=m.sequence_parallel)
    if m.fine_grained:
        layer = oases_moe_layer_kept_bytes(micro_batch=m.micro_batch_size, seq=m.seq_length, hidden=m.hidden_size,
                                           heads=m.num_attention_heads, ffn=m.ffn_hidden_size, moe=m.moe, tp=m.tp,
                                           ep=m.ep, bytes_per_element=m.bytes_per_element, variant=m.variant,
                                           sequence_parallel=m.sequence_parallel, hidden_dropout=m.hidden_dropout > 0,
                                           attention_dropout=m.attention_dropout > 0,
                                           core_attention=m.core_attention)
        saved = layer - block_memory(m, "attention", m.micro_batch_size, m.tp)[0]
    return (saved, runtime + max(0.0, delta)) if m.recompute else (saved + delta, runtime)
