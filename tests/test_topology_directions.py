"""Every shipped NVLink / NVSwitch figure is one direction (issue 49 item 1).

The loader cannot tell a two-way total from a one-way rate (both are a number in
``p2p_bandwidth_GBps``), and the topologies once disagreed: ``dgx-a100`` priced a ring on the A100's
600 GB/s (both ways) where ``dgx-a100-hdr8`` used 300 (one way). The simulator's ring needs one way
(``topology.spec``'s docstring), so each NVLink level of each shipped topology is pinned here to the
data sheet's number halved; a new NVLink topology fails until it is added with its source.
"""
from __future__ import annotations

import pathlib

import pytest

from megatron_oases.topology import load_topology

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = sorted([*(ROOT / "megatron_oases" / "topology" / "examples").glob("*.yaml"),
                  *(ROOT / "examples" / "topologies").glob("*.yaml"),
                  *(ROOT / "examples" / "validation" / "topologies").glob("*.yaml")])

A100 = 600 / 2
"""A100 SXM NVLink3: 600 GB/s per GPU both ways (12 links x 50), A100 data sheet."""
H100 = 900 / 2
"""H100 SXM NVLink4: 900 GB/s per GPU both ways (18 links x 50), H100 data sheet."""
NVLINK3_LINK = 50 / 2
"""One NVLink3 link: 50 GB/s both ways (A100 data sheet: 12 links, 600 GB/s)."""
NVLINK2_LINK = 300 / 6 / 2
"""One NVLink2 brick: V100 SXM2's 300 GB/s both ways over 6 bricks (V100 data sheet)."""
RTX3090_BRIDGE = 112.5 / 2
"""RTX 3090 NVLink bridge: 112.5 GB/s both ways (NVIDIA's GeForce RTX 3090 page)."""

ONE_WAY = {  # (topology name, level name): (p2p, group) GB/s each way
    ("dgx-a100", "nvswitch"): (A100, A100),
    ("2node-ib", "nvswitch"): (A100, A100),
    ("dgx-a100-hdr8", "nvswitch"): (A100, A100),
    ("jeanzay-a100-opa4", "nvswitch"): (A100, A100),
    ("dgx-h100-ndr8", "nvswitch"): (H100, H100),
    ("fig7a", "nvlink"): (4 * NVLINK3_LINK, 12 * NVLINK3_LINK),  # ATP Fig. 7(a): 4 links a pair, 12 a GPU
    ("longhorn-v100", "nvlink2-pair"): (3 * NVLINK2_LINK, 3 * NVLINK2_LINK),  # AC922: 3 bricks a pair
    ("atp-machine-b", "nvlink-bridge"): (A100, A100),  # ATP §2: "600 GB/s for NVLink-v3"
    ("nvlink-pairs", "nvlink-bridge"): (RTX3090_BRIDGE, RTX3090_BRIDGE),
    ("oases-nvlink3090-8node", "nvlink-bridge"): (RTX3090_BRIDGE, RTX3090_BRIDGE),
}


def _nvlink_levels():
    for path in SHIPPED:
        topo = load_topology(str(path))
        for lv in topo.levels:
            if "nvlink" in lv.name or "nvswitch" in lv.name:
                yield pytest.param(topo.name, lv, id=f"{topo.name}:{lv.name}")


@pytest.mark.parametrize("name, level", list(_nvlink_levels()))
def test_nvlink_figures_are_one_way(name, level):
    want = ONE_WAY.get((name, level.name))
    assert want is not None, f"{name}: NVLink level {level.name!r} has no data-sheet figure here; add it"
    assert (level.p2p_bandwidth_GBps, level.group_bandwidth_GBps) == pytest.approx(want)


def test_every_pinned_level_is_shipped():
    """The table names no topology that is gone (a renamed file would escape the pin)."""
    found = {(name, lv.name) for p in list(_nvlink_levels()) for name, lv in [p.values]}
    assert set(ONE_WAY) == found


NCCL_EFFICIENCY = {  # hardware: NCCL's measured bus bandwidth / link rate, with its source
    "a100-nvswitch": 0.667,  # ~200 GB/s all-reduce busbw, 8 x A100 80GB SXM (NVIDIA/nccl-tests issue 149)
    "h100-nvswitch": 0.822,  # dgx-h100-ndr8's measured figure (its YAML names the source)
}
SAME_HARDWARE = {  # (topology, level): the hardware whose measured efficiency it must carry
    ("dgx-a100", "nvswitch"): "a100-nvswitch",
    ("2node-ib", "nvswitch"): "a100-nvswitch",
    ("dgx-a100-hdr8", "nvswitch"): "a100-nvswitch",
    ("jeanzay-a100-opa4", "nvswitch"): "a100-nvswitch",
    ("dgx-h100-ndr8", "nvswitch"): "h100-nvswitch",
}


@pytest.mark.parametrize("name, level", [p for p in _nvlink_levels() if "nvswitch" in p.values[1].name])
def test_one_nvswitch_one_efficiency(name, level):
    """One fact, one number: every topology built of the same NVSwitch carries the same measured
    NCCL efficiency (dgx-a100 once gave none, so its rings ran at the link rate while
    dgx-a100-hdr8's ran at 0.667 of it on the same hardware)."""
    hw = SAME_HARDWARE.get((name, level.name))
    assert hw is not None, f"{name}: NVSwitch level {level.name!r} names no hardware here; add it"
    assert level.nccl_efficiency == pytest.approx(NCCL_EFFICIENCY[hw])
