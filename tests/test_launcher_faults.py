"""The launcher and the trainer under faults: long healthy runs live, stalled or stopped ranks
are named, and ``--dist-timeout`` reaches every process group (Megatron's and ours)."""
from __future__ import annotations

import time

import pytest

from megatron_oases.runtime.spawn import RankFailure, run_on_ranks
from tests import rank_fns_launch as fns


def test_progress_keeps_a_run_longer_than_the_stall_timeout_alive():
    start = time.monotonic()
    assert run_on_ranks(fns.progress_for, 2, args=(4.0, 0.2), timeout_s=None,
                        stall_timeout_s=1.5) == [0, 1]
    assert time.monotonic() - start > 4.0


def test_a_rank_without_progress_is_named():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] made no progress for 2 s") as exc:
        run_on_ranks(fns.stall_on_rank_one, 2, args=(30.0,), timeout_s=None, stall_timeout_s=2.0)
    assert time.monotonic() - start < 20
    assert "rank 1: running" in str(exc.value)


def test_a_stopped_rank_is_named_as_stopped():
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] made no progress") as exc:
        run_on_ranks(fns.stop_rank_one, 2, args=(30.0,), timeout_s=None, stall_timeout_s=3.0)
    assert "rank 1: stopped (SIGSTOP)" in str(exc.value)


def test_dist_timeout_reaches_megatron_and_our_groups():
    argv = fns.TINY + ["--dist-timeout", "42", "--tp-backend", "atp", "--atp-mesh", "1,2"]
    for rank in run_on_ranks(fns.group_timeouts, 2, args=(argv,), timeout_s=120):
        assert rank == {k: 42.0 for k in rank}, rank
        assert {"tp", "pp", "dp", "dp_gloo", "atp_axis1", "atp_axis2"} <= rank.keys()


def test_stopped_peer_ends_the_run_within_dist_timeout():
    """Rank 1 stops mid-training: rank 0's TP collective times out after --dist-timeout (not
    Megatron's 30-minute default) and the report names the stopped rank."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as exc:
        run_on_ranks(fns.stop_rank_one_mid_training, 2, args=(fns.TINY + ["--dist-timeout", "5"],),
                     timeout_s=150)
    assert time.monotonic() - start < 100
    text = str(exc.value)
    assert "rank(s) [0] failed" in text, text
    assert "rank 1: stopped (SIGSTOP)" in text, text
