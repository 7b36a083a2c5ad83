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


@pytest.mark.parametrize("qk", list(QK))
def test_oases_interleaved_tp2_pp2_matches_one_rank(qk):
    layout = TP2 + ["--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1"]
    got = run_training(4, MODEL + QK[qk] + layout + ["--schedule", "oases"] + RECOMPUTE)
    assert_same_training(got, _one_rank(qk), tol=TOL, what="one rank", iterations=3)


def _plan(tmp_path, tp, degrees):
    import json

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": tp,
                                "num_layers": len(degrees) // 2, "degrees": list(degrees)}))
    return str(path)


@pytest.mark.parametrize("qk", list(QK))
@pytest.mark.parametrize("schedule", [[], ["--schedule", "oases"] + RECOMPUTE], ids=["stock", "oases"])
def test_planned_blocks_match_one_rank(tmp_path, schedule, qk):
    """Per-block degrees [1, 2 | 2, 2 | 2, 1 | 2, 2] on T = 2 (replicas, reshards inside layers)."""
    plan = _plan(tmp_path, 2, [1, 2, 2, 2, 2, 1, 2, 2])
    got = run_training(2, MODEL + QK[qk] + TP2 + ["--oases-plan", plan] + schedule)
    assert_same_training(got, _one_rank(qk), tol=TOL, what="one rank", iterations=3)


def test_plan_degree_must_split_the_key_value_groups(tmp_path, capsys):
    from megatron_oases.train import main

    plan = _plan(tmp_path, 4, [4, 2, 2, 2, 2, 2, 2, 2])
    argv = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "4", *MODEL, "--oases-plan", plan]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-query-groups 2 must be divisible by the attention degree 4" in err[0]


ATP_MODEL = [*MODEL, "--num-attention-heads", "8", "--num-query-groups", "4", "--qk-layernorm"]
"""8 query heads in 4 key/value groups: every ATP mesh of up to 4 ranks holds whole groups."""
ATP_QK = {"qk-norm": ATP_MODEL, "no-qk-norm": ATP_MODEL[:-1]}


@pytest.mark.parametrize("n,layout", [
    (4, ["--tensor-model-parallel-size", "4", "--atp-mesh", "2,2"]),
    (4, TP2 + ["--atp-mesh", "1,2", "--pipeline-model-parallel-size", "2"]),
    (4, TP2 + ["--atp-mesh", "2,1", "--pipeline-model-parallel-size", "2"]),
    (2, TP2 + ["--atp-mesh", "1,2", "--schedule", "oases"] + RECOMPUTE),
], ids=["atp-2x2", "atp-1x2-pp2", "atp-2x1-pp2", "oases-atp-1x2"])
@pytest.mark.parametrize("qk", list(QK))
def test_atp_matches_one_rank(n, layout, qk):
    got = run_training(n, ATP_QK[qk] + ["--tp-backend", "atp"] + layout)
    assert_same_training(got, cached_training(1, ATP_QK[qk]), tol=TOL, what="one rank", iterations=3)


def _train_log(tmp_path, name, n, argv):
    """``megatron-oases train`` on ``n`` ranks (its rank path on forkserver ranks,
    ``tests/rank_fns_main.py``): {iteration: loss} of its ``--log-json``."""
    import json

    from tests.rank_fns_main import main_on_ranks

    log = tmp_path / f"{name}.jsonl"
    rc, out = main_on_ranks("megatron_oases.train", n, ["--device", "cpu", *argv, "--log-json", str(log)])
    assert rc == 0, out[-4000:]
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, log.read_text().splitlines())}


def _resume_in_stock_tp2(tmp_path, n: int, model: list[str], layout: list[str]) -> None:
    """Train 4 iterations under ``layout``, saving at 2 (and 4): the reference; then resume in
    stock TP 2 from the iteration-2 checkpoint: iterations 3 and 4 must be the reference's (Adam
    state too). One run both saves and gives the reference (a separate uninterrupted run cost
    another launch of n ranks; a save that disturbed the run would still show as a mismatch)."""
    model = [a for a in model if a not in ("--train-iters", "3")] + ["--optimizer", "adam"]
    ckpt = str(tmp_path / "ckpt")
    ref = _train_log(tmp_path, "ref", n, model + layout + ["--train-iters", "4", "--save", ckpt,
                                                           "--save-interval", "2"])
    assert sorted(ref) == [1, 2, 3, 4]
    stock = _train_log(tmp_path, "stock", 2, model + TP2 + ["--train-iters", "4", "--load", ckpt,
                                                           "--ckpt-step", "2"])
    assert sorted(stock) == [3, 4]
    for it in (3, 4):
        assert stock[it] == pytest.approx(ref[it], rel=TOL), (it, stock, ref)


def test_atp_llama_checkpoint_loads_into_stock_tp(tmp_path):
    """ATP (2, 2)'s gated fc1 rows ([gate_i; up_i] per mesh part) and replicated QK-norms save
    in Megatron's layout: stock TP 2 resumes from the checkpoint with ATP's own losses."""
    _resume_in_stock_tp2(tmp_path, 4, ATP_MODEL, ["--tensor-model-parallel-size", "4", "--tp-backend",
                                                   "atp", "--atp-mesh", "2,2"])


@pytest.mark.parametrize("qk", list(QK))
def test_3d_matches_one_rank(qk):
    """The cube (TP 8, p = 2): RoPE, SwiGLU (gate and up rows per y-part), GQA (2 groups of 8
    heads: whole groups per head block), RMSNorm, no bias, QK-norm (replicated) on and off."""
    model = [*ATP_QK[qk], "--num-query-groups", "2", "--global-batch-size", "4"]
    got = run_training(8, model + ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"],
                       timeout_s=400)
    assert_same_training(got, cached_training(1, model), tol=TOL, what="one rank", iterations=3)


def test_3d_llama_checkpoint_loads_into_stock_tp(tmp_path):
    """The cube's gated fc1 (a two-dim factory) and replicated QK-norms save in Megatron's layout."""
    _resume_in_stock_tp2(tmp_path, 8, [*ATP_MODEL, "--num-query-groups", "2", "--global-batch-size", "4"],
                         ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"])
