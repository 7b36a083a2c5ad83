"""The topology format: every shipped example loads, rank placement and lookups follow the
documented rank order, and every class of bad input is one TopologyError naming the field."""
from __future__ import annotations

import copy
import math

import pytest

from megatron_oases.topology import (EXAMPLES_DIR, Level, Topology, TopologyError, list_examples,
                                     load_topology)

GOOD = {
    "name": "t",
    "levels": [
        {"name": "nvlink", "size": 4, "scope": "intra_node", "p2p_bandwidth_GBps": 200,
         "group_bandwidth_GBps": 600, "latency_us": 2},
        {"name": "ib", "size": 4, "scope": "inter_node", "p2p_bandwidth_GBps": 25,
         "group_bandwidth_GBps": 25, "latency_us": 5},
    ],
}


def test_expected_examples_are_shipped():
    names = set(list_examples())
    assert {"pcie-3090x4", "pcie-3090-2node", "nvlink-pairs", "dgx-a100", "2node-ib", "fig7a",
            "emu-flat4", "emu-2x2", "emu-2x4"} <= names


@pytest.mark.parametrize("name", list_examples())
def test_every_example_loads_and_round_trips(name):
    t = load_topology(name)
    assert t.name == name
    assert t.world_size == math.prod(lv.size for lv in t.levels)
    assert t.num_nodes * t.ranks_per_node == t.world_size
    assert Topology.from_dict(t.to_dict()) == t
    assert load_topology(EXAMPLES_DIR / f"{name}.yaml") == t  # by path too


def test_emulation_examples_have_small_rates():
    for name in ("emu-flat4", "emu-2x2", "emu-2x4"):
        assert all(lv.group_bandwidth_GBps <= 1 for lv in load_topology(name).levels)


