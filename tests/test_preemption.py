"""Preemption and time limits (Megatron-LM's --exit-signal-handler, --exit-signal,
--exit-duration-in-mins, --exit-interval; megatron_oases/runtime/exit_signal.py).

The signal tests run ``megatron-oases train --nproc-per-node 4`` (TP2 x DP2) as a subprocess and
signal the launcher, as a scheduler signals the job: it must forward the signal, the ranks must
finish the iteration, save and exit 0, and the same command (no flag changed) must resume with
the uninterrupted run's losses. The uninterrupted reference, those resumes and the time limits
run the trainer's rank path (``main`` as under torchrun) on forkserver ranks
(``tests/rank_fns_main.py``: no interpreter and imports per launch). Deadlines are generous: 2
shared cores.
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron_oases.checkpoint import PAUSE_ENV
from megatron_oases.runtime.exit_signal import REPEAT_GRACE_S

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--seed", "11", "--lr", "3e-3"]
FOUR_RANKS = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "2"]
ITERS = 8
DEADLINE_S = 400  # start-up of 4 ranks on 2 loaded cores takes 15-60 s


def _cli() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "megatron-oases")
    if os.path.exists(script):
        return [script, "train"]
    return [sys.executable, "-m", "megatron_oases.train"]


class Run:
    """A training subprocess whose merged output is read line by line as it comes."""

    def __init__(self, args: list[str], env: dict | None = None, cwd: str | None = None):
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})}, cwd=cwd)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = DEADLINE_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n"
                                     + "".join(self.lines[-40:])) from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before a line matching "
                                     f"{pattern!r}:\n" + "".join(self.lines[-60:]))
            self.lines.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float = DEADLINE_S) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("did not exit in time:\n" + "".join(self.lines[-40:])) from None
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return rc

    @property
    def out(self) -> str:
        return "".join(self.lines)


def losses(out: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r" iteration\s+(\d+)/\s*\d+ \| lm loss: (\S+) \|", out)}


def json_losses(path) -> dict[int, float]:
    """Full-precision losses of ``--log-json`` (the printed ones have 7 digits)."""
    with open(path, encoding="utf-8") as f:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, f)}


def tracker(d) -> int:
    with open(os.path.join(d, "latest_checkpointed_iteration.txt"), encoding="utf-8") as f:
        return int(f.read())


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> float:
    """Each of ``got`` within 1e-6 (relative) of ``want``; returns the largest difference."""
    assert got, "no iteration lines"
    for it, loss in got.items():
        assert abs(loss - want[it]) <= 1e-6 * abs(want[it]), (it, loss, want[it])
    return max(abs(loss - want[it]) for it, loss in got.items())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Losses of the uninterrupted run, full precision (``--log-json``)."""
    from tests.rank_fns_main import main_on_ranks

    log = tmp_path_factory.mktemp("uninterrupted") / "log.jsonl"
    rc, out = main_on_ranks("megatron_oases.train", 4, FOUR_RANKS[2:] + MODEL + [
        "--train-iters", str(ITERS), "--log-json", str(log)], timeout_s=DEADLINE_S)
    assert rc == 0, out[-3000:]
    out = json_losses(log)
    assert sorted(out) == list(range(1, ITERS + 1))
    return out


def _resubmitted(cmd: list[str]) -> tuple[int, str]:
    """``cmd`` (a launch of FOUR_RANKS) run again, no flag changed, on its ranks' path: the
    trainer's ``main`` with the same flags on 4 forkserver ranks (``tests/rank_fns_main.py``; the
    launcher, which only starts the ranks and forwards signals, is what the first launch tested).
    (status, output)."""
    from tests.rank_fns_main import main_on_ranks

    flags = cmd[len(_cli()):]
    assert flags[:2] == FOUR_RANKS[:2]
    return main_on_ranks("megatron_oases.train", 4, flags[2:], timeout_s=DEADLINE_S)


def test_sigterm_mid_iteration_saves_exits_0_and_the_same_command_resumes(tmp_path, uninterrupted):
    """SIGTERM to the launcher after the first iteration: every rank finishes the iteration it is
    in, saves, and the run exits 0; the same command resumes from that checkpoint and its losses
    are the uninterrupted run's."""
    d, log = str(tmp_path / "ck"), tmp_path / "log.jsonl"
    cmd = _cli() + FOUR_RANKS + MODEL + ["--train-iters", str(ITERS), "--save", d, "--load", d,
                                         "--exit-signal-handler", "--log-json", str(log)]
    first = Run(cmd)
    first.wait_for(r"^ iteration\s+1/")
    sent = time.monotonic()
    first.proc.send_signal(signal.SIGTERM)
    rc = first.finish()
    exit_s = time.monotonic() - sent
    assert rc == 0, first.out[-3000:]
    stopped = tracker(d)
    print(f"SIGTERM after iteration 1: saved iteration {stopped}, exit 0 after {exit_s:.2f} s")
    assert 1 <= stopped <= 3, first.out  # the iteration in progress (lines lag on a busy host)
    assert f" saving checkpoint at iteration {stopped} to {d}" in first.out
    assert " exiting program after receiving SIGTERM" in first.out
    assert max(losses(first.out)) == stopped and exit_s < 120
    assert sorted(json_losses(log)) == list(range(1, stopped + 1))
    assert_same_losses(json_losses(log), uninterrupted)

    rc, out = _resubmitted(cmd)
    assert rc == 0, out[-3000:]
    assert f" loaded checkpoint from {d} at iteration {stopped}" in out
    resumed = json_losses(log)
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1))
    diff = assert_same_losses(resumed, uninterrupted)
    print(f"resumed iterations {stopped + 1}-{ITERS}: largest loss difference {diff:.3g}")
    assert tracker(d) == ITERS


