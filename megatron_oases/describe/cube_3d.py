"""The 3-D TP layer (Bian et al. 2021) on a p x p x p cube of ranks, from ``layers/linear3d.py``,
``tp3d_attention.py``, ``tp3d_mlp.py`` and ``tp3d_spec.py``.

Between layers a rank holds ``[s, b/p^2, h/p]`` (samples split by x and y, hidden by z). Every
GEMM (form C = A B^T, directions (a, x, c)) all-gathers its activation block in ``a`` and its
weight block in x, computes, and reduce-scatters the result in ``c`` (a <-> c swap y and z: the
§3.2 exchange; QKV and fc1 go y -> z, proj and fc2 z -> y). Its backward runs two other forms
(dA: gathers dC in c and W in x, reduce-scatters in a; dW: gathers dC in c and A in a,
reduce-scatters in x). Norm statistics are all-reduced in z (the hidden split). Vectors (biases,
norm weights) live on the cube diagonal: each use broadcasts a ``N/p^2`` chunk along the other
activation direction and all-gathers the ``N/p`` block in x; backward reduce-scatters in x and
reduces along that direction. Collective axes are ``cube_x``, ``cube_y``, ``cube_z``.

Quantities are per rank and per (sub-)batch ``b``; FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

from .atp_2d import mesh_segment, mesh_segment_kernels
from .layer_query import LayerQuery
from .layout import BACKEND_FLAG, Layout
from .megatron_1d import tp_split_refusal
from .ops import GPT2, Collective, LayerDescription, LayerVariant, ModelingError, backward_of
from .saved import mesh_layer_saved_bytes

_OTHER = {"y": "z", "z": "y"}


def cube_root(tp: int) -> int | None:
    """p when ``tp`` is p^3 (p >= 1), else None: the one test of "a cube", read by
    :func:`cube_side` and the runtime's ``parallel.cube.Cube``."""
    p = round(tp ** (1.0 / 3.0)) if tp > 0 else 0
    return p if p >= 1 and p ** 3 == tp else None


def cube_side(tp: int) -> int:
    """p for a TP group of p^3 ranks (p >= 2)."""
    p = cube_root(tp)
    if p is None or p < 2:
        raise ModelingError(f"--tp-backend 3d: 3-D tensor parallelism needs --tensor-model-parallel-size = p^3 "
                            f"with p >= 2 (8, 27, 64, ...); got {tp}")
    return p


STATS_BYTES = 4
"""Bytes of one norm statistic on the wire: ``LayerNorm3D`` computes and all-reduces its
statistics in fp32 whatever the activations' dtype (``layers/linear3d.py``; in fp16 the rsqrt's
backward overflowed)."""