def test_rank_order_and_nodes():
    t = load_topology("fig7a")  # 4 nodes x 4 GPUs
    assert (t.world_size, t.ranks_per_node, t.num_nodes) == (16, 4, 4)
    assert [t.node_of(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert t.coords(6) == (2, 1)
    assert t.is_intra_node(4, 7) and not t.is_intra_node(3, 4)
    assert t.level_between(0, 3) == 0 and t.level_between(0, 4) == 1 and t.level_between(5, 5) == -1
    assert t.p2p_bandwidth(0, 1) == 100 and t.p2p_bandwidth(0, 12) == 25  # NVLink3 x 4 and HDR, one way
    assert t.link_latency(0, 1) == 2 and t.link_latency(1, 13) == 5
    with pytest.raises(ValueError):
        t.node_of(16)


def test_three_levels_outermost_difference():
    t = load_topology("nvlink-pairs")  # 2 (nvlink) x 4 (pcie), one node
    assert t.level_between(0, 1) == 0 and t.level_between(0, 2) == 1 and t.level_between(1, 2) == 1
    assert t.p2p_bandwidth(0, 1) == 56.25 and t.p2p_bandwidth(1, 6) == 12
    assert t.num_nodes == 1 and all(t.is_intra_node(0, r) for r in range(8))


def test_p2p_matrix_overrides_uniform_bandwidth():
    t = load_topology("fig7b-torus")
    assert t.p2p_bandwidth(0, 1) == 25 and t.p2p_bandwidth(0, 3) == 25 and t.p2p_bandwidth(0, 2) == 0
    assert t.p2p_bandwidth(0, 4) == 100 and t.p2p_bandwidth(1, 9) == 0  # ring-of-rings neighbours only
    lv = Level(name="x", size=2, scope="intra_node", p2p_bandwidth_GBps=1, group_bandwidth_GBps=2,
               p2p_matrix_GBps=[[0, 3], [1, 0]])
    t2 = Topology(name="m", levels=[lv])
    assert (t2.p2p_bandwidth(0, 1), t2.p2p_bandwidth(1, 0)) == (3.0, 1.0)


def test_calibration_lookup():
    t = load_topology("pcie-ic1")
    assert t.calibrated_allreduce([3, 2, 1, 0]) == 4.95
    assert t.calibrated_allreduce([1, 5]) == 1.20
    assert t.calibrated_allreduce(list(range(8))) == 0.97
    assert t.calibrated_allreduce([0, 3]) is None


def test_check_world_size():
    t = load_topology("emu-2x2")
    t.check_world_size(4)
    with pytest.raises(TopologyError, match=r"--nproc-per-node=3.*set --nproc-per-node=4"):
        t.check_world_size(3)
    with pytest.raises(TopologyError, match="--world"):
        t.check_world_size(8, flag="--world")


def _mutate(path, value):
    d = copy.deepcopy(GOOD)
    *head, last = path
    node = d
    for k in head:
        node = node[k]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return d


_DELETE = object()

BAD = [
    # (path, value, field named in message, words of the fix)
    (("levels", 1, "p2p_bandwidth_GBps"), -3, "levels[1].p2p_bandwidth_GBps", "must be > 0 (got -3)"),
    (("levels", 0, "group_bandwidth_GBps"), 0, "levels[0].group_bandwidth_GBps", "must be > 0"),
    (("levels", 0, "size"), "four", "levels[0].size", "must be an integer"),
    (("levels", 0, "size"), 0, "levels[0].size", "must be >= 1"),
    (("levels", 0, "scope"), "rack", "levels[0].scope", "intra_node, inter_node"),
    (("levels", 0, "latency_us"), -1, "levels[0].latency_us", ">= 0"),
    (("levels", 0, "bandwith_GBps"), 3, "levels[0].bandwith_GBps", "not a known field"),
    (("levels", 0, "name"), _DELETE, "levels[0].name", "required"),
    (("levels", 1, "group_bandwidth_GBps"), 10, "levels[1].group_bandwidth_GBps", ">= p2p_bandwidth_GBps"),
    (("levels", 0, "p2p_matrix_GBps"), [[0, 1], [1, 0]], "levels[0].p2p_matrix_GBps", "4x4"),
    (("levels", 0, "p2p_matrix_GBps"), [[1, 1, 1, 1]] * 4, "levels[0].p2p_matrix_GBps[0][0]", "diagonal"),
    (("levels", 0, "p2p_matrix_GBps"), [[0, -1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]],
     "levels[0].p2p_matrix_GBps[0][1]", ">= 0"),
    (("levels", 1, "name"), "nvlink", "levels[1].name", "unique"),
    (("levels",), [dict(GOOD["levels"][1], name="net"), GOOD["levels"][0]], "levels[1].scope", "before inter_node"),
    (("levels",), [], "levels", "non-empty"),
    (("levels",), _DELETE, "levels", "required"),
    (("levels", 0), "nvlink", "levels[0]", "must be a mapping"),
    (("name",), 7, "name", "non-empty string"),
    (("device",), ["a100"], "device", "string"),
    (("colour",), "blue", "colour", "not a known field"),
    (("calibration",), {"allreduce_GBps": [{"group_size": 2}]}, "calibration.allreduce_GBps[0].bandwidth_GBps", "required"),
    (("calibration",), {"allreduce_GBps": [{"bandwidth_GBps": 1}]}, "calibration.allreduce_GBps[0].ranks", "exactly one"),
    (("calibration",), {"allreduce_GBps": [{"ranks": [0, 99], "bandwidth_GBps": 1}]}, "calibration.allreduce_GBps[0]", "beyond world size"),
    (("calibration",), {"allreduce": []}, "calibration.allreduce", "not a known field"),
]


@pytest.mark.parametrize("path,value,field,fix", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_input_names_the_field(path, value, field, fix):
    with pytest.raises(TopologyError) as ei:
        Topology.from_dict(_mutate(path, value), source="examples/x.yaml")
    msg = str(ei.value)
    assert msg.startswith(f"topology examples/x.yaml: {field} "), msg
    assert fix in msg and "\n" not in msg


@pytest.mark.parametrize("text,fix", [
    ("name: [unclosed\n", "not valid YAML at line"),
    ("", "is empty"),
    ("- just\n- a list\n", "top level must be a mapping"),
])
def test_bad_files(tmp_path, text, fix):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(TopologyError, match=f"topology {p}: .*{fix}"):
        load_topology(p)


def test_unknown_name_and_unreadable_file(tmp_path):
    with pytest.raises(TopologyError, match="no such file or shipped example; .*emu-2x2"):
        load_topology("no-such-topology")
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TopologyError, match="cannot be read"):
        load_topology(p)
    assert isinstance(TopologyError("x"), ValueError)


def test_frozen_and_direct_construction_validates():
    t = load_topology("emu-2x2")
    with pytest.raises(AttributeError):
        t.name = "other"  # type: ignore[misc]
    with pytest.raises(TopologyError, match="p2p_bandwidth_GBps must be > 0"):
        Level(name="x", size=2, scope="intra_node", p2p_bandwidth_GBps=0, group_bandwidth_GBps=1)
    with pytest.raises(TypeError):
        Level("x", 2, "intra_node", 1, 1)  # kw_only
