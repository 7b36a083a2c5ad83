"""ATP's layer on a 2-D DeviceMesh(d1, d2) inside the TP group (paper 004), from the dataflow
tables in ``layers/atp_linear.py``, ``atp_attention.py`` and ``atp_norm.py``."""
from __future__ import annotations

from .ops import GPT2, Collective, Compute, LayerDescription, LayerVariant, ModelingError, backward_of


def atp_2d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int, d1: int,
                     d2: int, bytes_per_element: int = 2, chunks: int = 1,
                     variant: LayerVariant = GPT2) -> LayerDescription:
    """ATP's layer on DeviceMesh(d1, d2): hidden states ``[s, b, h/d2]`` between layers.

    Forward: LN partial sums -> 2 tiny all-reduces (mean, variance) on axis 2 -> QKV (column-first,
    f1: AR axis 2) -> own heads' core attention -> all-gather of heads on axis 2 -> proj (row-first,
    f2: AR axis 1) -> residual + LN -> fc1 (f3: AR axis 2) -> GeLU + fc2 (f4: AR axis 1).
    Backward runs the conjugate collectives (column-first dX on axis 1, row-first dX on axis 2,
    the head split's all-gather, the LN statistics' all-reduces).
    ``variant``: QKV's output is the queries plus a key and a value per group (GQA), fc1's is
    ``[gate_i; up_i]`` per axis-1 part (SwiGLU: 2 x ffn), RMSNorm all-reduces one statistic;
    RoPE and QK-norm work on the rank's own heads (element-wise, no collective; the q/k norms
    are replicated).
    ``chunks`` (``--atp-chunks``, §4.1): the four linears' forward all-reduces run as that many
    all-reduces of one chunk each, launched while the next chunk's GEMM runs.
    """
    n = d1 * d2
    if hidden % n or heads % n or ffn % d1 or hidden % d2:
        raise ModelingError(f"ATP mesh {d1}x{d2}: hidden {hidden}, heads {heads} must be divisible by {n} "
                       f"and ffn {ffn} by {d1}")
    if variant.query_groups and variant.query_groups % n:
        raise ModelingError(f"ATP mesh {d1}x{d2}: {variant.query_groups} key/value groups must be "
                            f"divisible by {n} (each rank's heads see whole groups)")
    b, s, h, f, a, e = micro_batch, seq, hidden, ffn, heads, bytes_per_element
    tok = b * s
    stats = tok * 4  # one fp32 statistic per token
    qkv_n, fc1_n = variant.qkv_rows(h, a), variant.fc1_rows(f)

    def ar(name: str, axis: int, nbytes: int, kind: str = "all_reduce") -> Collective:
        return Collective(name=name, kind=kind, axis=f"mesh{axis}", group_size=d1 if axis == 1 else d2,
                          payload_bytes=int(nbytes))

    ln = lambda nm: Compute(name=nm, gemm_flops=0.0, elementwise_bytes=e * 3 * tok * h / d2)  # noqa: E731
    qkv = Compute(name="atp.qkv", gemm_flops=2 * tok * (h / d2) * (qkv_n / d1),
                  elementwise_bytes=e * (3 * tok * h / d2))
    core = Compute(name="atp.core", gemm_flops=0.0, attention_flops=4 * b * s * s * h / n,
                   elementwise_bytes=e * (3 * b * (a // n) * s * s
                                          + tok * variant.qk_elementwise_per_token(h, a) / n))
    proj = Compute(name="atp.proj", gemm_flops=2 * tok * (h / d1) * (h / d2))
    fc1 = Compute(name="atp.fc1", gemm_flops=2 * tok * (h / d2) * (fc1_n / d1), elementwise_bytes=e * 3 * tok * h / d2)
    fc2 = Compute(name="atp.fc2", gemm_flops=2 * tok * (f / d1) * (h / d2), elementwise_bytes=e * 2 * tok * f / d1)
    if chunks < 1 or micro_batch % chunks:
        raise ModelingError(f"--atp-chunks {chunks} must divide the micro-batch {micro_batch}")

    def chunked(name: str, axis: int, nbytes: float) -> tuple[Collective, ...]:
        if chunks == 1:
            return (ar(name, axis, nbytes),)
        return tuple(ar(f"{name}.c{i}", axis, nbytes / chunks) for i in range(chunks))

    def norm_stats(name: str) -> tuple[Collective, ...]:
        """LayerNorm's mean and variance, RMSNorm's mean square: partial sums over axis 2."""
        kinds = ("mean", "var") if variant.normalization == "LayerNorm" else ("var",)
        return tuple(ar(f"{name}.{k}", 2, stats) for k in kinds)

    fwd = (ln("atp.ln1"), *norm_stats("ln1"), qkv,
           *chunked("qkv.f1", 2, e * tok * qkv_n / d1), core,
           ar("core.gather", 2, e * tok * h / d1, "all_gather"), proj,
           *chunked("proj.f2", 1, e * tok * h / d2), ln("atp.ln2"), *norm_stats("ln2"),
           fc1, *chunked("fc1.f3", 2, e * tok * fc1_n / d1), fc2,
           *chunked("fc2.f4", 1, e * tok * h / d2))
    fwd = tuple(op for op in fwd if not (isinstance(op, Collective) and op.group_size == 1))
    bw = {c.name: backward_of(c) for c in (ln("atp.ln1"), qkv, core, proj, ln("atp.ln2"), fc1, fc2)}
    bwd = (bw["atp.fc2"], ar("fc2.bwd", 2, e * tok * f / d1), bw["atp.fc1"], ar("fc1.bwd", 1, e * tok * h / d2),
           bw["atp.ln2"], *norm_stats("ln2.bwd"), bw["atp.proj"],
           ar("proj.bwd", 2, e * tok * h / d1), bw["atp.core"],
           ar("core.bwd", 2, e * tok * qkv_n / d1, "all_gather"), bw["atp.qkv"], ar("qkv.bwd", 1, e * tok * h / d2),
           bw["atp.ln1"], *norm_stats("ln1.bwd"))
    bwd = tuple(op for op in bwd if not (isinstance(op, Collective) and op.group_size == 1))
    return LayerDescription(backend="atp", forward=fwd, backward=bwd)
