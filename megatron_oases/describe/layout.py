"""A TP backend's layout: the TP group's ranks as a grid with named axes.

Megatron 1-D is ``{"tp": 8}``, ATP's mesh ``{"d1": 2, "d2": 4}``, the 3-D cube
``{"x": 2, "y": 2, "z": 2}``: in the spirit of Megatron-Core's ``HyperCommGrid`` (a shape with
dimension names, its size their product). Each backend record (``describe.backends``) parses,
labels, lists and refuses its own layouts; everything else (the simulator's ``Strategy``, the
planner's strategies, plan files, ``RunConfig.layout``) carries a ``Layout`` without knowing which
backend's axes it names, so a backend with another number of axes needs no new type.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from .ops import ModelingError

BACKEND_FLAG = "--tp-backend"
"""The flag that names a run's TP backend (each record's ``launch_flags`` key); ``megatron_oases.flags``
declares it under this name, so the name is written once below the front ends."""


class Layout:
    """Named axis sizes, in order (frozen, hashable; equal when names and sizes are)."""

    __slots__ = ("_axes",)

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]] = (), **sizes: int) -> None:
        items = tuple((axes.items() if isinstance(axes, Mapping) else axes)) + tuple(sizes.items())
        if not items:
            raise ModelingError("a layout needs at least one axis")
        names = [n for n, _ in items]
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ModelingError(f"layout axis names must be distinct non-empty strings (got {names})")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for _, v in items):
            raise ModelingError(f"layout axis sizes must be integers >= 1 (got {dict(items)})")
        object.__setattr__(self, "_axes", tuple((n, int(v)) for n, v in items))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Layout is frozen")

    def __reduce__(self):  # pickle / copy: rebuild through __init__ (the slot is frozen)
        return (Layout, (self._axes,))

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) per axis, in order."""
        return self._axes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(v for _, v in self._axes)

    @property
    def size(self) -> int:
        """Ranks in the grid: the product of the axes (the TP size it lays out)."""
        return math.prod(self.shape)

    def __getitem__(self, name: str) -> int:
        for n, v in self._axes:
            if n == name:
                return v
        raise KeyError(f"layout {self} has no axis {name!r} (axes: {', '.join(self.names)})")

    @property
    def label(self) -> str:
        """The sizes joined by ``x`` (``2x4``): short, for logs, event keys and plan labels, where
        the backend's name says which axes they are (:meth:`of_label` reads it back)."""
        return "x".join(map(str, self.shape))

    @classmethod
    def of_label(cls, text: str, names: tuple[str, ...]) -> Layout | None:
        """The layout a :attr:`label` names on axes ``names``; None if ``text`` is not one."""
        sizes = text.split("x")
        if len(sizes) != len(names) or not all(s.isdigit() and int(s) >= 1 for s in sizes):
            return None
        return cls(zip(names, map(int, sizes)))

    def to_json(self) -> dict[str, int]:
        """``{"d1": 2, "d2": 4}``: the form plan files store (JSON keeps the order)."""
        return dict(self._axes)

    @classmethod
    def from_json(cls, data: Any, names: tuple[str, ...] | None = None) -> Layout:
        """Inverse of :meth:`to_json`. A bare list of sizes (``[2, 4]``, how files stored ATP's
        mesh before layouts had names) reads on the axes ``names`` of the backend that wrote it."""
        if isinstance(data, Mapping):
            return cls(data)
        if isinstance(data, (list, tuple)) and names is not None and len(data) == len(names):
            return cls(zip(names, data))
        raise ModelingError(f"a layout is a JSON object of axis sizes such as {{\"d1\": 2, \"d2\": 4}} "
                            f"(got {data!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._axes == other._axes

    def __hash__(self) -> int:
        return hash(self._axes)

    def __repr__(self) -> str:
        return f"Layout({dict(self._axes)!r})"

    def __str__(self) -> str:
        return ",".join(f"{n}={v}" for n, v in self._axes)
