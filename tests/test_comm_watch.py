"""``CommCounter`` sees collectives issued straight through torch.distributed (Megatron's own)
once ``watch_torch_distributed`` is installed: what the benchmarks count traffic with."""
from __future__ import annotations

from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns import watched_torch_distributed


def test_direct_calls_recorded_once_ours_not_twice():
    got = run_on_ranks(watched_torch_distributed, 2, timeout_s=60)[0]
    ar = ("all_reduce", 2, 32, 32.0)  # 8 fp32: 2 (n - 1) / n x 32 bytes on the wire
    assert got["records"] == [ar, ar, ("all_gather", 2, 64, 32.0), ar]
    assert got["by_kind"] == {"all_reduce": {"calls": 3, "wire_bytes": 96.0},
                              "all_gather": {"calls": 1, "wire_bytes": 32.0}}
    assert got["x"] == [8.0] * 8  # summed three times; the timed async handle really waited
    assert got["blocked"] > 0  # time inside the calls and the wait was accounted
