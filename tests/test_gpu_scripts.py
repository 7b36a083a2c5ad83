"""The lent-GPU scripts (docs/gpu.md) stay runnable: ``scripts/gpu_measure.py`` on CPU at a small
shape (its numbers mean nothing there, its plumbing is what a GPU lease must not spend minutes
on) and ``scripts/gpu_check.sh``'s syntax."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("flags, message", [
    (["--what", "tiny", "--event-rows", "bogus"], "--event-rows: unknown row bogus; "),
    (["--rows", "h100-1.7B", "nope"], "--rows: unknown row nope; "),
    (["--what", "kernels", "--device", "cpu"], "--what kernels times CUDA kernels"),
    (["--reps", "0"], r"--reps must be >= 1 \(got 0\)"),
    (["--limit-s", "0"], r"--limit-s must be > 0 \(got 0.0\)"),
])
def test_gpu_measure_refuses_bad_flags_in_one_line(tmp_path, capsys, flags, message):
    """A bad flag is one line and status 2 before anything is measured or written (an unknown
    --event-rows id timed nothing and wrote an empty table with status 0)."""
    gm = load_script("scripts/gpu_measure.py")
    with pytest.raises(SystemExit) as exc:
        gm.main(["--out", str(tmp_path / "m"), "--shrink", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and re.match(f"gpu_measure.py: error: {message}", err)
    assert not (tmp_path / "m").exists()


def test_gpu_measure_refuses_cuda_without_a_cuda_device(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    with pytest.raises(SystemExit) as exc:
        load_script("scripts/gpu_measure.py").main(["--out", str(tmp_path), "--device", "cuda"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith(
        "gpu_measure.py: error: --device cuda: no CUDA device is visible")


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


def _gpu_check_on_cpu(tmp_path, steps: str, **env) -> tuple[int, str, str]:
    """``gpu_check.sh`` with DEVICE=cpu from a folder of its own (the repository's scripts and
    package linked in, a junk wheel in .whl/), TMPDIR inside ``tmp_path``: (status, summary, log)."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    (work / ".whl").mkdir(parents=True)
    tmp.mkdir()
    for name in ("scripts", "megatron_oases"):
        (work / name).symlink_to(os.path.join(ROOT, name))
    (work / ".whl" / "junk-0.0-py3-none-any.whl").write_text("not a wheel")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], capture_output=True, text=True, timeout=240, cwd=work,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, "DEVICE": "cpu",
                               "STEPS": steps, "BUDGET_S": "200", "TMPDIR": str(tmp),
                               # one intra-op thread: on a loaded 2-core host torch's spinning
                               # threads made a 1-step CPU benchmark take minutes
                               "OMP_NUM_THREADS": "1", **env})
    assert not list(tmp.glob("gpu_check_site.*"))  # a wheel folder, when made, is gone at exit
    return proc.returncode, (out / "summary.txt").read_text(), (out / "check.log").read_text()


def test_gpu_check_on_cpu_says_no_gpu_compares_last_and_installs_wheels_when_asked(tmp_path):
    """DEVICE=cpu: the env step succeeds saying no GPU is used, and compare runs once, after the
    other steps, wherever STEPS names it; WHEELS=1 installs .whl/ into a private folder, removed
    at exit (without it .whl/ is left alone on CPU: the overlap tests below)."""
    rc, summary, log = _gpu_check_on_cpu(tmp_path, "compare env", WHEELS="1")
    assert rc == 0, log[-3000:]
    assert [line.split()[:2] for line in summary.splitlines()] == [["env", "rc=0"], ["compare", "rc=0"]], summary
    assert "no GPU used (DEVICE=cpu)" in log
    assert f"-> {tmp_path / 'tmp'}/gpu_check_site." in log  # a private folder, removed at exit


def test_gpu_check_overlap_conn_runs_with_eight_hardware_queues(tmp_path):
    """On an H100 (2026-11-27) the step unset the variable, the trainer's runtime set it back to
    1, and the "8 queues" run repeated the 1-queue one (its JSON recorded "1"). The simulator's
    comparison (sim-standin) follows the overlap steps."""
    import tarfile

    small = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--micro-batch-size 2 --global-batch-size 4")
    rc, summary, log = _gpu_check_on_cpu(tmp_path, "overlap-conn", OVERLAP_FLAGS=small,
                                         OVERLAP_ARGS="--steps 1 --warmup 0")
    assert rc == 0 and [line.split()[:2] for line in summary.splitlines()] == [
        ["overlap-conn", "rc=0"], ["sim-standin", "rc=0"]], log[-3000:]
    assert "=== wheels" not in log  # DEVICE=cpu leaves .whl/ alone unless WHEELS=1
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        bench = json.load(tar.extractfile("json/overlap_standin_conn8.json"))
        rows = json.load(tar.extractfile("json/sim_vs_standin.json"))
    assert bench["cuda_device_max_connections"] == "8"
    assert [r["schedule"] for r in rows] == ["default", "oases"]  # the simulator beside it


