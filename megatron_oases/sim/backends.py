"""TP backends as the simulator sees them: the layer description, its groups, parameters, activations.

Megatron 1-D comes from ``layers/description.py`` (the description the executors and the planner
read). ATP's 2-D mesh layer is described here, from the dataflow tables in ``layers/atp_linear.py``,
``atp_attention.py`` and ``atp_norm.py``; it belongs next to ``megatron_1d_gpt_layer`` once the
layers' owner adopts it (same dataclasses, so moving it is a cut and paste).

Quantities are per rank and per (sub-)batch ``b``; FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

from ..layers.description import Collective, Compute, LayerDescription, megatron_1d_gpt_layer
from .device_model import SimError

BACKENDS = ("megatron", "atp")


def atp_2d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int, d1: int,
                     d2: int, bytes_per_element: int = 2) -> LayerDescription:
    """ATP's layer on DeviceMesh(d1, d2): hidden states ``[s, b, h/d2]`` between layers.

    Forward: LN partial sums -> 2 tiny all-reduces (mean, variance) on axis 2 -> QKV (column-first,
    f1: AR axis 2) -> own heads' core attention -> all-gather of heads on axis 2 -> proj (row-first,
    f2: AR axis 1) -> residual + LN -> fc1 (f3: AR axis 2) -> GeLU + fc2 (f4: AR axis 1).
    Backward runs the conjugate collectives (column-first dX on axis 1, row-first dX on axis 2,
    the head split's all-gather, the LN statistics' all-reduces).
    """
    n = d1 * d2
    if hidden % n or heads % n or ffn % d1 or hidden % d2:
        raise SimError(f"ATP mesh {d1}x{d2}: hidden {hidden}, heads {heads} must be divisible by {n} "
                       f"and ffn {ffn} by {d1}")
    b, s, h, f, a, e = micro_batch, seq, hidden, ffn, heads, bytes_per_element
    tok = b * s
    stats = tok * 4  # one fp32 statistic per token

    def ar(name: str, axis: int, nbytes: int, kind: str = "all_reduce") -> Collective:
        return Collective(name=name, kind=kind, axis=f"mesh{axis}", group_size=d1 if axis == 1 else d2,
                          payload_bytes=int(nbytes))

    ln = lambda nm: Compute(name=nm, gemm_flops=0.0, elementwise_bytes=e * 3 * tok * h / d2)  # noqa: E731
    qkv = Compute(name="atp.qkv", gemm_flops=2 * tok * (h / d2) * (3 * h / d1),
                  elementwise_bytes=e * (3 * tok * h / d2))
    core = Compute(name="atp.core", gemm_flops=0.0, attention_flops=4 * b * s * s * h / n,
                   elementwise_bytes=e * 3 * b * (a // n) * s * s)
    proj = Compute(name="atp.proj", gemm_flops=2 * tok * (h / d1) * (h / d2))
    fc1 = Compute(name="atp.fc1", gemm_flops=2 * tok * (h / d2) * (f / d1), elementwise_bytes=e * 3 * tok * h / d2)
    fc2 = Compute(name="atp.fc2", gemm_flops=2 * tok * (f / d1) * (h / d2), elementwise_bytes=e * 2 * tok * f / d1)
    fwd = (ln("atp.ln1"), ar("ln1.mean", 2, stats), ar("ln1.var", 2, stats), qkv,
           ar("qkv.f1", 2, e * tok * 3 * h / d1), core, ar("core.gather", 2, e * tok * h / d1, "all_gather"),
           proj, ar("proj.f2", 1, e * tok * h / d2), ln("atp.ln2"), ar("ln2.mean", 2, stats),
           ar("ln2.var", 2, stats), fc1, ar("fc1.f3", 2, e * tok * f / d1), fc2, ar("fc2.f4", 1, e * tok * h / d2))
    fwd = tuple(op for op in fwd if not (isinstance(op, Collective) and op.group_size == 1))
    bw = {c.name: _backward_of(c) for c in (ln("atp.ln1"), qkv, core, proj, ln("atp.ln2"), fc1, fc2)}
    bwd = (bw["atp.fc2"], ar("fc2.bwd", 2, e * tok * f / d1), bw["atp.fc1"], ar("fc1.bwd", 1, e * tok * h / d2),
           bw["atp.ln2"], ar("ln2.bwd.mean", 2, stats), ar("ln2.bwd.var", 2, stats), bw["atp.proj"],
           ar("proj.bwd", 2, e * tok * h / d1), bw["atp.core"],
           ar("core.bwd", 2, e * tok * 3 * h / d1, "all_gather"), bw["atp.qkv"], ar("qkv.bwd", 1, e * tok * h / d2),
           bw["atp.ln1"], ar("ln1.bwd.mean", 2, stats), ar("ln1.bwd.var", 2, stats))
    bwd = tuple(op for op in bwd if not (isinstance(op, Collective) and op.group_size == 1))
    return LayerDescription(backend="atp", forward=fwd, backward=bwd)


def _backward_of(c: Compute) -> Compute:
    return Compute(name=f"{c.name}.bwd", gemm_flops=2 * c.gemm_flops,
                   attention_flops=2 * c.attention_flops, elementwise_bytes=2 * c.elementwise_bytes)


def layer_description(*, backend: str, mesh: tuple[int, int] | None, micro_batch: int, seq: int,
                      hidden: int, heads: int, ffn: int, tp: int, bytes_per_element: int) -> LayerDescription:
    if backend == "megatron":
        return megatron_1d_gpt_layer(micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn,
                                     tp=tp, bytes_per_element=bytes_per_element)
    if backend == "atp":
        assert mesh is not None
        return atp_2d_gpt_layer(micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn,
                                d1=mesh[0], d2=mesh[1], bytes_per_element=bytes_per_element)
    raise SimError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")


def axis_ranks(axis: str, tp_ranks: tuple[int, ...], mesh: tuple[int, int] | None) -> tuple[int, ...]:
    """The group of the representative (TP position 0) on ``axis``: tp, mesh1 (stride d2), mesh2."""
    if axis == "tp":
        return tp_ranks
    d1, d2 = mesh or (len(tp_ranks), 1)
    if axis == "mesh2":
        return tp_ranks[:d2]
    if axis == "mesh1":
        return tp_ranks[::d2]
    raise SimError(f"unknown collective axis {axis!r}")


def layer_params(backend: str, h: int, f: int, t: int, mesh: tuple[int, int] | None) -> int:
    """Weights + biases + norms of one layer on one TP rank."""
    return sum(layer_param_tensors(backend, h, f, t, mesh))


def layer_param_tensors(backend: str, h: int, f: int, t: int, mesh: tuple[int, int] | None) -> tuple[int, ...]:
    """Sizes of one layer's parameter tensors on one TP rank (they sum to :func:`layer_params`):
    QKV, proj, fc1, fc2 weights and biases, two norms' weight and bias. The optimizer and the
    gradient norm run tensor by tensor, so their cost depends on these sizes, not only on the sum."""
    if backend == "atp" and mesh is not None:
        d1, d2 = mesh
        return (3 * h * h // t, 3 * h // d1, h * h // t, h // d2, h * f // t, f // d1, h * f // t, h // d2,
                *(h // d2,) * 4)
    return (3 * h * h // t, 3 * h // t, h * h // t, h, h * f // t, f // t, h * f // t, h, *(h,) * 4)


def layer_activation_bytes(backend: str, *, b: int, s: int, h: int, a: int, f: int, t: int, e: int,
                           mesh: tuple[int, int] | None) -> float:
    """Bytes one layer keeps for backward per micro-batch (no recompute, no SP, unfused attention).

    Megatron 1-D (Korthikanti et al. 2022, Table 2, generalised to e-byte elements and any FFN):
    replicated LN1/LN2/QKV/fc1 inputs (4 sbh elements) and two dropout masks (2 sbh bytes);
    TP-sharded Q, K, V, proj input (4 sbh/t), GeLU and fc2 inputs (2 sbf/t); attention scores,
    softmax/dropout outputs (2 a s^2 b/t elements) and mask (a s^2 b/t bytes). With e = 2 and
    f = 4h this is sbh(10 + 24/t) + 5 a s^2 b / t.
    ATP: norms and residual-side tensors are sharded by d2, the proj input by d1, the FFN by d1,
    heads by d1 * d2.
    """
    tok = b * s
    if backend == "atp" and mesh is not None:
        d1, d2 = mesh
        n = d1 * d2
        return (tok * (e * (3 * h / d2 + 3 * h / n + h / d1 + 2 * f / d1) + 2 * h / d2)
                + a * s * s * b / n * (2 * e + 1))
    return tok * (e * 4 * h + 2 * h + e * (4 * h + 2 * f) / t) + a * s * s * b / t * (2 * e + 1)


def layer_input_bytes(backend: str, *, b: int, s: int, h: int, e: int, mesh: tuple[int, int] | None) -> float:
    """One [s, b, h] hidden state as a rank holds it (sharded by d2 under ATP)."""
    d2 = mesh[1] if backend == "atp" and mesh is not None else 1
    return b * s * h * e / d2
