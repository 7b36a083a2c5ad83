"""ATP mesh search against the paper's worked numbers (§3.5, §5.3, §5.4), the described layer it
prices (FFN size, SwiGLU, GQA; the simulator's collectives) and the CLI's bad input."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megatron_oases.plan.atp_mesh import (
    AxisBandwidth, MeshCost, MeshError, axis_bandwidth, axis_groups, calibration_from_measurements,
    enumerate_meshes, measurement_plan, mesh_cost, search_mesh, valid_tp_sizes, with_calibration,
)
from megatron_oases.plan.mesh_cli import mesh_main
from megatron_oases.describe.ops import ModelingError
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.topology import Topology, load_topology
from tests.atp_eq2 import closed_form_t_comm, eq2_t_comm

# The paper's default run: batch 4, sequence 2048 (§5), model M2, fp16.
M2 = GPTShape(hidden_size=4096, num_layers=24, num_attention_heads=32, micro_batch_size=4, seq_length=2048,
              dtype="fp16")
CLI_MODEL = ["--hidden-size", "4096", "--num-layers", "24", "--num-attention-heads", "32", "--micro-batch-size", "4",
             "--seq-length", "2048", "--bf16"]
# Eq. 2 leaves out the LayerNorm statistics' all-reduces (4 bytes a token each) the described layer
# has on axis 2: at M2's sizes they are under 0.2% of any mesh's time
EQ2 = 2e-3


def flat(n: int, gbps: float, name: str = "flat") -> Topology:
    """One-level, fully connected topology (the paper's IC3/IC4/IC5 view)."""
    return Topology.from_dict({"name": name, "levels": [
        {"name": "fabric", "size": n, "scope": "inter_node", "p2p_bandwidth_GBps": gbps,
         "group_bandwidth_GBps": gbps}]})


def ic1() -> Topology:
    """8 GPUs on PCIe (2 per switch, 2 switches per socket, 2 sockets) with the paper's §5.3
    calibrated B values, placed on the groups of DeviceMesh(2,4) and (8,1) by our rank mapping."""
    lv = lambda name, bw: {"name": name, "size": 2, "scope": "intra_node",  # noqa: E731
                           "p2p_bandwidth_GBps": bw, "group_bandwidth_GBps": bw}
    return Topology.from_dict({"name": "ic1", "levels": [lv("switch", 12), lv("socket", 12), lv("qpi", 6)],
                               "calibration": {"allreduce_GBps": [
                                   {"group_size": 2, "stride": 4, "bandwidth_GBps": 1.20},  # DM(2,4) axis 1
                                   {"group_size": 4, "stride": 1, "bandwidth_GBps": 4.95},  # DM(2,4) axis 2
                                   {"group_size": 8, "stride": 1, "bandwidth_GBps": 0.97}]}})  # DM(8,1)


def cost(topo, tp, d1, d2):
    return mesh_cost(load_topology(topo), tp, d1, d2, M2)


# ---- search space and mapping ----------------------------------------------------------------
def test_enumerate_meshes_contains_megatron_first():
    assert enumerate_meshes(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert enumerate_meshes(12) == [(12, 1), (6, 2), (4, 3), (3, 4), (2, 6), (1, 12)]
    assert enumerate_meshes(1) == [(1, 1)]
    assert len(enumerate_meshes(2 ** 5)) == 6  # §3.2: 2^n devices give n + 1 meshes


def test_rank_mapping_axis2_is_consecutive():
    # Fig. 4 on DeviceMesh(2,2): the first level splits ranks [0,1] from [2,3].
    assert axis_groups(4, 2, 2, 2) == [[0, 1], [2, 3]]
    assert axis_groups(4, 2, 2, 1) == [[0, 2], [1, 3]]
    assert axis_groups(16, 8, 2, 1)[0] == [0, 2, 4, 6, 8, 10, 12, 14]


def test_valid_tp_sizes_follow_the_hierarchy():
    assert valid_tp_sizes(load_topology("fig7a")) == [1, 2, 4, 8, 16]
    assert valid_tp_sizes(load_topology("nvlink-pairs")) == [1, 2, 4, 8]


# ---- §3.5 worked example: Fig. 7(a), DeviceMesh(8,2) ------------------------------------------
def test_fig7a_devicemesh_8x2_bus_bandwidths():
    c = cost("fig7a", 16, 8, 2)
    # two GPUs in a node: NVLink p2p, not the group; the paper's 200 (600) count both directions
    assert c.axis2.bus_GBps == pytest.approx(100.0)  # 4 NVLink3 links x 25 GB/s each way, not 300 group
    assert c.axis1.bus_GBps == pytest.approx(12.5)   # 2 groups share the node's 25 GB/s HDR
    assert c.axis1.alg_GBps == pytest.approx(8 / 14 * 12.5)  # Eq. 4
    assert c.axis2.alg_GBps == pytest.approx(100.0)


def test_eq2_on_1d_mesh_is_megatrons_4Lbsh_over_B():
    c = cost(flat(8, 100.0), 8, 8, 1)
    b = 8 / 14 * 100.0
    expected = 4 * M2.num_layers * M2.micro_batch_size * M2.seq_length * M2.hidden_size * 2 / (b * 1e9)  # §2.3
    assert c.t_comm_s == pytest.approx(expected)
    assert math.isinf(c.axis2.alg_GBps)


# ---- §5.3: which ATP-k the paper picks --------------------------------------------------------
def test_ic3_nvswitch_8_gpus_picks_atp1():
    choice = search_mesh("dgx-a100", 8, M2)
    assert (choice.pick.d1, choice.pick.d2) == (8, 1) and choice.pick.label == "ATP-1"
    # Ambiguity kept visible: Eq. 2 + 4 alone rank (4,2) 7% ahead; the paper still picks ATP-1.
    raw = search_mesh("dgx-a100", 8, M2, min_gain=0.0)
    assert (raw.pick.d1, raw.pick.d2) == (4, 2)
    assert 1 - raw.pick.t_comm_s / raw.megatron.t_comm_s == pytest.approx(1 - 3.25 / 3.5, abs=EQ2)


def test_ic4_16_gpus_flat_ib_picks_atp2():
    choice = search_mesh(flat(16, 25.0, "ic4"), 16, M2)
    assert (choice.pick.d1, choice.pick.d2) == (8, 2) and choice.pick.label == "ATP-2"


def test_ic2_nvlink_pairs_picks_atp1():
    choice = search_mesh("nvlink-pairs", 8, M2)
    assert (choice.pick.d1, choice.pick.d2) == (8, 1)
    # The paper's argument: d2 * B1' (the row-first term) is the same for ATP-1/2/4 ...
    by = {c.d2: c for c in choice.candidates}
    assert {by[k].d2 * by[k].axis1.bus_GBps for k in (1, 2, 4)} == {24.0}
    # ... and ATP-2/4 add a column-first term that ATP-1 does not have.
    assert all(by[k].axis2.alg_GBps < math.inf for k in (2, 4)) and math.isinf(by[1].axis2.alg_GBps)


def test_ic1_calibrated_atp4_is_46_percent_below_atp1():
    topo = ic1()
    c4, c1 = cost(topo, 8, 2, 4), cost(topo, 8, 8, 1)
    assert (c4.axis1.alg_GBps, c4.axis2.alg_GBps, c1.axis1.alg_GBps) == (1.20, 4.95, 0.97)
    assert c4.axis1.calibrated and c4.axis2.calibrated and c1.axis1.calibrated
    assert 1 - c4.t_comm_s / c1.t_comm_s == pytest.approx(0.46, abs=0.006)
    choice = search_mesh(topo, 8, M2, meshes=[(8, 1), (2, 4)])  # the two the paper calibrated
    assert (choice.pick.d1, choice.pick.d2) == (2, 4)


def test_calibration_from_measurements_matches_inline_calibration():
    base = Topology.from_dict({k: v for k, v in ic1().to_dict().items() if k != "calibration"})
    measured = {(2, 4): 1.20, (4, 1): 4.95, (8, 1): 0.97}
    topo = with_calibration(base, calibration_from_measurements(measured))
    assert cost(topo, 8, 2, 4).t_comm_s == pytest.approx(cost(ic1(), 8, 2, 4).t_comm_s)
    # Bus bandwidths (nccl-tests busbw) go through Eq. 4 first.
    bus = calibration_from_measurements({(4, 1): 6.0}, kind="bus")
    assert bus.allreduce_GBps[0].bandwidth_GBps == pytest.approx(4 / 6 * 6.0)
    # New measurements win over what the topology already had.
    newer = with_calibration(ic1(), calibration_from_measurements({(8, 1): 2.0}))
    assert cost(newer, 8, 8, 1).axis1.alg_GBps == 2.0
    assert measurement_plan(8) == [(2, 1), (2, 4), (4, 1), (4, 2), (8, 1)]


def test_calibration_read_from_yaml(tmp_path):
    path = tmp_path / "ic1.yaml"
    import yaml
    path.write_text(yaml.safe_dump(ic1().to_dict()))
    assert cost(str(path), 8, 2, 4).axis2.alg_GBps == 4.95


# ---- §5.4 closed form (IC5 NVLink-Network switch, IC6 2-D torus) ------------------------------
@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_closed_form_equals_general_on_flat_switch(n):
    topo, m = flat(n, 450.0, "ic5"), dataclasses.replace(M2, num_attention_heads=64)  # heads split 64 ways
    for d1, d2 in enumerate_meshes(n):
        assert mesh_cost(topo, n, d1, d2, m).t_comm_s == pytest.approx(closed_form_t_comm(m, d1, d2, 450.0),
                                                                      rel=EQ2)


def test_closed_form_equals_general_on_torus():
    for d1, d2 in [(4, 4), (16, 1), (1, 16)]:
        c = cost("fig7b-torus", 16, d1, d2)
        assert {c.axis1.bus_GBps, c.axis2.bus_GBps} - {math.inf} == {50.0}  # B1' = B2' = GroupBW
        assert c.t_comm_s == pytest.approx(closed_form_t_comm(M2, d1, d2, 50.0), rel=EQ2)


def test_fig12_trends_atp1_grows_atp2_shrinks():
    t = lambda n, k: closed_form_t_comm(M2, n // k, k, 1.0)  # noqa: E731
    sizes = [4, 8, 16, 32, 64]
    assert all(t(a, 1) < t(b, 1) for a, b in zip(sizes, sizes[1:]))
    assert all(t(a, 2) > t(b, 2) for a, b in zip(sizes, sizes[1:]))


def test_exact_tie_goes_to_megatron(monkeypatch):
    import megatron_oases.plan.atp_mesh as atp_mesh

    real = atp_mesh.mesh_cost
    monkeypatch.setattr(atp_mesh, "mesh_cost", lambda *a: dataclasses.replace(real(*a), t_comm_s=1.0))
    choice = search_mesh(flat(4, 10.0), 4, M2, min_gain=0.0, meshes=[(2, 2), (4, 1)])
    assert choice.candidates[0].t_comm_s == choice.candidates[1].t_comm_s
    assert (choice.pick.d1, choice.pick.d2) == (4, 1) and choice.candidates[0].d2 == 1


# ---- bad input --------------------------------------------------------------------------------
def test_bad_input_raises_mesh_error():
    with pytest.raises(MeshError, match="tp=6 does not match"):
        search_mesh("fig7a", 6, M2)
    with pytest.raises(MeshError, match="exceeds the 16 ranks"):
        search_mesh("fig7a", 32, M2)
    with pytest.raises(ModelingError, match="--hidden-size must be a positive integer"):
        GPTShape(hidden_size=0, num_layers=1, num_attention_heads=1, micro_batch_size=1, seq_length=1)
    with pytest.raises(MeshError, match="--atp-mesh 3,5: d1 x d2 = 15 must equal --tensor-model-parallel-size 16"):
        search_mesh("fig7a", 16, M2, meshes=[(3, 5)])
    assert isinstance(axis_bandwidth(load_topology("fig7a"), 4, 4, 1, 2), AxisBandwidth)


def run_cli(capsys, *argv):
    rc = mesh_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prints_every_mesh_and_the_pick(capsys, tmp_path):
    out_json = tmp_path / "mesh.json"
    rc, out, err = run_cli(capsys, "--topology", "fig7a", "--tp", "16", *CLI_MODEL, "--json", str(out_json))
    assert rc == 0 and not err
    for mesh in ("(16,1)", "(8,2)", "(4,4)", "(2,8)", "(1,16)"):
        assert mesh in out
    assert "pick: DeviceMesh(" in out and "<- pick" in out
    data = json.loads(out_json.read_text())
    assert len(data["candidates"]) == 5 and data["pick"]["t_comm_ms"] > 0
    assert data["candidates"][[c["d2"] for c in data["candidates"]].index(1)]["axis2"]["alg_GBps"] is None


@pytest.mark.parametrize("argv, needle", [
    (["--topology", "fig7a", "--tp", "6"], "tp=6 does not match"),
    (["--topology", "fig7a", "--tp", "32"], "exceeds the 16 ranks"),
    (["--topology", "no-such-topology", "--tp", "8"], "topology no-such-topology: no such file"),
    (["--topology", "fig7a", "--tp", "0"], "--tensor-model-parallel-size must be > 0"),
    (["--topology", "fig7a", "--tp", "eight"], "invalid int value"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, argv, needle):
    rc, out, err = run_cli(capsys, *argv, *CLI_MODEL)
    assert rc == 2 and not out and needle in err and len(err.strip().splitlines()) == 1


def test_cli_non_positive_model_sizes_and_broken_yaml(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "--topology", "fig7a", "--tp", "8", *CLI_MODEL, "--seq-length", "-5")
    assert rc == 2 and "--seq-length must be a positive integer (got -5)" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nlevels: [{name: a, size: 0}]\n")
    rc, _, err = run_cli(capsys, "--topology", str(bad), "--tp", "2", *CLI_MODEL)
    assert rc == 2 and str(bad) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("json_arg, needle", [
    ("/proc/mesh.json", "--json /proc/mesh.json: /proc is not a writable directory"),
    ("", "--json is an empty path"),
    ("{tmp}", "is a directory; give a file name"),
    ("{tmp}/no/such/dir/m.json", "does not exist; create it or pick another path"),
])
def test_cli_unwritable_json_is_refused_before_the_table(capsys, tmp_path, json_arg, needle):
    """--json is checked with the other flags (output_paths.check_output_file): one line, exit 2,
    no table printed first (was: the whole table on stdout, then the error; --json '' ignored)."""
    rc, out, err = run_cli(capsys, "--topology", "fig7a", "--tp", "8", *CLI_MODEL,
                           "--json", json_arg.format(tmp=tmp_path))
    assert rc == 2 and not out and needle in err and len(err.strip().splitlines()) == 1, err


# ---- the described layer: what the trainer runs and the simulator prices ------------------------
@pytest.mark.parametrize("topology, tp", [("fig7a", 16), ("dgx-a100", 8), ("pcie-ic1", 4)])
def test_described_layer_is_eq2_at_ffn_4h(topology, tp):
    """The paper's Eq. 2 is the oracle at ffn = 4h: the described layer's all-reduces plus the
    head all-gathers (at half an all-reduce's factor) come to Eq. 2's 14h/d1 and 4h/d2 a token;
    only the LayerNorm statistics add to it, on axis 2."""
    for d1, d2 in enumerate_meshes(tp):
        c = cost(topology, tp, d1, d2)
        want = eq2_t_comm(M2, d1, d2, c.axis1.alg_GBps, c.axis2.alg_GBps)
        assert c.t_comm_s == pytest.approx(want, rel=EQ2)
        assert c.t_comm_s >= want * (1 - 1e-12)
        if d2 == 1:  # no statistics cross a group of one: exactly Megatron's 4 L b s h / B
            assert c.t_comm_s == pytest.approx(want, rel=1e-12)


def _cli_json(capsys, tmp_path, *argv) -> dict:
    out = tmp_path / "mesh.json"
    rc, _, err = run_cli(capsys, *argv, "--json", str(out))
    assert rc == 0, err
    return json.loads(out.read_text())


def _by_mesh(data: dict) -> dict:
    return {(c["d1"], c["d2"]): c for c in data["candidates"]}


def test_ffn_size_changes_the_price(capsys, tmp_path):
    """Doubling --ffn-hidden-size (16384 -> 32768) raises every mesh that splits the FFN's
    column-first output over d2 > 1 (fc1's all-reduce, fc2's input gradient); Megatron's (N, 1)
    all-reduces h-wide tensors only and keeps its price. (Was: the same table for both.)"""
    base = ["--topology", "fig7a", "--tp", "16", *CLI_MODEL]
    small = _by_mesh(_cli_json(capsys, tmp_path, *base, "--ffn-hidden-size", "16384"))
    large = _by_mesh(_cli_json(capsys, tmp_path, *base, "--ffn-hidden-size", "32768"))
    assert large[(16, 1)]["t_comm_ms"] == small[(16, 1)]["t_comm_ms"]
    for mesh in ((8, 2), (4, 4), (2, 8), (1, 16)):
        assert large[mesh]["t_comm_ms"] > small[mesh]["t_comm_ms"]
        d1 = mesh[0]
        # fc1's forward all-reduce and fc2's input-gradient all-reduce: 2 x 16384 / d1 more elements
        extra = 24 * 4 * 2048 * 2 * 2 * 16384 / d1 * 2 * (mesh[1] - 1) / mesh[1]
        assert large[mesh]["axis2"]["wire_bytes"] - small[mesh]["axis2"]["wire_bytes"] == pytest.approx(extra)


def test_swiglu_and_gqa_change_the_pick():
    """SwiGLU doubles fc1's output, GQA shrinks QKV's: on dgx-a100 at TP 8 a Llama-style layer
    (8 key/value groups, SwiGLU) picks DeviceMesh(4, 2) where GPT-2's layer keeps (8, 1)."""
    from megatron_oases.describe.ops import LayerVariant

    llama = dataclasses.replace(M2, ffn_hidden_size=11008, variant=LayerVariant(gated=True, query_groups=8))
    assert (search_mesh("dgx-a100", 8, M2).pick.d2, search_mesh("dgx-a100", 8, llama).pick.d2) == (1, 2)
    gated = dataclasses.replace(M2, variant=LayerVariant(gated=True))
    assert cost("dgx-a100", 8, 4, 2).t_comm_s < mesh_cost(load_topology("dgx-a100"), 8, 4, 2, gated).t_comm_s


@pytest.mark.parametrize("ffn", ["16384", "32768"])
def test_mesh_prices_the_collectives_sim_simulates(ffn):
    """For each mesh, the bytes the picker prices on each axis are the bytes of the layer
    collectives ``megatron-oases sim --tp-backend atp --atp-mesh d1,d2`` puts on that axis for the
    same flags (its events for one micro-batch of one stage: every layer, forward and backward)."""
    from megatron_oases.describe.ops import Collective
    from megatron_oases.plan.mesh_cli import _parser, run_shape
    from megatron_oases.sim.core.events import build_stage_events
    from megatron_oases.sim.frontends.cli import build_parser, model_from_args, strategy_from_args

    model_flags = ["--hidden-size", "4096", "--num-layers", "4", "--num-attention-heads", "32",
                   "--micro-batch-size", "2", "--seq-length", "512", "--ffn-hidden-size", ffn, "--swiglu",
                   "--group-query-attention", "--num-query-groups", "8"]
    _, shape = run_shape(_parser().parse_args(["--topology", "dgx-a100", "--tp", "8", "--bf16", *model_flags]))
    topo = load_topology("dgx-a100")
    for d1, d2 in enumerate_meshes(8):
        a = build_parser().parse_args(["--topology", "dgx-a100", *model_flags, "--dtype", "bf16", "--tp", "8",
                                       "--dp", "1", "--num-microbatches", "1", "--tp-backend", "atp",
                                       "--atp-mesh", f"{d1},{d2}"])
        (stage,) = build_stage_events(model_from_args(a, 8), strategy_from_args(a, 8), topo)
        (chunk,) = stage.chunks
        sent = {"mesh1": 0.0, "mesh2": 0.0}
        for ev in chunk.forward + chunk.backward:
            op = ev.op
            if isinstance(op, Collective) and op.axis in sent and not op.name.startswith("atp."):  # not the edges
                sent[op.axis] += op.wire_bytes_per_rank
        c = mesh_cost(topo, 8, d1, d2, shape)
        assert c.wire_bytes == pytest.approx((sent["mesh1"], sent["mesh2"])), (d1, d2)
        assert c.t_comm_s > 0 or (d1, d2) == (1, 1)


def test_cli_takes_megatron_names_short_aliases_and_the_trainers_defaults(capsys, tmp_path):
    """The long names and the short ones price the same; a flag left out takes
    ``megatron-oases train``'s default (fp32 without --bf16 / --fp16, ffn 4h; SwiGLU: Megatron-LM's)."""
    from megatron_oases.plan.mesh_cli import _parser, run_shape
    from megatron_oases.run_config import DEFAULTS, mesh_search_shape

    long = _cli_json(capsys, tmp_path, "--topology", "dgx-a100", "--tensor-model-parallel-size", "4",
                     "--hidden-size", "256", "--num-layers", "2")
    short = _cli_json(capsys, tmp_path, "--topology", "dgx-a100", "--tp", "4", "--hidden", "256", "--layers", "2")
    assert long == short
    assert long["model"]["bytes_per_element"] == 4 and long["model"]["ffn"] == 1024
    assert long["model"]["heads"] == DEFAULTS.num_attention_heads
    assert long["model"]["seq_length"] == DEFAULTS.seq_length
    assert long["model"]["micro_batch"] == DEFAULTS.micro_batch_size
    cfg, shape = run_shape(_parser().parse_args(["--topology", "x", "--swiglu", "--hidden-size", "768"]))
    assert shape == mesh_search_shape(dataclasses.replace(DEFAULTS, swiglu=True, hidden_size=768), 1)
    assert shape.ffn_hidden_size == 2048 and shape.variant.gated and cfg.ffn_hidden_size == 2048


@pytest.mark.parametrize("argv, needle", [
    (["--swiglu", "--hidden-size", "16"], "--swiglu with --hidden-size 16 gives Megatron-LM's default FFN size"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3", "--num-attention-heads", "12", "--hidden-size", "96"],
     "--num-query-groups 3 must be divisible by --tensor-model-parallel-size 4"),
    (["--num-attention-heads", "2"], "--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--bf16", "--bytes-per-element", "4"], "--bytes-per-element and --bf16 / --fp16 both set"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be > 0"),
    (["--num-layers", "5", "--pipeline-model-parallel-size", "2"], "--num-layers 5 is not divisible"),
])
def test_cli_refuses_a_layer_it_cannot_split_in_one_line(capsys, argv, needle):
    rc, out, err = run_cli(capsys, "--topology", "dgx-a100", "--tp", "4", *argv)
    assert rc == 2 and not out and needle in err and len(err.strip().splitlines()) == 1, err
