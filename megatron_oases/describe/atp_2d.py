"""ATP's layer on a 2-D DeviceMesh(d1, d2) inside the TP group (paper 004), from the dataflow
tables in ``layers/atp_linear.py``, ``atp_attention.py`` and ``atp_norm.py``."""
from __future__ import annotations

from .ops import Collective, Compute, LayerDescription, ModelingError, backward_of


def atp_2d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int, d1: int,
                     d2: int, bytes_per_element: int = 2, chunks: int = 1) -> LayerDescription:
    """ATP's layer on DeviceMesh(d1, d2): hidden states ``[s, b, h/d2]`` between layers.

    Forward: LN partial sums -> 2 tiny all-reduces (mean, variance) on axis 2 -> QKV (column-first,
    f1: AR axis 2) -> own heads' core attention -> all-gather of heads on axis 2 -> proj (row-first,
    f2: AR axis 1) -> residual + LN -> fc1 (f3: AR axis 2) -> GeLU + fc2 (f4: AR axis 1).
    Backward runs the conjugate collectives (column-first dX on axis 1, row-first dX on axis 2,
    the head split's all-gather, the LN statistics' all-reduces).
    ``chunks`` (``--atp-chunks``, §4.1): the four linears' forward all-reduces run as that many
    all-reduces of one chunk each, launched while the next chunk's GEMM runs.
    """
    n = d1 * d2
    if hidden % n or heads % n or ffn % d1 or hidden % d2:
        raise ModelingError(f"ATP mesh {d1}x{d2}: hidden {hidden}, heads {heads} must be divisible by {n} "
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
    if chunks < 1 or micro_batch % chunks:
        raise ModelingError(f"--atp-chunks {chunks} must divide the micro-batch {micro_batch}")

    def chunked(name: str, axis: int, nbytes: float) -> tuple[Collective, ...]:
        if chunks == 1:
            return (ar(name, axis, nbytes),)
        return tuple(ar(f"{name}.c{i}", axis, nbytes / chunks) for i in range(chunks))

    fwd = (ln("atp.ln1"), ar("ln1.mean", 2, stats), ar("ln1.var", 2, stats), qkv,
           *chunked("qkv.f1", 2, e * tok * 3 * h / d1), core,
           ar("core.gather", 2, e * tok * h / d1, "all_gather"), proj,
           *chunked("proj.f2", 1, e * tok * h / d2), ln("atp.ln2"), ar("ln2.mean", 2, stats),
           ar("ln2.var", 2, stats), fc1, *chunked("fc1.f3", 2, e * tok * f / d1), fc2,
           *chunked("fc2.f4", 1, e * tok * h / d2))
    fwd = tuple(op for op in fwd if not (isinstance(op, Collective) and op.group_size == 1))
    bw = {c.name: backward_of(c) for c in (ln("atp.ln1"), qkv, core, proj, ln("atp.ln2"), fc1, fc2)}
    bwd = (bw["atp.fc2"], ar("fc2.bwd", 2, e * tok * f / d1), bw["atp.fc1"], ar("fc1.bwd", 1, e * tok * h / d2),
           bw["atp.ln2"], ar("ln2.bwd.mean", 2, stats), ar("ln2.bwd.var", 2, stats), bw["atp.proj"],
           ar("proj.bwd", 2, e * tok * h / d1), bw["atp.core"],
           ar("core.bwd", 2, e * tok * 3 * h / d1, "all_gather"), bw["atp.qkv"], ar("qkv.bwd", 1, e * tok * h / d2),
           bw["atp.ln1"], ar("ln1.bwd.mean", 2, stats), ar("ln1.bwd.var", 2, stats))
    bwd = tuple(op for op in bwd if not (isinstance(op, Collective) and op.group_size == 1))
    return LayerDescription(backend="atp", forward=fwd, backward=bwd)