def cube_3d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int, tp: int,
                      bytes_per_element: int = 2, variant: LayerVariant = GPT2, core_attention: str = "local",
                      attention_dropout: bool = False) -> LayerDescription:
    """A GPT layer on the cube of ``tp = p^3`` ranks: GPT-2's (LayerNorm, biased linears, GeLU
    MLP) or a ``variant`` (GQA widens QKV's output to queries plus a key and a value per group,
    SwiGLU fc1's to gate and up; RMSNorm has one statistic and no bias vector; without biases
    the linears move no bias vectors; RoPE and QK-norm are element-wise on the rank's heads, the
    q/k norms replicated, no collective). Each segment counts its kernels and its block's framework
    share as ATP's (``atp_2d.mesh_segment``: the same eager norms, biases and activation)."""
    refused = cube_3d_split_refusal(tp=tp, hidden=hidden, heads=heads, ffn=ffn, micro_batch=micro_batch,
                                    query_groups=variant.query_groups)
    if refused:
        raise ModelingError(refused)
    p = cube_side(tp)
    q = p * p
    b, s, h, f, a, e = micro_batch, seq, hidden, ffn, heads, bytes_per_element
    qkv_n, fc1_n = variant.qkv_rows(h, a), variant.fc1_rows(f)
    layer_norm = variant.normalization == "LayerNorm"
    tok = b * s  # tokens of the (sub-)batch; a rank's activation block is tok/p^2 x h/p

    def coll(name: str, direction: str, nbytes: float, kind: str) -> Collective:
        return Collective(name=name, kind=kind, axis=f"cube_{direction}", group_size=p,
                          payload_bytes=int(nbytes))

    def vector(name: str, n: int, col_dir: str, backward: bool = False) -> tuple[Collective, ...]:
        """A diagonal vector of size n applied to columns split by ``col_dir`` (Algorithm 7)."""
        d = _OTHER[col_dir]
        if backward:
            return (coll(f"{name}.rs", "x", e * n / p, "reduce_scatter"),
                    coll(f"{name}.reduce", d, e * n / q, "reduce"))
        return (coll(f"{name}.bcast", d, e * n / q, "broadcast"),
                coll(f"{name}.ag", "x", e * n / p, "all_gather"))

    def gemm(name: str, n_in: int, n_out: int, a_dir: str, backward: bool = False) -> tuple[Collective, ...]:
        """Collectives of Linear3D (C = A W^T) around its local GEMM; forward: (before, after)."""
        c_dir = _OTHER[a_dir]
        act_in, act_out, weight = e * tok * n_in / q, e * tok * n_out / q, e * n_out * n_in / q
        if backward:  # dA = dC W (c, x, a); dW = dC^T A (c, a, x)
            return (coll(f"{name}.dA.ag_dc", c_dir, act_out, "all_gather"),
                    coll(f"{name}.dA.ag_w", "x", weight, "all_gather"),
                    coll(f"{name}.dA.rs", a_dir, act_in, "reduce_scatter"),
                    coll(f"{name}.dW.ag_dc", c_dir, act_out, "all_gather"),
                    coll(f"{name}.dW.ag_a", a_dir, act_in, "all_gather"),
                    coll(f"{name}.dW.rs", "x", weight, "reduce_scatter"))
        return (coll(f"{name}.ag_a", a_dir, act_in, "all_gather"),
                coll(f"{name}.ag_w", "x", weight, "all_gather"),
                coll(f"{name}.rs", c_dir, act_out, "reduce_scatter"))

    def norm(name: str, backward: bool = False) -> tuple[Collective, ...]:
        stats = tuple(coll(f"{name}.{k}", "z", STATS_BYTES * tok / q, "all_reduce")
                      for k in (("mean", "var") if layer_norm else ("var",)))
        beta = vector(f"{name}.beta", h, "z", backward) if layer_norm else ()
        return stats + vector(f"{name}.gamma", h, "z", backward) + beta

    def bias(name: str, n: int, col_dir: str, backward: bool = False) -> tuple[Collective, ...]:
        return vector(name, n, col_dir, backward) if variant.bias else ()

    per = tok * h / p ** 3  # elements of one activation block
    kernels = mesh_segment_kernels(variant, bytes_per_element=e, core_attention=core_attention,
                                   attention_dropout=attention_dropout)
    seg = lambda name, **work: mesh_segment(name, kernels, **work)  # noqa: E731
    ln = lambda nm: seg(nm, gemm_flops=0.0, elementwise_bytes=e * 4 * per)  # noqa: E731
    qkv = seg("3d.qkv", gemm_flops=2 * tok * h * qkv_n / p ** 3, elementwise_bytes=e * 3 * per)
    core = seg("3d.core", gemm_flops=0.0, attention_flops=4 * b * s * s * h / p ** 3,
               elementwise_bytes=e * (3 * (b // q) * (a // p) * s * s
                                      + tok * variant.qk_elementwise_per_token(h, a) / p ** 3))
    proj = seg("3d.proj", gemm_flops=2 * tok * h * h / p ** 3, elementwise_bytes=e * 3 * per)
    fc1 = seg("3d.fc1", gemm_flops=2 * tok * h * fc1_n / p ** 3, elementwise_bytes=e * 3 * per)
    fc2 = seg("3d.fc2", gemm_flops=2 * tok * f * h / p ** 3, elementwise_bytes=e * (2 * tok * f / p ** 3 + 3 * per))
    ln1, ln2 = ln("3d.ln1"), ln("3d.ln2")

    def block(name, n_in, n_out, a_dir, compute):
        before_a, before_w, after = gemm(name, n_in, n_out, a_dir)
        return (before_a, before_w, compute, after, *bias(f"{name}.bias", n_out, a_dir))

    fwd = (ln1, *norm("ln1"), *block("qkv", h, qkv_n, "y", qkv), core,
           *block("proj", h, h, "z", proj), ln2, *norm("ln2"),
           *block("fc1", h, fc1_n, "y", fc1), *block("fc2", f, h, "z", fc2))

    def back(name, n_in, n_out, a_dir, compute):
        # the segment's backward first, then its collectives (bias and GEMM backward), so the
        # planner cuts the layer into blocks at a segment (``3d.proj.bwd``)
        return (backward_of(compute), *bias(f"{name}.bias", n_out, a_dir, backward=True),
                *gemm(name, n_in, n_out, a_dir, backward=True))

    bwd = (*back("fc2", f, h, "z", fc2), *back("fc1", h, fc1_n, "y", fc1), backward_of(ln2),
           *norm("ln2", backward=True), *back("proj", h, h, "z", proj), backward_of(core),
           *back("qkv", h, qkv_n, "y", qkv), backward_of(ln1), *norm("ln1", backward=True))
    return LayerDescription(backend="3d", forward=fwd, backward=bwd)


def cube_block_edges(*, micro_batch: int, seq: int, hidden: int, tp: int,
                     bytes_per_element: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) collectives at a block's edges: leaving the cube all-gathers the hidden
    states in z, then y and x (samples); entering splits, whose backward gathers the same way."""
    p = cube_side(tp)
    full = micro_batch * seq * hidden * bytes_per_element

    def gathers(prefix: str) -> tuple[Collective, ...]:
        return tuple(Collective(name=f"{prefix}.{d}", kind="all_gather", axis=f"cube_{d}", group_size=p,
                                payload_bytes=int(full / p ** k))
                     for d, k in (("z", 2), ("y", 1), ("x", 0)))

    return gathers("3d.leave"), gathers("3d.enter.bwd")


# ---- the backend record's pieces (``describe.backends``) ------------------------------------------

def cube_3d_refusal(*, tp: int, layout: Layout | None, hidden: int, heads: int, ffn: int, micro_batch: int,
                    query_groups: int | None = None) -> str:
    """The record's divisibility check: Megatron's TP split of the model over the group's ``tp``
    ranks (``megatron_1d.tp_split_refusal``: the embedding and the output layer are Megatron's on
    every backend, and every consumer refuses it first), then the cube's
    (:func:`cube_3d_split_refusal`)."""
    return (tp_split_refusal(tp=tp, hidden=hidden, heads=heads, ffn=ffn)
            or cube_3d_split_refusal(tp=tp, hidden=hidden, heads=heads, ffn=ffn, micro_batch=micro_batch,
                                     query_groups=query_groups))


def cube_3d_run_refusal(cfg) -> str:
    """The trainer's refusals of the cube's layers with the run's other flags (``cfg``: a
    ``RunConfig``): SwiGLU only without linear biases, no sequence parallelism."""
    if cfg.swiglu and cfg.add_bias_linear:
        return "--tp-backend 3d runs --swiglu without linear biases only; add --disable-bias-linear"
    if cfg.sequence_parallel:
        return ("--tp-backend 3d does not support --sequence-parallel (its activations are already split "
                "p^3 ways); drop it")
    return ""


def cube_3d_split_refusal(*, tp: int, hidden: int, heads: int, ffn: int, micro_batch: int,
                          query_groups: int | None = None) -> str:
    """Why the cube's layer cannot split a model ("" when it can), naming the flags: TP is p^3
    with p >= 2; the hidden size and the FFN split over p^2, the heads and the key/value groups
    (``query_groups`` None: one per head) over p, and the micro-batch over p^2 blocks of whole
    sequences."""
    try:
        p = cube_side(tp)
    except ModelingError as e:
        return str(e)
    q = p * p
    for flag, value in (("--hidden-size", hidden), ("--ffn-hidden-size", ffn)):
        if value % q:
            return (f"--tp-backend 3d splits {flag} over p^2 = {q} ranks of the cube "
                    f"(--tensor-model-parallel-size {tp}); {value} is not a multiple of {q}")
    groups = query_groups or heads
    if heads % p or groups % cube_3d_kv_groups_divisor(tp, None):
        return (f"--tp-backend 3d splits heads over p = {p}: --num-attention-heads {heads} and "
                f"--num-query-groups {groups} must be multiples of {p}")
    if micro_batch % q:
        return (f"--tp-backend 3d splits each micro-batch into p^2 = {q} blocks of whole sequences: "
                f"--micro-batch-size {micro_batch} is not a multiple of {q}")
    return ""


def cube_3d_kv_groups_divisor(tp: int, layout: Layout | None) -> int:
    """The heads split over p, so the key/value groups do."""
    return cube_side(tp)


AXES = ("x", "y", "z")
"""The cube's axes (``parallel.cube.Cube``): x splits the weights, y and z the activations."""