def test_second_sigterm_during_the_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    """A second SIGTERM while the ranks save (held inside the save by a test hook: shards
    written, nothing published) ends them at once; the checkpoint of the previous save stays the
    one that loads, and resuming from it gives the uninterrupted losses."""
    d, log = str(tmp_path / "ck"), tmp_path / "log.jsonl"
    cmd = _cli() + FOUR_RANKS + MODEL + ["--train-iters", str(ITERS), "--save", d, "--load", d,
                                         "--save-interval", "2", "--exit-signal-handler",
                                         "--log-json", str(log)]
    run = Run(cmd, env={PAUSE_ENV: "3:120"})  # saves after iteration 2's
    run.wait_for(f" saving checkpoint at iteration 2 to {re.escape(d)}")
    run.wait_for(r"^ iteration\s+3/")
    first = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    line = run.wait_for(f"{PAUSE_ENV}: pausing")
    saving = int(line.split()[-1])
    time.sleep(max(0.0, first + REPEAT_GRACE_S + 0.5 - time.monotonic()))
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish(timeout=120)
    assert rc == 128 + signal.SIGTERM, run.out[-3000:]
    assert "a second SIGTERM ended the ranks at once" in run.out, run.out[-3000:]
    assert tracker(d) == 2 and saving > 2
    assert not os.path.exists(os.path.join(d, f"iter_{saving:07d}"))
    assert any(n.startswith(f"iter_{saving:07d}.tmp-") for n in os.listdir(d)), os.listdir(d)

    rc, out = _resubmitted(cmd)
    assert rc == 0, out[-3000:]
    assert f" loaded checkpoint from {d} at iteration 2" in out
    resumed = json_losses(log)
    assert sorted(resumed) == list(range(3, ITERS + 1))
    diff = assert_same_losses(resumed, uninterrupted)
    print(f"resumed from iteration 2 after the second SIGTERM: largest loss difference {diff:.3g}")


def test_sigterm_without_the_handler_ends_the_ranks_and_says_so(tmp_path):
    """Without --exit-signal-handler the launcher still forwards SIGTERM (a launcher killed by
    it would leave its ranks running); the ranks end, and the launcher says nothing was saved."""
    run = Run(_cli() + ["--nproc-per-node", "2"] + MODEL + ["--train-iters", "200"])
    run.wait_for(r"^ iteration\s+1/")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 128 + signal.SIGTERM
    assert "the ranks ended on SIGTERM without saving" in run.out, run.out[-3000:]


def _one_rank(args: list[str]) -> subprocess.CompletedProcess:
    """``megatron_oases.train``'s ``main`` as one rank torchrun started (RANK, WORLD_SIZE=1, ...),
    on a forkserver rank; stdout and stderr both hold its merged output."""
    from tests.rank_fns_main import main_on_ranks

    rc, out = main_on_ranks("megatron_oases.train", 1, MODEL + args, timeout_s=DEADLINE_S)
    return subprocess.CompletedProcess(["megatron_oases.train", *MODEL, *args], rc, out, out)


def test_exit_interval_stops_saves_and_the_same_command_goes_on(tmp_path):
    d = str(tmp_path / "ck")
    cmd = ["--train-iters", "6", "--exit-interval", "2", "--save", d, "--load", d]
    one = _one_rank(cmd)
    assert one.returncode == 0, one.stderr[-3000:]
    assert sorted(losses(one.stdout)) == [1, 2] and tracker(d) == 2
    assert " exiting program at iteration 2 (--exit-interval 2)" in one.stdout
    two = _one_rank(cmd)
    assert two.returncode == 0, two.stderr[-3000:]
    assert sorted(losses(two.stdout)) == [3, 4] and tracker(d) == 4


def test_exit_duration_stops_after_the_iteration_and_saves(tmp_path):
    d = str(tmp_path / "ck")
    run = _one_rank(["--train-iters", "6", "--exit-duration-in-mins", "0.0001", "--save", d])
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(losses(run.stdout)) == [1] and tracker(d) == 1
    assert re.search(r" exiting program after \d+\.\d\d minutes \(--exit-duration-in-mins 0.0001\)",
                     run.stdout), run.stdout


