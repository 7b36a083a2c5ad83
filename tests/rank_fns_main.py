"""A program's ``main(argv)`` on forkserver ranks (``runtime.spawn``), its output captured: for
the tests of Megatron-LM's ``pretrain`` through our entry, and of the trainer's one-rank path.

A launch through ``torchrun`` (or one rank as torchrun starts it) pays a fresh interpreter per
rank: about 3 s of torch + Megatron imports each, 15-20 s for 8 ranks on 2 cores, for well under
a second of training on the tests' tiny models. The ranks of ``run_on_ranks`` fork from a server
that imported torch and Megatron once and see the variables torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), so each runs the program's own rank path: the same parse, checks,
model build and training loop. What only a real launcher does (torchrun's agent, our launcher's
signal forwarding) stays tested through subprocesses (``tests/test_megatron_lm_wheel.py``'s stock
TP 2, ``tests/test_megatron_lm_launch.py``, ``tests/test_preemption.py``'s signal tests).
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import traceback


def main_on_rank(module: str, argv: list[str]) -> tuple[int, str]:
    """``module.main(argv)`` on this rank with file descriptors 1 and 2 in one file: (status,
    output). A raising rank prints its traceback into the output and raises with the output's
    tail, so the launcher stops the other ranks (which would wait in a collective)."""
    import multiprocessing

    # As in a torchrun rank, Megatron's data loaders start their workers (--num-workers, 2 by
    # default) the platform's default way, from a process that is no daemon (a forkserver child
    # is one, and inherits forkserver as its default start method).
    multiprocessing.current_process().daemon = False
    multiprocessing.set_start_method(None, force=True)
    main = importlib.import_module(module).main
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        failed = False
        try:
            status = main(list(argv))
        except SystemExit as exc:  # argparse's and Megatron's own exits
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - the traceback goes into the output
            traceback.print_exc()
            status, failed = 1, True
        sys.stdout.flush()
        sys.stderr.flush()
        out.seek(0)
        text = out.read().decode(errors="replace")
    if failed:
        raise RuntimeError(f"rank {os.environ.get('RANK')} failed; its output:\n{text[-4000:]}")
    return status, text


def main_on_ranks(module: str, nproc: int, argv: list[str], timeout_s: float = 300,
                  env: dict | None = None) -> tuple[int, str]:
    """``main_on_rank`` on ``nproc`` ranks: (the largest status, every rank's output in rank
    order); a failed run is (1, the launcher's report with the failing rank's output)."""
    from megatron_oases.runtime.spawn import RankFailure, run_on_ranks

    try:
        ranks = run_on_ranks(main_on_rank, nproc, args=(module, list(argv)), timeout_s=timeout_s,
                             env=env)
    except RankFailure as exc:
        return 1, str(exc)
    return max(abs(status) for status, _ in ranks), "".join(text for _, text in ranks)
