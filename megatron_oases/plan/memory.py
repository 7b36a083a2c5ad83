"""Bytes a planner block needs: optimizer states per parameter, what it saves for backward, and
its backward working set (``PlanModel`` in, numbers out; read by the families and the cost
model)."""
from __future__ import annotations

from megatron_oases.describe.optimizer import state_bytes_per_param as model_state_bytes
from megatron_oases.describe.planned import planned_block_saved_bytes
from megatron_oases.describe.saved import block_saved_bytes, layer_saved_bytes
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
    fused core attention (``GPTShape.core_attention``) no s x s tensor, as ``sim.core.memory``."""
    return block_saved_bytes(kind, b=samples, s=m.seq_length, h=m.hidden_size,
                             a=m.num_attention_heads, f=m.ffn_hidden_size, t=degree,
                             e=m.bytes_per_element, hidden_dropout=m.hidden_dropout > 0,
                             attention_dropout=m.attention_dropout > 0, variant=m.variant,
                             core_attention=m.core_attention)


def _sp_block_memory(m: PlanModel, samples: int, degree: int) -> float:
    """Saved bytes of one block under sequence parallelism: half the SP layer's
    (``describe.saved.layer_saved_bytes``, CUDA kernels; the planner's recompute is Oases'
    fine-grained one). The working set is the same two gradients as without SP (an upper bound)."""
    layer = layer_saved_bytes(schedule="oases" if m.sub_batches > 1 else "stock", recompute=m.recompute,
                              b=samples, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                              f=m.ffn_hidden_size, t=degree, e=m.bytes_per_element,
                              hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
                              variant=m.variant, sequence_parallel=True, core_attention=m.core_attention)
    return layer / 2


def block_memory(m: PlanModel, kind: str, samples: int, degree: int) -> tuple[float, float]:
    """(saved bytes per micro-batch, backward working set) of one block on ``samples`` samples.

    Recompute (Oases fine-grained): attention saves its input and its all-reduce output, MLP its
    all-reduce output (3 [s, b, h] tensors per layer, as ``sim.core.memory``); while a block runs
    backward its recomputed activations exist, plus the output and input gradients (2 e s b h).
    Without recompute the full activations are saved (under the Oases executor also its step
    boundary: ``describe.planned.planned_block_saved_bytes``, the simulator's too) and the working
    set is the two gradients.
    """
    one = samples * m.seq_length * m.hidden_size * m.bytes_per_element
    if m.sequence_parallel and degree > 1:
        return _sp_block_memory(m, samples, degree), 2 * one
    if m.recompute:
        return (2 if kind == "attention" else 1) * one, block_activation_bytes(m, kind, samples, degree) + 2 * one
    return planned_block_saved_bytes(kind, samples=samples, degree=degree, tp=m.tp, seq=m.seq_length,
                                     hidden=m.hidden_size, heads=m.num_attention_heads, ffn=m.ffn_hidden_size,
                                     bytes_per_element=m.bytes_per_element, oases=m.sub_batches > 1,
                                     variant=m.variant, hidden_dropout=m.hidden_dropout > 0,
                                     attention_dropout=m.attention_dropout > 0,
                                     core_attention=m.core_attention), 2 * one
