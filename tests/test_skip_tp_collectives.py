"""``--oases-skip-tp-collectives`` (benchmark only) removes the same collectives from stock layers
as from the Oases executor -- every TP collective of the transformer layers, none of the head's
-- so the executor-overhead benchmark compares compute with compute."""
from __future__ import annotations

from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns_oases import all_collectives_of_one_step
from tests.test_parity_sequence_parallel import MODEL

TP2 = ["--tensor-model-parallel-size", "2"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
SKIP = ["--oases-skip-tp-collectives"]


def _step(argv):
    return run_on_ranks(all_collectives_of_one_step, 2, args=(MODEL + TP2 + RECOMPUTE + argv,),
                        timeout_s=180)[0]


def test_skip_removes_the_same_collectives_from_stock_and_oases():
    stock, stock_skip = _step([]), _step(SKIP)
    oases_skip = _step(["--schedule", "oases"] + SKIP)
    assert stock_skip == oases_skip
    removed = sum(c for c, _ in stock.values()) - sum(c for c, _ in stock_skip.values())
    # 4 layers x 2 micro-batches: forward and recompute all-reduce 2 outputs, backward 2 inputs'
    # gradients (Megatron's full recompute repeats the forward's).
    assert removed == 4 * 2 * (2 + 2 + 2)
    assert stock_skip  # the head's (embedding, logits, loss) stay
