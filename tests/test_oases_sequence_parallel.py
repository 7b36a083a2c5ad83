"""Oases schedule with ``--sequence-parallel``: parity with one rank (dropout off) and with stock
sequence parallelism (dropout on: the masks of each rank's sequence chunk come from its RNG-tracker
stream, in stock and in Oases alike), losses and every gradient, fp32, 1e-5; the collectives it
issues (all-gathers and reduce-scatters, none in fine-grained recompute); what it saves."""
from __future__ import annotations

import pytest

from megatron_oases.runtime.spawn import run_on_ranks
from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, collectives_by_tag_and_kind, run_training
from tests.rank_fns_saved import oases_saved_bytes_after_one_step
from tests.test_parity_sequence_parallel import ITERS, MODEL, TOL

SP = ["--sequence-parallel"]
OASES = ["--schedule", "oases"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = [(2, TP2), (4, TP2 + ["--pipeline-model-parallel-size", "2"]),
           (4, ["--tensor-model-parallel-size", "4"])]
LAYOUT_IDS = ["tp2", "tp2-pp2", "tp4"]


def _parity(got, ref, what):
    assert_same_training(got, ref, tol=TOL, what=what, iterations=ITERS)


@pytest.mark.parametrize("n,layout", LAYOUTS, ids=LAYOUT_IDS)
def test_oases_sequence_parallel_matches_one_rank(n, layout):
    """Fine-grained recompute (the default) and cross-pass on, dropout off."""
    got = run_training(n, MODEL + SP + OASES + RECOMPUTE + layout)
    _parity(got, cached_training(1, MODEL), "one rank")


def test_oases_sequence_parallel_interleaved_pipeline_matches_one_rank():
    """TP 2 x PP 2 with two model chunks per stage (one layer each)."""
    layout = TP2 + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    got = run_training(4, MODEL + SP + OASES + RECOMPUTE + layout)
    _parity(got, cached_training(1, MODEL), "one rank")


@pytest.mark.parametrize("switches", [[], RECOMPUTE + ["--no-oases-fine-grained-recompute"],
                                      RECOMPUTE + ["--no-oases-cross-pass"]],
                         ids=["no-recompute", "no-fine-grained", "no-cross-pass"])
def test_oases_sequence_parallel_ablations_match_one_rank(switches):
    got = run_training(2, MODEL + SP + OASES + TP2 + switches)
    _parity(got, cached_training(1, MODEL), "one rank")


@pytest.mark.parametrize("n,layout", LAYOUTS, ids=LAYOUT_IDS)
def test_oases_sequence_parallel_with_dropout_matches_stock(n, layout):
    """Against stock SP with Megatron's full recompute, same layout, dropout on."""
    model = MODEL + DROPOUT + SP + layout
    _parity(run_training(n, model + OASES + RECOMPUTE), cached_training(n, model + RECOMPUTE),
            "stock --sequence-parallel")


def test_oases_sequence_parallel_rope_matches_stock():
    """RoPE (no learned positions): Megatron's embedding reduce-scatters its partial sums, the
    Oases entry tape per sub-batch (``embedding.rs``); dropout on, against stock SP."""
    model = MODEL + ["--position-embedding-type", "rope"] + DROPOUT + SP + TP2
    _parity(run_training(2, model + OASES + RECOMPUTE), cached_training(2, model + RECOMPUTE),
            "stock --sequence-parallel")


B, S, H, LAYERS = 4, 16, 32, 4
SUB_BATCH_ACTIVATION = S * (B // 2) * H * 4  # the full sequence of one sub-batch, fp32 bytes


def test_sequence_parallel_collectives_and_collective_free_recompute():
    """2 micro-batches x 4 layers x 2 sub-batches, each: forward all-gathers QKV's and fc1's input
    and reduce-scatters proj's and fc2's output; backward the conjugates (2 of each kind per
    pass, one per attention / MLP block); no all-reduce. The head adds per micro-batch and
    sub-batch the embedding's all-reduce (learned positions), the output layer's input
    all-gather and its gradient's reduce-scatter. Fine-grained recompute issues none; Megatron-style recompute repeats
    the forward's 2 + 2. Payload: the sub-batch's full-sequence activation, as the all-reduce
    it replaces (whose ring moves twice the bytes)."""
    from megatron_oases.describe.registry import layer_description

    base = MODEL + SP + OASES + TP2 + RECOMPUTE
    per_pass = 2 * LAYERS * 2 * 2  # of each kind: micro-batches x layers x sub-batches x blocks
    size = {SUB_BATCH_ACTIVATION}
    # what the simulator prices: the Oases SP layer of one sub-batch (no backward re-gather)
    desc = layer_description(backend="megatron", layout=None, micro_batch=B // 2, seq=S, hidden=H, heads=4,
                             ffn=4 * H, tp=2, bytes_per_element=4, sequence_parallel=True, schedule="oases")
    for pass_ in ("forward", "backward"):
        kinds = sorted(c.kind for c in desc.collectives(pass_))
        assert kinds == ["all_gather"] * 2 + ["reduce_scatter"] * 2, pass_
        assert {c.payload_bytes for c in desc.collectives(pass_)} == size
    fine = run_on_ranks(collectives_by_tag_and_kind, 2, args=(base,), timeout_s=120)[0]
    head = 2 * 2  # micro-batches x sub-batches
    assert fine == {("", "all_gather"): (2 * per_pass + head, size),
                    ("", "reduce_scatter"): (2 * per_pass + head, size),
                    ("", "all_reduce"): (head, size)}
    coarse = run_on_ranks(collectives_by_tag_and_kind, 2,
                          args=(base + ["--no-oases-fine-grained-recompute"],), timeout_s=120)[0]
    assert coarse == {**fine, ("recompute", "all_gather"): (per_pass, size),
                      ("recompute", "reduce_scatter"): (per_pass, size)}


@pytest.mark.parametrize("n,flag,full,chunks", [
    (2, "--oases-fine-grained-recompute", 2, 3), (4, "--oases-fine-grained-recompute", 2, 3),
    (2, "--no-oases-fine-grained-recompute", 0, 1)], ids=["tp2", "tp4", "tp2-coarse"])
def test_sequence_parallel_saved_bytes_per_layer(n, flag, full, chunks):
    """Fine-grained recompute keeps the layer input, the two reduce-scattered outputs (each this
    rank's sequence chunk) and the two all-gathered norm outputs (the full sequence): recompute
    then needs no collective. Megatron-style keeps the input chunk only."""
    argv = MODEL + SP + OASES + RECOMPUTE + ["--tensor-model-parallel-size", str(n),
                                             "--global-batch-size", str(B), flag]
    saved = run_on_ranks(oases_saved_bytes_after_one_step, n, args=(argv,), timeout_s=120)
    activation = S * B * H * 4
    assert saved == [LAYERS * (full * activation + chunks * activation // n)] * n


def test_sequence_parallel_on_atp_layers_is_refused():
    """ATP layers do not run sequence parallelism, with or without Oases: one line naming it."""
    from megatron_oases.errors import ConfigError
    from megatron_oases.schedules.oases.options import validate_oases_config
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(MODEL + SP + OASES + TP2 + ["--tp-backend", "atp",
                                                                 "--atp-mesh", "1,2"])
    with pytest.raises(ConfigError, match="does not support --sequence-parallel"):
        validate_config(run_config(args), world_size=2, cuda=False)
    with pytest.raises(ConfigError, match="drop --sequence-parallel"):
        validate_oases_config(run_config(args), None)


@pytest.mark.parametrize("schedule", [[], OASES + RECOMPUTE], ids=["stock", "oases"])
def test_llama_layers_with_sequence_parallel_match_one_rank(schedule):
    """RoPE over the gathered sequence, SwiGLU, GQA, RMSNorm, QK-norm (its torch norms are
    swapped too), no bias, untied output: stock and Oases SP at TP=2 against one rank."""
    from tests.test_llama import LLAMA

    model = MODEL + LLAMA + ["--qk-layernorm"]
    got = run_training(2, model + SP + TP2 + schedule)
    _parity(got, cached_training(1, model), "one rank")
