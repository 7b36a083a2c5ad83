"""Prices events: an analytical GPU + topology model, overridden by measured times when given.

DistSim (§4.2) profiles each unique event once; without hardware we price the same events from
data-sheet peaks and the topology. A ``ProfileDB`` of measured times replaces the analytical
price event by event, so the simulator's structure does not change when real numbers arrive.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Any, Mapping

from ..describe.ops import Collective, Compute, ModelingError, is_loop_event, ring_factor
from ..topology import Topology
from .stack import LOCAL, SoftwareStack

PROFILE_FORMAT = "megatron-oases-profile/2"


GRAD_ACCUMULATE = "main_grad.add"
"""The compute event of a layer's weight gradients added into DDP's fp32 ``main_grad``
(``sim.core.events.grad_accumulate``; the profiler times it as one add; optional in a profile),
priced 0 under a stack that fuses the accumulation into the weight-gradient GEMM."""

SimError = ModelingError
"""Bad simulator or planner input; the message is one line that names the offending values
(the same class the descriptions raise)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """Peak numbers of one GPU model, from its public data sheet (dense, no sparsity)."""

    name: str
    tensor_tflops: float
    """Dense fp16/bf16 tensor-core TFLOP/s (fp32 accumulate)."""
    fp32_tflops: float
    """Non-tensor fp32 TFLOP/s (used when elements are 4 bytes)."""
    hbm_GBps: float
    """Memory bandwidth, GB/s."""
    memory_GB: float
    gemm_efficiency: float = 0.75
    """Fraction of ``tensor_tflops`` the best-shaped large GEMM reaches (measured where a public
    measurement exists, see ``GPUS``; 0.75 otherwise)."""
    flash_attention_efficiency: float = 0.5
    """Fraction of ``tensor_tflops`` a fused (flash) attention kernel reaches, forward + backward,
    on the FLOPs it computes (see ``GPUS``)."""
    sms: int | None = None
    """Streaming multiprocessors (from the architecture whitepaper): one GEMM output tile runs
    on one SM at a time, so a GEMM's tiles run in ceil(tiles / sms) waves (``gemm_quantization``).
    None: unknown, no tile / wave quantization."""


