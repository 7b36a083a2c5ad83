"""The overlap benchmark's diagnosis tools on CPU: where a trace's compute stream sits idle
(``benchmarks/standin/trace_gaps.py``), the NCCL-like channel copy (``channel_copy.py``, under Triton's
interpreter), the ``nccl`` stand-in's paced copy (``paced_copy.py``: interpreted on a fake clock,
and compiled for an H100) and ``--trace`` / ``--kinds channels`` end to end. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.standin.trace_gaps import format_summary, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernel(stream, ts, dur, name):
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}


def test_idle_gaps_are_split_into_exposed_communication_and_host_time():
    trace = {"traceEvents": [
        _kernel(7, 0, 10, "gemm_a"), _kernel(7, 30, 10, "gemm_b"), _kernel(7, 40, 10, "softmax"),
        _kernel(7, 80, 20, "gemm_c"), _kernel(20, 12, 16, "sleep"), _kernel(20, 60, 5, "sleep"),
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100, "name": "aten::mm", "args": {}},  # not device
    ]}
    s = summarize(trace, min_gap_us=5)
    assert s["device_events"] == 6 and s["compute_stream"] == 7 and s["step_ms"] == pytest.approx(0.1)
    assert s["busy_ms_by_stream"] == {"7": 0.05, "20": 0.021}
    # gaps [10, 30] (a stand-in ran 16 us of it) and [50, 80] (5 us)
    assert s["compute_idle_ms"] == pytest.approx(0.05)
    assert s["idle_while_side_busy_ms"] == pytest.approx(0.021)
    assert s["idle_with_nothing_running_ms"] == pytest.approx(0.029)
    first, second = s["largest_gaps"]
    assert (first["after"], first["before"], first["ms"]) == ("softmax", "gemm_c", pytest.approx(0.03))
    assert (second["after"], second["before"], second["side_busy_ms"]) == ("gemm_a", "gemm_b", pytest.approx(0.016))
    assert "idle 0.05 ms (0.02 while a stand-in ran" in format_summary("x", s)
    assert s["side_stretches"] == [{"index": 0, "start_ms": 0.012, "ms": 0.016, "exposed_ms": 0.016},
                                   {"index": 1, "start_ms": 0.06, "ms": 0.005, "exposed_ms": 0.005}]
    assert summarize({"traceEvents": []}) == {"device_events": 0}


def test_the_compute_stream_is_the_one_with_the_most_kernels_not_the_busiest():
    """On an H100 (2026-11-27) a copy stand-in slowed by sharing the SMs with the GEMMs kept its
    stream busier than the compute stream (163 vs 111 ms), and the summary reported the stand-in
    stream's idle time as the compute stream's; a copy stand-in of many copies has more events."""
    copies = [_kernel(20, 5 + 10 * i, 10, "copy") for i in range(5)]  # more events than the GEMMs
    trace = {"traceEvents": [_kernel(7, 0, 5, "gemm_a"), _kernel(7, 10, 5, "gemm_b"), _kernel(7, 60, 5, "gemm_c"),
                             *copies]}
    s = summarize(trace, min_gap_us=1)
    assert s["compute_stream"] == 7 and s["busy_ms_by_stream"] == {"7": 0.015, "20": 0.05}
    assert s["compute_idle_ms"] == pytest.approx(0.05) and s["idle_while_side_busy_ms"] == pytest.approx(0.045)


def test_channel_copy_copies_with_few_blocks_under_the_triton_interpreter():
    pytest.importorskip("triton")
    code = ("import torch\n"
            "from benchmarks.standin.channel_copy import channel_copy\n"
            "src = torch.randint(0, 255, (40_003,), dtype=torch.uint8); dst = torch.zeros_like(src)\n"
            "channel_copy(src, dst, 40_001, 3)\n"
            "assert torch.equal(src[:40_000], dst[:40_000]) and int(dst[40_000:].sum()) == 0\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


PACED = """
import torch
from benchmarks.standin.paced_copy import BLOCK, paced_copy
step = BLOCK * 4
src = torch.randint(1, 255, (3 * step,), dtype=torch.uint8)

def run(nbytes, ms, GBps, dst=None):
    dst = torch.zeros_like(src) if dst is None else dst
    clock, stamps = torch.zeros(1, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    paced_copy(src, dst, nbytes, ms=ms, GBps=GBps, blocks=2, stamps=stamps, fake_clock=clock)
    return dst, [int(e - s) for s, e in stamps.view(2, 2).tolist()]

# a link that delivers one step of each block every 10 ticks; 5 steps wrap around 3 of scratch
dst, took = run(5 * step, 0.0, 2 * step / 10)
assert torch.equal(dst, src) and took[0] >= 20 and took[1] >= 10, took  # block 0's 3rd step at 20
# unpaced: no wait between steps
dst, unpaced = run(5 * step, 0.0, 0.0)
assert unpaced[0] < 10 and unpaced[1] < 10, unpaced
# the blocks stay resident for the duration (50 ticks), however few bytes they move
dst, held = run(step + 4, 50e-6, 0.0)
assert min(held) >= 50, held
assert torch.equal(dst[:step + 4], src[:step + 4]) and int(dst[step + 4:].sum()) == 0  # whole words, no more
print("ok")
"""


def test_paced_copy_moves_the_bytes_at_the_link_s_rate_and_holds_its_blocks_under_the_interpreter():
    """The ``nccl`` stand-in's kernel on a fake clock (one tick a read): each block's steps are
    released at the link's rate, every byte is copied (wrapping round the scratch), and the blocks
    stay until the duration is over."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", PACED], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_paced_copy_compiles_for_an_h100_with_the_gpu_timer():
    """The CUDA path (``%globaltimer``, the spin loops) compiles to an sm_90 binary with Triton's
    own ptxas, no GPU needed: what the interpreter cannot run is checked here."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.standin.paced_copy import BLOCK, NUM_WARPS, _paced_copy

    for ns in ("i32", "i64"):  # Triton types an int argument by its value: both widths occur
        sig = {"src": "*i32", "dst": "*i32", "clock": "*i64", "stamps": "*i64", "n": "i32", "scratch_words": "i32",
               "step_ns": ns, "total_ns": ns, "programs": "i32", "BLOCK": "constexpr", "FAKE_CLOCK": "constexpr"}
        try:
            kernel = triton.compile(ASTSource(fn=_paced_copy, signature=sig,
                                              constexprs={"BLOCK": BLOCK, "FAKE_CLOCK": False}),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
        except (FileNotFoundError, RuntimeError) as e:  # a Triton without its CUDA toolchain
            if "ptxas" in str(e):
                pytest.skip(f"no ptxas: {e}")
            raise
        assert "%globaltimer" in kernel.asm["ptx"] and kernel.asm["cubin"]


def test_script_traces_a_step_per_schedule_and_kind(tmp_path):
    out, traces = tmp_path / "overlap.json", tmp_path / "traces"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_gpu_overlap.py"), "--tp", "2", "--steps", "1",
           "--warmup", "0", "--kinds", "channels", "--schedules", "oases", "--trace", str(traces),
           "--out", str(out), "--", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
           "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    r = res["schedules"]["oases"]["channels"]
    assert r["trace"]["file"] == "oases-channels.json.gz" and (traces / "oases-channels.json.gz").stat().st_size > 0
    assert r["trace"]["device_events"] == 0  # CPU: no streams; on CUDA the summary names the gaps
    assert res["calibration"]["channels"] == 16 and "cuda_device_max_connections" in res
    assert "trace oases channels: no device events" in proc.stdout