def _valid_losses(path) -> dict:
    """Validation losses of ``--log-json``, by iteration and kind (interval / end)."""
    with open(path, encoding="utf-8") as f:
        return {(r["iteration"], k): r[k] for r in map(json.loads, f)
                for k in ("valid_lm_loss", "end_valid_lm_loss") if k in r}


def test_a_resumed_run_validates_on_the_uninterrupted_runs_batches(tmp_path):
    """Issue 48: after a resume validation restarted at batch 0 (6.251636 vs 6.253666 at
    iteration 6) while the training losses were identical. The checkpoint keeps Megatron-LM's
    consumed_valid_samples: stopped at 3 (--exit-interval) and resumed, iterations 4 and 6 and
    the end validate on the uninterrupted run's batches."""
    flags = ["--train-iters", "6", "--eval-interval", "2", "--eval-iters", "2"]
    whole = tmp_path / "whole.jsonl"
    assert _one_rank(flags + ["--log-json", str(whole)]).returncode == 0
    d, log = str(tmp_path / "ck"), tmp_path / "log.jsonl"
    cmd = flags + ["--exit-interval", "3", "--save", d, "--load", d, "--log-json", str(log)]
    first = _one_rank(cmd)
    assert first.returncode == 0 and tracker(d) == 3, first.stderr[-3000:]
    second = _one_rank(cmd)
    assert second.returncode == 0 and tracker(d) == 6, second.stderr[-3000:]
    want = _valid_losses(whole)
    got = _valid_losses(log)
    assert sorted(got) == [(4, "valid_lm_loss"), (6, "end_valid_lm_loss"), (6, "valid_lm_loss")]
    assert got == {k: want[k] for k in got}
    assert len(set(want.values())) == 4  # each validation read other batches


@pytest.mark.parametrize("flags, message", [
    (["--exit-signal-handler"], "--exit-signal-handler saves a checkpoint before exiting and needs "
                                "--save DIR"),
    (["--exit-signal", "SIGUSR1"], "--exit-signal SIGUSR1 has no effect without "
                                   "--exit-signal-handler"),
    (["--exit-signal-handler", "--save", "{d}", "--exit-signal", "SIGKILL"],
     "--exit-signal SIGKILL: not a signal --exit-signal-handler can catch"),
    (["--exit-interval", "0"], "--exit-interval must be >= 1 (got 0)"),
    (["--exit-interval", "10"], "--exit-interval 10 never stops training before --train-iters 10"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0 (got 0.0)"),
    (["--exit-interval", "2"], "--exit-interval saves a checkpoint before exiting and needs "
                               "--save DIR"),
    (["--exit-duration-in-mins", "5"], "--exit-duration-in-mins saves a checkpoint before "
                                       "exiting and needs --save DIR"),
], ids=["handler-without-save", "signal-without-handler", "uncatchable", "interval-0",
        "interval-past-the-end", "duration-0", "interval-without-save", "duration-without-save"])
def test_bad_exit_flags_are_refused_in_one_line_before_start_up(flags, message, tmp_path, capsys):
    import torch.distributed as dist

    from megatron_oases.train import main

    flags = [f.format(d=tmp_path / "ck") for f in flags]
    assert main(["--nproc-per-node", "2", *MODEL, "--train-iters", "10", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megatron-oases train: error: {message}"), err
    assert not dist.is_initialized() and not (tmp_path / "ck").exists()


def test_the_second_signal_within_the_grace_is_the_same_notice(monkeypatch):
    """A signal sent to a whole process group reaches a rank directly and through its launcher
    milliseconds apart: one notice. A later one ends the rank (the default action, re-raised)."""
    from megatron_oases.runtime import exit_signal

    killed = []
    monkeypatch.setattr(exit_signal.os, "kill", lambda pid, sig: killed.append(sig))
    handler = exit_signal._Handler(signal.SIGUSR2)
    try:
        clock = iter([100.0, 100.0 + REPEAT_GRACE_S / 2, 100.0 + REPEAT_GRACE_S + 0.1])
        monkeypatch.setattr(exit_signal.time, "monotonic", lambda: next(clock))
        handler(signal.SIGUSR2, None)
        assert handler.received and not killed
        handler(signal.SIGUSR2, None)
        assert not killed
        handler(signal.SIGUSR2, None)
        assert killed == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, handler.previous)


def test_the_launchers_line_names_what_ended_the_ranks():
    from megatron_oases.train import _ended_by_signal
    from megatron_oases.train_args import build_parser

    plain = build_parser().parse_args([])
    handled = build_parser().parse_args(["--exit-signal-handler", "--save", "ck"])
    term = int(signal.SIGTERM)
    assert "without saving" in _ended_by_signal(plain, (term,))
    assert "while starting" in _ended_by_signal(handled, (term,))
    assert "a second SIGTERM ended the ranks at once" in _ended_by_signal(handled, (term, term))