# Data-sheet numbers (dense; the sheets' larger "with sparsity" figures are halved back):
#  V100 SXM2 32GB  (NVIDIA V100 data sheet, 2020): 125 TF tensor, 15.7 TF fp32, 900 GB/s HBM2.
#  A100 40GB SXM   (NVIDIA A100 data sheet, 2021): 312 TF bf16/fp16, 19.5 TF fp32, 1,555 GB/s.
#  A100 80GB SXM   (same sheet): 312 TF, 19.5 TF fp32, 2,039 GB/s HBM2e.
#  H100 SXM 80GB   (NVIDIA H100 data sheet): 989 TF bf16 (1,979 sparse), 67 TF fp32, 3.35 TB/s.
#  RTX 3090        (GA102 whitepaper, app. A): 71 TF fp16 tensor w/ fp32 accumulate, 35.6 TF
#                  fp32, 936 GB/s GDDR6X, 24 GB.
#  H200 SXM 141GB (NVIDIA H200 data sheet): 989 TF bf16 dense, 67 TF fp32, 4.8 TB/s HBM3e, 141 GB;
#                  the H100 SXM's SM array and clocks (132 SMs), so its GEMM ceiling and flash
#                  efficiency are the H100's (our GEMM measurements on one H200, docs/gpu.md: the
#                  H100 GEMM model within 1-11% of 93 shapes).
#  A10 24GB        (NVIDIA A10 Tensor Core GPU data sheet, 2021): 125 TF fp16/bf16 tensor (250
#                  sparse), 31.2 TF fp32, 600 GB/s GDDR6, 24 GB (DistSim §6's GPU).
#
# Measured efficiencies (docs/sim.md, Device model, has the full citations):
#  gemm_efficiency: Maximum Achievable Matmul FLOPS (MAMF) over the data-sheet peak, bf16, the best
#    shape of a brute-force shape search (S. Bekman, ml-engineering, compute/accelerator/README.md,
#    "Maximum Achievable Matmul FLOPS comparison table"): A100 SXM 271.2 / 312 = 86.9%, H100 SXM
#    794.5 / 989 = 80.3%. Other GPUs keep 0.75 (no measurement at hand).
#  flash_attention_efficiency: FlashAttention-2 (Dao 2023, arXiv 2307.08691, abstract: "50-73% of
#    the theoretical maximum FLOPs/s on A100") -> 0.50, the low end (training, forward + backward);
#    on H100 FlashAttention-2 reaches "only 35%" (Shah et al. 2024, FlashAttention-3, arXiv
#    2407.08608, abstract) -> 0.35. Other GPUs keep 0.5.
#  sms (streaming multiprocessors): V100 80 (NVIDIA Tesla V100 GPU Architecture whitepaper,
#    2017), A100 108 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020; the figure NVIDIA's
#    "Matrix Multiplication Background User's Guide" uses for wave quantization), H100 SXM5 132
#    (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022), RTX 3090 82 (GA102 whitepaper,
#    appendix A). A10: not listed here (no source at hand), no quantization.
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(name="v100-sxm2", tensor_tflops=125.0, fp32_tflops=15.7, hbm_GBps=900.0, memory_GB=32.0, sms=80),
    GpuSpec(name="a100-40gb", tensor_tflops=312.0, fp32_tflops=19.5, hbm_GBps=1555.0, memory_GB=40.0,
            gemm_efficiency=0.869, flash_attention_efficiency=0.50, sms=108),
    GpuSpec(name="a100-80gb", tensor_tflops=312.0, fp32_tflops=19.5, hbm_GBps=2039.0, memory_GB=80.0,
            gemm_efficiency=0.869, flash_attention_efficiency=0.50, sms=108),
    GpuSpec(name="h100-sxm", tensor_tflops=989.0, fp32_tflops=67.0, hbm_GBps=3350.0, memory_GB=80.0,
            gemm_efficiency=0.803, flash_attention_efficiency=0.35, sms=132),
    GpuSpec(name="h200-sxm", tensor_tflops=989.0, fp32_tflops=67.0, hbm_GBps=4800.0, memory_GB=141.0,
            gemm_efficiency=0.803, flash_attention_efficiency=0.35, sms=132),
    GpuSpec(name="rtx-3090", tensor_tflops=71.0, fp32_tflops=35.6, hbm_GBps=936.0, memory_GB=24.0, sms=82),
    GpuSpec(name="a10-24gb", tensor_tflops=125.0, fp32_tflops=31.2, hbm_GBps=600.0, memory_GB=24.0),
)}


def _measured_stacks() -> tuple[str, ...]:
    from .gemm_table import MEASURED_STACKS
    return MEASURED_STACKS


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def resolve_gpu_name(name: str) -> str:
    """A GPU name of ``GPUS``; accepts spellings such as ``rtx3090-24gb`` (the shipped
    ``pcie-3090x4`` topology's ``device``) for ``rtx-3090``, as long as one entry matches."""
    if name in GPUS:
        return name
    n = _norm(name)
    hits = [g for g in GPUS if _norm(g) == n] or [g for g in GPUS if n.startswith(_norm(g))] \
        or [g for g in GPUS if _norm(g).startswith(n)]
    if len(hits) == 1:
        return hits[0]
    raise SimError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


def gpu_of_device_name(device_name: str) -> str | None:
    """The ``GPUS`` entry of a card as ``torch.cuda.get_device_name()`` names it (a profile's
    ``device``), or None where the table has no such card (a PCIe or NVL H100 has other clocks
    than the SXM one; ``cpu``)."""
    n = device_name.upper()
    if "H100" in n:
        return None if "PCIE" in n or "NVL" in n else "h100-sxm"
    if "H200" in n:
        return "h200-sxm"
    if "A100" in n:
        return "a100-40gb" if "40GB" in n else "a100-80gb"
    if "V100" in n:
        return "v100-sxm2"
    if "3090" in n:
        return "rtx-3090"
    if re.search(r"\bA10\b", n):
        return "a10-24gb"
    return None


def gpu_spec(name: str) -> GpuSpec:
    return GPUS[resolve_gpu_name(name)]


def gemm_efficiency(ideal_ms: float, *, max_efficiency: float, half_ms: float) -> float:
    """Fraction of peak a GEMM of ``ideal_ms`` (time at peak) reaches: saturating in size.

    eff = max_efficiency * t / (t + half_ms): tiny GEMMs are launch/tail dominated, large ones
    approach ``max_efficiency`` (~0.75 is what cuBLAS reaches on big bf16 GEMMs). Equivalently
    time = (t + half_ms) / max_efficiency: a fixed overhead plus an efficiency factor.
    """
    if ideal_ms <= 0:
        return max_efficiency
    return max_efficiency * ideal_ms / (ideal_ms + half_ms)


