"""Llama-family layers (RoPE, SwiGLU, grouped-query attention, RMSNorm, no-bias linears, untied
embeddings, QK-norm on and off) through the stock schedule and the Oases schedule on Megatron
1-D TP: losses and every gradient equal to one rank's (fp32, <= 1e-5 relative), and Oases with
dropout equal to stock at the same TP."""
from __future__ import annotations

import pytest

from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, run_training

TOL = 1e-5
LLAMA = ["--position-embedding-type", "rope", "--rotary-base", "500", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--seed", "11", "--train-iters", "3", "--optimizer", "sgd",
         "--lr", "0.05", *LLAMA]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
TP2 = ["--tensor-model-parallel-size", "2"]
QK = {"qk-norm": ["--qk-layernorm"], "no-qk-norm": []}


def _one_rank(qk):
    return cached_training(1, MODEL + QK[qk])


@pytest.mark.parametrize("qk", list(QK))
@pytest.mark.parametrize("n,layout", [
    (2, TP2),
    (4, TP2 + ["--pipeline-model-parallel-size", "2"]),
], ids=["stock-tp2", "stock-tp2-pp2"])
def test_stock_matches_one_rank(n, layout, qk):
    assert_same_training(run_training(n, MODEL + QK[qk] + layout), _one_rank(qk), tol=TOL,
                         what="one rank", iterations=3)


@pytest.mark.parametrize("qk", list(QK))
def test_oases_tp2_matches_one_rank(qk):
    got = run_training(2, MODEL + QK[qk] + TP2 + ["--schedule", "oases"] + RECOMPUTE)
    assert_same_training(got, _one_rank(qk), tol=TOL, what="one rank", iterations=3)


def test_oases_tp2_with_dropout_equals_stock_tp2():
    drop = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--qk-layernorm"]
    stock = cached_training(2, MODEL + drop + TP2 + RECOMPUTE)
    oases = run_training(2, MODEL + drop + TP2 + ["--schedule", "oases"] + RECOMPUTE)
    assert_same_training(oases, stock, tol=TOL, iterations=3)


def test_oases_interleaved_tp2_pp2_matches_one_rank():
    layout = TP2 + ["--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1"]
    got = run_training(4, MODEL + ["--qk-layernorm"] + layout + ["--schedule", "oases"] + RECOMPUTE)
    assert_same_training(got, _one_rank("qk-norm"), tol=TOL, what="one rank", iterations=3)


def _plan(tmp_path, tp, degrees):
    import json

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": tp,
                                "num_layers": len(degrees) // 2, "degrees": list(degrees)}))
    return str(path)


@pytest.mark.parametrize("schedule", [[], ["--schedule", "oases"] + RECOMPUTE], ids=["stock", "oases"])
def test_planned_blocks_match_one_rank(tmp_path, schedule):
    """Per-block degrees [1, 2 | 2, 2 | 2, 1 | 2, 2] on T = 2 (replicas, reshards inside layers)."""
    plan = _plan(tmp_path, 2, [1, 2, 2, 2, 2, 1, 2, 2])
    got = run_training(2, MODEL + ["--qk-layernorm"] + TP2 + ["--oases-plan", plan] + schedule)
    assert_same_training(got, _one_rank("qk-norm"), tol=TOL, what="one rank", iterations=3)


def test_plan_degree_must_split_the_key_value_groups(tmp_path, capsys):
    from megatron_oases.train import main

    plan = _plan(tmp_path, 4, [4, 2, 2, 2, 2, 2, 2, 2])
    argv = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", *MODEL, "--oases-plan", plan]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-query-groups 2 must be divisible by the attention degree 4" in err[0]
