"""The TP backends, one record each: the one table every consumer iterates.

A record points into its backend's description module (``megatron_1d``, ``atp_2d``, ``cube_3d``)
for everything the planner, the simulator and the validation read: the layer, the collectives at
the edges of a run of its layers, the rank group of each collective axis, how its parameter
vectors and hidden states are split, what a layer keeps for backward, the candidate meshes for a
TP size, the one divisibility check (its refusal text) and the event-key tag. It also owns its
layouts (``describe.layout.Layout``, named axes: ``{"tp": 8}``, ``{"d1": 2, "d2": 4}``, the cube
``{"x": 2, "y": 2, "z": 2}``): it parses the launch's layout, labels, lists and refuses layouts, and
names (as ``module:function`` text, resolved where they run, since the runtime sits above
``describe``) its runtime spec builder, its Oases tape and its profiling workloads.
``describe.registry`` answers by backend name from here; ``plan.graph`` offers one strategy family
per record. A new backend is one description module and one row (plus its layers and spec).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from . import atp_2d, cube_3d, megatron_1d
from .layer_query import LayerQuery
from .layout import Layout
from .ops import Collective, LayerDescription, ModelingError
from .planned import ATTENTION_FIRST_BWD, MLP_FIRST

Edges = tuple[tuple[Collective, ...], tuple[Collective, ...]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """One TP backend (``--tp-backend NAME``). Callables take ``tp`` (the TP group's size) and
    ``layout`` (a ``Layout`` on ``layout_axes``; None: the backend's layout at ``tp``, where it
    has one without a flag)."""

    name: str
    summary: str
    """One line: what the layer is."""
    layer: Callable[[LayerQuery], LayerDescription]
    block_edges: Callable[..., Edges]
    """(layout=, micro_batch=, seq=, hidden=, tp=, bytes_per_element=) -> (forward, backward)
    collectives where a run of its layers meets Megatron's replicated ``[s, b, h]``."""
    axes: tuple[str, ...]
    """The collective axes its descriptions name."""
    block_split: tuple[str, str]
    """(the first forward op of the MLP block, the first backward op of the attention block): where
    the planner cuts its layer description into the attention and MLP blocks."""
    axis_ranks: Callable[[str, tuple[int, ...], Layout | None], tuple[int, ...]]
    """(axis, TP group ranks, layout) -> the group of TP position 0 on that axis."""
    vector_splits: Callable[[int, Layout | None], tuple[int, int]]
    """(tp, layout) -> ways a rank splits the QKV / fc1 output vectors and the hidden-size vectors."""
    input_split: Callable[[int, Layout | None], int]
    """(tp, layout) -> ways a rank splits one ``[s, b, h]`` hidden state between layers."""
    saved_bytes: Callable[..., float]
    """Bytes one layer keeps for backward (``registry.layer_activation_bytes``' keywords)."""
    layout_axes: tuple[str, ...]
    """Its layouts' axis names (``Layout.names``)."""
    layouts: Callable[[int], tuple[Layout, ...]]
    """tp -> the layouts to offer at that TP size (planner, simulator search); () if none."""
    layout_refusal: Callable[[Layout | None, int], str]
    """(layout, tp) -> why it cannot lay out a TP group of ``tp`` ranks, "" when it can: one line
    naming the flag, the rule every consumer refuses first."""
    refusal: Callable[..., str]
    """(tp=, layout=, hidden=, heads=, ffn=, micro_batch=, query_groups=) -> why it cannot split
    the model, "" when it can: the rule's one home. Megatron's TP split first, in the flags' words
    (``megatron_1d.tp_split_refusal``: every backend's embedding and output layer are Megatron's),
    then the backend's own, in its description's words. ``query_groups`` None: not checked."""
    run_refusal: Callable[[Any], str]
    """(the run's ``RunConfig``) -> why the trainer cannot run its layers with the run's other flags
    (``--sequence-parallel``, ``--swiglu`` with biases), "" when it can: one line in the trainer's
    words naming the flag (``train_args.validate_layout`` asks it before the split)."""
    kv_groups_divisor: Callable[[int, Layout | None], int]
    """(tp, layout) -> the number the key/value groups must divide by (each rank's whole groups)."""
    event_tag: Callable[[Layout | None], str]
    """layout -> the tag its layer events carry in profile keys (``event_key.layer_shape``)."""
    launch_flags: Callable[[Layout | None], dict[str, str]]
    """layout -> the trainer flags that run the whole model in that layout (``plan --rewrite-cmd``
    for a whole-model plan)."""
    title: Callable[[Layout], str]
    """layout -> its words in the simulator's header (``ATP mesh 2x4``, ``3-D cube``; "" none)."""
    run_words: Callable[[Layout, Any], str]
    """(layout, the run's ``RunConfig``) -> its words in the runtime's start-up line (``1-D TP``,
    ``mesh 2x4, --atp-chunks 1``, ``cube 2x2x2``: ``specs.build_line``)."""
    spec_builder: str
    """``module:function`` building its process groups and layer spec (``specs.SpecBuilder``)."""
    profile_workloads: str
    """``module:function`` that builds the profiler's workload of one of its compute events
    (``sim.calibrate.workloads``)."""
    oases_tape: str | None = None
    """``module:function`` building the Oases executor's tape of one of its layers (two sub-batches,
    fine-grained recompute); None: the Oases executor does not run its layers."""
    layout_flag: str | None = None
    """The trainer flag whose text ``parse_text`` reads (``--atp-mesh``); None: its layout follows
    from the TP size."""
    layout_help: str = ""
    """What ``layout_flag`` takes, for the line that asks for it (``D1,D2 (e.g. ...)``)."""
    parse_text: Callable[[str, int], Layout] | None = None
    """(``layout_flag`` text, tp) -> its layout (one line naming the flag if it is not one)."""
    strategy_tag: Callable[[Layout], str] | None = None
    """layout -> its part of the simulator's strategy label; None: the name and the layout's label."""
    event_dims: Callable[[int, Layout | None], tuple[tuple[str, int], ...]] | None = None
    """(tp, layout) -> the layout's dims in a profile event (None: ``d1 = tp, d2 = 1``, the dims
    profiles have always carried for a layout without ATP's mesh)."""
    real_layer_events: bool = False
    """Its layer events are profiled on a real layer (their keys also carry the dropouts and the
    executor, ``event_key.layer_event_tag``); others run synthetic ops."""
    sequence_parallel: bool = False
    """It runs and describes Megatron's ``--sequence-parallel``."""
    per_block_plans: bool = False
    """Its layers run at per-block TP degrees under ``--oases-plan`` (TP sub-groups and their
    reshards between blocks: the planner's one family that mixes degrees)."""
    empty_local_params: bool = False
    """Some ranks hold empty parameter tensors (the cube's vectors live on its diagonal): Megatron-LM's
    checkpointing must accept them (``runtime.dist_ckpt.with_empty_params_local``)."""
    megatron_modules: bool = False
    """Its layer is Megatron's ``SelfAttention`` and ``MLP``: Megatron's selective recompute
    checkpoints its core attention, and Megatron-LM's options on those modules carry over (the
    others build their own attention and MLP modules)."""

    def default_layout(self, tp: int) -> Layout | None:
        """The layout a launch that names none runs at ``tp``: its one candidate (Megatron's
        ``{"tp": tp}``, the cube); None where it takes ``layout_flag`` or has none at ``tp``."""
        return None if self.layout_flag else next(iter(self.layouts(tp)), None)

    def parse_layout(self, text: str | None, tp: int) -> Layout:
        """The launch's layout from ``layout_flag``'s text (None: the flag not given), checked
        against the TP size; ModelingError, one line in the trainer's words, when it is not one
        (the flag given to a backend that takes none, missing where needed, or refused)."""
        if text is not None and self.parse_text is None:
            raise ModelingError("; ".join(f"{b.layout_flag} needs --tp-backend {b.name}"
                                          for b in BACKENDS.values() if b.layout_flag))
        if text is None:
            layout = self.default_layout(tp)
            if layout is None and self.layout_flag:
                raise ModelingError(f"--tp-backend {self.name} needs {self.layout_flag} {self.layout_help}")
        else:
            layout = self.parse_text(text, tp)
        refused = self.layout_refusal(layout, tp)
        if refused:
            raise ModelingError(refused)
        return layout

    def label(self, layout: Layout | None, tp: int) -> str:
        """The short name of ``layout`` in plan files and logs: the TP size where the layout
        follows from it (no ``layout_flag``: the cube is ``8``), else its sizes (``4x2``)."""
        return layout.label if self.layout_flag and layout is not None else str(tp)

    def layout_of_label(self, text: str) -> Layout | None:
        """Inverse of :meth:`label` (also the sizes of a layout that follows from the TP size);
        None if ``text`` names none of its layouts."""
        layout = Layout.of_label(text, self.layout_axes)
        if layout is None and text.isdigit() and not self.layout_flag:
            layout = self.default_layout(int(text))
        return layout

    def tag(self, layout: Layout | None) -> str:
        """Its part of the simulator's strategy label (``atp2x4``, ``3d``; Megatron's none)."""
        if self.strategy_tag is not None:
            return self.strategy_tag(layout)
        return self.name + (layout.label if layout is not None else "")

    def dims(self, tp: int, layout: Layout | None) -> tuple[tuple[str, int], ...]:
        """The layout's dims in a profile event (``event_dims``)."""
        return self.event_dims(tp, layout) if self.event_dims else (("d1", tp), ("d2", 1))


def resolve(ref: str) -> Any:
    """The object a record names as ``module:function`` (``spec_builder``, ``oases_tape``,
    ``profile_workloads``), imported where it runs."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


BACKENDS: dict[str, Backend] = {
    "megatron": Backend(
        name="megatron", summary="Megatron-Core's 1-D tensor parallelism (column / row-parallel linears)",
        layer=megatron_1d.megatron_1d_layer, block_edges=megatron_1d.megatron_1d_edges, axes=("tp",),
        block_split=(MLP_FIRST, ATTENTION_FIRST_BWD),
        axis_ranks=megatron_1d.megatron_1d_axis_ranks, vector_splits=megatron_1d.megatron_1d_vector_splits,
        input_split=megatron_1d.megatron_1d_input_split, saved_bytes=megatron_1d.megatron_1d_saved_bytes,
        layout_axes=("tp",), layouts=megatron_1d.megatron_1d_layouts,
        layout_refusal=megatron_1d.megatron_1d_layout_refusal, refusal=megatron_1d.megatron_1d_refusal,
        kv_groups_divisor=megatron_1d.megatron_1d_kv_groups_divisor, event_tag=megatron_1d.megatron_1d_event_tag,
        launch_flags=megatron_1d.megatron_1d_launch_flags, title=lambda layout: "", strategy_tag=lambda layout: "",
        run_refusal=lambda cfg: "",
        run_words=lambda layout, cfg: "1-D TP",
        spec_builder="megatron_oases.specs:megatron_builder",
        profile_workloads="megatron_oases.sim.calibrate.workloads:megatron_forward",
        oases_tape="megatron_oases.schedules.oases.tape:megatron_layer_tape",
        real_layer_events=True, sequence_parallel=True, per_block_plans=True, megatron_modules=True),
    "atp": Backend(
        name="atp", summary="ATP's 2-D mesh d1 x d2 = TP inside the TP group (hidden states split by d2)",
        layer=atp_2d.atp_2d_layer, block_edges=atp_2d.atp_2d_edges, axes=("mesh1", "mesh2"),
        block_split=("atp.ln2", "atp.proj.bwd"),
        axis_ranks=atp_2d.atp_2d_axis_ranks, vector_splits=atp_2d.atp_2d_vector_splits,
        input_split=atp_2d.atp_2d_input_split, saved_bytes=atp_2d.atp_2d_saved_bytes,
        layout_axes=atp_2d.AXES, layouts=atp_2d.atp_2d_layouts, layout_refusal=atp_2d.atp_2d_layout_refusal,
        layout_flag="--atp-mesh", layout_help="D1,D2 (e.g. from `megatron-oases mesh`)",
        parse_text=atp_2d.atp_2d_parse_mesh, refusal=atp_2d.atp_2d_refusal,
        kv_groups_divisor=atp_2d.atp_2d_kv_groups_divisor, event_tag=atp_2d.atp_2d_event_tag,
        event_dims=atp_2d.atp_2d_event_dims, launch_flags=atp_2d.atp_2d_launch_flags,
        run_refusal=atp_2d.atp_2d_run_refusal,
        title=lambda layout: f"ATP mesh {layout.label}", strategy_tag=lambda layout: f"atp{layout.label}",
        run_words=lambda layout, cfg: f"mesh {layout.label}, --atp-chunks {cfg.atp_chunks}",
        spec_builder="megatron_oases.specs:atp_builder",
        profile_workloads="megatron_oases.sim.calibrate.workloads:atp_forward",
        oases_tape="megatron_oases.schedules.oases.atp_tape:atp_layer_tape"),
    "3d": Backend(
        name="3d", summary="the 3-D cube p x p x p = TP (Bian et al. 2021)",
        layer=cube_3d.cube_3d_layer, block_edges=cube_3d.cube_3d_edges, axes=("cube_x", "cube_y", "cube_z"),
        block_split=("3d.ln2", "3d.proj.bwd"),
        axis_ranks=cube_3d.cube_3d_axis_ranks, vector_splits=cube_3d.cube_3d_vector_splits,
        input_split=cube_3d.cube_3d_input_split, saved_bytes=cube_3d.cube_3d_saved_bytes,
        layout_axes=cube_3d.AXES, layouts=cube_3d.cube_3d_layouts, layout_refusal=cube_3d.cube_3d_layout_refusal,
        refusal=cube_3d.cube_3d_refusal,
        kv_groups_divisor=cube_3d.cube_3d_kv_groups_divisor, event_tag=cube_3d.cube_3d_event_tag,
        launch_flags=cube_3d.cube_3d_launch_flags, title=lambda layout: "3-D cube", strategy_tag=lambda layout: "3d",
        run_words=lambda layout, cfg: f"cube {layout.label}", run_refusal=cube_3d.cube_3d_run_refusal,
        empty_local_params=True,
        spec_builder="megatron_oases.specs:cube_builder",
        profile_workloads="megatron_oases.sim.calibrate.workloads:cube_forward"),
}
"""Every TP backend by ``--tp-backend`` name, in the order the flags list them."""


def backend(name: str) -> Backend:
    """The record of ``--tp-backend name``; ModelingError naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ModelingError(f"backend must be one of {', '.join(BACKENDS)} (got {name!r})") from None
