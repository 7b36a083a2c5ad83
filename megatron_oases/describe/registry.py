"""The backends by name: layer description, collective groups, parameters, activation bytes."""
from __future__ import annotations

from .atp_2d import atp_2d_gpt_layer
from .cube_3d import cube_3d_gpt_layer, cube_block_edges, cube_side
from .megatron_1d import megatron_1d_gpt_layer
from .ops import GPT2, Collective, LayerDescription, LayerVariant, ModelingError
from .core_attention import attention_kernel, keeps_scores
from .saved import CUDA_KERNELS, layer_saved_bytes, logsumexp_bytes

BACKENDS = ("megatron", "atp", "3d")


def layer_description(*, backend: str, mesh: tuple[int, int] | None, micro_batch: int, seq: int,
                      hidden: int, heads: int, ffn: int, tp: int, bytes_per_element: int,
                      variant: LayerVariant = GPT2, sequence_parallel: bool = False,
                      schedule: str = "stock", attention_dropout: bool = False,
                      hidden_dropout: bool = False, recompute_core_attention: bool = False,
                      core_attention: str = "local") -> LayerDescription:
    """A backend's layer; ``sequence_parallel`` only on Megatron 1-D, whose Oases tape
    (``schedule="oases"``) keeps the all-gathered column inputs instead of re-gathering them.
    The dropouts' element-wise traffic is described for Megatron 1-D only, and so is
    ``recompute_core_attention`` (selective recompute: Megatron's attention module checkpoints
    its core attention; the ATP and 3-D attention modules do not) and ``core_attention``'s kernel
    count (``GPTShape.core_attention``; the ATP and 3-D descriptions count no kernels)."""
    if sequence_parallel and backend != "megatron":
        raise ModelingError(f"--sequence-parallel is described for --tp-backend megatron only (got {backend})")
    if recompute_core_attention and backend != "megatron":
        raise ModelingError(f"--recompute-granularity selective is described for --tp-backend megatron only "
                            f"(got {backend})")
    if backend == "megatron":
        return megatron_1d_gpt_layer(micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn,
                                     tp=tp, bytes_per_element=bytes_per_element, variant=variant,
                                     sequence_parallel=sequence_parallel,
                                     keeps_gathered_input=schedule == "oases",
                                     attention_dropout=attention_dropout, hidden_dropout=hidden_dropout,
                                     recompute_core_attention=recompute_core_attention,
                                     core_attention=core_attention)
    if backend == "atp":
        assert mesh is not None
        return atp_2d_gpt_layer(micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn,
                                d1=mesh[0], d2=mesh[1], bytes_per_element=bytes_per_element,
                                variant=variant)
    if backend == "3d":
        return cube_3d_gpt_layer(micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn,
                                 tp=tp, bytes_per_element=bytes_per_element, variant=variant)
    raise ModelingError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")


def block_edges(*, backend: str, mesh: tuple[int, int] | None, micro_batch: int, seq: int, hidden: int,
                tp: int, bytes_per_element: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) collectives where a run of a backend's layers meets Megatron's
    replicated ``[s, b, h]`` (embedding, pipeline sends, output layer): leaving all-gathers,
    entering splits (its backward all-gathers). None for Megatron 1-D or ATP with d2 = 1."""
    full = micro_batch * seq * hidden * bytes_per_element
    if backend == "atp" and mesh is not None and mesh[1] > 1:
        return ((Collective(name="atp.leave", kind="all_gather", axis="mesh2", group_size=mesh[1],
                            payload_bytes=full),),
                (Collective(name="atp.enter.bwd", kind="all_gather", axis="mesh2", group_size=mesh[1],
                            payload_bytes=full),))
    if backend == "3d":
        return cube_block_edges(micro_batch=micro_batch, seq=seq, hidden=hidden, tp=tp,
                                bytes_per_element=bytes_per_element)
    return (), ()


def axis_ranks(axis: str, tp_ranks: tuple[int, ...], mesh: tuple[int, int] | None) -> tuple[int, ...]:
    """The group of the representative (TP position 0) on ``axis``: tp, mesh1 (stride d2), mesh2;
    cube_z (consecutive), cube_x (stride p), cube_y (stride p^2) in the cube's default order."""
    if axis == "tp":
        return tp_ranks
    if axis.startswith("cube_"):
        p = cube_side(len(tp_ranks))
        stride = {"cube_z": 1, "cube_x": p, "cube_y": p * p}.get(axis)
        if stride is None:
            raise ModelingError(f"unknown collective axis {axis!r}")
        return tp_ranks[::stride][:p]
    d1, d2 = mesh or (len(tp_ranks), 1)
    if axis == "mesh2":
        return tp_ranks[:d2]
    if axis == "mesh1":
        return tp_ranks[::d2]
    raise ModelingError(f"unknown collective axis {axis!r}")


def layer_params(backend: str, h: int, f: int, t: int, mesh: tuple[int, int] | None, *, heads: int = 1,
                 variant: LayerVariant = GPT2) -> int:
    """Weights + biases + norms of one layer on one TP rank."""
    return sum(layer_param_tensors(backend, h, f, t, mesh, heads=heads, variant=variant))


