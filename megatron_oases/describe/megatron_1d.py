"""Megatron's 1-D TP layer, its output layer's weight gradient and Megatron's async pairings."""
from __future__ import annotations

from .ops import GPT2, Collective, Compute, LayerDescription, LayerVariant, backward_of


def megatron_1d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int,
                          tp: int, bytes_per_element: int = 4, sequence_parallel: bool = False,
                          variant: LayerVariant = GPT2) -> LayerDescription:
    """Megatron's TP layer: [LN, QKV, core, proj] g [LN, fc1, act, fc2] g (g = all-reduce);
    in backward the f before each block all-reduces the input gradient. ``variant``: GQA shrinks
    QKV's output to the queries plus a key and a value per group; SwiGLU doubles fc1's output
    and adds the gate's product to the element-wise work; RoPE and QK-norm each read and write
    the rank's queries and keys (element-wise; their FLOPs are negligible)."""
    if hidden % tp or heads % tp or ffn % tp:
        raise ValueError(f"hidden {hidden}, heads {heads}, ffn {ffn} must be divisible by TP {tp}")
    b, s, h, f, t = micro_batch, seq, hidden, ffn, tp
    act = b * s * h * bytes_per_element  # one full activation [s, b, h]
    ew_attn = bytes_per_element * (4 * b * s * h + 3 * b * (heads // t) * s * s  # LN + softmax
                                   + b * s * variant.qk_elementwise_per_token(h, heads) // t)
    # LN, residual, GeLU; a gated unit reads gate and up and writes their product
    ew_mlp = bytes_per_element * (4 * b * s * h + (5 if variant.gated else 2) * b * s * f // t)
    attn = Compute(name="attention",
                   gemm_flops=2 * b * s * h * (variant.qkv_rows(h, heads) // t) + 2 * b * s * (h // t) * h,
                   attention_flops=4 * b * s * s * h // t, elementwise_bytes=ew_attn)
    mlp = Compute(name="mlp", gemm_flops=2 * b * s * h * (variant.fc1_rows(f) // t) + 2 * b * s * (f // t) * h,
                  elementwise_bytes=ew_mlp)
    if t == 1:
        return LayerDescription(backend="megatron", forward=(attn, mlp),
                                backward=(backward_of(mlp), backward_of(attn)))
    if sequence_parallel:
        # Megatron's SP also re-gathers each column-parallel input in backward for the weight
        # gradient; not described until it can be checked against a real layer (needs Apex/TE
        # norms, since Megatron's torch LayerNorm refuses SP).
        raise NotImplementedError("sequence-parallel layer description is not written yet")
    fwd = (attn,
           Collective(name="attention.g", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act),
           mlp,
           Collective(name="mlp.g", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act))
    # Backward: g is the identity; the f before each block all-reduces dX of its input.
    bwd = (backward_of(mlp),
           Collective(name="mlp.f.bwd", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act),
           backward_of(attn),
           Collective(name="attention.f.bwd", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act))
    return LayerDescription(backend="megatron", forward=fwd, backward=bwd)


STOCK_ASYNC_DGRAD = {"attention.f.bwd": "attention.wgrad", "mlp.f.bwd": "mlp.wgrad"}
"""Stock Megatron's input-gradient all-reduces that run async beside a weight-gradient GEMM."""
OUTPUT_ASYNC_DGRAD = {"logits.f.bwd": "logits.wgrad"}
"""The output layer (Megatron's column-parallel linear whatever the layers' backend or schedule)
does the same: its input-gradient all-reduce runs beside its weight gradient."""


def output_wgrad(*, b: int, s: int, h: int, v: int, t: int, e: int) -> Compute:
    """The weight gradient of the output layer (``[v/t, h]``, no bias) alone."""
    out = v // t
    return Compute(name=OUTPUT_ASYNC_DGRAD["logits.f.bwd"], gemm_flops=2.0 * b * s * h * out,
                   elementwise_bytes=e * (b * s * (h + out) + h * out))


def column_wgrad(event: str, *, b: int, s: int, h: int, heads: int, f: int, t: int, e: int,
                 variant: LayerVariant = GPT2) -> Compute:
    """The weight gradient of a Megatron block's column-parallel linear (QKV or fc1) alone."""
    out = variant.qkv_rows(h, heads) // t if event == "attention.wgrad" else variant.fc1_rows(f) // t
    return Compute(name=event, gemm_flops=2.0 * b * s * h * out, elementwise_bytes=e * (b * s * (h + out) + h * out))
