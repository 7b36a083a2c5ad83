"""The lent-GPU scripts (docs/gpu.md) stay runnable: ``scripts/gpu_measure.py`` on CPU at a small
shape (its numbers mean nothing there, its plumbing is what a GPU lease must not spend minutes
on) and ``scripts/gpu_check.sh``'s syntax."""
from __future__ import annotations

import json
import os
import subprocess

from tests.script_modules import ROOT, load_script


def test_gpu_measure_runs_on_cpu_and_writes_its_tables(tmp_path):
    gm = load_script("scripts/gpu_measure.py")
    assert gm.main(["--out", str(tmp_path), "--rows", "h100-1.7B", "--shrink", "--device", "cpu",
                    "--what", "gemms", "dispatch", "tiny", "--reps", "1", "--limit-s", "30"]) == 0
    gemms = json.loads((tmp_path / "gpu_gemms.json").read_text())["gemms"]
    row, = gemms["rows"]
    assert row["row"] == "h100-1.7B" and row["gpu"] == "h100-sxm" and row["complete"]
    assert row["measured_ms"] > 0 and row["model_ms"] > 0 and gemms["shapes"]
    assert set(json.loads((tmp_path / "gpu_dispatch.json").read_text())["dispatch"]) == {
        "add_us", "linear_bias_gelu_us"}
    tiny = json.loads((tmp_path / "gpu_tiny.json").read_text())["tiny"]
    assert {"attention", "mlp", "attention.bwd", "mlp.bwd"} <= {
        r["event"].split(":")[1].split("[")[0] for r in tiny if "error" not in r}


def test_kernel_classes():
    gm = load_script("scripts/gpu_measure.py")
    assert gm.kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert gm.kernel_class("void (anonymous namespace)::softmax_warp_forward<float>") == "softmax"
    assert gm.kernel_class("void at::native::fused_dropout_kernel_vec<c10::BFloat16>") == "dropout"
    assert gm.kernel_class("void at::native::vectorized_elementwise_kernel<8, GeluCUDAKernelImpl>") == "elementwise"


def test_gpu_check_script_parses():
    out = subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "gpu_check.sh")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
