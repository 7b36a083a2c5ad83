"""scripts/bench_oases.py's communication-only row reads the described layer (no ranks, no timing)."""
import argparse

import pytest

from megatron_oases.describe.ops import ModelingError
from tests.script_modules import load_script

S = load_script("scripts/bench_oases.py")


@pytest.mark.parametrize("tp", [2, 4])
def test_the_comm_row_runs_the_oases_steps_collectives(tp):
    """Megatron's layer under the Oases tape: per layer and sub-batch 4 all-reduces of the
    sub-batch's [s, b, h] (2 forward, 2 backward), or under sequence parallelism 4 all-gathers and
    4 reduce-scatters of it (the tape keeps the gathered inputs for the backward)."""
    a = argparse.Namespace(micro_batch=4, seq=64, hidden=256, heads=8, layers=3, micro_batches=2)
    sub = a.micro_batch // 2
    assert S.step_collectives(a, tp, sequence_parallel=False) == (a.seq * sub * a.hidden, 4 * 2 * 3 * 2)
    assert S.step_collectives(a, tp, sequence_parallel=True) == (a.seq * sub * a.hidden, 8 * 2 * 3 * 2)
    with pytest.raises(ModelingError, match="--micro-batch-size"):
        S.step_collectives(argparse.Namespace(**{**vars(a), "micro_batch": 3}), tp, sequence_parallel=False)
