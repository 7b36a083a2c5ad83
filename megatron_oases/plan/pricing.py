"""The planner's one seam to measured or modelled times: a ``Pricer``.

The cost model asks a Pricer for milliseconds of a ``Compute`` segment or a ``Collective`` on a
rank group; it never reads a profile or a device model itself. ``DevicePricer`` is the one we
ship: it names every event exactly as the simulator does (``sim.core.events``: ``compute:<name>[<shape>]``
and ``<kind>:<name>[<shape>]@<axis>x<group class>``), takes the time from a ``ProfileDB``
(``pricing.device_model``, format ``megatron-oases-profile/*``) when the key is there, and otherwise
from the analytical ``DeviceModel`` on the topology. One profile thus serves simulator and planner.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from megatron_oases.describe.backends import backend
from megatron_oases.describe.core_attention import scores_on_chip
from megatron_oases.describe.event_key import layer_shape
from megatron_oases.describe.ops import Collective, Compute
from megatron_oases.pricing.device_model import (GPUS, DeviceModel, ProfileDB, SimError, gpu_spec,
                                                 resolve_gpu_name)
from megatron_oases.pricing.event import Event, group_tag
from megatron_oases.topology import Topology

from .graph import PlanError, PlanModel


Dims = tuple[tuple[str, Any], ...]


class Pricer(Protocol):
    """Milliseconds of one event on one rank. ``shape`` names the event's sizes as the simulator
    does; ``dims`` are the same sizes as data (what the profiler needs to run the event)."""

    def compute_ms(self, op: Compute, *, shape: str, dims: Dims = ()) -> float: ...

    def collective_ms(self, op: Collective, *, shape: str, ranks: tuple[int, ...], dims: Dims = ()) -> float: ...

    def summary(self) -> dict: ...


def event_shape(m: PlanModel, samples: int, strategy) -> tuple[str, Dims]:
    """(shape, dims) of a block's events under ``strategy``, spelt as the simulator spells them
    (``describe.event_key.layer_shape``): samples per (sub-)batch, model sizes, degree, mesh or
    cube, dtype, dropout, executor (the schedule's: a degree-1 block runs one sub-batch through
    the Oases executor) and core attention."""
    return layer_shape(b=samples, s=m.seq_length, h=m.hidden_size, a=m.num_attention_heads,
                       f=m.ffn_hidden_size, t=strategy.degree, v=m.padded_vocab_size, dtype=m.dtype,
                       backend=strategy.family, layout=strategy.layout, hidden_dropout=m.hidden_dropout,
                       attention_dropout=m.attention_dropout, chains=m.sub_batches, variant=m.variant,
                       sequence_parallel=m.sequence_parallel and backend(strategy.family).sequence_parallel,
                       core_attention=m.core_attention, attention_kernels=m.attention_kernels)


def resolve_gpu(name: str) -> str:
    """A GPU name of the device model's table (``pricing.device_model.resolve_gpu_name``), with
    the planner's error."""
    try:
        return resolve_gpu_name(name)
    except SimError:
        raise PlanError(f"unknown GPU {name!r} (pass --gpu one of {', '.join(GPUS)})") from None


@dataclasses.dataclass
class DevicePricer:
    """Profile first, analytical device model (``pricing.device_model.DeviceModel``) otherwise."""

    topology: Topology
    model: PlanModel
    gpu: str | None = None
    profile_path: str | None = None
    strict: bool = False
    """With a profile: every event must be in it (a missing key is an error naming it)."""

    def __post_init__(self) -> None:
        name = self.gpu or self.topology.device
        if not name:
            raise PlanError(f"topology {self.topology.name!r} names no device; pass --gpu")
        profile = None
        if self.profile_path:
            try:
                profile = ProfileDB.load(self.profile_path)
            except SimError as e:
                raise PlanError(f"--profile {e}") from None
        # the stack is DeviceModel's default, ``local``: what the plan's runtime (our builds, no
        # Apex) runs; the core attention is the plan model's, as the simulator prices it
        self._dm = DeviceModel(gpu=gpu_spec(resolve_gpu(name)), topology=self.topology, profile=profile,
                               bytes_per_element=self.model.bytes_per_element,
                               fused_attention=scores_on_chip(self.model.core_attention))
        self._cache: dict[str, float] = {}
        self.events: dict[str, Any] = {}
        """key -> ``pricing.event.Event`` of everything priced (``profile_events`` can measure them)."""
        self.from_profile = 0
        self.analytical = 0
        self.missing: list[str] = []

    def _price(self, key: str, op, *, kind: str, ranks: tuple[int, ...] = (), dims: Dims = ()) -> float:
        if key in self._cache:
            return self._cache[key]
        self.events[key] = Event(key=key, name=op.name, kind=kind, op=op, ranks=tuple(ranks),
                                 nbytes=getattr(op, "payload_bytes", 0), dims=tuple(dims))
        prof = self._dm.profile
        if prof is not None and key in prof.events_ms:
            self.from_profile += 1
        else:
            if prof is not None:
                if self.strict:
                    raise PlanError(f"--profile {self.profile_path} lacks event {key}; measure it with "
                                    "`megatron-oases profile` or drop --strict-profile")
                self.missing.append(key)
            self.analytical += 1
        try:
            t = float(self._dm.price(key, op, kind=kind, nbytes=getattr(op, "payload_bytes", 0), ranks=ranks))
        except SimError as e:
            raise PlanError(str(e)) from None
        self._cache[key] = t
        return t

    def compute_ms(self, op: Compute, *, shape: str, dims: Dims = ()) -> float:
        return self._price(f"compute:{op.name}[{shape}]", op, kind="compute", dims=dims)

    def collective_ms(self, op: Collective, *, shape: str, ranks: tuple[int, ...], dims: Dims = ()) -> float:
        if len(ranks) <= 1:
            return 0.0
        bad = [r for r in ranks if r >= self.topology.world_size]
        if bad:
            raise PlanError(f"topology {self.topology.name!r} has {self.topology.world_size} ranks; the plan "
                            f"needs rank {bad[0]} ({op.name} on {len(ranks)} ranks)")
        key = f"{op.kind}:{op.name}[{shape}]@{op.axis}x{group_tag(self.topology, tuple(ranks))}"
        return self._price(key, op, kind="collective", ranks=tuple(ranks), dims=dims)

    def summary(self) -> dict:
        out = {"gpu": self._dm.gpu.name, "topology": self.topology.name,
               "events_from_profile": self.from_profile, "events_analytical": self.analytical}
        if self.profile_path:
            out["profile"] = self.profile_path
            out["profile_missing"] = sorted(set(self.missing))[:20]
        return out
