"""Bytes a planner block needs: optimizer states per parameter, what it saves for backward, and
its backward working set (``PlanModel`` in, numbers out; read by the families and the cost
model)."""
from __future__ import annotations

from megatron_oases.describe.optimizer import state_bytes_per_param as model_state_bytes
from megatron_oases.describe.saved import block_saved_bytes, layer_saved_bytes, oases_kept_beyond_stock
from megatron_oases.describe.split import sub_batches_at
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
    boundary, ``describe.saved.oases_kept_beyond_stock``, at every degree of a TP group of more
    than one rank: a degree-1 block runs in the executor too, on one sub-batch) and the working
    set is the two gradients.
    """
    one = samples * m.seq_length * m.hidden_size * m.bytes_per_element
    if m.sequence_parallel and degree > 1:
        return _sp_block_memory(m, samples, degree), 2 * one
    full = block_activation_bytes(m, kind, samples, degree)
    if m.recompute:
        return (2 if kind == "attention" else 1) * one, full + 2 * one
    if m.sub_batches > 1 and m.tp > 1:  # the Oases executor's step boundary, one per block
        # a degree-1 block of a plan runs its share whole (one sub-batch) but in the executor all the
        # same: it keeps its boundary and builds nothing anew per sub-batch (tests/test_round_trip.py);
        # at TP 1 no executor runs (schedules/oases/options.oases_runs)
        full += oases_kept_beyond_stock(one, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                                        e=m.bytes_per_element, variant=m.variant,
                                        sub_batches=sub_batches_at(degree, oases=True),
                                        core_attention=m.core_attention,
                                        attention_dropout=m.attention_dropout > 0) / 2
    return full, 2 * one
