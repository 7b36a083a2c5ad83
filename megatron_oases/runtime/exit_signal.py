"""Preemption and time limits: Megatron-LM's ``--exit-signal-handler``, ``--exit-signal``,
``--exit-duration-in-mins`` and ``--exit-interval`` for the reference trainer.

Same names and meaning as Megatron-LM (``megatron/training/training.py``,
``checkpoint_and_decide_exit``): after an iteration, every rank stops when the signal has reached
any rank, when any rank's time since the program started exceeds the duration, or when the
iteration is a multiple of the interval; it saves a checkpoint first (with ``--save``) and the run
exits 0. The decision is one collective (a MAX all-reduce of the per-rank flags, as Megatron's
``DistributedSignalHandler.signals_received`` all-gathers them), so no rank stops alone and
leaves its peers blocked in the next iteration's collectives.

The handler is ours, not Megatron's ``dist_signal_handler.DistributedSignalHandler``: that class
ships in ``megatron.training``, which the megatron-core 0.16 wheel lacks, and it ignores a
second signal, whereas here a second signal means "stop now" (``_Handler``).
"""
from __future__ import annotations

import os
import signal
import time

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU")
"""Signals ``--exit-signal`` takes: those a scheduler or a user sends to ask a job to end. The
rest either cannot be caught (SIGKILL, SIGSTOP) or are not termination requests (job control,
SIGCHLD, faults), so a handler for them would never be what the user meant."""
REPEAT_GRACE_S = 1.0
"""A repeat of the signal within this many seconds of the first is the same notice delivered
twice, not a second request: a signal sent to a whole process group (``kill -- -PGID``, GNU
``timeout``, SLURM signalling every process of a step) reaches each rank directly and again
through its launcher (ours or torchrun), milliseconds apart."""
START_ENV = "MEGATRON_OASES_START_TIME"
"""Set by ``megatron-oases train --nproc-per-node`` for its ranks: the launcher's start (epoch
seconds), where ``--exit-duration-in-mins`` counts from, as Megatron-LM counts from its
program's start."""
_IMPORTED_AT = time.time()


def launcher_env() -> dict:
    """What ``megatron-oases train --nproc-per-node`` passes its ranks: its own start time."""
    return {START_ENV: repr(_IMPORTED_AT)}


def forwarded_signals(cfg) -> tuple[int, ...]:
    """Signals the local launcher forwards to its ranks instead of dying of them: SIGTERM always
    (a launcher killed by it would leave its ranks running without their rendezvous host), and
    the ``--exit-signal`` of a run with ``--exit-signal-handler``."""
    sigs = [signal.SIGTERM]
    if cfg.exit_signal_handler:
        sigs.append(signal.Signals[cfg.exit_signal])
    return tuple(dict.fromkeys(sigs))


class _Handler:
    """The rank's handler: the first signal (and its repeats within ``REPEAT_GRACE_S``) only
    sets a flag that the next end-of-iteration collective reads; a later one restores the default
    action and re-raises it, so the rank ends at once. If that happens in the middle of the save
    the first signal asked for, the save is never published and the previous checkpoint stays
    the one that loads (``checkpoint.save_checkpoint`` is atomic)."""

    def __init__(self, sig: signal.Signals):
        self.sig = sig
        self.first_at: float | None = None
        self.previous = signal.signal(sig, self)

    @property
    def received(self) -> bool:
        return self.first_at is not None

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            return
        if now - self.first_at < REPEAT_GRACE_S:
            return  # the same notice, delivered twice
        if os.environ.get("RANK", "0") == "0":  # os.write: print() is not reentrant
            os.write(2, f"second {self.sig.name}: ending now without finishing the save in "
                        f"progress; the previous checkpoint stays the one that loads\n".encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class ExitConditions:
    """Per rank: installs the handler (``--exit-signal-handler``) and decides, after each
    iteration and together with every other rank, whether training stops there."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.handler = _Handler(signal.Signals[cfg.exit_signal]) if cfg.exit_signal_handler else None
        self.start = float(os.environ.get(START_ENV, _IMPORTED_AT))

    @property
    def active(self) -> bool:
        return any((self.handler, self.cfg.exit_duration_in_mins, self.cfg.exit_interval))

    def begin(self, device) -> None:
        """After the process groups exist: the program's start is the earliest rank's (as
        Megatron-LM takes the minimum over ranks)."""
        if self.cfg.exit_duration_in_mins:
            import torch

            t = torch.tensor([self.start], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            self.start = float(t.item())

    def reason(self, iteration: int, device) -> str | None:
        """Why training stops after ``iteration`` (the same on every rank), or None. Collective
        on the default group when a signal handler or a duration is set."""
        minutes = (time.time() - self.start) / 60.0
        if self.handler or self.cfg.exit_duration_in_mins:
            import torch

            flags = torch.tensor(
                [int(bool(self.handler and self.handler.received)),
                 int(bool(self.cfg.exit_duration_in_mins)
                     and minutes > self.cfg.exit_duration_in_mins)],
                dtype=torch.int32, device=device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            signalled, overtime = (bool(v) for v in flags.tolist())
            if signalled:
                return f"exiting program after receiving {self.cfg.exit_signal}"
            if overtime:
                return (f"exiting program after {minutes:.2f} minutes "
                        f"(--exit-duration-in-mins {self.cfg.exit_duration_in_mins:g})")
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0:
            return f"exiting program at iteration {iteration} (--exit-interval {self.cfg.exit_interval})"
        return None
