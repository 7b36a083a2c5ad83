"""A TP transformer layer as compute segments separated by collectives: described once.

Per ../shared/design.md, the executors (which launch the collectives), the planner's cost model
(which prices them) and the simulator (which places them on streams) all read this description.
If they disagree about what a layer does, the bug is here. Each backend contributes a function
returning a ``LayerDescription``; this module has Megatron's 1-D TP. A test checks it against the collectives a real Megatron-Core layer issues.

Quantities are per rank and per micro-batch; FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

import dataclasses
from typing import Union


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compute:
    """A run of local work between two collectives."""

    name: str
    gemm_flops: float
    """Matrix-multiply FLOPs on this rank (forward)."""
    attention_flops: float = 0.0
    """The s^2 part (QK^T and AV) on this rank, priced apart: its efficiency differs from GEMMs."""
    elementwise_bytes: float = 0.0
    """Bytes read + written by element-wise work (norms, activations, softmax, residual)."""

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.attention_flops


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """A collective on one group (``axis``) between segments."""

    name: str
    kind: str
    """all_reduce | all_gather | reduce_scatter."""
    axis: str
    """The group it runs on: "tp" for Megatron 1-D; mesh axes / cube directions for other backends."""
    group_size: int
    payload_bytes: int
    """Bytes of the full logical tensor (all-reduce input, all-gather output, reduce-scatter input)."""

    @property
    def wire_bytes_per_rank(self) -> float:
        """Ring-algorithm bytes each rank sends (as ``CommCounter`` records them)."""
        n = self.group_size
        factor = 2.0 * (n - 1) / n if self.kind == "all_reduce" else (n - 1) / n
        return factor * self.payload_bytes


Op = Union[Compute, Collective]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerDescription:
    backend: str
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    """In execution order; backward GEMM FLOPs are 2x forward (dgrad + wgrad)."""

    def collectives(self, pass_: str = "forward") -> list[Collective]:
        return [op for op in getattr(self, pass_) if isinstance(op, Collective)]

    def computes(self, pass_: str = "forward") -> list[Compute]:
        return [op for op in getattr(self, pass_) if isinstance(op, Compute)]

    def flops(self, pass_: str = "forward") -> float:
        return sum(c.flops for c in self.computes(pass_))


def megatron_1d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int,
                          tp: int, bytes_per_element: int = 4,
                          sequence_parallel: bool = False) -> LayerDescription:
    """Megatron's TP layer: [LN, QKV, core, proj] g [LN, fc1, act, fc2] g (g = all-reduce);
    in backward the f before each block all-reduces the input gradient."""
    if hidden % tp or heads % tp or ffn % tp:
        raise ValueError(f"hidden {hidden}, heads {heads}, ffn {ffn} must be divisible by TP {tp}")
    b, s, h, f, t = micro_batch, seq, hidden, ffn, tp
    act = b * s * h * bytes_per_element  # one full activation [s, b, h]
    ew_attn = bytes_per_element * (4 * b * s * h + 3 * b * (heads // t) * s * s)  # LN + softmax
    ew_mlp = bytes_per_element * (4 * b * s * h + 2 * b * s * f // t)  # LN, residual, GeLU
    attn = Compute(name="attention", gemm_flops=2 * b * s * h * (3 * h // t) + 2 * b * s * (h // t) * h,
                   attention_flops=4 * b * s * s * h // t, elementwise_bytes=ew_attn)
    mlp = Compute(name="mlp", gemm_flops=2 * 2 * b * s * h * (f // t), elementwise_bytes=ew_mlp)
    if t == 1:
        return LayerDescription(backend="megatron", forward=(attn, mlp),
                                backward=(_backward_of(mlp), _backward_of(attn)))
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
    bwd = (_backward_of(mlp),
           Collective(name="mlp.f.bwd", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act),
           _backward_of(attn),
           Collective(name="attention.f.bwd", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act))
    return LayerDescription(backend="megatron", forward=fwd, backward=bwd)


def _backward_of(c: Compute) -> Compute:
    return Compute(name=f"{c.name}.bwd", gemm_flops=2 * c.gemm_flops,
                   attention_flops=2 * c.attention_flops, elementwise_bytes=2 * c.elementwise_bytes)
