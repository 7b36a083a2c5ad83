"""Model FLOPs per iteration, by the formula Megatron-LM's training loop reports TFLOP/s with.

12 B s L h^2 [ (1 + G/H + s/h) q + f/h * g + V / (2 L h) ] for a dense GPT: B global batch,
s sequence, L layers, h hidden, H heads, G query groups, q = (kv_channels * H) / h, f FFN size,
g = 3/2 for gated (SwiGLU) MLPs, V padded vocabulary. Forward + backward, no recompute counted
(Megatron reports model FLOPs, so recomputation shows up as lower TFLOP/s, not more FLOPs).

``recompute=True`` counts a full activation recompute as well: the transformer layers' forward
runs twice (x 4/3 on the layer terms; the logits are not recomputed), 96 B s L h^2 (1 + s/6h +
V/16Lh) for a GPT -- the count the 2021 Megatron-LM A100 scaling table reports TFLOP/s with
(docs/sim_validation.md).
"""
from __future__ import annotations


def gpt_flops_per_iteration(*, global_batch_size: int, seq_length: int, num_layers: int,
                            hidden_size: int, num_attention_heads: int, ffn_hidden_size: int,
                            padded_vocab_size: int, num_query_groups: int | None = None,
                            kv_channels: int | None = None, gated_mlp: bool = False,
                            recompute: bool = False) -> float:
    groups = num_query_groups or num_attention_heads
    kv = kv_channels or hidden_size // num_attention_heads
    q_ratio = kv * num_attention_heads / hidden_size
    gated = 1.5 if gated_mlp else 1.0
    layers = ((1 + groups / num_attention_heads + seq_length / hidden_size) * q_ratio
              + ffn_hidden_size / hidden_size * gated) * (4.0 / 3.0 if recompute else 1.0)
    return (12.0 * global_batch_size * seq_length * num_layers * hidden_size ** 2 * (
        layers + padded_vocab_size / (2.0 * num_layers * hidden_size)))
