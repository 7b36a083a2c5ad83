"""Bytes a planner block needs: optimizer states per parameter, what it saves for backward, and
its backward working set (``PlanModel`` in, numbers out; read by the families and the cost
model)."""
from __future__ import annotations

from .model import PlanModel


def state_bytes_per_param(m: PlanModel, shard: int) -> float:
    """Weights (e) + fp32 main grads (4) + Adam m, v (8) + fp32 master copy when e = 2 (4), the
    optimizer part divided by ``shard`` (distributed optimizer); as ``sim.memory``."""
    e = m.bytes_per_element
    return e + 4 + ((4 if e == 2 else 0) + 8) / shard


def block_activation_bytes(m: PlanModel, kind: str, samples: int, degree: int) -> float:
    """Bytes a block keeps for backward without recompute (Korthikanti et al. 2022, Table 2,
    split at the all-reduce; e-byte elements): attention keeps LN1 and QKV inputs (2 e h), a
    dropout mask (h), Q, K, V, proj input (4 e h / d) per token plus scores, softmax and their
    mask (a s^2 b (2e + 1) / d); MLP keeps LN2 and fc1 inputs (2 e h), a mask (h), GeLU and fc2
    inputs (2 e f / d)."""
    e, h, f, s, a = m.bytes_per_element, m.hidden_size, m.ffn_hidden_size, m.seq_length, m.num_attention_heads
    tok = samples * s
    if kind == "attention":
        return tok * (2 * e * h + h + 4 * e * h / degree) + a * s * s * samples / degree * (2 * e + 1)
    return tok * (2 * e * h + h + 2 * e * f / degree)


def block_memory(m: PlanModel, kind: str, samples: int, degree: int) -> tuple[float, float]:
    """(saved bytes per micro-batch, backward working set) of one block on ``samples`` samples.

    Recompute (Oases fine-grained): attention saves its input and its all-reduce output, MLP its
    all-reduce output (3 [s, b, h] tensors per layer, as ``sim.memory``); while a block runs
    backward its recomputed activations exist, plus the output and input gradients (2 e s b h).
    Without recompute the full activations are saved and the working set is the two gradients.
    """
    one = samples * m.seq_length * m.hidden_size * m.bytes_per_element
    full = block_activation_bytes(m, kind, samples, degree)
    if m.recompute:
        return (2 if kind == "attention" else 1) * one, full + 2 * one
    return full, 2 * one
