"""The Oases executor over Megatron-Core MoE layers (``schedules/oases/moe_tape.py``): losses and
every gradient (router and experts included) equal stock at the same layout, fp32, dropless, aux
loss on, 2 iterations (bf16 and fp16 within their bounds; the distributed optimizer's Adam; 1F1B and
interleaved 1F1B); its recompute issues no collective; what it cannot equal is refused."""
from __future__ import annotations

import pytest

from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, run_training
from tests.test_moe_parity import EP, MODEL, SGD

from megatron_oases.mcore_compat import oases_moe_hooks_missing

pytestmark = pytest.mark.skipif(bool(oases_moe_hooks_missing()),
                                reason="megatron-core without 0.19's router hooks refuses Oases over MoE")

TOL = 1e-5
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
OASES = ["--schedule", "oases"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
TP2_SP_EP2 = [EP, "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", *ALLTOALL]
TP1_EP2 = [EP, "2", *ALLTOALL]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
NO_AUX = ["--moe-aux-loss-coeff", "0", "--moe-router-load-balancing-type", "none"]  # no barrier, no aux step


@pytest.mark.parametrize("n, layout, extra", [
    (4, TP2_SP_EP2, RECOMPUTE),
    (4, TP2_SP_EP2, RECOMPUTE + ["--no-oases-fine-grained-recompute"]),
    (2, TP1_EP2, RECOMPUTE),
    (2, TP1_EP2, RECOMPUTE + ["--no-oases-fine-grained-recompute"]),
    (2, TP1_EP2, []),
    (2, TP1_EP2, RECOMPUTE + ["--no-oases-cross-pass"]),
    (2, TP1_EP2 + DROPOUT, RECOMPUTE),
    (4, TP1_EP2 + ["--overlap-grad-reduce"], RECOMPUTE),
    (2, TP1_EP2 + NO_AUX + ["--swiglu", "--moe-router-topk", "3", "--moe-ffn-hidden-size", "48"], RECOMPUTE),
], ids=["tp2-sp-ep2-recompute", "tp2-sp-ep2-coarse", "tp1-ep2-fine-grained", "tp1-ep2-coarse", "tp1-ep2-no-recompute",
        "tp1-ep2-no-cross-pass", "tp1-ep2-dropout", "dp4-ep2-overlap-grad-reduce", "tp1-ep2-no-aux-swiglu-top3"])
def test_oases_moe_equals_stock(n, layout, extra):
    """``layout`` is the stock reference's too; ``extra`` the Oases run's own flags."""
    argv = MODEL + SGD + layout
    ref = cached_training(n, argv)
    got = run_training(n, argv + OASES + extra)
    assert_same_training(got, ref, tol=TOL, what="stock", iterations=2)


def test_oases_moe_under_1f1b_equals_stock():
    """PP 2 x EP 2: two micro-batches in flight on the first stage, each with its own routing
    metadata until its backward; MoE and dense layers (``--moe-layer-freq 2``)."""
    argv = MODEL + SGD + TP1_EP2 + ["--pipeline-model-parallel-size", "2", "--moe-layer-freq", "2",
                                    "--num-layers", "4"]
    got = run_training(4, argv + OASES + RECOMPUTE)
    assert_same_training(got, run_training(4, argv), tol=TOL, what="stock", iterations=2)


# bf16 / fp16 (Float16Module, fp32 main grads): losses within mixed precision's BF16_TOL /
# FP16_TOL (one rounded op); each gradient within four units of the format (bf16 2^-8 each, fp16
# 2^-10) of its tensor's largest element: the sub-batch split rounds every GEMM's partial sums, the
# dgrad / wgrad sums and the dispatched tokens at other points than stock does, forward and
# backward. Measured (TP 1 x EP 2): bf16 <= 1.1e-2 (the same with --overlap-grad-reduce), while
# stock bf16 itself is up to 0.36 from fp32 on the same tensors; fp16 (loss scale 4096) <= 1.6e-3
# (TP 2 x EP 2 with SP: 1.8e-3). A lost sub-batch's gradient is ~0.5 (a layer-norm's: 0.43).
HALF = {"bf16": (["--bf16"], 4 * 2.0**-8), "fp16": (["--fp16", "--initial-loss-scale", "4096"], 4 * 2.0**-10)}


@pytest.mark.parametrize("n, layout, dtype", [(2, TP1_EP2, "bf16"), (4, TP2_SP_EP2, "bf16"), (2, TP1_EP2, "fp16"),
                                               (4, TP2_SP_EP2, "fp16"),
                                               (2, TP1_EP2 + ["--overlap-grad-reduce"], "bf16")],
                         ids=["tp1-ep2-bf16", "tp2-sp-ep2-bf16", "tp1-ep2-fp16", "tp2-sp-ep2-fp16",
                              "dp2-ep2-overlap-grad-reduce-bf16"])
def test_oases_moe_half_precision_equals_stock(n, layout, dtype):
    argv = MODEL + SGD + layout + HALF[dtype][0]
    _assert_within_half(run_training(n, argv + OASES + RECOMPUTE), run_training(n, argv), dtype)


def _assert_within_half(got: dict, ref: dict, dtype: str) -> None:
    """Losses within ``dtype``'s one-op tolerance; every gradient of both iterations within
    ``HALF``'s four units of the tensor's largest element (and every final parameter, when both
    runs return them)."""
    from tests.conftest import max_rel_diff
    from tests.test_mixed_precision import BF16_TOL, FP16_TOL

    tol, loss_tol = HALF[dtype][1], BF16_TOL if dtype == "bf16" else FP16_TOL
    for it, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= loss_tol * abs(b), (it, a, b)
    assert len(got["grads"]) == len(ref["grads"]) == 2
    for what, a, b in [(f"grad {it}", *pair) for it, pair in enumerate(zip(got["grads"], ref["grads"]), 1)] + (
            [("param", got["params"], ref["params"])] if "params" in ref else []):
        assert a.keys() == b.keys()
        for key in a:
            assert max_rel_diff(a[key], b[key]) <= tol, (what, key, max_rel_diff(a[key], b[key]))


@pytest.mark.parametrize("n, layout", [(4, TP2_SP_EP2), (2, TP1_EP2 + ["--overlap-grad-reduce"])],
                         ids=["tp2-sp-ep2", "dp2-ep2-overlap-grad-reduce"])
def test_oases_moe_bf16_distributed_adam_equals_stock(n, layout):
    """bf16, the distributed optimizer (Adam, lr 1e-4), TP 2 x EP 2 with SP, and DP 2 x EP 2 with
    ``--overlap-grad-reduce`` (the dense gradients reduce-scattered over DP 2): every parameter's
    reduced gradient as the optimizer steps on it (fp32 main grads, the reduce-scattered shards
    joined: ``rank_fns_moe.reduced_grads_and_params``) within ``HALF``'s bf16 bound at both
    iterations (measured 1.06e-2 and 1.3e-2); with Adam's eps at 1e-2, where its step is about
    linear in the gradient, the parameters too (measured 7.9e-3 and 9.3e-3). At Megatron's eps
    (1e-8) the same first gradients give parameters up to 0.067 (0.090) apart on a zero-initialised
    layer-norm bias: Adam divides each element's step by its own gradient's size, so an element
    whose gradient is 0.3% of its tensor's largest moves by ~lr either way, and iteration 2's
    gradients, taken there, differ more (DP 2: 1.58e-2). docs/oases_schedule.md, MoE."""
    from tests.rank_fns_moe import reduced_grads_and_params
    from megatron_oases.runtime.spawn import run_on_ranks

    argv = ([a if a != "0.05" else "1e-4" for a in MODEL] + ["--optimizer", "adam", "--use-distributed-optimizer"]
            + ["--adam-eps", "1e-2"] + layout + HALF["bf16"][0])
    ref, got = (run_on_ranks(reduced_grads_and_params, n, args=(a,), timeout_s=240)
                for a in (argv, argv + OASES + RECOMPUTE))
    _assert_within_half({**got[0], "losses": got[-1]["losses"]}, {**ref[0], "losses": ref[-1]["losses"]}, "bf16")


def test_oases_moe_distributed_adam_equals_stock():
    """The distributed optimizer with Adam at a Megatron-like lr (1e-4), fp32, EP 2: losses and the
    final parameters equal stock's (1e-5 of each tensor's largest element; measured 1.1e-6). The
    difference grows with lr (1e-3: 8.4e-6, 0.05: 1.9e-4): Adam's first steps move an element by
    ~lr whatever its gradient's size, so an element whose gradient is float noise (another
    summation order: the sub-batches') moves by ~lr in either direction."""
    from tests.conftest import max_rel_diff
    from tests.rank_fns_moe import losses_and_params

    adam = [a if a != "0.05" else "1e-4" for a in MODEL] + ["--optimizer", "adam", "--use-distributed-optimizer"]
    ref = losses_and_params(2, adam + TP1_EP2)
    got = losses_and_params(2, adam + TP1_EP2 + OASES + RECOMPUTE)
    assert got["losses"] == pytest.approx(ref["losses"], rel=TOL)
    assert got["params"].keys() == ref["params"].keys()
    for key, value in got["params"].items():
        assert max_rel_diff(value, ref["params"][key]) <= TOL, key


def test_oases_moe_under_interleaved_1f1b_equals_stock():
    """PP 2 x EP 2 with two virtual stages per rank (``--num-layers-per-virtual-pipeline-stage
    1``): each model chunk's block runs its own executor, MoE and dense chunks alternating."""
    argv = MODEL + SGD + TP1_EP2 + ["--pipeline-model-parallel-size", "2", "--moe-layer-freq", "2",
                                    "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
    got = run_training(4, argv + OASES + RECOMPUTE)
    assert_same_training(got, run_training(4, argv), tol=TOL, what="stock", iterations=2)


def aux_and_collectives(argv: list[str]) -> dict:
    """Two training steps: the router loss Megatron's MoE tracker logged per layer, and every
    collective issued (ours and, watched, Megatron's own) as (tag, kind, group size, bytes)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    from megatron_oases.parallel.collectives import CommCounter, watch_torch_distributed
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup, train_step
    from megatron_oases.train_args import build_parser

    watch_torch_distributed()
    _count_megatron_gathers()
    tr = setup(run_config(build_parser().parse_args(argv)))
    with CommCounter() as counter:
        for it in (1, 2):
            train_step(tr, it)
    entry = get_moe_metrics_tracker()._metrics["load_balancing_loss"]
    return {"aux": entry.values.clone(),
            "records": sorted((r.tag, r.kind, r.group_size, r.payload_bytes) for r in counter.records)}


def _count_megatron_gathers() -> None:
    """Megatron's even all-gathers (the dispatcher's token-count gather over TP x EP among them)
    go through a function it bound at import, which ``watch_torch_distributed`` cannot see once
    Megatron is imported: count them here."""
    from megatron.core.tensor_parallel import mappings

    from megatron_oases.parallel.collectives import record_collective

    gather = mappings.dist_all_gather_func
    if getattr(gather, "counted", False):
        return

    def counted(output, input_, group=None, async_op=False):
        record_collective("all_gather", output, group)
        return gather(output, input_, group=group, async_op=async_op)

    counted.counted = True
    mappings.dist_all_gather_func = counted


def _on_ranks(n: int, argv: list[str]) -> list[dict]:
    from megatron_oases.runtime.spawn import run_on_ranks

    return run_on_ranks(aux_and_collectives, n, args=(argv,), timeout_s=240)


def test_router_loss_logged_as_stock_and_recompute_issues_no_collective():
    """TP 2 x EP 2 with SP: the per-layer load-balancing loss Megatron's tracker holds equals
    stock's on every rank; with fine-grained recompute the step issues exactly the collectives of
    the run without recompute (none tagged "recompute", Megatron's count gathers included), while
    coarse recompute repeats the dispatch (so the count can fail)."""
    argv = MODEL + SGD + TP2_SP_EP2
    stock = _on_ranks(4, argv)
    fine = _on_ranks(4, argv + OASES + RECOMPUTE)
    kept = _on_ranks(4, argv + OASES)
    coarse = _on_ranks(4, argv + OASES + RECOMPUTE + ["--no-oases-fine-grained-recompute"])
    for rank, (a, b) in enumerate(zip(fine, stock)):
        assert a["aux"].shape == b["aux"].shape and bool((b["aux"] > 0).all()), rank
        assert float((a["aux"] - b["aux"]).abs().max()) <= TOL * float(b["aux"].abs().max()), rank
    for f, k, c in zip(fine, kept, coarse):
        assert not [r for r in f["records"] if r[0] == "recompute"]
        assert f["records"] == k["records"]
        assert any(r[1] == "all_to_all" for r in f["records"])
        assert any(r[1] == "all_gather" and r[2] == 4 for r in f["records"])  # the count gathers
        assert [r for r in c["records"] if r[0] == "recompute" and r[1] == "all_to_all"]


def _megatron_lm_parse(argv: list[str], monkeypatch):
    """The Megatron-LM entry's parse (``megatron_lm.flags``) over a Megatron-like parser with the
    MoE flags the trainer's checks read."""
    from megatron_oases.megatron_lm.flags import extra_args_provider
    from tests.test_megatron_lm_flags import BASE, megatron_like_parser

    monkeypatch.setenv("WORLD_SIZE", "2")
    parser = megatron_like_parser()
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--moe-token-dispatcher-type", default="allgather")
    parser.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    parser.add_argument("--moe-z-loss-coeff", type=float, default=None)
    return extra_args_provider(parser).parse_args(BASE + argv)


def test_megatron_lm_entry_takes_oases_over_moe_and_refuses_what_it_cannot_split(monkeypatch, capsys):
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
           "--schedule", "oases"]
    assert _megatron_lm_parse(moe + ALLTOALL, monkeypatch).schedule == "oases"
    with pytest.raises(SystemExit):
        _megatron_lm_parse(moe, monkeypatch)
    assert "use --moe-token-dispatcher-type alltoall" in capsys.readouterr().err
    # Megatron's router options the tape does not split by sub-batch: refused at parse, not at build
    with pytest.raises(SystemExit):
        _megatron_lm_parse(moe + ALLTOALL + ["--moe-z-loss-coeff", "1e-3"], monkeypatch)
    assert "does not support --moe-z-loss-coeff;" in capsys.readouterr().err
