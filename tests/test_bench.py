"""The benchmark helpers (``benchmarks.harness``): topologies they write load, statistics read
the trainer's logs, and the counting trainer records Megatron's own collectives per step."""
from __future__ import annotations

import glob
import json
import os

import pytest

from benchmarks import harness
from megatron_oases.topology import load_topology


def test_topology_yaml_loads(tmp_path):
    flat = load_topology(harness.write_topology(str(tmp_path), "f4", harness.flat_topology_yaml("f4", 4, 0.1)))
    assert flat.world_size == 4 and len(flat.levels) == 1
    two = harness.two_level_topology_yaml("t", "2 x 2", 1.0, 0.1, device="a100-80gb")
    topo = load_topology(harness.write_topology(str(tmp_path), "t", two))
    assert topo.world_size == 4 and [lv.size for lv in topo.levels] == [2, 2]


def test_step_and_rank_stats(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step_ms": ms, "peak_mem_mb": 10.0, "lm_loss": 5.0 - i})
                           + "\n" for i, ms in enumerate([900.0, 100.0, 120.0, 110.0])))
    st = harness.step_stats(str(log), warmup=1)
    assert st["step_ms"] == 110.0 and st["step_ms_min"] == 100.0 and st["loss"] == 2.0
    for r, wire in enumerate([1e6, 3e6]):
        steps = [{"wire_bytes": wire, "calls": 4, "comm_s": 0.0, "cpu_s": 0.5, "param_bytes": 8,
                  "peak_mem_mb": 5.0 + r, "kinds": {"all_reduce": {"calls": 4, "wire_bytes": wire}}}] * 2
        (tmp_path / f"s.rank{r}.json").write_text(json.dumps({"rank": r, "steps": steps}))
    rs = harness.rank_stats(sorted(glob.glob(str(tmp_path / "s.rank*.json"))), warmup=1)
    assert rs["wire_MB_per_rank"] == 2.0 and rs["wire_MB_max_rank"] == 3.0
    assert rs["peak_mem_mb_max_rank"] == 6.0 and rs["kinds_rank0"]["all_reduce"]["calls"] == 4


def test_lock_yields_the_wait(tmp_path):
    with harness.bench_lock(str(tmp_path / "lock")) as waited:
        assert waited >= 0


def _counted(tmp_path, layers: int) -> dict:
    stats = str(tmp_path / f"L{layers}")
    flags = ["--tensor-model-parallel-size", "2", "--num-layers", str(layers), "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--vocab-size", "128", "--train-iters", "2", "--device", "cpu"]
    harness.launch_ranks(harness.counting_trainer(stats) + ["--"] + flags, 2, timeout=240)
    return harness.rank_stats([f"{stats}.rank{r}.json" for r in range(2)], warmup=0)


def test_counting_trainer_counts_megatrons_layer_all_reduces(tmp_path):
    """One more stock layer adds Megatron's four TP all-reduces of [s, b, h] per micro-batch
    (proj and fc2 forward, QKV and fc1 input gradients), issued by Megatron, not by us."""
    one, two = _counted(tmp_path, 1), _counted(tmp_path, 2)
    ar1, ar2 = one["kinds_rank0"]["all_reduce"], two["kinds_rank0"]["all_reduce"]
    micro_batches, hidden_bytes = 2, 16 * 2 * 32 * 4
    assert ar2["calls"] - ar1["calls"] == 4 * micro_batches
    assert ar2["wire_bytes"] - ar1["wire_bytes"] == pytest.approx(4 * micro_batches * hidden_bytes)
    assert os.path.exists(tmp_path / "L1.rank1.json")
