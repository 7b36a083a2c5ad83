"""ATP's layer on a 2-D DeviceMesh(d1, d2) inside the TP group (paper 004), from the dataflow
tables in ``layers/atp_linear.py``, ``atp_attention.py`` and ``atp_norm.py``."""
from __future__ import annotations

from .atp_meshes import atp_mesh_refusal, atp_meshes
from .layer_query import LayerQuery
from .layout import BACKEND_FLAG, Layout
from .megatron_1d import core_kernels, megatron_1d_saved_bytes, tp_split_refusal
from .ops import GPT2, Collective, Compute, LayerDescription, LayerVariant, ModelingError, backward_of
from .saved import mesh_layer_saved_bytes


def eager_norm_kernels(normalization: str, *, bytes_per_element: int) -> int:
    """Forward kernels of ATP's and the cube's norms in eager PyTorch (``layers.atp_norm.ATPNorm``,
    ``layers.linear3d.LayerNorm3D``; Megatron's norm is one fused kernel): LayerNorm = the sum,
    mean, centring, square, sum, variance, + eps, rsqrt, scale, weight and bias (11); RMSNorm =
    square, sum, mean, + eps, rsqrt, scale, weight (7); below fp32 the cast to fp32 and back (2)."""
    return (11 if normalization == "LayerNorm" else 7) + (2 if bytes_per_element < 4 else 0)


def mesh_segment_kernels(variant: LayerVariant, *, bytes_per_element: int, core_attention: str = "local",
                         attention_dropout: bool = False) -> dict[str, int]:
    """Forward kernels of each segment of a layer cut at its collectives (ATP's, the cube's:
    ln1, qkv, core, proj, ln2, fc1, fc2), counted as ``megatron_1d`` counts Megatron's (its
    attention's 7 + the core attention's, its MLP's 5) with the eager norms
    (:func:`eager_norm_kernels`) and the MLP's unfused bias add and activation
    (``layers.atp_mlp.ATPMLP.activate``: act(gate) * up is two kernels)."""
    norm = eager_norm_kernels(variant.normalization, bytes_per_element=bytes_per_element)
    bias = 1 if variant.bias else 0
    return {"ln1": norm,
            "qkv": 2,  # the GEMM and its bias (Megatron's count keeps it with or without one)
            # the q/k/v split copies as Megatron's 7 leave them (less norm, QKV 2, proj, b-d-a: 2)
            "core": 2 + core_kernels(core_attention, attention_dropout=attention_dropout),
            "proj": 1,
            "ln2": 1 + norm,  # the attention's bias-dropout-add, then the norm
            "fc1": 1 + bias + (2 if variant.gated else 1),
            "fc2": 2}  # the GEMM, the MLP's bias-dropout-add


MESH_BLOCKS = {"ln1": 4, "qkv": 4, "core": 4, "proj": 4, "ln2": 3, "fc1": 3, "fc2": 3}
"""Segments of the block each segment belongs to (attention: ln1, qkv, core, proj; MLP: ln2, fc1,
fc2): each carries that share of its block's framework cost (``Compute.framework_share``)."""


def mesh_segment(name: str, kernels: dict[str, int], **work) -> Compute:
    """The segment ``<backend>.<part>`` with ``work`` (``Compute``'s FLOPs and bytes), its kernels
    (:func:`mesh_segment_kernels`) and its block's framework share (``MESH_BLOCKS``)."""
    part = name.split(".")[-1]
    return Compute(name=name, kernels=kernels[part], framework_share=1 / MESH_BLOCKS[part], **work)