def cube_3d_layouts(tp: int) -> tuple[Layout, ...]:
    """The one layout of a cube TP group, ``{"x": p, "y": p, "z": p}``, or none when TP is not
    p^3 (p >= 2)."""
    p = cube_root(tp)
    return (Layout(zip(AXES, (p,) * 3)),) if p is not None and p >= 2 else ()


def cube_3d_layout_refusal(layout: Layout | None, tp: int) -> str:
    """TP is a cube p^3 (p >= 2) and the layout is that cube (:func:`cube_side`'s words)."""
    try:
        p = cube_side(tp)
    except ModelingError as e:
        return str(e)
    if layout is None or layout == Layout(zip(AXES, (p,) * 3)):
        return ""
    return f"--tp-backend 3d lays out --tensor-model-parallel-size {tp} as the cube x=y=z={p} (got {layout})"


def cube_3d_layer(q: LayerQuery) -> LayerDescription:
    """The record's layer: the cube's of ``q.tp`` ranks."""
    return cube_3d_gpt_layer(micro_batch=q.micro_batch, seq=q.seq, hidden=q.hidden, heads=q.heads, ffn=q.ffn,
                             tp=q.tp, bytes_per_element=q.bytes_per_element, variant=q.variant,
                             core_attention=q.core_attention, attention_dropout=q.attention_dropout)


