"""Stand-ins for TP collectives: a kernel of priced duration with NCCL's stream semantics.

Each watched collective (``parallel.collectives.replace_watched_collectives``) becomes:
record an event on the current stream; the group's side ("communication") stream waits on it;
the stand-in kernel runs on that side stream; a sync call then makes the current stream wait
for its done event, an ``async_op`` call returns a handle whose ``wait()`` does. That is what
ProcessGroupNCCL does with its own stream, so stock Megatron (sync all-reduces on the critical
path; its async input-gradient all-reduce beside the weight-gradient GEMM) and the Oases executor
(async handles, waited when needed) get the same treatment. The handle keeps the call's tensors
alive until ``wait()`` (what NCCL does without ``recordStream``), so the caching allocator cannot
hand their memory to the current stream while the side stream may still run.

Two kernels bracket what NCCL does to the other stream's compute:

* ``sleep``: ``torch.cuda._sleep`` (a spin on the SM clock, one block): leaves the SMs and the
  memory bandwidth free, so it measures the overlap the schedule allows (no contention);
* ``copy``: device-to-device copies of the collective's bytes, repeated to fill the duration at
  the calibrated copy rate: uses memory bandwidth (and SMs) for the whole duration, more than
  NCCL does at a link's rate, so it bounds contention from above;
* ``channels``: the same copies on ``channels`` thread blocks only (``channel_copy``, Triton), as
  NCCL runs a collective on its channels: a few SMs and the bandwidth they draw. On CPU it runs
  as ``copy``.
* ``nccl``: what NCCL itself takes (``paced_copy``, Triton): as many resident blocks as NCCL has
  channels for the link (``nccl_channels``) for the priced duration, moving the bytes the rank
  sends (``ring_factor`` x payload) at the link's rate, not at memory speed. On CPU: the bytes
  copied once, then a sleep for the rest of the duration.

``comm_disabled`` stand-ins last zero time (the stream hand-offs stay): the step with TP
communication switched off.

Durations are priced by ``pricing.DeviceModel.collective_ms`` (the project's ring formula) on a
one-level topology of the chosen link. On CPU (tests) there are no streams: the runtime's no-op
streams and events make the same code run the stand-in synchronously (``time.sleep`` / a tensor
copy): the mechanics are tested there, not the overlap.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import torch

KINDS = ("sleep", "copy", "channels", "nccl")
CHANNELS = 16
"""Blocks of the ``channels`` stand-in: NCCL's channel count for a ring on an NVLink node."""
NCCL_CHANNEL_GBps = 25.0
"""Link bandwidth per pair of NCCL channels: NCCL launches two blocks per NVLink (25 GB/s a
direction) to saturate it, and duplicates a PCIe or network ring's one channel."""
NCCL_MAX_CHANNELS = 32
"""NCCL's ``MAXCHANNELS``."""


def nccl_channels(link_GBps: float) -> int:
    """The blocks NCCL runs a ring collective on over this link: 2 per 25 GB/s, at most 32 (2 on
    a 24 GB/s PCIe link, 12 at 150 GB/s, 24 on an A100's NVLink, 32 on an H100's)."""
    return min(NCCL_MAX_CHANNELS, 2 * math.ceil(link_GBps / NCCL_CHANNEL_GBps))