def atp_2d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int, d1: int,
                     d2: int, bytes_per_element: int = 2, chunks: int = 1,
                     variant: LayerVariant = GPT2, core_attention: str = "local",
                     attention_dropout: bool = False) -> LayerDescription:
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
    The backward dX all-reduces are not overlapped at ``chunks`` 1, so nothing here says so: our
    linears run them as ``copy_to_group``'s backward, blocking, after the linear's whole backward
    (``layers/atp_linear.py``). The paper's §4.2 overlap of each with its weight-gradient GEMM is
    ours only with ``--atp-chunks`` > 1 (``_OverlappedMeshLinear``), which the simulator refuses;
    ``tests/test_atp_dgrad_overlap.py`` pins both halves. Megatron's own linears (``megatron_1d``)
    do overlap it (``STOCK_ASYNC_DGRAD``).
    Each segment counts its kernels (:func:`mesh_segment_kernels`) and its block's framework share
    (``MESH_BLOCKS``): the software stack prices its host time and element-wise factors as Megatron's.
    """
    n = d1 * d2
    refused = atp_2d_split_refusal(d1=d1, d2=d2, hidden=hidden, heads=heads, ffn=ffn,
                                   query_groups=variant.query_groups)
    if refused:
        raise ModelingError(refused)
    b, s, h, f, a, e = micro_batch, seq, hidden, ffn, heads, bytes_per_element
    tok = b * s
    stats = tok * 4  # one fp32 statistic per token
    qkv_n, fc1_n = variant.qkv_rows(h, a), variant.fc1_rows(f)

    def ar(name: str, axis: int, nbytes: int, kind: str = "all_reduce") -> Collective:
        return Collective(name=name, kind=kind, axis=f"mesh{axis}", group_size=d1 if axis == 1 else d2,
                          payload_bytes=int(nbytes))

    kernels = mesh_segment_kernels(variant, bytes_per_element=e, core_attention=core_attention,
                                   attention_dropout=attention_dropout)
    seg = lambda name, **work: mesh_segment(name, kernels, **work)  # noqa: E731

    ln = lambda nm: seg(nm, gemm_flops=0.0, elementwise_bytes=e * 3 * tok * h / d2)  # noqa: E731
    qkv = seg("atp.qkv", gemm_flops=2 * tok * (h / d2) * (qkv_n / d1), elementwise_bytes=e * (3 * tok * h / d2))
    core = seg("atp.core", gemm_flops=0.0, attention_flops=4 * b * s * s * h / n,
               elementwise_bytes=e * (3 * b * (a // n) * s * s + tok * variant.qk_elementwise_per_token(h, a) / n))
    proj = seg("atp.proj", gemm_flops=2 * tok * (h / d1) * (h / d2))
    fc1 = seg("atp.fc1", gemm_flops=2 * tok * (h / d2) * (fc1_n / d1), elementwise_bytes=e * 3 * tok * h / d2)
    fc2 = seg("atp.fc2", gemm_flops=2 * tok * (f / d1) * (h / d2), elementwise_bytes=e * 2 * tok * f / d1)
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


# ---- the backend record's pieces (``describe.backends``) ------------------------------------------

AXES = ("d1", "d2")
"""The mesh's axes: d1 shards the column-first outputs (FFN, heads), d2 the hidden states."""


def atp_2d_mesh(layout: Layout | None, tp: int) -> tuple[int, int]:
    """(d1, d2) of ``layout``; without one, Megatron's layout (tp, 1)."""
    return (layout["d1"], layout["d2"]) if layout is not None else (tp, 1)


def atp_layout(d1: int, d2: int) -> Layout:
    """ATP's ``DeviceMesh(d1, d2)`` as a layout."""
    return Layout(d1=d1, d2=d2)


def atp_2d_layout_refusal(layout: Layout | None, tp: int) -> str:
    """The mesh's own rule d1 x d2 = TP (``atp_meshes.atp_mesh_refusal``), in ``--atp-mesh``'s words."""
    if layout is not None and layout.names != AXES:
        return f"--atp-mesh must be two sizes D1,D2 (got a layout on {', '.join(layout.names)})"
    return atp_mesh_refusal(None if layout is None else layout.shape, tp)


