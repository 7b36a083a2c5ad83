"""The TP backends, one record each: the one table every consumer iterates.

A record points into its backend's description module (``megatron_1d``, ``atp_2d``, ``cube_3d``)
for everything the planner, the simulator and the validation read: the layer, the collectives at
the edges of a run of its layers, the rank group of each collective axis, how its parameter
vectors and hidden states are split, what a layer keeps for backward, the candidate meshes for a
TP size, the one divisibility check (its refusal text) and the event-key tag. ``describe.registry``
answers by backend name from here; ``plan.graph`` offers one strategy family per record. A new
backend is one description module and one row (plus its layers and spec).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from . import atp_2d, cube_3d, megatron_1d
from .layer_query import LayerQuery, Mesh
from .ops import Collective, LayerDescription, ModelingError

Edges = tuple[tuple[Collective, ...], tuple[Collective, ...]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """One TP backend (``--tp-backend NAME``). Callables take ``tp`` (the TP group's size) and
    ``mesh`` (ATP's (d1, d2); None for the others)."""

    name: str
    summary: str
    """One line: what the layer is."""
    layer: Callable[[LayerQuery], LayerDescription]
    block_edges: Callable[..., Edges]
    """(mesh=, micro_batch=, seq=, hidden=, tp=, bytes_per_element=) -> (forward, backward)
    collectives where a run of its layers meets Megatron's replicated ``[s, b, h]``."""
    axes: tuple[str, ...]
    """The collective axes its descriptions name."""
    axis_ranks: Callable[[str, tuple[int, ...], Mesh | None], tuple[int, ...]]
    """(axis, TP group ranks, mesh) -> the group of TP position 0 on that axis."""
    vector_splits: Callable[[int, Mesh | None], tuple[int, int]]
    """(tp, mesh) -> ways a rank splits the QKV / fc1 output vectors and the hidden-size vectors."""
    input_split: Callable[[int, Mesh | None], int]
    """(tp, mesh) -> ways a rank splits one ``[s, b, h]`` hidden state between layers."""
    saved_bytes: Callable[..., float]
    """Bytes one layer keeps for backward (``registry.layer_activation_bytes``' keywords)."""
    meshes: Callable[[int], tuple[Mesh | None, ...]]
    """tp -> the layouts to offer at that TP size (planner, simulator search); () if none."""
    refusal: Callable[..., str]
    """(tp=, mesh=, hidden=, heads=, ffn=, micro_batch=, query_groups=) -> why it cannot split
    the model, "" when it can: the rule's one home. Megatron's TP split first, in the flags' words
    (``megatron_1d.tp_split_refusal``: every backend's embedding and output layer are Megatron's),
    then the backend's own, in its description's words. ``query_groups`` None: not checked."""
    kv_groups_divisor: Callable[[int, Mesh | None], int]
    """(tp, mesh) -> the number the key/value groups must divide by (each rank's whole groups)."""
    event_tag: Callable[[Mesh | None], str]
    """mesh -> the tag its layer events carry in profile keys (``event_key.layer_shape``)."""
    launch_flags: Callable[[Mesh | None], dict[str, str]]
    """mesh -> the trainer flags that run the whole model in that layout (``plan --rewrite-cmd``
    for a whole-model plan)."""
    real_layer_events: bool = False
    """Its layer events are profiled on a real layer (their keys also carry the dropouts and the
    executor, ``event_key.layer_event_tag``); others run synthetic ops."""
    oases_tape: bool = False
    """The Oases executor runs its layers (two sub-batches, fine-grained recompute)."""
    sequence_parallel: bool = False
    """It runs and describes Megatron's ``--sequence-parallel``."""
    megatron_modules: bool = False
    """Its layer is Megatron's ``SelfAttention`` and ``MLP``: Megatron's selective recompute
    checkpoints its core attention, and Megatron-LM's options on those modules carry over (the
    others build their own attention and MLP modules)."""


BACKENDS: dict[str, Backend] = {
    "megatron": Backend(
        name="megatron", summary="Megatron-Core's 1-D tensor parallelism (column / row-parallel linears)",
        layer=megatron_1d.megatron_1d_layer, block_edges=megatron_1d.megatron_1d_edges, axes=("tp",),
        axis_ranks=megatron_1d.megatron_1d_axis_ranks, vector_splits=megatron_1d.megatron_1d_vector_splits,
        input_split=megatron_1d.megatron_1d_input_split, saved_bytes=megatron_1d.megatron_1d_saved_bytes,
        meshes=megatron_1d.megatron_1d_meshes, refusal=megatron_1d.megatron_1d_refusal,
        kv_groups_divisor=megatron_1d.megatron_1d_kv_groups_divisor, event_tag=megatron_1d.megatron_1d_event_tag,
        launch_flags=megatron_1d.megatron_1d_launch_flags,
        real_layer_events=True, oases_tape=True, sequence_parallel=True, megatron_modules=True),
    "atp": Backend(
        name="atp", summary="ATP's 2-D mesh d1 x d2 = TP inside the TP group (hidden states split by d2)",
        layer=atp_2d.atp_2d_layer, block_edges=atp_2d.atp_2d_edges, axes=("mesh1", "mesh2"),
        axis_ranks=atp_2d.atp_2d_axis_ranks, vector_splits=atp_2d.atp_2d_vector_splits,
        input_split=atp_2d.atp_2d_input_split, saved_bytes=atp_2d.atp_2d_saved_bytes,
        meshes=atp_2d.atp_2d_meshes, refusal=atp_2d.atp_2d_refusal,
        kv_groups_divisor=atp_2d.atp_2d_kv_groups_divisor, event_tag=atp_2d.atp_2d_event_tag,
        launch_flags=atp_2d.atp_2d_launch_flags, oases_tape=True),
    "3d": Backend(
        name="3d", summary="the 3-D cube p x p x p = TP (Bian et al. 2021)",
        layer=cube_3d.cube_3d_layer, block_edges=cube_3d.cube_3d_edges, axes=("cube_x", "cube_y", "cube_z"),
        axis_ranks=cube_3d.cube_3d_axis_ranks, vector_splits=cube_3d.cube_3d_vector_splits,
        input_split=cube_3d.cube_3d_input_split, saved_bytes=cube_3d.cube_3d_saved_bytes,
        meshes=cube_3d.cube_3d_meshes, refusal=cube_3d.cube_3d_refusal,
        kv_groups_divisor=cube_3d.cube_3d_kv_groups_divisor, event_tag=cube_3d.cube_3d_event_tag,
        launch_flags=cube_3d.cube_3d_launch_flags),
}
"""Every TP backend by ``--tp-backend`` name, in the order the flags list them."""


def backend(name: str) -> Backend:
    """The record of ``--tp-backend name``; ModelingError naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ModelingError(f"backend must be one of {', '.join(BACKENDS)} (got {name!r})") from None
