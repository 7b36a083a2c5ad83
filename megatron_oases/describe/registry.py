"""The backends by name: layer description, collective groups, parameters, activation bytes.

Thin lookups into the backend records (``describe.backends``), under the names the planner, the
simulator and the tests call."""
from __future__ import annotations

from .backends import BACKENDS as RECORDS, backend as record
from .layer_query import LayerQuery
from .layout import Layout
from .moe import MoEShape, moe_layer
from .ops import GPT2, Collective, LayerDescription, LayerVariant, ModelingError

BACKENDS = RECORDS
"""The ``--tp-backend`` names, in the records' order (the table itself, so that a record added
later, as the tests' fake backend, is one of them)."""


def layer_description(*, backend: str, layout: Layout | None, micro_batch: int, seq: int,
                      hidden: int, heads: int, ffn: int, tp: int, bytes_per_element: int,
                      variant: LayerVariant = GPT2, sequence_parallel: bool = False,
                      schedule: str = "stock", attention_dropout: bool = False,
                      hidden_dropout: bool = False, recompute_core_attention: bool = False,
                      core_attention: str = "local", moe: MoEShape | None = None, ep: int = 1) -> LayerDescription:
    """A backend's layer; ``sequence_parallel`` only on Megatron 1-D, whose Oases tape
    (``schedule="oases"``) keeps the all-gathered column inputs instead of re-gathering them.
    The dropouts' element-wise traffic is described for Megatron 1-D only, and so is
    ``recompute_core_attention`` (selective recompute: Megatron's attention module checkpoints
    its core attention; the ATP and 3-D attention modules do not). ``core_attention``'s kernel
    count (``GPTShape.core_attention``) holds for every backend (ATP and 3-D count their segments'
    kernels with it: ``describe.atp_2d.mesh_segment_kernels``). ``moe``:
    an MoE layer (``describe.moe``, Megatron's own modules only) with ``ep`` expert-parallel ranks,
    under ``schedule="oases"`` as the Oases executor's MoE tape runs it."""
    if sequence_parallel and not (backend in RECORDS and record(backend).sequence_parallel):
        raise ModelingError(f"--sequence-parallel is described for --tp-backend megatron only (got {backend})")
    if recompute_core_attention and not (backend in RECORDS and record(backend).megatron_modules):
        raise ModelingError(f"--recompute-granularity selective is described for --tp-backend megatron only "
                            f"(got {backend})")
    if moe is not None and not (backend in RECORDS and record(backend).megatron_modules):
        raise ModelingError(f"--num-experts is described for --tp-backend megatron only (got {backend})")
    dense = record(backend).layer(LayerQuery(
        layout=layout, micro_batch=micro_batch, seq=seq, hidden=hidden, heads=heads, ffn=ffn, tp=tp,
        bytes_per_element=bytes_per_element, variant=variant, sequence_parallel=sequence_parallel,
        schedule=schedule, attention_dropout=attention_dropout, hidden_dropout=hidden_dropout,
        recompute_core_attention=recompute_core_attention, core_attention=core_attention))
    if moe is None:
        return dense
    return moe_layer(dense, micro_batch=micro_batch, seq=seq, hidden=hidden, moe=moe, tp=tp, ep=ep,
                     bytes_per_element=bytes_per_element, variant=variant, hidden_dropout=hidden_dropout,
                     oases=schedule == "oases")


def block_edges(*, backend: str, layout: Layout | None, micro_batch: int, seq: int, hidden: int,
                tp: int, bytes_per_element: int) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) collectives where a run of a backend's layers meets Megatron's
    replicated ``[s, b, h]`` (embedding, pipeline sends, output layer): leaving all-gathers,
    entering splits (its backward all-gathers). None for Megatron 1-D or ATP with d2 = 1."""
    return record(backend).block_edges(layout=layout, micro_batch=micro_batch, seq=seq, hidden=hidden, tp=tp,
                                       bytes_per_element=bytes_per_element)


def axis_ranks(axis: str, tp_ranks: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """The group of the representative (TP position 0) on ``axis``, from the backend that names the
    axis: tp; mesh1 (stride d2), mesh2; cube_z (consecutive), cube_x (stride p), cube_y (stride p^2)
    in the cube's default order."""
    for b in RECORDS.values():
        if axis in b.axes:
            return b.axis_ranks(axis, tp_ranks, layout)
    raise ModelingError(f"unknown collective axis {axis!r}")


def layer_params(backend: str, h: int, f: int, t: int, layout: Layout | None, *, heads: int = 1,
                 variant: LayerVariant = GPT2) -> int:
    """Weights + biases + norms of one layer on one TP rank."""
    return sum(layer_param_tensors(backend, h, f, t, layout, heads=heads, variant=variant))


def layer_param_tensors(backend: str, h: int, f: int, t: int, layout: Layout | None, *,
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
    out_split, h_split = record(backend).vector_splits(t, layout)
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
                           layout: Layout | None, hidden_dropout: bool = True,
                           attention_dropout: bool = True, variant: LayerVariant = GPT2,
                           recompute_core_attention: bool = False, core_attention: str = "local") -> float:
    """Bytes one layer keeps for backward per micro-batch (no recompute, no SP, stock schedule;
    CUDA kernels): the backend's ``saved_bytes`` (Megatron 1-D: the measured inventory,
    ``describe.saved``; ATP and 3-D: their layers' measured inventory,
    ``saved.mesh_layer_saved_bytes`` through ``atp_2d.atp_2d_saved_bytes`` and
    ``cube_3d.cube_3d_saved_bytes``)."""
    return record(backend).saved_bytes(b=b, s=s, h=h, a=a, f=f, t=t, e=e, layout=layout, hidden_dropout=hidden_dropout,
                                       attention_dropout=attention_dropout, variant=variant,
                                       recompute_core_attention=recompute_core_attention,
                                       core_attention=core_attention)


def layer_input_bytes(backend: str, *, b: int, s: int, h: int, e: int, layout: Layout | None,
                      t: int = 1) -> float:
    """One [s, b, h] hidden state as a rank holds it (sharded by d2 under ATP, by t under 3-D)."""
    return b * s * h * e / record(backend).input_split(t, layout)