def atp_2d_parse_mesh(text: str, tp: int) -> Layout:
    """``--atp-mesh D1,D2`` as a layout; one line if it is not two integers >= 1."""
    try:
        d1, d2 = (int(v) for v in text.split(","))
    except ValueError:
        raise ModelingError(f"--atp-mesh must be D1,D2 (got {text!r})") from None
    if d1 < 1 or d2 < 1:
        raise ModelingError(atp_mesh_refusal((d1, d2), tp))
    return atp_layout(d1, d2)

def atp_2d_refusal(*, tp: int, layout: Layout | None, hidden: int, heads: int, ffn: int,
                   micro_batch: int | None = None, query_groups: int | None = None) -> str:
    """The record's divisibility check: Megatron's TP split of the model over the group's ``tp``
    ranks (``megatron_1d.tp_split_refusal``: the embedding and the output layer are Megatron's on
    every backend, and every consumer refuses it first), then the mesh's
    (:func:`atp_2d_split_refusal`). The mesh's own rule d1 x d2 = TP
    (``atp_meshes.atp_mesh_refusal``) comes before both. No micro-batch rule."""
    d1, d2 = atp_2d_mesh(layout, tp)
    return (tp_split_refusal(tp=tp, hidden=hidden, heads=heads, ffn=ffn)
            or atp_2d_split_refusal(d1=d1, d2=d2, hidden=hidden, heads=heads, ffn=ffn, query_groups=query_groups))


def atp_2d_run_refusal(cfg) -> str:
    """The trainer's refusals of ATP's layers with the run's other flags (``cfg``: a ``RunConfig``)."""
    if cfg.sequence_parallel:
        return "--tp-backend atp does not support --sequence-parallel yet; drop it"
    return ""


def atp_2d_split_refusal(*, d1: int, d2: int, hidden: int, heads: int, ffn: int,
                         query_groups: int | None = None) -> str:
    """Why ATP's layer on the mesh (d1, d2) cannot split a model ("" when it can): the hidden size
    and the heads split over all d1 x d2 ranks, the FFN over d1, the hidden states between layers
    over d2, and each rank's heads see whole key/value groups (the groups' line names the flags,
    as the trainer refuses them)."""
    n = d1 * d2
    if hidden % n or heads % n or ffn % d1 or hidden % d2:
        return f"ATP mesh {d1}x{d2}: hidden {hidden}, heads {heads} must be divisible by {n} and ffn {ffn} by {d1}"
    if query_groups and query_groups % atp_2d_kv_groups_divisor(n, atp_layout(d1, d2)):
        return (f"--tp-backend atp gives each of its {n} ranks whole key/value groups: --num-query-groups "
                f"{query_groups} must be divisible by --tensor-model-parallel-size {n}")
    return ""


def atp_2d_kv_groups_divisor(tp: int, layout: Layout | None) -> int:
    """Each of the d1 x d2 ranks holds whole key/value groups."""
    d1, d2 = atp_2d_mesh(layout, tp)
    return d1 * d2


def atp_2d_layer(q: LayerQuery) -> LayerDescription:
    """The record's layer: ATP's on ``q.layout``."""
    assert q.layout is not None
    return atp_2d_gpt_layer(micro_batch=q.micro_batch, seq=q.seq, hidden=q.hidden, heads=q.heads, ffn=q.ffn,
                            d1=q.layout["d1"], d2=q.layout["d2"], bytes_per_element=q.bytes_per_element, variant=q.variant,
                            core_attention=q.core_attention, attention_dropout=q.attention_dropout)