def wire_bytes(kind: str, payload_bytes: int, group_size: int) -> int:
    """The bytes one rank sends over the link for the collective (ring algorithm)."""
    from megatron_oases.describe.ops import ring_factor

    return int(ring_factor(kind, group_size) * payload_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """The emulated TP link the stand-ins are priced on."""

    GBps: float
    """Link bandwidth per rank, GB/s (the topology level's p2p and group bandwidth)."""
    latency_us: float = 5.0
    """One-way latency per ring step, microseconds."""

    def __post_init__(self) -> None:
        if not self.GBps > 0 or self.latency_us < 0:
            raise ValueError(f"link: bandwidth must be > 0 GB/s and latency >= 0 us "
                             f"(got {self.GBps}, {self.latency_us})")

    def collective_ms(self, kind: str, payload_bytes: float, group_size: int) -> float:
        """The collective's time on a ring of ``group_size`` ranks over this link."""
        return _device_model(self, group_size).collective_ms(kind, payload_bytes, tuple(range(group_size)))


def link_topology(link: Link, n: int, device: str | None = None):
    """The one-level topology of ``n`` ranks over ``link`` the stand-ins are priced on (the
    simulator prices a run on it the same way, ``scripts/sim_vs_standin.py``)."""
    from megatron_oases.topology import Level, Topology

    level = Level(name="standin", size=n, scope="intra_node", p2p_bandwidth_GBps=link.GBps,
                  group_bandwidth_GBps=link.GBps, latency_us=link.latency_us)
    return Topology(name="standin", device=device, levels=(level,))


@functools.lru_cache(maxsize=16)
def _device_model(link: Link, n: int):
    from megatron_oases.pricing.device_model import device_model

    # The GPU entry is not read: only collectives are priced here.
    return device_model(link_topology(link, n), gpu="h100-sxm")


def link_matching(target_ms: float, calls, latency_us: float) -> Link:
    """The link on which ``calls`` ((kind, group size, payload bytes) of one step) take
    ``target_ms`` in all (bisection on the bandwidth: the price falls as it rises)."""
    def total(gbps):
        link = Link(GBps=gbps, latency_us=latency_us)
        return sum(link.collective_ms(k, b, n) for k, n, b in calls)

    if not calls or total(1e9) >= target_ms:
        raise ValueError(f"no link speed makes the step's {len(calls)} stand-ins take {target_ms:.3f} ms "
                         f"(latency alone: {total(1e9) if calls else 0:.3f} ms); lower --latency-us")
    lo, hi = 1e-6, 1e9
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if total(mid) > target_ms else (lo, mid)
    return Link(GBps=hi, latency_us=latency_us)


# ---- timing and calibration ------------------------------------------------------------------
def time_ms(rt, fn) -> float:
    """Time of ``fn()`` on the device: CUDA events after a synchronize, the wall clock on CPU."""
    rt.synchronize()
    start, end = rt.event(enable_timing=True), rt.event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    rt.synchronize()
    return start.elapsed_time(end) if rt.is_cuda else (time.perf_counter() - t0) * 1e3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """What the stand-in kernels need, measured on this device at start-up."""

    sleep_cycles_per_ms: float | None
    """``torch.cuda._sleep`` cycles per millisecond (CUDA only; a slope of two lengths, so the
    launch cost drops out)."""
    copy_GBps: float
    """Bytes a device-to-device ``copy_`` of ``scratch_bytes`` moves per second, /1e9."""
    scratch_bytes: int
    channel_GBps: float | None = None
    """The same for ``channel_copy`` on ``channels`` blocks (CUDA, when calibrated with them)."""
    channels: int = CHANNELS
    nccl_blocks: int | None = None
    """Blocks of the ``nccl`` stand-in (``calibrate_nccl``)."""
    nccl_GBps: float | None = None
    """The most ``paced_copy`` moves on ``nccl_blocks`` blocks unpaced (CUDA): a link faster than
    this is not kept up with."""


def calibrate(rt, scratch_bytes: int, reps: int = 5,
              channels: int | None = None) -> tuple[Calibration, torch.Tensor, torch.Tensor]:
    """Measure the sleep and copy rates (and, on CUDA with ``channels``, the rate of a copy on
    that many blocks); returns them and the two scratch buffers."""
    src = torch.empty(scratch_bytes, dtype=torch.uint8, device=rt.device)
    dst = torch.empty_like(src)
    src.fill_(1)
    med = lambda fn: statistics.median(time_ms(rt, fn) for _ in range(reps))  # noqa: E731
    med(lambda: dst.copy_(src))  # warm-up
    copy_ms = med(lambda: dst.copy_(src))
    cycles = None
    if rt.is_cuda:
        short, long_ = 2_000_000, 20_000_000
        t_short, t_long = med(lambda: torch.cuda._sleep(short)), med(lambda: torch.cuda._sleep(long_))
        cycles = (long_ - short) / max(t_long - t_short, 1e-6)
    channel_GBps = None
    if rt.is_cuda and channels:
        from benchmarks.standin.channel_copy import channel_copy

        med(lambda: channel_copy(src, dst, scratch_bytes, channels))  # compile
        channel_GBps = scratch_bytes / max(med(lambda: channel_copy(src, dst, scratch_bytes, channels)), 1e-6) / 1e6
    return Calibration(sleep_cycles_per_ms=cycles, copy_GBps=scratch_bytes / max(copy_ms, 1e-6) / 1e6,
                       scratch_bytes=scratch_bytes, channel_GBps=channel_GBps,
                       channels=channels or CHANNELS), src, dst


def calibrate_nccl(rt, cal: Calibration, src: torch.Tensor, dst: torch.Tensor, blocks: int,
                   reps: int = 5) -> Calibration:
    """``cal`` with the ``nccl`` stand-in's blocks and, on CUDA, the rate they reach unpaced."""
    if not rt.is_cuda:
        return dataclasses.replace(cal, nccl_blocks=blocks)
    from benchmarks.standin.paced_copy import paced_copy

    stamps = torch.zeros(2 * blocks, dtype=torch.int64, device=rt.device)
    run = lambda: paced_copy(src, dst, cal.scratch_bytes, ms=0.0, GBps=0.0, blocks=blocks, stamps=stamps)  # noqa: E731
    run()  # compile
    ms = statistics.median(time_ms(rt, run) for _ in range(reps))
    return dataclasses.replace(cal, nccl_blocks=blocks, nccl_GBps=cal.scratch_bytes / max(ms, 1e-6) / 1e6)


# ---- the stand-ins ---------------------------------------------------------------------------------
class StandInWork:
    """The async handle: ``wait()`` makes the current stream wait for the stand-in (the host does
    not block), then lets the call's tensors go."""

    def __init__(self, done, keep: tuple):
        self._done, self._keep = done, keep

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        self._keep = ()
        return True

    def is_completed(self) -> bool:
        return self._done.query()

    def is_success(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Issued:
    """One stand-in as issued in a step."""

    kind: str
    group_size: int
    payload_bytes: int
    ms: float
    async_op: bool
    group: object = dataclasses.field(compare=False, repr=False)

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.kind, self.payload_bytes, self.group_size)


class StandIns:
    """The replacement for ``replace_watched_collectives``: each call runs a ``kernel`` stand-in
    (one of ``KINDS``) of its priced duration, zero with ``comm_disabled``, on its group's side
    stream; ``issued`` lists them (``clear()`` between steps). ``priced``, a predicate on the call,
    prices only the calls it accepts: the others last zero (an MoE world's DP gradient reduction,
    ``moe.ExpertWorld``)."""

    def __init__(self, rt, kernel: str, link: Link, cal: Calibration, scratch: tuple[torch.Tensor, torch.Tensor],
                 comm_disabled: bool = False, priced=None):
        if kernel not in KINDS:
            raise ValueError(f"stand-in kind must be one of {', '.join(KINDS)} (got {kernel!r})")
        if kernel == "sleep" and rt.is_cuda and not cal.sleep_cycles_per_ms:
            raise ValueError("sleep stand-ins need the calibrated cycles per ms")
        if kernel == "channels" and rt.is_cuda and not cal.channel_GBps:
            raise ValueError("channels stand-ins need a calibration with channels (calibrate(..., channels=N))")
        if kernel == "nccl" and not cal.nccl_blocks:
            raise ValueError("nccl stand-ins need calibrate_nccl's blocks")
        self.rt, self.kernel, self.link, self.cal = rt, kernel, link, cal
        self.comm_disabled = comm_disabled
        self.priced = priced
        self._src, self._dst = scratch
        self._stamps = (torch.zeros(2 * cal.nccl_blocks, dtype=torch.int64, device=rt.device)
                        if kernel == "nccl" else None)
        self._streams: dict[int, object] = {}
        self.issued: list[Issued] = []

    def clear(self) -> None:
        self.issued = []

    def __call__(self, call) -> StandInWork | None:
        off = self.comm_disabled or (self.priced is not None and not self.priced(call))
        ms = 0.0 if off else self.link.collective_ms(call.kind, call.payload_bytes, call.group_size)
        issued = Issued(call.kind, call.group_size, call.payload_bytes, ms, call.async_op, call.group)
        self.issued.append(issued)
        return self.launch(issued, call.tensors, call.async_op)

    def launch(self, issued: Issued, keep: tuple = (), async_op: bool = True):
        """Run ``issued`` on its group's side stream after the current stream's work so far."""
        side = self._streams.get(id(issued.group))
        if side is None:
            side = self._streams[id(issued.group)] = self.rt.stream()
        ready = self.rt.event()
        ready.record()
        side.wait_event(ready)
        with self.rt.use_stream(side):
            self._run(issued)
            done = self.rt.event()
            done.record()
        work = StandInWork(done, keep)
        if async_op:
            return work
        work.wait()
        return None

    def _run(self, issued: Issued) -> None:
        ms, payload_bytes = issued.ms, issued.payload_bytes
        if ms <= 0:
            return
        if self.kernel == "nccl":
            self._nccl(ms, issued.wire_bytes)
            return
        if self.kernel == "sleep":
            if self.rt.is_cuda:
                torch.cuda._sleep(max(1, int(ms * self.cal.sleep_cycles_per_ms)))
            else:
                time.sleep(ms / 1e3)
            return
        # copy / channels: the collective's bytes (at most the scratch; at least 1/16 of the total,
        # to bound the launches), repeated until the calibrated rate has filled the duration
        on_channels = self.kernel == "channels" and self.rt.is_cuda
        rate = self.cal.channel_GBps if on_channels else self.cal.copy_GBps
        total = int(ms * rate * 1e6)
        chunk = max(1, min(self.cal.scratch_bytes, max(payload_bytes, total // 16)))
        while total > 0:
            m = min(chunk, total)
            if on_channels:
                from benchmarks.standin.channel_copy import channel_copy

                channel_copy(self._src, self._dst, max(m, 4), self.cal.channels)
            else:
                self._dst[:m].copy_(self._src[:m])
            total -= m

    def _nccl(self, ms: float, nbytes: int) -> None:
        """The collective's bytes at the link's rate on NCCL's blocks for ``ms`` (CUDA); on CPU
        the bytes copied once (wrapping around the scratch), then a sleep for the rest of ``ms``."""
        if self.rt.is_cuda:
            from benchmarks.standin.paced_copy import paced_copy

            paced_copy(self._src, self._dst, nbytes, ms=ms, GBps=self.link.GBps, blocks=self.cal.nccl_blocks,
                       stamps=self._stamps)
            return
        t0 = time.perf_counter()
        for start in range(0, nbytes, self.cal.scratch_bytes):
            m = min(self.cal.scratch_bytes, nbytes - start)
            self._dst[:m].copy_(self._src[:m])
        time.sleep(max(0.0, ms / 1e3 - (time.perf_counter() - t0)))

    def replay(self, issued: list[Issued]) -> None:
        """The stand-ins of a step back to back, without compute (the stand-in-only time)."""
        works = [self.launch(i) for i in issued]
        for w in works:
            w.wait()
