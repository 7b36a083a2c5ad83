"""The trainer's preemption and time-limit flags (Megatron-LM's ``--exit-signal-handler``,
``--exit-signal``, ``--exit-duration-in-mins``, ``--exit-interval``) and their validation; the
handler and the per-iteration decision that act on them are ``runtime/exit_signal.py``'s."""
from __future__ import annotations

import argparse

from megatron_oases.errors import ConfigError
from megatron_oases.run_config import DEFAULTS, RunConfig
from megatron_oases.runtime.exit_signal import EXIT_SIGNALS


def add_exit_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "preemption and time limits (Megatron-LM's flags; docs/checkpoints.md#preemption-and-time-limits)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (SIGTERM), every rank finishes the current iteration, "
                        "saves a checkpoint to --save and the run exits 0 (needs --save); a second "
                        "signal ends it at once and the previous checkpoint stays the one that loads")
    g.add_argument("--exit-signal", default=DEFAULTS.exit_signal, metavar="NAME",
                   help=f"the signal --exit-signal-handler catches: {', '.join(EXIT_SIGNALS)}")
    g.add_argument("--exit-duration-in-mins", type=float, default=DEFAULTS.exit_duration_in_mins,
                   metavar="M", help="save to --save (needed) and stop after the first iteration that "
                                     "ends more than M minutes after the program started")
    g.add_argument("--exit-interval", type=int, default=DEFAULTS.exit_interval, metavar="N",
                   help="save to --save (needed) and stop after an iteration that is a "
                        "multiple of N")


def validate_exit_config(cfg: RunConfig) -> None:
    """The exit flags, before any process group: each refused where it would do nothing, and
    each that stops training early without ``--save`` (it would end the run having saved
    nothing, exit 0)."""
    if cfg.exit_signal not in EXIT_SIGNALS:
        raise ConfigError(f"--exit-signal {cfg.exit_signal}: not a signal --exit-signal-handler can "
                          f"catch as a request to stop; use one of {', '.join(EXIT_SIGNALS)}")
    if cfg.exit_signal != "SIGTERM" and not cfg.exit_signal_handler:
        raise ConfigError(f"--exit-signal {cfg.exit_signal} has no effect without "
                          f"--exit-signal-handler; add it or drop --exit-signal")
    if cfg.exit_duration_in_mins is not None and not cfg.exit_duration_in_mins > 0:
        raise ConfigError(f"--exit-duration-in-mins must be > 0 (got {cfg.exit_duration_in_mins})")
    if cfg.exit_interval is not None:
        if cfg.exit_interval < 1:
            raise ConfigError(f"--exit-interval must be >= 1 (got {cfg.exit_interval})")
        if cfg.exit_interval >= cfg.train_iters:
            raise ConfigError(f"--exit-interval {cfg.exit_interval} never stops training before "
                              f"--train-iters {cfg.train_iters} ends it; lower it or drop it")
    for flag, given in (("--exit-signal-handler", cfg.exit_signal_handler),
                        ("--exit-duration-in-mins", cfg.exit_duration_in_mins is not None),
                        ("--exit-interval", cfg.exit_interval is not None)):
        if given and cfg.save is None:
            # Megatron-LM would only exit, losing the work since the last checkpoint.
            raise ConfigError(f"{flag} saves a checkpoint before exiting and needs --save DIR "
                              f"(pass --load DIR too, so a resubmitted job resumes)")