def atp_2d_edges(*, layout: Layout | None, micro_batch: int, seq: int, hidden: int, tp: int,
                 bytes_per_element: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """ATP keeps ``[s, b, h/d2]`` between its layers: leaving its run of layers all-gathers over
    axis 2, entering splits (its backward all-gathers). None with d2 = 1 (Megatron's layout)."""
    if layout is None or layout["d2"] == 1:
        return (), ()
    full = micro_batch * seq * hidden * bytes_per_element
    d2 = layout["d2"]
    return ((Collective(name="atp.leave", kind="all_gather", axis="mesh2", group_size=d2, payload_bytes=full),),
            (Collective(name="atp.enter.bwd", kind="all_gather", axis="mesh2", group_size=d2,
                        payload_bytes=full),))


def atp_2d_axis_ranks(axis: str, tp_ranks: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """Axis 2 is the fastest-varying (consecutive ranks), axis 1 strides by d2."""
    d1, d2 = atp_2d_mesh(layout, len(tp_ranks))
    return tp_ranks[:d2] if axis == "mesh2" else tp_ranks[::d2]


def atp_2d_saved_bytes(*, b: int, s: int, h: int, a: int, f: int, t: int, e: int, layout: Layout | None,
                       hidden_dropout: bool, attention_dropout: bool, variant: LayerVariant,
                       recompute_core_attention: bool, core_attention: str) -> float:
    """The ATP layer's inventory (``describe.saved.mesh_layer_saved_bytes``, measured on CPU): the
    residual stream, the norms and the QKV and fc1 inputs on h / d2 features, the heads on d1 x d2
    ranks, the proj input gathered to h / d1 (a fused kernel also keeps its heads' own context when
    d2 > 1), the FFN on d1. Without a mesh, Megatron's inventory."""
    flags = dict(hidden_dropout=hidden_dropout, attention_dropout=attention_dropout, variant=variant,
                 core_attention=core_attention)
    if layout is None:
        return megatron_1d_saved_bytes(b=b, s=s, h=h, a=a, f=f, t=t, e=e, layout=None,
                                       recompute_core_attention=recompute_core_attention, **flags)
    if recompute_core_attention:
        raise ModelingError("selective recompute is described for --tp-backend megatron only (got atp)")
    d1, d2 = atp_2d_mesh(layout, t)
    return mesh_layer_saved_bytes(b=b, s=s, h=h, a=a, f=f, e=e, residual_split=d2, norm_width=h / d2,
                                  heads_split=d1 * d2, context_split=d1, ffn_split=d1, **flags)


def atp_2d_vector_splits(t: int, layout: Layout | None) -> tuple[int, int]:
    """(QKV / fc1 output vectors, hidden-size vectors) split ways: column-first outputs by d1,
    the hidden dim by d2 (without a mesh, Megatron's (t, 1))."""
    return atp_2d_mesh(layout, t)


def atp_2d_input_split(t: int, layout: Layout | None) -> int:
    """Hidden states between layers are ``[s, b, h/d2]``."""
    return atp_2d_mesh(layout, t)[1]


def atp_2d_layouts(tp: int) -> tuple[Layout, ...]:
    """Every mesh d1 x d2 = TP, d2 = 1 too (``atp_meshes.atp_meshes``): ``--tp-backend atp --atp-mesh
    TP,1`` runs ATP's layers (their norms, collectives and saved bytes, not Megatron's), so it is a
    launch of its own, which the simulator's search prices as ATP's layer, as the planner does
    (at TP > 1: the 1 x 1 mesh has no TP group)."""
    return tuple(atp_layout(d1, d2) for d1, d2 in atp_meshes(tp, with_1d=tp > 1))


def atp_2d_launch_flags(layout: Layout | None) -> dict[str, str]:
    """``--tp-backend atp --atp-mesh d1,d2`` (literal names: ``describe`` sits below the flag
    table, ``megatron_oases.flags``, which reads the records)."""
    return {BACKEND_FLAG: "atp", "--atp-mesh": ",".join(map(str, layout.shape))}


def atp_2d_event_tag(layout: Layout | None) -> str:
    """The mesh, ``m{d1}x{d2}``."""
    return f"m{layout.label}"


def atp_2d_event_dims(tp: int, layout: Layout | None) -> tuple[tuple[str, int], ...]:
    """``d1``, ``d2``: the profiler's ATP workloads read them (``sim.calibrate.workloads``)."""
    d1, d2 = atp_2d_mesh(layout, tp)
    return ("d1", d1), ("d2", d2)