def layer_param_tensors(backend: str, h: int, f: int, t: int, mesh: tuple[int, int] | None, *,
                        heads: int = 1, variant: LayerVariant = GPT2) -> tuple[int, ...]:
    """Sizes of one layer's parameter tensors on one TP rank (they sum to :func:`layer_params`):
    QKV, proj, fc1, fc2 weights and biases, two norms' weight and bias (0: no such tensor), then
    under QK-norm the query and key norms' weight and bias (head_dim each, replicated over TP on
    every backend). The optimizer and the gradient norm run tensor by tensor, so their cost
    depends on these sizes, not only on the sum. ``heads`` matters only with the variant's GQA
    and QK-norm."""
    qkv, fc1 = variant.qkv_rows(h, heads), variant.fc1_rows(f)
    b = 1 if variant.bias else 0
    nb = 1 if variant.normalization == "LayerNorm" else 0
    qk_norms = (h // heads, nb * h // heads) * 2 if variant.qk_norm else ()
    # the vectors' splits: (QKV and fc1 outputs, proj and fc2 outputs and norms)
    if backend == "atp" and mesh is not None:
        out_split, h_split = mesh  # column-first outputs by d1; the hidden dim by d2
    elif backend == "3d":  # TP position 0 holds a diagonal block of every vector (N / p^2)
        out_split = h_split = cube_side(t) ** 2
    else:
        out_split, h_split = t, 1
    return (qkv * h // t, b * qkv // out_split, h * h // t, b * h // h_split, h * fc1 // t,
            b * fc1 // out_split, h * f // t, b * h // h_split, h // h_split, nb * h // h_split,
            h // h_split, nb * h // h_split, *qk_norms)


MLP_PARAM_TENSORS = (4, 5, 6, 7, 10, 11)
"""Positions in ``layer_param_tensors`` of the MLP block's tensors (fc1, fc2, the pre-MLP norm);
the rest (QKV, proj, the input norm, the q/k norms) are the attention block's."""


def block_param_tensors(kind: str, tensors: tuple[int, ...]) -> tuple[int, ...]:
    """The tensors of ``layer_param_tensors`` that belong to block ``kind`` (attention | mlp)."""
    mine = kind == "mlp"
    return tuple(n for i, n in enumerate(tensors) if (i in MLP_PARAM_TENSORS) == mine)


def layer_activation_bytes(backend: str, *, b: int, s: int, h: int, a: int, f: int, t: int, e: int,
                           mesh: tuple[int, int] | None, hidden_dropout: bool = True,
                           attention_dropout: bool = True, variant: LayerVariant = GPT2,
                           recompute_core_attention: bool = False, core_attention: str = "local") -> float:
    """Bytes one layer keeps for backward per micro-batch (no recompute, no SP, stock schedule;
    CUDA kernels).

    Megatron 1-D: the measured inventory of Megatron's local layer (``describe.saved``; with
    dropout, e = 2, f = 4h: Korthikanti et al. 2022's sbh(10 + 24/t) + 5 a s^2 b / t plus norm
    statistics, the causal mask and the fp32 softmax output).
    ATP and 3-D (Korthikanti's terms, not measured; the variant's MLP keeps
    ``mlp_saved_per_ffn`` x ffn): ATP shards norms and residual-side tensors
    by d2, the proj input by d1, the FFN by d1, heads by d1 * d2; under 3-D every saved tensor is
    a rank's own block, 1/t of the TP-1 layer's. ``core_attention`` (``describe.core_attention``):
    Megatron 1-D from the inventory; ATP and 3-D keep Korthikanti's s^2 term where the kernel
    keeps scores, else the fused kernel's logsumexp (its output is the context already counted).
    """
    tok = b * s
    if backend == "megatron" or mesh is None and backend == "atp":
        return layer_saved_bytes(b=b, s=s, h=h, a=a, f=f, t=t, e=e, hidden_dropout=hidden_dropout,
                                 attention_dropout=attention_dropout, variant=variant,
                                 recompute_core_attention=recompute_core_attention, core_attention=core_attention)
    if recompute_core_attention:
        raise ModelingError(f"selective recompute is described for --tp-backend megatron only (got {backend})")
    mlp = variant.mlp_saved_per_ffn * f
    n = t if backend == "3d" else mesh[0] * mesh[1] if mesh is not None else 0
    # Korthikanti's s^2 term (softmax output, dropped-out probabilities, dropout mask) or the fused
    # kernel's statistics, on the rank's a / n heads
    kernel = attention_kernel(core_attention, attention_dropout=attention_dropout,
                              fused_dropout=CUDA_KERNELS.fused_attention_dropout)
    core = a * s * s * b / n * (2 * e + 1) if keeps_scores(kernel) else logsumexp_bytes(b=b, s=s, heads=a / n)
    if backend == "3d":
        return tok * (e * 4 * h + 2 * h + e * (4 * h + mlp)) / t + core
    if backend == "atp" and mesh is not None:
        d1, d2 = mesh
        return tok * (e * (3 * h / d2 + 3 * h / n + h / d1 + mlp / d1) + 2 * h / d2) + core
    raise ModelingError(f"no activation model for backend {backend!r}")


def layer_input_bytes(backend: str, *, b: int, s: int, h: int, e: int, mesh: tuple[int, int] | None,
                      t: int = 1) -> float:
    """One [s, b, h] hidden state as a rank holds it (sharded by d2 under ATP, by t under 3-D)."""
    if backend == "3d":
        return b * s * h * e / t
    d2 = mesh[1] if backend == "atp" and mesh is not None else 1
    return b * s * h * e / d2