GEMM_TILES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((256, 128), (128, 256)), ((128, 128),), ((256, 64), (64, 256)), ((128, 64), (64, 128)), ((64, 64),))
"""cuBLAS's typical tensor-core output tile sizes, most efficient (largest) first, as NVIDIA's
"Matrix Multiplication Background User's Guide" (section "Typical Tile Dimensions In cuBLAS And
Performance") lists them; each entry holds a size and its transpose."""


@functools.lru_cache(maxsize=65536)
def gemm_quantization(m: int, n: int, sms: int) -> float:
    """Fraction of a GEMM's tile-slots that hold useful output: tile and wave quantization.

    An ``m x n`` output is cut into tiles (the last row / column of tiles partly empty: tile
    quantization) and the tiles run ``sms`` at a time (the last wave partly idle: wave
    quantization), NVIDIA's "Matrix Multiplication Background User's Guide", chapter "Dimension
    Quantization Effects". The tile is the largest of ``GEMM_TILES`` whose tiles fill at least
    one wave (the guide: larger tiles are more efficient, smaller ones give a small problem more
    parallelism), the better-filled of its two orientations; the smallest tile when none fills a
    wave. Returns m n / (waves x sms x tile area), in (0, 1]."""
    if m <= 0 or n <= 0 or sms <= 0:
        return 1.0
    for sizes in GEMM_TILES:
        best = 0.0
        fills = False
        for tm, tn in sizes:
            tiles = -(-m // tm) * -(-n // tn)
            fills = fills or tiles >= sms
            best = max(best, m * n / (-(-tiles // sms) * sms * tm * tn))
        if fills or sizes is GEMM_TILES[-1]:
            return best
    return 1.0  # unreachable


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileDB:
    """Measured times, event key -> ms (keys as ``sim.core.events`` names them). See docs/sim.md."""

    device: str
    """What the compute events ran on (``torch.cuda.get_device_name()`` or ``cpu``)."""
    events_ms: Mapping[str, float]
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Optional per-key provenance: ``measured``, ``extrapolated from 4 ranks``, ``scaled from N bytes``."""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form: torch version, threads, warm-up / repetitions, topology, ranks at hand."""
    contention: Mapping[str, Mapping[int, float]] = dataclasses.field(default_factory=dict)
    """Optional: ms with k ranks busy at once, ``{key: {k: ms}}`` (measured by
    ``sim.calibrate.emulated_profile``). Compute events: k ranks computing, ``events_ms`` holds the
    all-ranks-busy time. A pipeline stage's collectives: its own stage's ranks plus those of other
    stages computing beside it, ``events_ms`` holds the plain time (no other stage busy). See
    ``sim.core.contention``."""
    overlapped: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Optional: ms of an event while the same rank's other stream is busy -- a collective while the
    rank computes, a compute event while a collective is in flight (measured by
    ``sim.calibrate.emulated_profile`` for overlapping schedules; where cores are shared, the two slow each
    other down). The simulator prices overlapped stretches of a template with it (``sim.core.timeline``)."""

    def __post_init__(self) -> None:
        bad = [k for k, v in self.events_ms.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v)]
        if bad:
            raise SimError(f"profile for {self.device!r}: times must be finite numbers >= 0 (bad: {', '.join(bad[:3])})")

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> "ProfileDB":
        if isinstance(data, dict) and str(data.get("format", "")).startswith("megatron-oases-profile/") \
                and data.get("format") != PROFILE_FORMAT:
            raise SimError(f"{source}: profile format {data.get('format')!r} is not {PROFILE_FORMAT!r}; "
                           "measure it again with `megatron-oases profile`")
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT or not isinstance(data.get("events"), dict):
            raise SimError(f"{source}: expected {{'format': {PROFILE_FORMAT!r}, 'device': ..., 'events': {{key: ms}}}}")
        try:
            contention = {k: {int(n): float(ms) for n, ms in v.items()}
                          for k, v in (data.get("contention") or {}).items()}
        except (AttributeError, TypeError, ValueError):
            raise SimError(f"{source}: 'contention' must map event keys to {{busy ranks: ms}}") from None
        try:
            overlapped = {k: float(v) for k, v in (data.get("overlapped") or {}).items()}
        except (AttributeError, TypeError, ValueError):
            raise SimError(f"{source}: 'overlapped' must map event keys to ms") from None
        return cls(device=str(data.get("device", "")), events_ms=dict(data["events"]),
                   sources=dict(data.get("sources") or {}), meta=dict(data.get("meta") or {}),
                   contention=contention, overlapped=overlapped)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ProfileDB":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise SimError(f"{os.fspath(path)}: cannot read profile ({e.__class__.__name__}: {e})") from None
        return cls.from_dict(data, source=os.fspath(path))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PROFILE_FORMAT, "device": self.device, "events": dict(sorted(self.events_ms.items()))}
        if self.sources:
            out["sources"] = dict(sorted(self.sources.items()))
        if self.meta:
            out["meta"] = dict(self.meta)
        if self.contention:
            out["contention"] = {k: {str(n): ms for n, ms in sorted(v.items())}
                                 for k, v in sorted(self.contention.items())}
        if self.overlapped:
            out["overlapped"] = dict(sorted(self.overlapped.items()))
        return out

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def merged(self, other: "ProfileDB") -> "ProfileDB":
        """This DB with ``other``'s entries added (``other`` wins on equal keys)."""
        if self.device and other.device and self.device != other.device:
            raise SimError(f"cannot merge profiles of different devices ({self.device!r}, {other.device!r})")
        meta = {**self.meta, **other.meta}
        if "host_issue_ms" in self.meta and "host_issue_ms" in other.meta:  # per event, as events_ms
            meta["host_issue_ms"] = {**self.meta["host_issue_ms"], **other.meta["host_issue_ms"]}
        return ProfileDB(device=self.device or other.device, events_ms={**self.events_ms, **other.events_ms},
                         sources={**self.sources, **other.sources}, meta=meta,
                         contention={**self.contention, **other.contention},
                         overlapped={**self.overlapped, **other.overlapped})

    @classmethod
    def median_of(cls, dbs: "list[ProfileDB]") -> "ProfileDB":
        """One profile from repeated profiles of the same events: every time (plain, per busy
        level, overlapped) is the median over the profiles that measured it, so one profile's
        outlier (a burst of outside load during one event) does not reach the prediction."""
        import statistics

        if not dbs:
            raise SimError("no profiles to combine")
        if len({db.device for db in dbs}) > 1:
            raise SimError(f"cannot combine profiles of different devices ({', '.join(sorted({db.device for db in dbs}))})")

        def med(maps) -> dict:
            keys = dict.fromkeys(k for mp in maps for k in mp)
            return {k: statistics.median(mp[k] for mp in maps if k in mp) for k in keys}
        cont_keys = dict.fromkeys(k for db in dbs for k in db.contention)
        contention = {k: med([db.contention[k] for db in dbs if k in db.contention]) for k in cont_keys}
        return cls(device=dbs[0].device, events_ms=med([db.events_ms for db in dbs]),
                   sources={k: v for db in reversed(dbs) for k, v in db.sources.items()},
                   meta={**dbs[0].meta, "profiles_combined": len(dbs)}, contention=contention,
                   overlapped=med([db.overlapped for db in dbs]))

    def missing(self, keys: list[str]) -> list[str]:
        """The events of ``keys`` the profile lacks (loop events are optional: priced 0 unmeasured;
        so is the ``main_grad`` accumulation, which profiles before issue 49 lack: priced
        analytically)."""
        return sorted(set(k for k in keys if k not in self.events_ms and not is_loop_event(k)
                          and not k.startswith(f"compute:{GRAD_ACCUMULATE}[")))

    def require(self, keys: list[str]) -> None:
        """Raise naming every event the simulation needs that the profile lacks."""
        missing = self.missing(keys)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise SimError(f"profile for {self.device!r} lacks {len(missing)} event(s): "
                           f"{', '.join(missing[:5])}{more}; measure them with `megatron-oases profile` "
                           "for this model, strategy and topology")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """One GPU model plus the cluster topology; prices compute, collectives and P2P in ms."""

    gpu: GpuSpec
    topology: Topology
    bytes_per_element: int = 2
    """2 -> tensor-core peak; 4 -> fp32 peak."""
    max_gemm_efficiency: float | None = None
    """Large-GEMM ceiling; None: the GPU's measured ``gemm_efficiency``."""
    gemm_shape_factor: float = 0.80
    """Fraction of the best-shape ceiling (``max_gemm_efficiency``) that training GEMMs reach at
    their real shapes beyond tile / wave quantization (fewer K iterations to amortise the
    prologue / epilogue, cuBLAS's tile choice, clocks under sustained load). No card we can
    measure covers the published runs' GPUs, so it is fitted by leave-one-source-out
    cross-validation on the published table (``scripts/validate_published.py``,
    docs/sim_validation.md): 0.80, the median of the folds' fits (0.80-0.85 on a 0.70-1.0 grid).
    Lower than our one GEMM measurement alone suggests (bf16 GEMMs of the H100 rows' shapes on an
    H200 ran 1-11% below the best-shape model, docs/gpu.md, i.e. 0.89-0.99): the fitted factor also
    carries what the published steps lose beside their GEMMs that the model lacks (clocks under
    sustained multi-node load, the SMs Transformer Engine's overlap kernels take)."""
    gemm_half_ms: float = 0.01
    """A GEMM whose ideal time is this reaches half of ``max_gemm_efficiency`` (10 us)."""
    attention_efficiency: float = 0.5
    """The s^2 attention part runs at this fraction of the GEMM curve (unfused softmax path)."""
    memory_efficiency: float = 0.8
    """Fraction of HBM bandwidth element-wise kernels reach."""
    fused_attention: bool = False
    """Flash / Transformer Engine fused attention (``--use-flash-attn``, ``--transformer-impl
    transformer_engine``): the s x s scores stay on chip (a compute event's ``score_bytes`` are
    dropped), the causal mask skips the upper half of the score blocks (half the attention FLOPs
    are computed) and what is computed runs at the GPU's ``flash_attention_efficiency``."""
    gemm_quantization: bool = True
    """Tile and wave quantization of GEMMs whose shapes the description gives
    (``Compute.gemms``, :func:`gemm_quantization`); needs the GPU's SM count."""
    stack: SoftwareStack = LOCAL
    """The software stack the layers run on (``pricing.stack``): kernel counts, element-wise
    traffic, softmax precision and host cost per kernel and per event. Default ``local``: what
    ``megatron-oases train`` runs (no Apex), measured on an H200. The host runs ahead of the GPU,
    so a compute event costs max(GPU time, the stack's host time): only work too small to cover
    its own launches is slowed."""
    use_gemm_table: bool = True
    """Price GEMMs near measured shapes from ``pricing.gemm_table`` (False: the factor model
    alone, as before issue 49)."""
    collective_beside_compute: float = 1.0
    """An analytically priced collective's duration while the compute stream runs, over its
    duration alone (``timeline``: it progresses at the slower rate while both streams are busy,
    as a profile's ``overlapped`` times). 1: no contention priced, the default, since nothing we
    measured gives real NCCL's (the SMs and HBM bandwidth its kernels share with the GEMMs). The
    one-GPU stand-in benchmark sets it (``scripts/sim_vs_standin.py``): its ``sleep`` stand-ins
    spin a calibrated number of SM cycles, so beside the GEMMs, which pull the card to its power
    limit and its clock down, each lasts its clock alone over the loaded clock longer (about
    1,975 / 1,642 MHz on the H100 of 2026-11-27). With it the Oases templates run the fluid
    timeline (``timeline._run_template_shared``), which does not let the host issue ahead."""
    profile: ProfileDB | None = None
    """Measured times; when given, every event must be in it (``strict``) or falls back."""
    strict_profile: bool = True

    def __post_init__(self) -> None:
        if self.max_gemm_efficiency is None:
            object.__setattr__(self, "max_gemm_efficiency", self.gpu.gemm_efficiency)

    @property
    def peak_tflops(self) -> float:
        return self.gpu.tensor_tflops if self.bytes_per_element <= 2 else self.gpu.fp32_tflops

    # ---- analytical prices ----------------------------------------------------------------
    def compute_ms(self, c: Compute) -> float:
        """GPU time (GEMM curve + attention + element-wise), floored by the host's dispatch time."""
        return max(self.gpu_compute_ms(c), self.dispatch_floor_ms(c))

    def dispatch_floor_ms(self, c: Compute) -> float:
        """Host time to issue the event's kernels under the stack (``SoftwareStack.host_ms``)."""
        if c.name == GRAD_ACCUMULATE and self.stack.fused_grad_accumulation:
            return 0.0
        return self.stack.host_ms(c)

    def gpu_compute_ms(self, c: Compute) -> float:
        if c.name == GRAD_ACCUMULATE and self.stack.fused_grad_accumulation:
            return 0.0
        peak_per_ms = self.peak_tflops * 1e9  # FLOP per ms
        t = self.gemm_ms(c) if c.gemm_flops else 0.0
        fused = self.fused_attention and self.bytes_per_element <= 2
        ew = self.stack.elementwise_bytes(c, scores_on_chip=fused)
        if c.attention_flops and fused:
            # causal: half the score blocks computed, at the fused kernel's efficiency
            t += 0.5 * c.attention_flops / (peak_per_ms * self.gpu.flash_attention_efficiency)
        elif c.attention_flops:
            ideal = c.attention_flops / peak_per_ms
            eff = self.attention_efficiency * gemm_efficiency(
                ideal, max_efficiency=self.max_gemm_efficiency, half_ms=self.gemm_half_ms)
            t += ideal / eff
        return t + ew / (self.gpu.hbm_GBps * 1e6 * self.memory_efficiency)

    def gemm_ms(self, c: Compute) -> float:
        """The segment's GEMM time: each GEMM near measured shapes of this card and stack at the
        measured efficiency (``pricing.gemm_table``), the rest (or every GEMM, where the table has
        none for the card, dtype or stack) by the factor model: tile / wave quantization times the
        best-shape ceiling times the cross-validated ``gemm_shape_factor``, with the segment's
        fixed cost ``gemm_half_ms``."""
        table = self.gemm_table()
        rest, t = c.gemms, 0.0
        if table is not None and c.gemms:
            rest = []
            for m, n, k in c.gemms:
                tf = table.tflops(m, n, k)
                if tf is None:
                    rest.append((m, n, k))
                else:  # in the segment's FLOP count (a GQA / SwiGLU count may differ from 2 M N K)
                    t += c.gemm_flops * m * n * k / sum(a * b * d for a, b, d in c.gemms) / (tf * 1e9)
            rest = tuple(rest)
            if not rest:
                return t
            flops = c.gemm_flops * sum(m * n * k for m, n, k in rest) / sum(m * n * k for m, n, k in c.gemms)
        else:
            flops = c.gemm_flops
        ideal = flops / (self.peak_tflops * 1e9) / self.gemm_utilisation(rest)
        return t + ideal / gemm_efficiency(ideal, max_efficiency=self.max_gemm_efficiency * self.gemm_shape_factor,
                                           half_ms=self.gemm_half_ms)

    def gemm_table(self):
        """The measured GEMM table pricing this card under this stack, or None
        (``gemm_table.table_for``; ``use_gemm_table`` off: always None)."""
        if not self.use_gemm_table:
            return None
        from .gemm_table import table_for
        return table_for(self.gpu.name, self.bytes_per_element, self.stack.name)

    def pricing_notes(self, gemms: "list[tuple[int, int, int]] | tuple" = ()) -> list[str]:
        """One line each for what this device model prices from another card or a fitted
        constant rather than a measurement on this card: the GEMMs (how many of ``gemms`` the
        measured table priced) and the stack's host costs."""
        table = self.gemm_table()
        factor = f"the cross-validated gemm_shape_factor {self.gemm_shape_factor:g}"
        if table is None:
            why = (f"the {self.stack.name} stack's GEMMs were not measured" if self.bytes_per_element == 2
                   and self.stack.name not in _measured_stacks() else f"no measured GEMM table for {self.gpu.name}"
                   + (" in 16-bit" if self.bytes_per_element == 2 else " in fp32"))
            lines = [f"GEMMs: {why}: priced by tile/wave quantization x {factor}"]
        else:
            shapes = sorted(set(gemms))
            hit = sum(table.tflops(*g) is not None for g in shapes)
            which = (f"priced {hit} of {len(shapes)} GEMM shapes" if shapes
                     else "prices GEMMs within a factor 2 of its shapes")
            lines = [f"GEMMs: measured table for {self.gpu.name} bf16 ({len(table.points)} points) {which}; "
                     f"the rest by {factor}"]
        host = self.stack.host_measured_on
        if not host:
            why = self.stack.source.split(";")[0].removeprefix("host cost: ")
            lines.append(f"host cost ({self.stack.name}): not measured for this stack on any card ({why})")
        elif self.gpu.name not in host:
            lines.append(f"host cost ({self.stack.name}): measured on {', '.join(host)}, none on "
                         f"{self.gpu.name}: borrowed")
        return lines

    def gemm_utilisation(self, gemms: tuple[tuple[int, int, int], ...]) -> float:
        """FLOP-weighted tile / wave utilisation of a segment's GEMMs (1 where shapes or the SM
        count are unknown): the segment's GEMM time at peak is divided by it."""
        sms = self.gpu.sms
        if not gemms or not sms or not self.gemm_quantization:
            return 1.0
        flops = sum(m * n * k for m, n, k in gemms)
        slots = sum(m * n * k / gemm_quantization(m, n, sms) for m, n, k in gemms)
        return flops / slots if slots > 0 else 1.0

    def ring_link(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(bottleneck GB/s, worst latency us) of the ring over ``ranks`` in the given order.

        A calibrated group's measured number is ATP's algorithm bandwidth B (bytes / all-reduce
        time, ``topology.spec.AllReduceCalibration``, as ``plan.atp_mesh`` reads it), so its ring
        link is B x 2(n-1)/n (Eq. 4's B'): ``collective_ms`` then prices the all-reduce at S / B.
        Used as the link itself, ATP IC1's calibrated ATP-4 came out 59% below ATP-1 where the
        paper's Eq. 2 gives 46% (ATP §5.3)."""
        cal = self.topology.calibrated_allreduce(ranks)
        n = len(ranks)
        pairs = [(ranks[i], ranks[(i + 1) % n]) for i in range(n)] if n > 1 else []
        if not any(lv.p2p_matrix_GBps is not None for lv in self.topology.levels):
            # Uniform levels: neighbours crossing the same level share bandwidth and latency.
            pairs = list({link_level(self.topology, a, b): (a, b) for a, b in pairs}.values())
        lat = max((self.topology.link_latency(a, b) for a, b in pairs), default=0.0)
        if cal is not None:
            return cal * ring_factor("all_reduce", n), lat
        return min((self.link_bandwidth(a, b) * self.nic_share(ranks, a, b) * self.nccl_efficiency(a, b)
                    for a, b in pairs), default=math.inf), lat

    def nccl_efficiency(self, a: int, b: int) -> float:
        """The fraction of the link rate NCCL achieves between two ranks (the crossed level's
        ``nccl_efficiency``, measured nccl-tests bus bandwidth over the link rate; 1 if unset)."""
        level = link_level(self.topology, a, b)
        eff = self.topology.levels[level].nccl_efficiency if level >= 0 else None
        return 1.0 if eff is None else eff

    def nic_share(self, ranks: tuple[int, ...], a: int, b: int) -> float:
        """The part of an inter-node link's bandwidth one ring over ``ranks`` gets.

        An inter_node level's bandwidth is a unit's (a node's) aggregate over its network cards.
        Every group of a hybrid-parallel run runs its collectives together with the other groups
        of its kind, so the unit's ranks/m concurrent rings share it, m being the group's ranks in
        one unit: a ring through all of a node's GPUs (TP 16 over 2 nodes) gets the whole node
        (NCCL spreads it over every card), each of the eight one-GPU-per-node DP rings of TP 8 an
        eighth. Intra-node links are per GPU already."""
        level = link_level(self.topology, a, b)
        if level < 0 or self.topology.levels[level].scope != "inter_node":
            return 1.0
        unit = math.prod(self.topology.sizes[:level])
        per_unit: dict[int, int] = {}
        for r in ranks:
            per_unit[r // unit] = per_unit.get(r // unit, 0) + 1
        return max(per_unit.values()) / unit

    def link_bandwidth(self, a: int, b: int) -> float:
        """GB/s between two ranks; a missing link (0 in the level's p2p matrix) is an error."""
        bw = self.topology.p2p_bandwidth(a, b)
        if not bw > 0:
            lv = self.topology.levels[self.topology.level_between(a, b)]
            raise SimError(f"topology {self.topology.name!r} has no link between ranks {a} and {b} "
                           f"(level {lv.name!r} p2p_matrix_GBps entry is 0), but the strategy sends between them; "
                           "add the link or choose a strategy whose groups avoid it")
        return bw

    def collective_ms(self, kind: str, payload_bytes: float, ranks: tuple[int, ...]) -> float:
        """Ring algorithm: all-reduce 2(n-1)/n S/B + 2(n-1) lat; gather/scatter and all-to-all (n-1)/n S/B + (n-1) lat;
        broadcast / reduce (3-D vectors) S/B + (n-1) lat."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        bw, lat_us = self.ring_link(ranks)
        if kind == "all_reduce":
            factor, steps = ring_factor(kind, n), 2 * (n - 1)
        elif kind in ("all_gather", "reduce_scatter", "all_to_all"):  # all-to-all: MoE's dispatch, n - 1 peers
            factor, steps = ring_factor(kind, n), n - 1
        elif kind in ("broadcast", "reduce"):  # pipelined along the ring: the root's S, n - 1 hops
            factor, steps = 1.0, n - 1
        else:
            raise SimError(f"unknown collective kind {kind!r}")
        return factor * payload_bytes / (bw * 1e6) + steps * lat_us / 1e3

    def p2p_ms(self, nbytes: float, src: int, dst: int) -> float:
        if src == dst:
            return 0.0
        return (nbytes / (self.link_bandwidth(src, dst) * self.nccl_efficiency(src, dst) * 1e6)
                + self.topology.link_latency(src, dst) / 1e3)

    def analytical_ms(self, op: Compute | Collective | None, *, kind: str, nbytes: float,
                      ranks: tuple[int, ...]) -> float:
        if kind == "compute":
            assert isinstance(op, Compute)
            return 0.0 if is_loop_event(op.name) else self.compute_ms(op)
        if kind == "p2p":
            return self.p2p_ms(nbytes, ranks[0], ranks[1])
        assert isinstance(op, Collective)
        return self.collective_ms(op.kind, op.payload_bytes, ranks)

    def host_split(self, key: str, op: Compute | Collective | None, *, kind: str) -> tuple[float, float] | None:
        """(GPU ms, host ms) of an analytically priced compute event, for a timeline that lets the
        host issue ahead of the GPU (``timeline.run_template``); None for a collective, P2P, or an
        event the profile measured (its time already holds the host's share)."""
        if kind != "compute" or not isinstance(op, Compute) or is_loop_event(op.name):
            return None
        if self.profile is not None and key in self.profile.events_ms:
            return None
        return self.gpu_compute_ms(op), self.dispatch_floor_ms(op)

    def price(self, key: str, op: Compute | Collective | None, *, kind: str, nbytes: float = 0.0,
              ranks: tuple[int, ...] = (), hidden_by: Compute | None = None) -> float:
        """Measured time when the profile has ``key``, else the analytical one; a collective
        ``hidden_by`` a GEMM (TP communication overlap) costs only what the GEMM cannot hide."""
        if self.profile is not None and key in self.profile.events_ms:
            return float(self.profile.events_ms[key])
        t = self.analytical_ms(op, kind=kind, nbytes=nbytes, ranks=ranks)
        if hidden_by is not None:
            t = max(0.0, t - self.gpu_compute_ms(hidden_by))
        return t


@functools.lru_cache(maxsize=64)
def _strides(topo: Topology) -> tuple[tuple[int, int], ...]:
    """(level, rank stride of one unit of that level), outermost first."""
    out, stride = [], topo.world_size
    for i in range(len(topo.levels) - 1, -1, -1):
        stride //= topo.levels[i].size
        out.append((i, stride))
    return tuple(out)


def link_level(topo: Topology, a: int, b: int) -> int:
    """The level two ranks' link crosses (the outermost level where their coordinates differ)."""
    if a == b:
        return -1
    for i, stride in _strides(topo):
        if a // stride != b // stride:
            return i
    return -1


def device_model(topology: Topology, *, gpu: str | None = None, profile: ProfileDB | None = None,
                 **kw: Any) -> DeviceModel:
    """A DeviceModel for ``topology``; the GPU defaults to the topology's ``device`` field."""
    name = gpu or topology.device
    if not name:
        raise SimError(f"topology {topology.name!r} names no device; pass --gpu (gpu=) one of {', '.join(GPUS)}")
    return DeviceModel(gpu=gpu_spec(name), topology=topology, profile=profile, **kw)
