"""``megatron-oases profile``: a flag either acts in the chosen mode (one strategy, ``--search``,
``-- <train flags>``, ``--emulate``) or is one error line naming it, before anything is measured
(no rank is spawned here: every refusal comes first)."""
from __future__ import annotations

import pytest

from megatron_oases.pricing.device_model import ProfileDB
from megatron_oases.sim.frontends.profile_cli import profile_main

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--vocab-size", "128"]
TRAIN = ["--", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size",
         "32", "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--device", "cpu"]
GBS = ["--global-batch-size", "4"]


@pytest.mark.parametrize("flags, needle", [
    (["--num-layers", "7", "--tp", "4", "--hidden-size", "999", *TRAIN], "--num-layers has no effect with `-- <train"),
    (["--tp", "4", *TRAIN], "--tensor-model-parallel-size has no effect with `-- <train flags>`"),
    (["--search", *GBS, *TRAIN], "--search has no effect with `-- <train flags>`"),
    (["--global-batch-size", "64", *TRAIN], "--global-batch-size has no effect with `-- <train flags>`"),
    (["--emulate", *MODEL, "--tp", "2"], "--emulate profiles a trainer run"),
    (["--nice", "5", *MODEL, "--tp", "2"], "--nice applies to --emulate only"),
    (["--repeats", "3", *TRAIN], "--repeats applies to --emulate only"),
    (["--emulate", "--topology", "local", "--nproc", "2", *TRAIN], "--nproc has no effect with --emulate"),
    (["--emulate", "--topology", "local", "--device", "cpu", *TRAIN], "--device has no effect with --emulate"),
    (["--emulate", "--topology", "local", "--threads", "1", *TRAIN], "--threads has no effect with --emulate"),
    (["--emulate", "--topology", "local", "--max-comm-mb", "1", *TRAIN], "--max-comm-mb has no effect with --emulate"),
    (["--emulate", "--topology", "local", "--repeats", "0", *TRAIN], "--repeats must be >= 1 (got 0)"),
    (["--jobs", "2", "--search", *GBS, *MODEL], "--jobs has no effect on profile"),
    (["--search", *GBS, "--tp", "2", *MODEL], "--tensor-model-parallel-size names one strategy"),
    ([*MODEL, "--tp", "2", "--tp-sizes", "1,2"], "--tp-sizes applies to --search only"),
    ([*MODEL, "--tp", "0"], "--tensor-model-parallel-size must be >= 1 (got 0)"),
    ([*MODEL, "--pp", "0"], "--pipeline-model-parallel-size must be >= 1 (got 0)"),
    ([*MODEL, "--num-microbatches", "0"], "--num-microbatches must be >= 1 (got 0)"),
    ([*MODEL, "--search", "--global-batch-size", "0"], "--global-batch-size must be >= 1 (got 0)"),
    ([*MODEL, "--search", *GBS, "--gpus", "0"], "--gpus must be >= 1 (got 0)"),
    ([*MODEL, "--search", *GBS, "--schedules", "foo"], "--schedules: 'foo' is not one of default, oases"),
    ([*MODEL, "--nproc", "0"], "--nproc must be >= 1 (got 0)"),
    ([*MODEL, "--reps", "0"], "--reps must be >= 1 (got 0)"),
    ([*MODEL, "--warmup", "-1"], "--warmup must be >= 0 (got -1)"),
    ([*MODEL, "--max-comm-mb", "0"], "--max-comm-mb must be > 0"),
    ([*MODEL, "--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ([*MODEL, "--attention-backend", "flash", "--dtype", "fp32"], "--attention-backend flash has no fp32 kernel"),
], ids=["train-model-flags", "train-tp", "train-search", "train-global-batch", "emulate-without-train",
        "nice-without-emulate", "repeats-without-emulate", "emulate-nproc", "emulate-device", "emulate-threads",
        "emulate-max-comm", "repeats-0", "jobs", "search-tp", "one-strategy-tp-sizes", "tp-0", "pp-0",
        "microbatches-0", "global-batch-0", "gpus-0", "overlaps-foo", "nproc-0", "reps-0", "warmup-negative",
        "max-comm-0", "sp-at-tp-1", "flash-fp32"])
def test_a_flag_the_mode_ignores_or_a_bad_value_is_refused(flags, needle, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert profile_main(["--out", str(out), *flags]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists() and not captured.out


def test_flags_are_not_abbreviated(tmp_path, capsys):
    """As Megatron-LM (allow_abbrev=False): a prefix of a flag is no flag."""
    with pytest.raises(SystemExit) as exc:
        profile_main(["--out", str(tmp_path / "p.json"), "--war", "1", *MODEL, "--tp", "2"])
    assert exc.value.code == 2 and "unrecognized arguments: --war" in capsys.readouterr().err


def test_the_measurement_flags_act_on_a_trainer_run(tmp_path, monkeypatch, capsys):
    """With ``-- <train flags>`` --warmup, --reps, --nproc, --threads and --max-comm-mb reach the
    measurement (they were dropped unless --nproc, --threads or --device was given), and the
    trainer's --device holds unless --device is given."""
    from megatron_oases.sim.frontends import predict

    seen = []

    def measure(events, topo, settings):
        seen.append(settings)
        return ProfileDB(device="cpu", events_ms={k: 1.0 for k in events})

    monkeypatch.setattr(predict, "profile_events", measure)
    out = str(tmp_path / "p.json")
    assert profile_main(["--out", out, "--warmup", "0", "--reps", "1", *TRAIN]) == 0
    # the run's events first (then the loop overhead's one-rank events, calibrate.loop_overhead)
    assert (seen[0].warmup, seen[0].reps, seen[0].nproc, seen[0].device) == (0, 1, 2, "cpu")
    assert seen[-1].nproc == 1 and seen[-1].reps == 1
    seen.clear()
    assert profile_main(["--out", out, "--nproc", "1", "--threads", "3", "--max-comm-mb", "1", *TRAIN]) == 0
    s = seen[0]
    assert (s.nproc, s.threads, s.max_comm_bytes, s.device, s.warmup, s.reps) == (1, 3, 1 << 20, "cpu", 2, 5)
