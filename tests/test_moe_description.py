"""The MoE rows of the round-trip contract (issue 51 item 3): for one trainer command line with
``--num-experts``, the MoE layer Megatron-Core builds (``megatron_oases.moe``, ``specs``) equals
what ``describe.moe`` says and ``sim`` prices: its parameters per rank, its collectives per pass
(the dispatcher's all-to-alls and gathers: kind, group, bytes) and the bytes it keeps for backward.

The readings are ``tests/test_round_trip.py``'s (imported, not copied): the trainer's one
micro-batch through each rank's chunk at 2 and at 1 layers (``tests/rank_fns_round_trip.py``),
their difference one layer; the simulator's the same difference through ``sim --predict``'s
mapping of the trainer's flags. A real router is uneven: what a rank receives (the combine's
all-to-all, the dispatch's gradient, the experts' activations) varies with the data, and only its
mean over the ranks is the even share the description prices (every routed copy is sent once and
received once, dropless). So the trainer's bytes per layer are compared as that mean: per pass
and per (kind, group size), the count and the bytes. With TP > 1 the alltoall dispatcher gathers
over TP in uneven pieces, which gloo runs as all-reduces (``runtime/cpu_moe_compat.py``): that row
compares its all-to-alls only. The Oases rows (``--schedule oases``, fine-grained recompute, the
load-balancing loss on) pin the executor's MoE tape to ``describe.moe``'s Oases layer (its
collectives, per sub-batch) and ``describe.moe_oases`` (what recompute keeps: every forward
collective's output and the dispatcher's routing metadata; with dropout on, the generator state
of each dropout site, the attention dropout's per sub-batch: ``describe.saved.redraw_state_bytes``).
The ``oases-dense-layer`` rows
(``--moe-layer-freq 2``: the second layer is dense, at TP 1 in the executor for the run's
all-to-alls) pin what such a layer keeps, with RoPE without recompute (each sub-batch's tables)
and under fine-grained recompute (its input and its dropout sites' generator states). Tiny sizes;
one spawned group per
world size (2 and 4 ranks)."""
from __future__ import annotations

import collections

import pytest

from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns_round_trip import readings_of
from tests.test_round_trip import Row, _sim_chunk, argv_of, cpu_kernels  # noqa: F401

