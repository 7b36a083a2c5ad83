"""The simulator's MoE pieces: where an MoE model runs, its groups, its layers' events and bytes.

The layer itself is ``describe.moe`` (read through ``describe.registry.layer_description``);
this module maps it onto a ``Strategy``: the EP group of a stage's representative (one rank of
each of ``ep`` consecutive data-parallel replicas, Megatron's expert order ``tp-ep-dp-pp`` with the
experts' TP equal to TP), the TP x EP group of the allgather dispatcher, the expert-data-parallel
group (DP / EP replicas) over which the experts' gradients are reduced and their optimizer states
sharded, and which layers are MoE (``--moe-layer-freq``). ``events`` and ``memory`` call it.
"""
from __future__ import annotations

from ...describe.moe import (EXPERT_TENSORS_FROM, flops_ffn_width, moe_block_param_tensors,
                             moe_block_saved_delta, moe_refusal)
from ...describe.moe_oases import oases_moe_layer_kept_bytes
from ...describe.moe import is_moe_op  # noqa: F401  (events.py reads it from here)
from ...describe.moe import moe_axis_ranks as axis_ranks
from ...describe.ops import ModelingError
from ...describe.registry import MLP_PARAM_TENSORS, layer_param_tensors
from ...describe.shapes import GPTShape
from ...pricing.device_model import SimError


def moe_check(m: GPTShape, s) -> None:
    """Where an MoE model runs, in the trainer's words (``megatron_oases.moe``, ``describe.moe``):
    EP divides the experts and DP, SP and no linear biases at TP > 1, Megatron's modules, no per-block plan, the
    Oases executor only where it equals stock (dispatcher, dropless, load balancing); EP > 1 needs MoE layers."""
    from ...describe.backends import backend as record

    refused = moe_refusal(m.moe, tp=s.tp, ep=s.ep, dp=s.dp, sequence_parallel=s.sequence_parallel,
                          megatron_modules=record(s.backend).megatron_modules, bias=m.variant.bias,
                          per_block_plan=s.block_degrees is not None, oases=s.schedule == "oases")
    if refused:
        raise SimError(refused)


def is_moe_layer(m: GPTShape, layer: int) -> bool:
    """Whether layer ``layer`` of the model is an MoE layer."""
    return m.moe is not None and m.moe.is_moe(layer)


def moe_axis_ranks(axis: str, tp_ranks: tuple[int, ...], s) -> tuple[int, ...]:
    """The group of TP rank 0 of a stage on an MoE axis (``describe.moe.moe_axis_ranks``, the
    planner's too): EP (stride TP over data-parallel replicas 0..EP-1, ``Strategy.rank``'s order)
    or TP x EP."""
    try:
        return axis_ranks(axis, tp_ranks, tp=s.tp, ep=s.ep)
    except ModelingError as e:
        raise SimError(str(e)) from None


def expert_dp_ranks(s, stage: int) -> tuple[int, ...]:
    """The expert-data-parallel group of the stage's representative: the DP replicas at the same
    EP position (0, EP, 2 EP, ...)."""
    return tuple(s.rank(dp=k * s.ep, pp=stage) for k in range(s.dp // s.ep))


def moe_layer_tensors(m: GPTShape, s, degree: int) -> tuple[int, ...]:
    """``layer_param_tensors`` of an MoE layer on TP rank 0 of EP rank 0: the attention block's
    tensors, then the MoE block's (``describe.moe.moe_block_param_tensors``)."""
    dense = layer_param_tensors(s.backend, m.hidden_size, m.ffn_hidden_size, degree, s.layout,
                                heads=m.num_attention_heads, variant=m.variant)
    attention = tuple(n for i, n in enumerate(dense) if i not in MLP_PARAM_TENSORS)
    return attention + moe_block_param_tensors(h=m.hidden_size, moe=m.moe, t=degree, ep=s.ep, variant=m.variant)


def expert_tensor_count(m: GPTShape, s, layer: int) -> int:
    """How many of the layer's tensors (the last ones of :func:`moe_layer_tensors`) are experts'."""
    if not is_moe_layer(m, layer):
        return 0
    return len(moe_block_param_tensors(h=m.hidden_size, moe=m.moe, t=s.tp, ep=s.ep, variant=m.variant)) \
        - EXPERT_TENSORS_FROM


def layer_expert_params(m: GPTShape, s, layer: int) -> int:
    """Expert parameters of the layer on one rank (0 for a dense layer)."""
    n = expert_tensor_count(m, s, layer)
    return sum(moe_layer_tensors(m, s, s.tp)[-n:]) if n else 0


def moe_saved_delta(m: GPTShape, s, layers: list[int], *, recomputed: int, kept_rc: float = 0.0) -> float:
    """Bytes the MoE layers among ``layers`` keep per micro-batch beyond what the same layers
    would keep dense (their MoE block's inventory, ``describe.moe.moe_block_saved_bytes``, minus
    the dense MLP block's); the first ``recomputed`` layers keep what dense ones keep, plus
    ``kept_rc`` (:func:`moe_oases_kept`'s difference under Oases fine-grained recompute)."""
    if m.moe is None:
        return 0.0
    return sum(moe_block_delta(m, s) if i >= recomputed else kept_rc
               for i, layer in enumerate(layers) if is_moe_layer(m, layer))


def moe_oases_kept(m: GPTShape, s) -> float:
    """Bytes a recomputed MoE layer keeps per micro-batch under the Oases executor's fine-grained
    recompute (``describe.moe_oases.oases_moe_layer_kept_bytes``, the planner's too)."""
    return oases_moe_layer_kept_bytes(micro_batch=m.micro_batch_size, seq=m.seq_length, hidden=m.hidden_size,
                                      heads=m.num_attention_heads, ffn=m.ffn_hidden_size, moe=m.moe, tp=s.tp,
                                      ep=s.ep, bytes_per_element=m.bytes_per_element, variant=m.variant,
                                      sequence_parallel=s.sequence_parallel, hidden_dropout=m.hidden_dropout > 0,
                                      attention_dropout=m.attention_dropout > 0, core_attention=m.core_attention)


def moe_block_delta(m: GPTShape, s) -> float:
    """One MoE block's saved bytes minus the dense MLP block's (stock, CUDA kernels:
    ``describe.moe.moe_block_saved_delta``, the planner's too)."""
    return moe_block_saved_delta(b=m.micro_batch_size, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                                 f=m.ffn_hidden_size, moe=m.moe, t=s.tp, ep=s.ep, e=m.bytes_per_element,
                                 variant=m.variant, hidden_dropout=m.hidden_dropout > 0,
                                 sequence_parallel=s.sequence_parallel)


def flops_ffn(m: GPTShape) -> float:
    """The FFN width Megatron-LM's model-FLOPs formula sees per layer (``describe.moe.flops_ffn_width``)."""
    if m.moe is None:
        return m.ffn_hidden_size
    return flops_ffn_width((m.moe.is_moe(i) for i in range(m.num_layers)), dense_ffn=m.ffn_hidden_size,
                           moe_ffn=m.moe.ffn, topk=m.moe.topk)
