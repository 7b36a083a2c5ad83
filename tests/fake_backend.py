"""A fake fourth TP backend with a three-axis layout ``{"a": p, "b": p, "c": p}``, for
``tests/test_fake_backend.py``: one record row (``describe.backends.Backend``) and the parts it
names, nothing else. Its layer is the cube's with its own event names (``fake.qkv``, ...), so its
numbers can be checked against the cube's; it names its own layout rules, block split and
profiling workloads (which count the events they build), and borrows the cube's runtime spec."""
from __future__ import annotations

import dataclasses

from megatron_oases.describe.backends import BACKENDS
from megatron_oases.describe.cube_3d import cube_3d_layer, cube_root
from megatron_oases.describe.layout import Layout
from megatron_oases.describe.ops import LayerDescription

AXES = ("a", "b", "c")

BUILT: list[str] = []
"""The compute events whose profiling workload :func:`workloads` built."""


def layouts(tp: int) -> tuple[Layout, ...]:
    p = cube_root(tp)
    return (Layout(zip(AXES, (p,) * 3)),) if p is not None and p >= 2 else ()


def layout_refusal(layout: Layout | None, tp: int) -> str:
    if layout is None and layouts(tp) or layout in layouts(tp):
        return ""
    return f"--tp-backend fake lays out --tensor-model-parallel-size p^3 as a=b=c=p (got {layout}, TP {tp})"


def _own(op):
    return dataclasses.replace(op, name="fake." + op.name[3:]) if op.name.startswith("3d.") else op


def layer(q) -> LayerDescription:
    """The cube's layer, its compute segments named ``fake.*``."""
    cube = cube_3d_layer(q)
    return LayerDescription(backend="fake", forward=tuple(map(_own, cube.forward)),
                            backward=tuple(map(_own, cube.backward)))


def workloads(name, dims, maker):
    """The cube's workload of the same segment, counted."""
    from megatron_oases.sim.calibrate.workloads import cube_forward

    if not name.startswith("fake."):
        return None
    BUILT.append(name)
    return cube_forward("3d." + name[len("fake."):], dims, maker)


FAKE = dataclasses.replace(
    BACKENDS["3d"], name="fake", summary="a test backend: the cube's layer on a three-axis layout a x b x c",
    layer=layer, block_split=("fake.ln2", "fake.proj.bwd"), layout_axes=AXES, layouts=layouts,
    layout_refusal=layout_refusal,
    title=lambda layout: f"fake grid {layout.label}", strategy_tag=None, event_tag=lambda layout: "fake",
    run_words=lambda layout, cfg: f"grid {layout}", launch_flags=lambda layout: {"--tp-backend": "fake"},
    profile_workloads="tests.fake_backend:workloads")
"""The fake record; the tests add it to ``BACKENDS`` (the one edit a backend makes to the package)."""

NEW_PARTS = ("layer", "spec_builder", "profile_workloads")
"""The record's fields a new backend fills from modules of its own (docs/architecture.md: its
description, its layers with their spec builder, its profiling workloads); the rest of the row
points into them or is data."""