MOE = ["--num-experts", "4"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
TP2 = ["--sequence-parallel", "--disable-bias-linear"]
EP2 = ["--expert-model-parallel-size", "2"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # the recompute's generator states
OASES = ["--schedule", "oases", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--moe-aux-loss-coeff", "0.01", *DROPOUT]  # fine-grained recompute (the default); the sub-batches join

FREQ2 = ["--moe-layer-freq", "2"]
ROPE = ["--position-embedding-type", "rope"]  # RoPE tables: what each Oases sub-batch builds anew

GRID = [
    Row("moe-ep2-alltoall", 1, (*MOE, *A2A, *EP2), dp=2),
    Row("moe-ep2-allgather", 1, (*MOE, *EP2), dp=2),
    Row("moe-ep2-top3-swiglu-rms", 1, (*MOE, *A2A, *EP2, "--moe-router-topk", "3", "--swiglu",
                                       "--normalization", "RMSNorm", "--moe-ffn-hidden-size", "96"), dp=2),
    Row("moe-tp2-sp-allgather", 2, (*MOE, *TP2)),
    Row("moe-tp2-sp-ep2-alltoall", 2, (*MOE, *A2A, *TP2, *EP2), dp=2),
    Row("moe-ep2-alltoall-oases", 1, (*MOE, *A2A, *EP2, *OASES), dp=2),
    Row("moe-tp2-sp-ep2-alltoall-oases", 2, (*MOE, *A2A, *TP2, *EP2, *OASES), dp=2),
    # --moe-layer-freq 2: the second layer, what the 2-layer reading adds, is a dense one at TP 1
    # that the Oases executor runs (split, for the run's all-to-alls): with and without recompute
    Row("moe-ep2-oases-dense-layer", 1, (*MOE, *A2A, *EP2, *FREQ2, *ROPE, "--schedule", "oases"), dp=2),
    Row("moe-ep2-oases-dense-layer-recompute", 1, (*MOE, *A2A, *EP2, *FREQ2, *OASES), dp=2),
]
GLOO_UNEVEN_GATHERS = {"moe-tp2-sp-ep2-alltoall", "moe-tp2-sp-ep2-alltoall-oases"}
WORLDS = sorted({r.world for r in GRID})
CASES = [pytest.param(r, id=r.name) for r in GRID]


@pytest.fixture(scope="module")
def moe_readings(tmp_path_factory):
    """Every rank's readings of every row at 2 and at 1 layers: one spawned group per world size."""
    tmp = tmp_path_factory.mktemp("moe")
    out = {}
    for world in WORLDS:
        rows = [r for r in GRID if r.world == world]
        argvs = [argv_of(r, n, tmp) for r in rows for n in (2, 1)]
        ranks = run_on_ranks(readings_of, world, args=(argvs,), timeout_s=300)
        for i, r in enumerate(rows):
            out[r.name] = [(rank[2 * i], rank[2 * i + 1]) for rank in ranks]
    return out, tmp


def _totals(rows) -> dict:
    """Per (kind, group size): [count, bytes]."""
    out: dict = collections.defaultdict(lambda: [0, 0])
    for kind, n, size in rows:
        out[kind, n][0] += 1
        out[kind, n][1] += size
    return out


def _layer(pairs: list[tuple[dict, dict]], kinds=None) -> dict:
    """One layer (the 2-layer reading minus the 1-layer one) as the mean over ``pairs`` (one per
    rank): per pass and (kind, group size) the count and the bytes; the saved bytes; rank 0's
    parameters."""
    out: dict = {"saved": 0.0}
    for big, small in pairs:
        for p in ("forward", "backward"):
            b, s = _totals(big[p]), _totals(small[p])
            for key in b.keys() | s.keys():
                if kinds is None or key[0] in kinds:
                    mine = out.setdefault((p, *key), [0.0, 0.0])
                    mine[0] += (b[key][0] - s[key][0]) / len(pairs)
                    mine[1] += (b[key][1] - s[key][1]) / len(pairs)
        out["saved"] += (big["saved"] - small["saved"]) / len(pairs)
    big = pairs[0][0]
    out["params"], out["rank_params"] = big["layer_params"], big["params"]
    return {k: v for k, v in out.items() if not isinstance(v, list) or any(v)}


def _both(row: Row, moe_readings, kinds=None) -> tuple[dict, dict]:
    readings, tmp = moe_readings
    sim = (_sim_chunk(argv_of(row, 2, tmp), row.world), _sim_chunk(argv_of(row, 1, tmp), row.world))
    return _layer(readings[row.name], kinds), _layer([sim], kinds)


@pytest.mark.parametrize("row", CASES)
def test_moe_parameters_per_layer_and_rank(row, moe_readings):
    trainer, sim = _both(row, moe_readings)
    assert sim["params"] == trainer["params"] and sim["rank_params"] == trainer["rank_params"]


@pytest.mark.parametrize("row", CASES)
def test_moe_collectives_per_layer(row, moe_readings):
    """Each pass's collectives of one MoE layer, as the ranks' mean: the all-to-alls (this rank's
    tokens x topk x h x e), the token counts' gather, the experts' TP gathers, the allgather
    dispatcher's TP x EP gathers (the routing map, the probabilities, the tokens)."""
    kinds = {"all_to_all"} if row.name in GLOO_UNEVEN_GATHERS else None
    trainer, sim = _both(row, moe_readings, kinds)
    coll = lambda d: {(*k, what): v[i] for k, v in d.items() if isinstance(k, tuple)  # noqa: E731
                      for i, what in enumerate(("count", "bytes"))}
    assert coll(sim) == pytest.approx(coll(trainer))
    assert any(k[1] == "all_to_all" for k in coll(sim)) == ("alltoall" in row.flags and "--moe-layer-freq" not in row.flags)


@pytest.fixture
def moe_cpu_kernels(cpu_kernels, monkeypatch):
    """``test_round_trip``'s ``cpu_kernels`` for ``describe.moe``'s inventory too (its pre-MLP
    norm: CPU's RMSNorm also keeps the normalised input)."""
    from megatron_oases.describe import moe, saved

    monkeypatch.setitem(moe.moe_block_saved_bytes.__kwdefaults__, "kernels", saved.CPU_KERNELS)


@pytest.mark.parametrize("row", CASES)
def test_moe_saved_bytes_per_layer(row, moe_readings, moe_cpu_kernels):
    trainer, sim = _both(row, moe_readings)
    assert sim["saved"] == pytest.approx(trainer["saved"])


@pytest.mark.parametrize("types,coeffs", [("aux_loss", 0.01), ("none", 0.01), ("aux_loss", 0.0),
                                          (("seq_aux_loss", "aux_loss"), (0.001, 0.01)),
                                          (("seq_aux_loss",), (0.01,))])
def test_the_aux_loss_is_read_as_megatrons_router_reads_it(types, coeffs):
    """``describe.moe.aux_loss_coeff`` (what ``sim``, ``plan`` and ``megatron_oases.moe`` read) is
    Megatron's ``TopKRouter.get_aux_loss_coeff``, which the Oases executor's MoE tape calls, on the
    same flags as ``normalized_moe`` hands them to ``TransformerConfig`` (a list for several)."""
    import types as namespaces

    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_oases.describe.moe import aux_loss_coeff

    listed = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - moe_config_kwargs's lists
    router = namespaces.SimpleNamespace(routing_type=listed(types),
                                        config=namespaces.SimpleNamespace(moe_aux_loss_coeff=listed(coeffs)))
    for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        assert aux_loss_coeff(types, coeffs, kind) == TopKRouter.get_aux_loss_coeff(router, kind)
