"""GEMM throughput by shape, card and dtype, from measured kernels (issue 49 item 1).

One constant (``DeviceModel.gemm_shape_factor``) times tile / wave quantization cannot tell a
GEMM of half the tokens from a whole one on a Hopper card (cuBLAS's Hopper kernels pick tiles
NVIDIA's guide does not list), nor one software stack's GEMMs from another's. This table holds
measured (M, N, K) -> ms per card and dtype, each point with where it was measured
(``gemm_table.json``, built by ``scripts/gemm_table_build.py`` from our own device runs; the
``gemm`` step of ``scripts/gpu_check.sh`` measures more). A GEMM near measured shapes is priced
at their efficiency (inverse-distance weighted in log2 of M, N and K); a GEMM far from every
point, a card or dtype the table lacks, or a stack whose GEMMs were not measured keeps the
cross-validated factor, and the device model says which (``DeviceModel.pricing_notes``).

What is measured is torch's GEMM (``torch.mm`` / ``F.linear``, cuBLAS), the kernels of the
``local`` stack; ``apex-fused`` runs the same calls for the forward and input gradients (its
weight gradient with gradient-accumulation fusion writes fp32 into ``main_grad``, not measured).
Transformer Engine calls cuBLASLt through its own GEMM wrapper; none of its GEMMs were measured,
so it keeps the factor. Published per-shape tables for A100 or H100 were not at hand: those
cards' entries come only from our runs (none for A100).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

TABLE_FORMAT = "megatron-oases-gemm-table/1"
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_table.json")

MEASURED_STACKS = ("local", "apex-fused")
"""Stacks whose GEMMs are torch's cuBLAS calls, the ones the table measured."""

RADIUS = 1.0
"""Points farther than this (euclidean, in log2 of M, N and K: a factor 2 in one dimension) do
not price a GEMM; with none within it the GEMM keeps the factor model."""


def is_gemm_kernel(name: str) -> bool:
    """A cuBLAS / CUTLASS GEMM kernel by its name (Hopper's ``nvjet``, ``sm90_xmma``, ...)."""
    n = name.lower()
    return any(t in n for t in ("nvjet", "gemm", "xmma", "cutlass", "cublas"))


@dataclasses.dataclass(frozen=True)
class GemmPoint:
    m: int
    n: int
    k: int
    ms: float
    source: str

    @property
    def tflops(self) -> float:
        return 2.0 * self.m * self.n * self.k / self.ms / 1e9


@dataclasses.dataclass(frozen=True)
class GemmTable:
    """The points of one (card, dtype)."""

    gpu: str
    dtype: str
    points: tuple[GemmPoint, ...]

    def tflops(self, m: int, n: int, k: int) -> float | None:
        """Interpolated TFLOP/s of an (M, N, K) GEMM, or None when no point is within ``RADIUS``."""
        return _interpolate(self, m, n, k)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.source for p in self.points))


@functools.lru_cache(maxsize=65536)
def _interpolate(table: GemmTable, m: int, n: int, k: int) -> float | None:
    q = (math.log2(m), math.log2(n), math.log2(k))
    near = []
    for p in table.points:
        d = math.dist(q, (math.log2(p.m), math.log2(p.n), math.log2(p.k)))
        if d <= RADIUS:
            near.append((d, p.tflops))
    if not near:
        return None
    exact = [t for d, t in near if d < 1e-9]
    if exact:
        return sum(exact) / len(exact)
    w = [(1.0 / d ** 2, t) for d, t in near]
    return sum(a * t for a, t in w) / sum(a for a, _ in w)


@functools.lru_cache(maxsize=4)
def load_tables(path: str = TABLE_PATH) -> dict[tuple[str, str], GemmTable]:
    """(card, dtype) -> its table, from the committed data file."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: not a {TABLE_FORMAT} file")
    by: dict[tuple[str, str], list[GemmPoint]] = {}
    for p in data["points"]:
        by.setdefault((p["gpu"], p["dtype"]), []).append(GemmPoint(p["m"], p["n"], p["k"], float(p["ms"]), p["source"]))
    return {key: GemmTable(key[0], key[1], tuple(pts)) for key, pts in by.items()}


def table_for(gpu: str, bytes_per_element: int, stack: str) -> GemmTable | None:
    """The measured table that prices this card's GEMMs under ``stack``, or None (the factor
    model). 16-bit elements read the bf16 table (fp16 has the same tensor-core rate on every
    card's data sheet); fp32 and unmeasured stacks have none."""
    if bytes_per_element != 2 or stack not in MEASURED_STACKS:
        return None
    return load_tables().get((gpu, "bf16"))
