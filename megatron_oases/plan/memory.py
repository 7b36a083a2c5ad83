"""Bytes a planner block needs: optimizer states per parameter, what it saves for backward, and
its backward working set (``PlanModel`` in, numbers out; read by the families and the cost
model)."""
from __future__ import annotations

from megatron_oases.describe.optimizer import state_bytes_per_param as model_state_bytes
from megatron_oases.describe.planned import planned_block_saved_bytes, reshard_saved_bytes
from megatron_oases.describe.saved import (block_saved_bytes, checkpoint_rng_state_bytes, layer_saved_bytes,
                                          redraw_state_bytes)
from megatron_oases.describe.split import recompute_boundaries
from .model import PlanModel


def state_bytes_per_param(m: PlanModel, shard: int) -> float:
    """Model-state bytes of one parameter (weights, gradient buffer, optimizer states; the last
    divided by ``shard``, the distributed optimizer's): ``describe.optimizer``, as the simulator."""
    return sum(model_state_bytes(bytes_per_element=m.bytes_per_element, grad_reduce_bytes=m.grad_reduce_bytes,
                                 shard=shard))


def block_activation_bytes(m: PlanModel, kind: str, samples: int, degree: int) -> float:
    """Bytes a block keeps for backward without recompute under the stock executor: Megatron's
    local layer split at its all-reduces (``describe.saved.block_saved_bytes``: attention keeps
    LN1 and QKV inputs, Q, K, V, the proj input, softmax output, causal mask and, with dropout,
    its masks; MLP keeps LN2 and fc1 inputs, GeLU and fc2 inputs and its dropout mask). Under a
    fused core attention (``GPTShape.core_attention``) no s x s tensor, as ``sim.core.memory``;
    under selective recompute none either (the core attention's checkpointed inputs instead)."""
    return block_saved_bytes(kind, b=samples, s=m.seq_length, h=m.hidden_size,
                             a=m.num_attention_heads, f=m.ffn_hidden_size, t=degree,
                             e=m.bytes_per_element, hidden_dropout=m.hidden_dropout > 0,
                             attention_dropout=m.attention_dropout > 0, variant=m.variant,
                             core_attention=m.core_attention, recompute_core_attention=m.selective_recompute)


def _sp_block_memory(m: PlanModel, samples: int, degree: int) -> float:
    """Saved bytes of one block under sequence parallelism: half the SP layer's
    (``describe.saved.layer_saved_bytes``, CUDA kernels, the run's recompute). The working set is
    the same two gradients as without SP (an upper bound)."""
    layer = layer_saved_bytes(schedule="oases" if m.sub_batches > 1 else "stock", recompute=m.recompute,
                              fine_grained=m.fine_grained, recompute_core_attention=m.selective_recompute,
                              b=samples, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                              f=m.ffn_hidden_size, t=degree, e=m.bytes_per_element,
                              hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
                              variant=m.variant, sequence_parallel=True, core_attention=m.core_attention)
    return layer / 2


def recomputed_block_bytes(m: PlanModel, kind: str, hidden_state: float, degree: int) -> float:
    """What a block at TP ``degree`` keeps under full recompute: its part of the layer's boundaries
    (``describe.split.recompute_boundaries``, ``hidden_state`` bytes each): the layer input on the
    attention block and, fine-grained at degree > 1, each block its forward all-reduce output;
    under the Oases executor with dropout the generator states of its dropout sites
    (``describe.saved.redraw_state_bytes``), under Megatron's checkpoint the layer's snapshot of the
    generators on its attention block (``describe.saved.checkpoint_rng_state_bytes``), as ``sim``
    and ``describe.saved``."""
    layer_input = recompute_boundaries(fine_grained=False, tp=degree)
    outputs = recompute_boundaries(fine_grained=m.fine_grained, tp=degree) - layer_input
    if m.sub_batches > 1:
        states = redraw_state_bytes((kind,), hidden_dropout=m.hidden_dropout > 0,
                                    attention_dropout=m.attention_dropout > 0, core_attention=m.core_attention)
    else:  # Megatron's checkpoint of the layer, which starts at its attention block
        states = checkpoint_rng_state_bytes(sequence_parallel=False, attention_dropout=m.attention_dropout > 0,
                                            core_attention=m.core_attention) if kind == "attention" else 0.0
    return hidden_state * ((layer_input if kind == "attention" else 0) + outputs / 2) + states


def block_memory(m: PlanModel, kind: str, samples: int, degree: int) -> tuple[float, float]:
    """(saved bytes per micro-batch, backward working set) of one block on ``samples`` samples.

    Full recompute (``PlanModel.recompute``): the block keeps its part of the layer's recompute
    boundaries (:func:`recomputed_block_bytes`); while it runs backward its recomputed activations
    exist, plus the output and input gradients (2 e s b h). Otherwise its activations are saved
    (selective recompute: without the core attention's s^2 tensors; under the Oases executor also
    its step boundary: ``describe.planned.planned_block_saved_bytes``, the simulator's too) and the
    working set is the two gradients (selective: plus the core attention it reruns).
    """
    one = samples * m.seq_length * m.hidden_size * m.bytes_per_element
    if m.sequence_parallel and degree > 1:
        return _sp_block_memory(m, samples, degree), 2 * one
    if m.recompute:
        return recomputed_block_bytes(m, kind, one, degree), block_activation_bytes(m, kind, samples, degree) + 2 * one
    kw = dict(samples=samples, degree=degree, tp=m.tp, seq=m.seq_length, hidden=m.hidden_size,
              heads=m.num_attention_heads, ffn=m.ffn_hidden_size, bytes_per_element=m.bytes_per_element,
              oases=m.sub_batches > 1, variant=m.variant, hidden_dropout=m.hidden_dropout > 0,
              attention_dropout=m.attention_dropout > 0, core_attention=m.core_attention,
              expert_parallel=m.ep if m.moe is not None else 1)
    kept = planned_block_saved_bytes(kind, **kw, recompute_core_attention=m.selective_recompute)
    rerun = planned_block_saved_bytes(kind, **kw) - kept  # one core attention's tensors at a time
    return kept, 2 * one + rerun


def reshard_kept_bytes(m: PlanModel, src: int, dst: int) -> float:
    """Bytes one micro-batch keeps at an edge from a block of degree ``src`` into one of degree
    ``dst`` (``describe.planned.reshard_saved_bytes``, the simulator's too: under the Oases
    executor the reshard's output), a term of the pair that the planner's problem carries on its
    edges (``PlanProblem.edge_mem``)."""
    return reshard_saved_bytes(src, dst, tp=m.tp, micro_batch=m.micro_batch_size, seq=m.seq_length,
                               hidden=m.hidden_size, bytes_per_element=m.bytes_per_element, oases=m.sub_batches > 1)