def cube_3d_edges(*, layout: Layout | None, micro_batch: int, seq: int, hidden: int, tp: int,
                  bytes_per_element: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """The record's block edges: :func:`cube_block_edges`."""
    return cube_block_edges(micro_batch=micro_batch, seq=seq, hidden=hidden, tp=tp,
                            bytes_per_element=bytes_per_element)


def cube_3d_axis_ranks(axis: str, tp_ranks: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """TP position 0's line of the cube in its default order: cube_z consecutive, cube_x stride p,
    cube_y stride p^2 (``parallel.cube.Cube``, order "zxy")."""
    p = cube_side(len(tp_ranks))
    stride = {"cube_z": 1, "cube_x": p, "cube_y": p * p}[axis]
    return tp_ranks[::stride][:p]


def cube_3d_vector_splits(t: int, layout: Layout | None) -> tuple[int, int]:
    """TP position 0 holds a diagonal block of every vector (N / p^2)."""
    return (cube_side(t) ** 2,) * 2


def cube_3d_saved_bytes(*, b: int, s: int, h: int, a: int, f: int, t: int, e: int, layout: Layout | None,
                        hidden_dropout: bool, attention_dropout: bool, variant: LayerVariant,
                        recompute_core_attention: bool, core_attention: str) -> float:
    """The 3-D layer's inventory (``describe.saved.mesh_layer_saved_bytes``, measured on CPU): every
    activation is a rank's own block, 1/t of the TP-1 layer's; the norms work on rows of h / p
    features and keep the diagonal weight expanded to them (h / p, p the cube's side); the proj's
    input is the core attention's context (one storage)."""
    if recompute_core_attention:
        raise ModelingError("selective recompute is described for --tp-backend megatron only (got 3d)")
    p = cube_side(t)
    return mesh_layer_saved_bytes(b=b, s=s, h=h, a=a, f=f, e=e, residual_split=t, norm_width=h / p,
                                  norm_weight_copy=h / p, heads_split=t, context_split=t, ffn_split=t,
                                  hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                                  variant=variant, core_attention=core_attention)


def cube_3d_input_split(t: int, layout: Layout | None) -> int:
    """Hidden states between layers are ``[s, b/p^2, h/p]``: 1/t of the whole."""
    return t


def cube_3d_launch_flags(layout: Layout | None) -> dict[str, str]:
    """``--tp-backend 3d`` (the cube's side is the TP size's cube root)."""
    return {BACKEND_FLAG: "3d"}


def cube_3d_event_tag(layout: Layout | None) -> str:
    """``cube``: the degree t = p^3 in the key gives p."""
    return "cube"
