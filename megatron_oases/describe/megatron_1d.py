"""Megatron's 1-D TP layer, its output layer's weight gradient and Megatron's async pairings."""
from __future__ import annotations

from .core_attention import attention_kernel
from .layer_query import LayerQuery
from .layout import Layout
from .ops import GPT2, Collective, Compute, LayerDescription, LayerVariant, ModelingError, backward_of
from .saved import CUDA_KERNELS, layer_saved_bytes

LOCAL_CORE_KERNELS = 5
"""Forward kernels of Megatron's local core attention in eager PyTorch: the scores GEMM, the
fused scale-mask-softmax, the attention dropout, the context GEMM and the context's transpose
copy back to ``[s, b, h]`` (SDPA's math kernel, ``unfused``, launches as many: its scores GEMM,
softmax, dropout, context GEMM and the copy out of its ``[b, np, s, d]`` output)."""
FUSED_CORE_KERNELS = 1
"""A fused kernel (SDPA flash / efficient / cuDNN) does all of it in one launch, dropout
included, and writes its output in the query's layout, so the context is a view (no copy;
``describe.core_attention``)."""


def core_kernels(core_attention: str, *, attention_dropout: bool) -> int:
    """Forward kernels of the core attention ``core_attention`` (``describe.core_attention``) runs
    on CUDA (``CUDA_KERNELS``: a fused kernel keeps dropout on chip)."""
    kernel = attention_kernel(core_attention, attention_dropout=attention_dropout,
                              fused_dropout=CUDA_KERNELS.fused_attention_dropout)
    return FUSED_CORE_KERNELS if kernel == "fused" else LOCAL_CORE_KERNELS


