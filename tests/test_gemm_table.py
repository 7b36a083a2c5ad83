"""Issue 49 item 1: GEMMs priced from measured throughput by shape, card and stack
(``pricing/gemm_table.py``), every point traceable to a committed device run."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_oases.describe.ops import Compute
from megatron_oases.pricing import gemm_table
from megatron_oases.pricing.device_model import DeviceModel, gpu_spec
from megatron_oases.pricing.stack import LOCAL, TRANSFORMER_ENGINE
from megatron_oases.topology import Level, Topology
from tests.script_modules import ROOT, load_script

TOPO = Topology(name="one", levels=(Level(name="l", size=1, scope="intra_node", p2p_bandwidth_GBps=100.0,
                                          group_bandwidth_GBps=100.0, latency_us=5.0),))
RUNS = "examples/gpu/h100-2026-11-27/call1/"


def _dm(gpu: str, stack=LOCAL, **kw) -> DeviceModel:
    return DeviceModel(gpu=gpu_spec(gpu), topology=TOPO, stack=stack, **kw)


def _gemm(m: int, n: int, k: int) -> Compute:
    return Compute(name="gemm", gemm_flops=2.0 * m * n * k, gemms=((m, n, k),))


def test_the_committed_table_is_what_the_committed_runs_measured():
    """Rebuilt from the traces and the H200 GEMM file, point for point (no number typed in)."""
    build = load_script("scripts/gemm_table_build.py")
    built = build.build([(f"{ROOT}/{RUNS}traces/traces_default-sleep.json.gz", f"{ROOT}/{RUNS}overlap_standin.json")],
                        [f"{ROOT}/examples/gpu/h200-2026-11-26/gpu_gemms.json"])
    with open(gemm_table.TABLE_PATH, encoding="utf-8") as f:
        committed = json.load(f)

    def key(p):
        return p["gpu"], p["m"], p["n"], p["k"], p["ms"], p["source"].split(" (")[0].rsplit("examples/", 1)[-1]
    assert sorted(map(key, built["points"])) == sorted(map(key, committed["points"]))
    cards = {p["gpu"] for p in committed["points"]}
    assert cards == {"h100-sxm", "h200-sxm"}  # no A100 point: none was measured or sourced


def test_a_measured_shape_is_priced_at_its_measured_time_and_a_far_one_by_the_factor():
    table = gemm_table.load_tables()[("h100-sxm", "bf16")]
    p = table.points[0]
    dm = _dm("h100-sxm")
    assert dm.gemm_ms(_gemm(p.m, p.n, p.k)) == pytest.approx(p.ms, rel=1e-9)
    far = _gemm(64, 64, 64)
    assert table.tflops(64, 64, 64) is None
    assert dm.gemm_ms(far) == pytest.approx(_dm("h100-sxm", use_gemm_table=False).gemm_ms(far))
    # between measured shapes: a weighted mean of the points within the radius
    import math
    q = (5000, 4096, 8192)
    near = [x.tflops for x in table.points
            if math.dist([math.log2(v) for v in q], [math.log2(v) for v in (x.m, x.n, x.k)]) <= gemm_table.RADIUS]
    assert len(near) >= 2 and min(near) <= table.tflops(*q) <= max(near)


def test_no_point_comes_from_an_oases_run():
    """The Oases split is checked against the stand-in runs (scripts/sim_vs_standin.py), so no
    GEMM of theirs prices it: the H100's points are the stock trace's whole micro-batch, whose
    tokens (8,192) are M of every forward / input-gradient GEMM and K of every weight gradient."""
    with open(gemm_table.TABLE_PATH, encoding="utf-8") as f:
        points = json.load(f)["points"]
    assert not [p for p in points if "oases" in p["source"].split(" (")[0]]
    h100 = [p for p in points if p["gpu"] == "h100-sxm"]
    assert h100 and all(8192 in (p["m"], p["k"]) for p in h100)


@pytest.mark.parametrize("gpu, stack, gemm_line, host_line", [
    ("h100-sxm", LOCAL, "measured table for h100-sxm", "measured on h200-sxm, none on h100-sxm: borrowed"),
    ("h200-sxm", LOCAL, "measured table for h200-sxm", None),
    ("a100-80gb", LOCAL, "no measured GEMM table for a100-80gb", "none on a100-80gb: borrowed"),
    ("h100-sxm", TRANSFORMER_ENGINE, "the transformer_engine stack's GEMMs were not measured", "not measured for this stack on any card"),
])
def test_the_notes_say_what_is_borrowed_or_fitted(gpu, stack, gemm_line, host_line):
    notes = _dm(gpu, stack).pricing_notes([(8192, 6144, 4096), (64, 64, 64)])
    assert gemm_line in notes[0] and "gemm_shape_factor 0.8" in notes[0]
    if host_line is None:
        assert len(notes) == 1
    else:
        assert len(notes) == 2 and host_line in notes[1]


def test_fp32_and_unmeasured_stacks_keep_the_factor_model():
    g = _gemm(8192, 6144, 4096)
    for dm in (_dm("h100-sxm", bytes_per_element=4), _dm("h100-sxm", TRANSFORMER_ENGINE)):
        assert dm.gemm_table() is None
        assert dm.gemm_ms(g) == dataclasses.replace(dm, use_gemm_table=False).gemm_ms(g)
