"""Oases schedule on ATP layers (``--tp-backend atp``) against the stock schedule with the same
ATP backend and Megatron's full recompute: losses and every gradient over 5 iterations, fp32,
SGD, dropout on, relative difference <= 1e-5; meshes (1,2), (2,1) on 2 ranks, (2,2) on 4, and
PP=2, RMSNorm; collective counts with and without fine-grained recompute; flag refusals."""
from __future__ import annotations

import pytest

from megatron_oases.errors import ConfigError
from tests.conftest import assert_same_training
from tests.rank_fns_oases import cached_training, count_recompute_collectives, run_training

TOL = 1e-5
LAYERS = 3  # first (enters the mesh layout), middle, last (leaves it)
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "8", "--vocab-size", "128", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--seed", "7", "--train-iters", "5", "--optimizer", "sgd",
         "--lr", "0.05", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
         "--tp-backend", "atp"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OASES = ["--schedule", "oases"]
ABLATIONS_OFF = ["--no-oases-fine-grained-recompute", "--no-oases-cross-pass"]


def _layout(tp: int, mesh: str, *extra: str) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--atp-mesh", mesh, *extra]


_run = run_training


def _reference(n, layout):
    """Stock schedule, same layout, Megatron's full recompute (one run per layout)."""
    return cached_training(n, MODEL + RECOMPUTE + layout)


def _assert_parity(got, ref):
    assert_same_training(got, ref, tol=TOL, iterations=5)


@pytest.mark.parametrize("n,layout,switches", [
    (2, _layout(2, "1,2"), RECOMPUTE),
    (2, _layout(2, "2,1"), RECOMPUTE + ABLATIONS_OFF),
    (2, _layout(2, "1,2", "--normalization", "RMSNorm"), RECOMPUTE),
    (4, _layout(4, "2,2"), RECOMPUTE),
    (4, _layout(4, "2,2"), RECOMPUTE + ABLATIONS_OFF),
    (4, _layout(4, "2,2"), []),
    (4, _layout(2, "1,2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"), RECOMPUTE),
], ids=["mesh1x2", "mesh2x1-ablations-off", "mesh1x2-rmsnorm", "mesh2x2", "mesh2x2-ablations-off",
        "mesh2x2-no-recompute", "pp2-mesh1x2"])
def test_atp_matches_stock(n, layout, switches):
    _assert_parity(_run(n, MODEL + OASES + layout + switches), _reference(n, layout))


def test_fine_grained_recompute_issues_no_collective():
    """Mesh (2,2), 2 micro-batches x 2 sub-batches. Per layer and sub-batch: forward 4 norm
    sums + f1..f4 + the head gather, backward 4 norm sums + 4 dX all-reduces + the head
    all-gather; the block's first layer all-gathers dX at its input and its last gathers the
    output; the head all-reduces the embedding and the output layer's input gradient.
    Megatron-style recompute repeats the 9 forward collectives per layer."""
    from megatron_oases.runtime.spawn import run_on_ranks

    base = MODEL + OASES + RECOMPUTE + _layout(4, "2,2")
    fine = run_on_ranks(count_recompute_collectives, 4, args=(base,), timeout_s=240)
    coarse = run_on_ranks(count_recompute_collectives, 4,
                          args=(base + ["--no-oases-fine-grained-recompute"],), timeout_s=240)
    per_micro_batch = 2 * (18 * LAYERS + 2 + 2)
    assert fine == [{"": 2 * per_micro_batch}] * 4
    assert coarse == [{"": 2 * per_micro_batch, "recompute": 2 * 2 * 9 * LAYERS}] * 4


@pytest.mark.parametrize("world,argv,needle", [
    (2, ["--tp-backend", "atp"] + _layout(2, "1,2", "--atp-chunks", "2"),
     "--atp-chunks 2 cannot be combined with --schedule oases"),
    (8, ["--tensor-model-parallel-size", "8", "--tp-backend", "3d", "--hidden-size", "64",
         "--num-attention-heads", "8"],
     "--schedule oases does not support --tp-backend 3d"),
], ids=["atp-chunks", "3d"])
def test_refused_combinations(world, argv, needle):
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(OASES + ["--micro-batch-size", "4", "--global-batch-size",
                                              "8"] + argv)
    with pytest.raises(ConfigError, match=needle):
        validate_config(run_config(args), world_size=world, cuda=False)


def test_oases_atp_flags_validate():
    """--schedule oases with --tp-backend atp (chunks 1) passes validation."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    args = build_parser().parse_args(MODEL + OASES + RECOMPUTE + _layout(4, "2,2"))
    validate_config(run_config(args), world_size=4, cuda=False)