def test_gpu_compare_help_and_a_missing_folder():
    script = os.path.join(ROOT, "scripts", "gpu_compare.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "run-<name>.json" in out.stdout and "compare.json" in out.stdout
    out = subprocess.run([sys.executable, script, "/nonexistent-folder"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr == (
        "gpu_compare.py: error: FOLDER /nonexistent-folder is not a directory; give the folder of "
        "the run-<name>.json logs\n")


def test_fusion_bench_runs_on_cpu(tmp_path):
    fb = load_script("scripts/gpu_fusion_bench.py")
    out = tmp_path / "fusion.json"
    assert fb.main(["--device", "cpu", "--hidden", "32", "--heads", "2", "--seq", "16",
                    "--reps", "1", "--warmup", "1", "--no-compile", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["variant"]) for r in rows if "ms_fwd_bwd" in r} >= {
        ("bias_gelu", "eager"), ("swiglu", "megatron_fused"), ("softmax", "eager_fp32"),
        ("bias_dropout_add", "megatron_fused"), ("rms_norm", "eager")}


def test_gpu_compare_reads_trainer_logs_and_prices_mfu(tmp_path):
    gc = load_script("scripts/gpu_compare.py")
    for name, loss in (("mfu-default-auto", 7.0), ("mfu-oases-auto", 7.0007)):
        (tmp_path / f"run-{name}.json").write_text("\n".join(json.dumps(
            {"iteration": i, "lm_loss": loss, "step_ms": 100.0, "tflops_per_rank": 494.5,
             "peak_mem_mb": 1.0}) for i in (1, 2, 3)) + "\n")
    (tmp_path / "fusion.json").write_text("{}")  # other JSON beside the logs is not a run
    assert gc.main([str(tmp_path), "NVIDIA H100 80GB HBM3"]) == 0
    out = json.loads((tmp_path / "compare.json").read_text())
    assert abs(out["runs"]["mfu-default-auto"]["mfu"] - 0.5) < 1e-9
    assert abs(out["pairs"]["mfu-oases-auto vs mfu-default-auto"]["max_rel_loss_diff"] - 1e-4) < 1e-9
    assert out["runs"]["mfu-default-auto"]["forward_backward_host_ms"] is None  # an older log


def test_gpu_compare_reports_the_hosts_share_of_forward_backward(tmp_path, capsys):
    """The trainer's log carries how long the host took to issue forward-backward; compare shows
    it as a share of the phase (a host-bound GPU step reads near 100%)."""
    gc = load_script("scripts/gpu_compare.py")
    (tmp_path / "run-sim-h512-default.json").write_text("\n".join(json.dumps(
        {"iteration": i, "lm_loss": 7.0, "step_ms": 40.0, "tflops_per_rank": 10.0, "peak_mem_mb": 1.0,
         "forward_backward_ms": 30.0, "forward_backward_host_ms": 27.0}) for i in (1, 2, 3)) + "\n")
    assert gc.main([str(tmp_path), "NVIDIA H100 80GB HBM3"]) == 0
    assert " 90.0%" in capsys.readouterr().out
    run = json.loads((tmp_path / "compare.json").read_text())["runs"]["sim-h512-default"]
    assert (run["forward_backward_ms"], run["forward_backward_host_ms"]) == (30.0, 27.0)


def test_gpu_compare_takes_a_log_without_step_times(tmp_path):
    """A log with losses only (no ``step_ms``) is compared on its losses; no speed is made up."""
    gc = load_script("scripts/gpu_compare.py")
    for name, rec in (("tp1-stock", {"step_ms": 10.0}), ("tp1-oases", {})):
        (tmp_path / f"run-{name}.json").write_text("\n".join(json.dumps(
            {"iteration": i, "lm_loss": 7.0, **rec}) for i in (1, 2, 3)) + "\n")
    assert gc.main([str(tmp_path), "cpu"]) == 0
    pair = json.loads((tmp_path / "compare.json").read_text())["pairs"]["tp1-oases vs tp1-stock"]
    assert pair == {"max_rel_loss_diff": 0.0, "speedup": None}


def test_gpu_settle_says_it_skipped_without_cuda(capsys):
    """On a CPU-only machine the settle step costs nothing and says so in its one summary line."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine settles for real")
    assert load_script("scripts/gpu_settle.py").main(["--seconds", "3", "--label", "sim-h512-default"]) == 0
    assert capsys.readouterr().out == "clocks sim-h512-default: no CUDA, not settled\n"


def test_gpu_settle_reads_the_clocks_of_the_gpu_torch_loads(monkeypatch):
    """``nvidia-smi`` ignores ``CUDA_VISIBLE_DEVICES`` and lists every GPU of the node, so the
    first line read was physical GPU 0's even when torch's device was another GPU; now the GPU
    is named by torch's UUID (``-i GPU-<uuid>``), and an id nvidia-smi does not take (a MIG
    instance's) falls back to the first line as before."""
    import types
    import uuid

    import torch

    gs = load_script("scripts/gpu_settle.py")
    u = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid=types.SimpleNamespace(bytes=list(u.bytes)))
                        if d == 3 else None)
    assert gs.torch_gpu_id() == f"GPU-{u}"
    calls = []

    def smi(cmd, **kw):
        calls.append(cmd)
        known = "-i" not in cmd or cmd[cmd.index("-i") + 1] == f"GPU-{u}"
        return types.SimpleNamespace(returncode=0 if known else 6, stdout="1980 MHz, 2619 MHz\n" if known
                                     else "", stderr="" if known else "No devices were found")
    monkeypatch.setattr(gs.subprocess, "run", smi)
    assert gs.read_clocks(f"GPU-{u}") == "1980 MHz, 2619 MHz"
    assert calls[-1][-2:] == ["-i", f"GPU-{u}"]
    assert gs.read_clocks("MIG-abc") == "1980 MHz, 2619 MHz" and "-i" not in calls[-1]


def test_fusion_bench_times_on_the_device_s_stream(monkeypatch):
    """``--device cuda:1`` ran the cases on cuda:1 but recorded the CUDA events on the current
    device's (cuda:0) stream, where nothing ran: the times were of an empty stream."""
    import torch

    from tests.fake_cuda import fake_cuda_events

    fb = load_script("scripts/gpu_fusion_bench.py")
    recorded = fake_cuda_events(monkeypatch, 2.0)
    assert fb._timer(torch.device("cuda", 1))(lambda: None) == 2.0
    assert recorded == ["stream of cuda:1"] * 2


def test_sim_vs_standin_prices_the_benchmark_s_collectives_as_the_simulator_does(tmp_path, capsys):
    """The one-GPU overlap benchmark's stand-ins are priced with ``DeviceModel.collective_ms`` and
    the simulator gets their link as it ran alone: its collectives alone add up to the stand-ins
    alone for every committed H100 run (both schedules, with and without recompute); beside
    compute they last longer (the SM clock under load), so the step's comm time is longer."""
    svs = load_script("scripts/sim_vs_standin.py")
    runs = [os.path.join(ROOT, "examples", "gpu", "h100-2026-11-27", "call1", f"overlap_standin{s}.json")
            for s in ("", "_conn8", "_rc")] + [os.path.join(ROOT, "examples", "gpu", "h100-2026-11-26",
                                                             "overlap_standin.json")]
    out = tmp_path / "rows.json"
    assert svs.main(runs + ["--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and {r["schedule"] for r in rows} == {"default", "oases"}
    for r in rows:
        assert r["sim_comm_alone_ms"] == pytest.approx(r["standins_alone_ms"], rel=0.005), r
        assert r["sim_comm_ms"] >= r["sim_comm_alone_ms"] and r["collective_beside_compute"] > 1, r
        assert r["gpu"] == "h100-sxm" and r["sim_step_ms"] > r["sim_compute_ms"] > 0
    assert "sim_exposed_ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        svs.main([str(tmp_path / "missing.json")])
    assert "OVERLAP_JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        svs.main(runs[:1] + ["--out", str(tmp_path / "no-such-folder" / "rows.json")])
    assert "--out" in capsys.readouterr().err and not (tmp_path / "no-such-folder").exists()


def _script_array(name: str) -> list[str]:
    """The words of ``gpu_check.sh``'s bash array ``name`` (its ``=(...)`` and ``+=(...)`` parts)."""
    import shlex

    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh"), encoding="utf-8").read()
    return [w for m in re.findall(rf"\b{name}\+?=\(([^)]*)\)", text) for w in shlex.split(m.replace("\\\n", " "))]


@pytest.mark.parametrize("tp, array", [(2, "MFU_MODEL"), (8, "L70")])
def test_overlap_summary_models_pass_the_benchmark_s_checks(tp, array):
    """The next GPU call's two models (the hidden-4096 model at TP 2, one rank's shard of
    Llama-2-70B at TP 8) as gpu_check.sh spells them pass the benchmark's and the trainer's
    checks at their TP, with and without full recompute (the CPU run below shrinks them)."""
    from benchmarks.standin.measure import build_parser, validate_args

    flags = _script_array(array)
    assert "--hidden-size" in flags and (array != "L70" or {"--swiglu", "--group-query-attention"} <= set(flags))
    for rc in ([], ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]):
        a, rest = build_parser().parse_known_args(["--tp", str(tp), "--kinds", "sleep,nccl", "--link-gbps", "24",
                                                   "--label", array, "--device", "cpu", *flags, *rc])
        validate_args(a, rest)


def test_gpu_check_overlap_summary_on_cpu_writes_one_record_per_run_and_kind(tmp_path):
    """The prepared GPU call's step at tiny sizes: a benchmark run per model, recompute and link
    (2 x 2 x 2 on the GPU), then overlap_summary.json with a record per kind of each. Here at
    one link of the script's own SUMMARY_LINKS (its second: the value reaches each record and
    file name); each run is a process paying torch's and Megatron's imports, ~5 s on 2 cores,
    and a second link would repeat the same four runs at another number."""
    import tarfile

    from benchmarks.standin.summary import FIELDS

    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh"), encoding="utf-8").read()
    links = re.search(r"for gbps in \$\{SUMMARY_LINKS:-([^}]*)\}", text)[1].split()
    assert links == ["24", "150"]  # the GPU call's links (docs/gpu.md, "The next GPU call")
    link = links[-1]
    rc, summary, log = _gpu_check_on_cpu(
        tmp_path, "overlap-summary", OVERLAP_ARGS="--steps 1 --warmup 0", SUMMARY_LINKS=link,
        OVERLAP_FLAGS="--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                      "--micro-batch-size 2 --global-batch-size 4",
        LLAMA_SIZES="--num-layers 1 --hidden-size 64 --num-attention-heads 8 --num-query-groups 8 --ffn-hidden-size 64 "
                    "--seq-length 16 --max-position-embeddings 16 --vocab-size 1024 --micro-batch-size 2")
    models = ("h4096", "llama2-70b-tp8")
    runs = [f"summary-{m}-{r}-{link}" for m in models for r in ("none", "full")]
    assert rc == 0 and [line.split()[:2] for line in summary.splitlines()] == [
        [name, "rc=0"] for name in runs + ["overlap-summary"]], log[-3000:]
    assert "=== wheels" not in log
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        recs = json.load(tar.extractfile("json/overlap_summary.json"))
        assert sorted(n for n in tar.getnames() if n.startswith("json/summary/")) == sorted(
            f"json/summary/overlap-{m}-{r}-{link}.json" for m in models for r in ("none", "full"))
    assert all(list(r) == list(FIELDS) for r in recs)
    assert [(r["model"], r["recompute"], r["link_GBps"], r["kind"]) for r in recs] == [
        (m, r, float(link), k) for m in models for r in ("none", "full") for k in ("sleep", "nccl")]
    assert all(r["stock_ms"] > 0 and r["oases_ms"] > 0 and r["comm_disabled_ms"] > 0 for r in recs)


def _moe_layouts() -> list[tuple[int, int]]:
    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh"), encoding="utf-8").read()
    return [tuple(int(x) for x in w.split("x")) for w in re.search(r"for layout in \$\{MOE_LAYOUTS:-([^}]*)\}", text)[1].split()]


def test_moe_standin_model_passes_the_benchmark_s_checks():
    """The MoE step's model (one rank's shard of Mixtral-8x7B layers) as gpu_check.sh spells it
    passes the benchmark's and the trainer's checks at each layout of the step (TP 1 x EP 2, TP 2
    x EP 2 with sequence parallelism, which Megatron needs for MoE at TP > 1)."""
    from benchmarks.standin.measure import build_parser, validate_args

    flags = _script_array("MOE")
    assert {"--num-experts", "--swiglu", "--group-query-attention"} <= set(flags)
    assert flags[flags.index("--moe-token-dispatcher-type") + 1] == "alltoall"  # the one Oases runs
    assert _moe_layouts() == [(1, 2), (2, 2)]
    for tp, ep in _moe_layouts():
        a, rest = build_parser().parse_known_args(["--tp", str(tp), "--ep", str(ep), "--kinds", "sleep,nccl",
                                                   "--link-gbps", "24", "--device", "cpu", *flags]
                                                  + (["--sequence-parallel"] if tp > 1 else []))
        validate_args(a, rest)


def test_gpu_check_moe_standin_on_cpu_writes_the_records_and_the_simulator_s_rows(tmp_path):
    """The MoE step at tiny sizes (the Mixtral family flags kept): a benchmark run per layout at
    one link, then moe_summary.json (the dense runs' records) and the simulator beside each run."""
    import tarfile

    from benchmarks.standin.summary import FIELDS

    rc, summary, log = _gpu_check_on_cpu(
        tmp_path, "moe-standin", OVERLAP_ARGS="--steps 1 --warmup 0", MOE_LINKS="24",
        MOE_SIZES="--num-layers 1 --hidden-size 64 --num-attention-heads 8 --num-query-groups 8 --ffn-hidden-size 64 "
                  "--num-experts 4 --seq-length 16 --max-position-embeddings 16 --vocab-size 1024 --micro-batch-size 2")
    names = [f"mixtral-8x7b-tp{t}ep{e}" for t, e in _moe_layouts()]
    assert rc == 0 and [line.split()[:2] for line in summary.splitlines()] == [
        [f"moe-{n}-24", "rc=0"] for n in names] + [["moe-summary", "rc=0"], ["sim-standin-moe", "rc=0"]], log[-3000:]
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        recs = json.load(tar.extractfile("json/moe_summary.json"))
        rows = json.load(tar.extractfile("json/sim_vs_standin_moe.json"))
        runs = [json.load(tar.extractfile(f"json/moe/overlap-{n}-24.json")) for n in names]
    assert [(r["model"], r["link_GBps"], r["kind"]) for r in recs] == [
        (n, 24.0, k) for n in names for k in ("sleep", "nccl")]
    assert all(list(r) == list(FIELDS) and r["stock_ms"] > 0 and r["oases_ms"] > 0 for r in recs)
    assert [(b["tp"], b["ep"], "--sequence-parallel" in b["trainer_flags"]) for b in runs] == [
        (t, e, t > 1) for t, e in _moe_layouts()]
    assert [(r["model"], r["tp"], r["ep"], r["schedule"]) for r in rows] == [
        (n, t, e, s) for n, (t, e) in zip(names, _moe_layouts()) for s in ("default", "oases")]
    assert all(r["sim_step_ms"] > 0 and r["sim_dp_grad_ms_left_out"] > 0 for r in rows)


def test_gpu_check_gemm_step_times_the_table_s_shapes_into_a_file_the_table_builder_reads(tmp_path):
    """Issue 49 item 1: the gemm step (``gpu_measure.py --what table``) on CPU at two tiny shapes;
    on a GPU it times every shape of ``pricing/gemm_table.json`` and the builder adds the file."""
    import tarfile

    rc, summary, log = _gpu_check_on_cpu(tmp_path, "gemm", GEMM_ARGS="--table-shapes 32x16x8 16x16x16 --reps 2")
    assert rc == 0 and [line.split()[:2] for line in summary.splitlines()] == [["gemm", "rc=0"]], log[-3000:]
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        data = json.load(tar.extractfile("json/gpu_table.json"))
    shapes = data["table"]["shapes"]
    assert [(s["m"], s["n"], s["k"]) for s in shapes] == [(32, 16, 8), (16, 16, 16)] and data["table"]["complete"]
    assert all(s["measured_ms"] > 0 and s["dtype"] == "bf16" for s in shapes) and "back to back" in data["meta"]["method"]
    path = tmp_path / "gpu_table.json"
    path.write_text(json.dumps({**data, "meta": {**data["meta"], "device": "NVIDIA H100 80GB HBM3"}}))
    pts = load_script("scripts/gemm_table_build.py").from_gemms(str(path))
    assert [(p["gpu"], p["m"], p["ms"]) for p in pts] == [("h100-sxm", s["m"], s["measured_ms"]) for s in shapes]
    assert "back to back" in pts[0]["source"]


def test_gpu_measure_table_shapes_default_to_the_table_and_refuse_bad_ones(tmp_path, capsys):
    gm = load_script("scripts/gpu_measure.py")
    from megatron_oases.pricing.gemm_table import load_tables

    assert set(gm.gemm_table_shapes()) == {(p.m, p.n, p.k) for t in load_tables().values() for p in t.points}
    with pytest.raises(SystemExit) as exc:
        gm.main(["--out", str(tmp_path / "m"), "--what", "table", "--table-shapes", "64x64"])
    assert exc.value.code == 2 and "expected MxNxK" in capsys.readouterr().err
