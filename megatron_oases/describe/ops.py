"""What a TP layer computes and communicates: compute segments separated by collectives.

Per ../shared/design.md, the executors (which launch the collectives), the planner's cost model
(which prices them) and the simulator (which places them on streams) all read these descriptions;
if they disagree about what a layer does, the bug is in ``megatron_oases.describe``. Pure Python
(no torch), so the planner and the simulator run anywhere.

Quantities are per rank and per (sub-)batch; FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

import dataclasses
from typing import Union


LOOP_EVENTS = ("loop.microbatch", "loop.layer")
"""The reference trainer's host work per micro-batch outside the described events: Megatron's
schedule, the loss function, DDP's gradient hooks, autograd's bookkeeping. A fixed part per
micro-batch and a part per layer, measured by a trainer-flags profile
(``sim.calibrate.loop_overhead``) and priced 0 where it was not measured (the analytical model's
host costs are the software stack's, ``pricing.stack``)."""


def is_loop_event(name: str) -> bool:
    """Whether the event named ``name`` (or keyed ``compute:<name>[...]``) is a loop event."""
    return name.split(":", 1)[-1].split("[", 1)[0] in LOOP_EVENTS


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
    score_bytes: float = 0.0
    """The part of ``elementwise_bytes`` that reads or writes the s x s attention scores (mask,
    softmax, their dropout): a fused (flash) attention kernel keeps them on chip."""
    kernels: int = 0
    """CUDA kernels the segment launches in eager PyTorch (0: unknown, counted as 1); the device
    model's dispatch floor (``DeviceModel.dispatch_us``)."""
    framework_share: float = 1.0
    """The share of its block's framework host cost (``SoftwareStack.layer_framework_us``: the
    module calls, hooks and autograd around an attention or MLP block) this event carries: 1 for
    Megatron's segments (one per block), 1 / n for each of the n segments a layer cut by its
    collectives makes of one block (ATP, 3-D), so cutting a block does not multiply its cost."""
    gemms: tuple[tuple[int, int, int], ...] = ()
    """The segment's GEMMs as ``(M, N, K)``: an ``M x N`` output reduced over ``K`` (2 M N K
    FLOPs each; together ``gemm_flops``). Empty: shapes unknown (the device model then prices
    ``gemm_flops`` without tile / wave quantization)."""
    optimizer_params: float = 0.0
    """Parameters an optimizer step updates here: the Adam update's traffic per parameter is the
    software stack's (``pricing.stack.SoftwareStack.adam_bytes_per_param``), not in
    ``elementwise_bytes``."""

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.attention_flops


def ring_factor(kind: str, n: int) -> float:
    """Share of a collective's payload each of its ``n`` ranks sends with a ring algorithm:
    ``2(n-1)/n`` for an all-reduce (a reduce-scatter then an all-gather), ``(n-1)/n`` for an
    all-gather or a reduce-scatter (and, as the per-rank average of a pipelined chain, for the 3-D
    broadcast / reduce; for an all-to-all, the share of its payload that leaves the rank). The one home of the formula: the descriptions' wire bytes, the runtime's
    ``CommCounter``, the device model's ``collective_ms``, the profiler's scaling and the scripts
    read it (ATP's Eq. 4, ``plan.atp_mesh.rabenseifner_alg_bandwidth``, is its inverse in the
    paper's form). It lives here, the lowest layer, because ``describe`` may import nothing above it."""
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """A collective on one group (``axis``) between segments."""

    name: str
    kind: str
    """all_reduce | all_gather | reduce_scatter | all_to_all (MoE's dispatch: ``describe.moe``)."""
    axis: str
    """The group it runs on: "tp" for Megatron 1-D; mesh axes / cube directions for other backends."""
    group_size: int
    payload_bytes: int
    """Bytes of the full logical tensor (all-reduce input, all-gather output, reduce-scatter input)."""
    blocking: bool = False
    """The issuing rank waits for it where it is issued (a host sync: MoE's token counts), so
    under the Oases executor it overlaps nothing of the other sub-batch's: the simulator runs it
    on the compute stream."""

    @property
    def wire_bytes_per_rank(self) -> float:
        """Ring-algorithm bytes each rank sends (as ``CommCounter`` records them)."""
        return ring_factor(self.kind, self.group_size) * self.payload_bytes

    @property
    def output_bytes(self) -> float:
        """Bytes of its result on one rank: what fine-grained recompute keeps so as not to issue it
        again (a reduce-scatter's 1 / n of its input; all-reduce, all-gather and all-to-all:
        the payload, an all-to-all's being what the rank receives in all)."""
        return self.payload_bytes / self.group_size if self.kind == "reduce_scatter" else float(self.payload_bytes)


Op = Union[Compute, Collective]


def holds_compute(op) -> bool:
    """Whether ``op`` occupies its rank's compute stream: a compute segment, or a collective the
    rank waits for where it issues it (``Collective.blocking``: MoE's token counts), which overlaps
    nothing. The simulator's timeline places events by it and the planner's lock-step prices such
    a collective with the compute it holds up (``plan.cost_model``), so both read one rule."""
    return isinstance(op, Compute) or bool(getattr(op, "blocking", False))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerDescription:
    backend: str
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    """In execution order; backward GEMM FLOPs are 2x forward (dgrad + wgrad)."""
    joins: tuple[int, ...] = ()
    """Positions in ``forward`` after which every sub-batch of the Oases split must have arrived
    before any goes on (a barrier: the MoE load-balancing loss needs the whole micro-batch
    routed, ``describe.moe``); none for a layer run whole."""

    def collectives(self, pass_: str = "forward") -> list[Collective]:
        return [op for op in getattr(self, pass_) if isinstance(op, Collective)]

    def computes(self, pass_: str = "forward") -> list[Compute]:
        return [op for op in getattr(self, pass_) if isinstance(op, Compute)]

    def flops(self, pass_: str = "forward") -> float:
        return sum(c.flops for c in self.computes(pass_))


class ModelingError(ValueError):
    """A description, price or simulation that cannot be made; one line naming the cause."""


def backward_gemms(gemms: tuple[tuple[int, int, int], ...]) -> tuple[tuple[int, int, int], ...]:
    """The backward GEMMs of forward ``(M, N, K)`` GEMMs (``Y[M, N] = X[M, K] W``): per GEMM the
    input gradient ``dX[M, K]`` (reduced over N) and the weight gradient ``dW[N, K]`` (over M)."""
    return tuple(g for m, n, k in gemms for g in ((m, k, n), (n, k, m)))


def backward_of(c: Compute) -> Compute:
    """A segment's backward: dgrad + wgrad GEMMs (2x), and twice the element-wise traffic."""
    return Compute(name=f"{c.name}.bwd", gemm_flops=2 * c.gemm_flops,
                   attention_flops=2 * c.attention_flops, elementwise_bytes=2 * c.elementwise_bytes,
                   score_bytes=2 * c.score_bytes, kernels=2 * c.kernels, gemms=backward_gemms(c.gemms),
                   framework_share=c.framework_share)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerVariant:
    """Which GPT layer: GPT-2's by default; Llama-family options change its shapes.

    ``query_groups``: key/value groups (None: one per head, no GQA); ``gated``: SwiGLU MLP (fc1
    computes gate and up, 2 x ffn rows); ``normalization``: LayerNorm or RMSNorm; ``rotary``:
    rotary embeddings on queries and keys (no parameters; the model then has no learned position
    embeddings); ``qk_norm``: Megatron's ``qk_layernorm``, a ``normalization`` over each head's
    query and key (head_dim features, weights replicated over TP)."""

    query_groups: int | None = None
    gated: bool = False
    normalization: str = "LayerNorm"
    bias: bool = True
    """Linears with bias (``--disable-bias-linear`` turns them off)."""
    rotary: bool = False
    rotary_percent: float = 1.0
    """The part of each head's dimension RoPE rotates (``--rotary-percent``)."""
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.rotary_percent <= 1.0 or (self.rotary_percent != 1.0 and not self.rotary):
            raise ValueError(f"rotary_percent {self.rotary_percent} must be in (0, 1], and 1 without rotary")

    @property
    def is_default(self) -> bool:
        return self == GPT2

    def qkv_rows(self, hidden: int, heads: int) -> int:
        """Output features of QKV: queries of every head plus a key and a value per group."""
        groups = self.query_groups or heads
        return hidden // heads * (heads + 2 * groups)

    def qk_rows(self, hidden: int, heads: int) -> int:
        """Features of the queries and keys (what RoPE and QK-norm work on)."""
        return hidden // heads * (heads + (self.query_groups or heads))

    def qk_elementwise_per_token(self, hidden: int, heads: int) -> int:
        """Elements RoPE and QK-norm read and write per token over the whole layer (each reads
        and writes the queries and keys); a backend divides by its split of the heads."""
        return 2 * self.qk_rows(hidden, heads) * (self.rotary + self.qk_norm)

    def rotary_dim(self, head_dim: int) -> int:
        """Features of a head RoPE rotates: Megatron's ``int(kv_channels * rotary_percent)``,
        rounded up to even (its frequency table repeats ``dim / 2`` frequencies)."""
        return -(-int(head_dim * self.rotary_percent) // 2) * 2 if self.rotary else 0

    def fc1_rows(self, ffn: int) -> int:
        """Output features of fc1 (gate and up under SwiGLU)."""
        return 2 * ffn if self.gated else ffn

    @property
    def mlp_saved_per_ffn(self) -> int:
        """Activations of width ffn the MLP keeps for backward, per token (measured on
        Megatron's layer): GeLU's input and output (2); SwiGLU's [gate; up], silu(gate) and
        their product (5)."""
        return 5 if self.gated else 2

    def position_params(self, seq: int, hidden: int) -> int:
        """Learned absolute position embeddings of the model (none under rotary embeddings)."""
        return 0 if self.rotary else seq * hidden

    def key(self) -> str:
        """Suffix of the event keys (empty for GPT-2's layer, so its profiles keep their keys)."""
        return ((f"_g{self.query_groups}" if self.query_groups else "")
                + ("_swiglu" if self.gated else "")
                + ("_rms" if self.normalization == "RMSNorm" else "")
                + ("" if self.bias else "_nobias")
                + (("_rope" + (f"{self.rotary_percent:g}" if self.rotary_percent != 1.0 else ""))
                   if self.rotary else "")
                + ("_qkn" if self.qk_norm else ""))


GPT2 = LayerVariant()