def megatron_1d_gpt_layer(*, micro_batch: int, seq: int, hidden: int, heads: int, ffn: int,
                          tp: int, bytes_per_element: int = 4, sequence_parallel: bool = False,
                          keeps_gathered_input: bool = False,
                          variant: LayerVariant = GPT2, attention_dropout: bool = False,
                          hidden_dropout: bool = False, recompute_core_attention: bool = False,
                          core_attention: str = "local") -> LayerDescription:
    """Megatron's TP layer: [LN, QKV, core, proj] g [LN, fc1, act, fc2] g (g = all-reduce);
    in backward the f before each block all-reduces the input gradient. ``variant``: GQA shrinks
    QKV's output to the queries plus a key and a value per group; SwiGLU doubles fc1's output
    and adds the gate's product to the element-wise work; RoPE and QK-norm each read and write
    the rank's queries and keys (element-wise; their FLOPs are negligible). ``attention_dropout``:
    the dropout on the attention probabilities reads them and writes the result and a one-byte mask
    per score (part of ``score_bytes``: a fused attention kernel keeps it on chip);
    ``hidden_dropout``: bias-dropout-add writes a one-byte mask per element of each block's output.

    ``sequence_parallel`` (Megatron's ``--sequence-parallel``, :func:`sp_collectives`): norms,
    dropout and residual adds run on this rank's s/t tokens; ``keeps_gathered_input``: the column
    linears keep their all-gathered input (the Oases tape) instead of re-gathering it in backward.

    ``recompute_core_attention`` (Megatron's ``--recompute-granularity selective``, its default
    ``recompute_modules`` ``core_attn``): the backward reruns the core attention's forward
    (:func:`core_attention`, no collective) before the attention block's backward.

    ``core_attention`` (``describe.core_attention.CORE_ATTENTIONS``, ``GPTShape.core_attention``):
    the kernels the core attention launches (:func:`core_kernels`: 12 forward kernels in the
    attention segment under Megatron's local one or SDPA's math kernel, 8 under a fused kernel).
    The FLOPs and the score traffic are the same numbers: the device model prices a fused kernel's
    scores on chip (``DeviceModel.fused_attention``)."""
    refused = tp_split_refusal(tp=tp, hidden=hidden, heads=heads, ffn=ffn)
    if refused:
        raise ModelingError(refused)
    sp = sequence_parallel and tp > 1
    if sp and seq % tp:
        raise ValueError(f"sequence parallelism needs seq {seq} divisible by TP {tp}")
    b, s, h, f, t = micro_batch, seq, hidden, ffn, tp
    act = b * s * h * bytes_per_element  # one full activation [s, b, h]
    residual = b * s * h // (t if sp else 1)  # elements a norm or residual add works on
    scores = b * (heads // t) * s * s
    score_bytes = 3 * bytes_per_element * scores + ((2 * bytes_per_element + 1) * scores if attention_dropout else 0)
    mask = residual if hidden_dropout else 0  # bias-dropout-add's one-byte mask
    ew_attn = (bytes_per_element * (4 * residual + b * s * variant.qk_elementwise_per_token(h, heads) // t)
               + score_bytes + mask)  # LN, residual; softmax (+ dropout) on the scores
    # LN, residual, GeLU; a gated unit reads gate and up and writes their product
    ew_mlp = bytes_per_element * (4 * residual + (5 if variant.gated else 2) * b * s * f // t) + mask
    # kernels of Megatron's local layer in eager PyTorch (forward): attention = norm, QKV GEMM,
    # bias, q/k/v split copies (3), the core attention (``core_kernels``: 5 local, 1 fused),
    # proj GEMM, bias-dropout-add (12 local, 8 fused); mlp = norm, fc1 GEMM, bias-activation,
    # fc2 GEMM, bias-dropout-add (5). ``backward_of`` doubles them.
    core = core_kernels(core_attention, attention_dropout=attention_dropout)
    # GEMMs (M, N, K) on the rank's b*s tokens (the whole sequence: SP gathers it first)
    attn_gemms = ((b * s, variant.qkv_rows(h, heads) // t, h), (b * s, h, h // t))  # QKV, proj
    mlp_gemms = ((b * s, variant.fc1_rows(f) // t, h), (b * s, h, f // t))  # fc1, fc2
    attn = Compute(name="attention",
                   gemm_flops=2 * b * s * h * (variant.qkv_rows(h, heads) // t) + 2 * b * s * (h // t) * h,
                   attention_flops=4 * b * s * s * h // t, elementwise_bytes=ew_attn,
                   score_bytes=score_bytes, kernels=7 + core, gemms=attn_gemms)
    mlp = Compute(name="mlp", gemm_flops=2 * b * s * h * (variant.fc1_rows(f) // t) + 2 * b * s * (f // t) * h,
                  elementwise_bytes=ew_mlp, kernels=5, gemms=mlp_gemms)
    # under selective recompute the core attention's forward runs again right before its backward
    attn_bwd = ((core_attention_recompute(b=b, s=s, hidden=h, t=t, score_bytes=score_bytes, kernels=core),)
                if recompute_core_attention else ()) + (backward_of(attn),)
    if t == 1:
        return LayerDescription(backend="megatron", forward=(attn, mlp),
                                backward=(backward_of(mlp), *attn_bwd))
    if sp:
        return sp_layer((attn, mlp), act=act, t=t, regather=not keeps_gathered_input, attention_backward=attn_bwd)
    fwd = (attn,
           Collective(name="attention.g", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act),
           mlp,
           Collective(name="mlp.g", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act))
    # Backward: g is the identity; the f before each block all-reduces dX of its input.
    bwd = (backward_of(mlp),
           Collective(name="mlp.f.bwd", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act),
           *attn_bwd,
           Collective(name="attention.f.bwd", kind="all_reduce", axis="tp", group_size=t, payload_bytes=act))
    return LayerDescription(backend="megatron", forward=fwd, backward=bwd)


def core_attention_recompute(*, b: int, s: int, hidden: int, t: int, score_bytes: float,
                             kernels: int = LOCAL_CORE_KERNELS - 1) -> Compute:
    """The core attention forward on this rank's heads (``DotProductAttention``: the scores GEMM,
    the scaled masked softmax, its dropout, attention over V; or one fused kernel), the part of
    the ``attention`` segment that selective recompute reruns in backward: the s^2 FLOPs and the
    score traffic, no weight GEMM, no collective. ``kernels``: :func:`core_kernels` (the local
    one's rerun makes no context copy: 4; a fused kernel 1)."""
    return Compute(name=CORE_ATTENTION_RECOMPUTE, gemm_flops=0.0, attention_flops=4 * b * s * s * hidden // t,
                   elementwise_bytes=score_bytes, score_bytes=score_bytes,
                   kernels=min(kernels, LOCAL_CORE_KERNELS - 1))


CORE_ATTENTION_RECOMPUTE = "attention.core"
"""The event of the core attention's forward rerun under selective recompute."""


def sp_collectives(block: str, *, act: int, t: int, regather: bool) -> dict[str, tuple[Collective, ...]]:
    """One block's collectives under sequence parallelism (Megatron-Core's
    ``LinearWithGradAccumulationAndAsyncCommunication`` and the sequence-parallel regions),
    payload the full ``[s, b, h]``: ``"enter"`` (forward) the all-gather of the normed chunk
    before the column linear; ``"leave"`` the reduce-scatter of the row linear's output;
    ``"leave.bwd"`` the all-gather of that output's gradient; ``"regather.bwd"`` (stock) the
    column linear's input gathered again for its weight gradient (launched async before the input
    gradient GEMM); ``"enter.bwd"`` the reduce-scatter of the input gradient, launched async
    beside the weight gradient (``STOCK_ASYNC_DGRAD``)."""
    def op(name, kind):
        return Collective(name=f"{block}.{name}", kind=kind, axis="tp", group_size=t, payload_bytes=act)
    return {"enter": (op("ag", "all_gather"),), "leave": (op("rs", "reduce_scatter"),),
            "leave.bwd": (op("rs.bwd", "all_gather"),),
            "regather.bwd": (op("ag.wgrad", "all_gather"),) if regather else (),
            "enter.bwd": (op("ag.bwd", "reduce_scatter"),)}


def sequence_parallel_refusal(tp: int, seq_length: int) -> str:
    """Empty when ``--sequence-parallel`` can split ``seq_length`` tokens over TP ``tp``; else the
    one line that refuses it, in the trainer's words (the trainer and the simulator both say it)."""
    if tp == 1:
        return "--sequence-parallel needs --tensor-model-parallel-size > 1"
    if seq_length % tp:
        return (f"--sequence-parallel splits --seq-length {seq_length} over --tensor-model-parallel-size "
                f"{tp}; it must be a multiple")
    return ""


def sp_layer(blocks: tuple[Compute, Compute], *, act: int, t: int, regather: bool,
             attention_backward: tuple[Compute, ...] | None = None) -> LayerDescription:
    """The layer under sequence parallelism: per block, forward AG, compute, RS; backward the RS's
    AG, the input re-gather (stock), compute, the input gradient's RS. Each block's norm runs on
    the chunk before its all-gather, folded into the block's compute segment (as the non-SP
    description folds it in before f). ``attention_backward``: the attention block's backward
    segments (default its ``backward_of``; selective recompute puts the core attention first)."""
    fwd: list = []
    bwd: list = []
    for c in blocks:
        col = sp_collectives(c.name, act=act, t=t, regather=regather)
        fwd += [*col["enter"], c, *col["leave"]]
        own = attention_backward if c.name == "attention" and attention_backward else (backward_of(c),)
        bwd = [*col["leave.bwd"], *col["regather.bwd"], *own, *col["enter.bwd"]] + bwd
    return LayerDescription(backend="megatron", forward=tuple(fwd), backward=tuple(bwd))


STOCK_ASYNC_DGRAD = {"attention.f.bwd": "attention.wgrad", "mlp.f.bwd": "mlp.wgrad",
                     "attention.ag.bwd": "attention.wgrad", "mlp.ag.bwd": "mlp.wgrad"}
"""Stock Megatron's input-gradient collectives that run async beside a weight-gradient GEMM:
the all-reduces, and under sequence parallelism the reduce-scatters that replace them."""
OUTPUT_ASYNC_DGRAD = {"logits.f.bwd": "logits.wgrad", "logits.ag.bwd": "logits.wgrad"}
"""The output layer (Megatron's column-parallel linear whatever the layers' backend or schedule)
does the same: its input-gradient all-reduce runs beside its weight gradient."""


def output_wgrad(*, b: int, s: int, h: int, v: int, t: int, e: int) -> Compute:
    """The weight gradient of the output layer (``[v/t, h]``, no bias) alone."""
    out = v // t
    return Compute(name=OUTPUT_ASYNC_DGRAD["logits.f.bwd"], gemm_flops=2.0 * b * s * h * out,
                   elementwise_bytes=e * (b * s * (h + out) + h * out), gemms=((out, h, b * s),))


def column_wgrad(event: str, *, b: int, s: int, h: int, heads: int, f: int, t: int, e: int,
                 variant: LayerVariant = GPT2) -> Compute:
    """The weight gradient of a Megatron block's column-parallel linear (QKV or fc1) alone."""
    out = variant.qkv_rows(h, heads) // t if event == "attention.wgrad" else variant.fc1_rows(f) // t
    return Compute(name=event, gemm_flops=2.0 * b * s * h * out, elementwise_bytes=e * (b * s * (h + out) + h * out),
                   gemms=((out, h, b * s),))


# ---- the backend record's pieces (``describe.backends``) ------------------------------------------

def tp_split_refusal(*, tp: int, hidden: int, heads: int, ffn: int | None) -> str:
    """Why Megatron's TP of ``tp`` ranks cannot split a model ("" when it can): each rank holds
    ``hidden / tp`` columns, ``heads / tp`` whole heads of ``hidden / heads`` each, and
    ``ffn / tp`` FFN columns (``ffn`` None: not yet known, not checked). The one home of the rule:
    this layer's description, the runtime's ``ParallelDims`` (every backend: the embedding and the
    output layer are Megatron's vocab-parallel ones) and the planner's ``PlanModel``."""
    if hidden % tp:
        return (f"--hidden-size {hidden} is not divisible by --tensor-model-parallel-size {tp}; "
                f"pick a hidden size that is a multiple of {tp}")
    if heads % tp:
        return (f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; "
                f"use a multiple of {tp} heads")
    if hidden % heads:
        return f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}"
    if ffn is not None and ffn % tp:
        return f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}"
    return ""


def megatron_1d_refusal(*, tp: int, layout: Layout | None, hidden: int, heads: int, ffn: int,
                        query_groups: int | None = None, micro_batch: int | None = None) -> str:
    """The record's divisibility check: :func:`tp_split_refusal`, and with ``query_groups`` the
    attention's rule (each rank holds whole key/value groups: the groups divide by the attention's
    degree ``tp``). The groups are optional because a per-block plan runs MLP blocks at degrees
    the groups need not divide (``plan.graph.attention_fits``). No micro-batch rule."""
    refused = tp_split_refusal(tp=tp, hidden=hidden, heads=heads, ffn=ffn)
    if refused or query_groups is None or query_groups % tp == 0:
        return refused
    return (f"--num-query-groups {query_groups} must be divisible by the --tensor-model-parallel-size {tp} "
            f"(each rank holds whole key/value groups)")


def megatron_1d_layer(q: LayerQuery) -> LayerDescription:
    """The record's layer: the Oases tape (``schedule="oases"``) keeps the gathered column inputs."""
    return megatron_1d_gpt_layer(micro_batch=q.micro_batch, seq=q.seq, hidden=q.hidden, heads=q.heads, ffn=q.ffn,
                                 tp=q.tp, bytes_per_element=q.bytes_per_element, variant=q.variant,
                                 sequence_parallel=q.sequence_parallel, keeps_gathered_input=q.schedule == "oases",
                                 attention_dropout=q.attention_dropout, hidden_dropout=q.hidden_dropout,
                                 recompute_core_attention=q.recompute_core_attention,
                                 core_attention=q.core_attention)


def megatron_1d_saved_bytes(*, b: int, s: int, h: int, a: int, f: int, t: int, e: int, layout: Layout | None,
                            hidden_dropout: bool, attention_dropout: bool, variant: LayerVariant,
                            recompute_core_attention: bool, core_attention: str) -> float:
    """The measured inventory of Megatron's local layer (``describe.saved``; with dropout, e = 2,
    f = 4h: Korthikanti et al. 2022's sbh(10 + 24/t) + 5 a s^2 b / t plus norm statistics, the
    causal mask and the fp32 softmax output)."""
    return layer_saved_bytes(b=b, s=s, h=h, a=a, f=f, t=t, e=e, hidden_dropout=hidden_dropout,
                             attention_dropout=attention_dropout, variant=variant,
                             recompute_core_attention=recompute_core_attention, core_attention=core_attention)


def megatron_1d_vector_splits(t: int, layout: Layout | None) -> tuple[int, int]:
    """(QKV / fc1 output vectors, hidden-size vectors) split ways: column-parallel biases by t;
    row-parallel biases and norms replicated."""
    return t, 1


def megatron_1d_axis_ranks(axis: str, tp_ranks: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """Every collective runs on the whole TP group (axis ``tp``)."""
    return tp_ranks


def megatron_1d_edges(*, layout: Layout | None, micro_batch: int, seq: int, hidden: int, tp: int,
                      bytes_per_element: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """None: its layers take and give Megatron's replicated ``[s, b, h]``."""
    return (), ()


def megatron_1d_input_split(t: int, layout: Layout | None) -> int:
    """Hidden states between layers are whole on every rank."""
    return 1


def megatron_1d_layouts(tp: int) -> tuple[Layout, ...]:
    """One layout at every TP size: the whole group on one axis, ``{"tp": tp}``."""
    return (Layout(tp=tp),)


def megatron_1d_layout_refusal(layout: Layout | None, tp: int) -> str:
    """Its one layout lays out the whole TP group on one axis."""
    if layout is None or layout == Layout(tp=tp):
        return ""
    return f"--tp-backend megatron lays out --tensor-model-parallel-size {tp} as tp={tp} (got {layout})"


def megatron_1d_kv_groups_divisor(tp: int, layout: Layout | None) -> int:
    """Each of the (attention's) ``tp`` ranks holds whole key/value groups."""
    return tp


def megatron_1d_launch_flags(layout: Layout | None) -> dict[str, str]:
    """None: Megatron 1-D is the default ``--tp-backend``."""
    return {}


def megatron_1d_event_tag(layout: Layout | None) -> str:
    """No layout tag: the degree ``t`` in the key says it all."""
    return ""
