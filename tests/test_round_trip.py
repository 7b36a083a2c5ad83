"""The round-trip contract (issue 47 item 5): for one command line, the model the trainer builds
equals what ``plan`` and ``sim`` price.

For each row of the grid (backends, Llama and GPT-2 layers, sequence parallelism, recompute modes,
the Oases schedule, per-block plans, PP, DP) the trainer's flags are read three ways:

* the trainer: ``train.setup`` builds the model on CPU in a spawned rank group and one
  micro-batch runs through rank 0's chunk (``tests/rank_fns_round_trip.py``): the collectives it
  issues per pass (``CommCounter``), the bytes its forward keeps for backward
  (``SavedTensorLedger``) and each decoder layer's parameters;
* the simulator: ``sim``'s ``--predict`` front end (``sim_inputs_from_train_args``) and its events
  (``build_stage_events``; saved bytes: ``sim.core.memory.chunk_activation_bytes``);
* the planner: ``plan``'s parser on the same flags and its cost model (``build_cost_model``) with a
  pricer that prices a collective at its payload bytes, so its per-block "milliseconds" are bytes.

One layer's reading is the difference between the run at ``2 x PP`` and at ``PP`` layers (rank 0's
stage holds one layer more), so the embedding, the output layer, the loss and a backend's block
edges cancel out. Compared exactly: per layer and pass the collectives (kind, group, bytes; the
planner: their total bytes), the saved bytes and the parameters per rank.

Every row runs in one spawned group per world size, each command line on process groups of its own
(``rank_fns_round_trip.groups_released``): about 43 s on 2 cores in all, 55 s before they were released.
"""
from __future__ import annotations

import collections
import dataclasses
import json

import pytest

from megatron_oases.runtime.spawn import run_on_ranks
from tests.rank_fns_round_trip import readings_of

S, H, A, B = 16, 64, 8, 4
BASE = ["--hidden-size", str(H), "--num-attention-heads", str(A), "--seq-length", str(S),
        "--max-position-embeddings", str(S), "--vocab-size", "128", "--micro-batch-size", str(B),
        "--device", "cpu"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope", "--disable-bias-linear"]
SP = ["--sequence-parallel"]
OASES = ["--schedule", "oases"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
SELECTIVE = ["--recompute-granularity", "selective"]
FINE = [*OASES, *FULL, "--oases-fine-grained-recompute"]
COARSE = [*OASES, *FULL, "--no-oases-fine-grained-recompute"]


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    tp: int
    flags: tuple[str, ...] = ()
    dp: int = 1
    pp: int = 1
    plan: tuple[int, int] | None = None
    """Each layer's (attention, mlp) degrees: the row runs ``--oases-plan`` with them."""

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp


def _atp(d1: int, d2: int) -> list[str]:
    return ["--tp-backend", "atp", "--atp-mesh", f"{d1},{d2}"]


CUBE = ["--tp-backend", "3d"]

GRID = [
    Row("gpt2-tp2", 2),
    Row("llama-tp2", 2, (*LLAMA,)),
    Row("gpt2-tp2-sp", 2, (*SP,)),
    Row("llama-tp2-sp", 2, (*LLAMA, *SP)),
    Row("gpt2-tp2-selective", 2, (*SELECTIVE,)),
    Row("llama-tp2-selective", 2, (*LLAMA, *SELECTIVE)),
    Row("gpt2-tp2-sp-selective", 2, (*SP, *SELECTIVE)),
    Row("gpt2-tp2-full", 2, (*FULL,)),
    Row("llama-tp2-sp-full", 2, (*LLAMA, *SP, *FULL)),
    Row("gpt2-tp2-oases", 2, (*OASES,)),
    Row("llama-tp2-oases", 2, (*LLAMA, *OASES)),
    Row("gpt2-tp2-oases-fine", 2, (*FINE,)),
    Row("llama-tp2-oases-fine", 2, (*LLAMA, *FINE)),
    Row("gpt2-tp2-oases-full", 2, (*COARSE,)),
    Row("gpt2-tp2-sp-oases", 2, (*SP, *OASES)),
    Row("gpt2-tp2-plan-2-1", 2, plan=(2, 1)),
    Row("gpt2-tp2-plan-1-1-oases", 2, (*OASES,), plan=(1, 1)),
    Row("gpt2-tp2-plan-1-2-oases", 2, (*OASES,), plan=(1, 2)),
    Row("gpt2-atp-1x2", 2, (*_atp(1, 2),)),
    Row("gpt2-atp-2x1", 2, (*_atp(2, 1),)),
    Row("llama-atp-1x2", 2, (*LLAMA, *_atp(1, 2))),
    Row("gpt2-atp-1x2-oases", 2, (*_atp(1, 2), *OASES)),
    Row("gpt2-tp1-dp2", 1, dp=2),
    Row("gpt2-tp1-pp2", 1, pp=2),
    # --schedule oases at TP 1: stock layers (describe.split.oases_splits), priced as such
    Row("gpt2-tp1-dp2-oases", 1, (*OASES,), dp=2),
    Row("gpt2-tp1-dp2-oases-full", 1, (*OASES, *FULL), dp=2),
    Row("gpt2-tp4", 4),
    Row("llama-tp4", 4, (*LLAMA, "--num-query-groups", "4")),
    Row("llama-tp4-sp-oases", 4, (*LLAMA, "--num-query-groups", "4", *SP, *OASES)),
    Row("gpt2-tp4-oases-fine", 4, (*FINE,)),
    Row("gpt2-tp2-dp2", 2, dp=2),
    Row("llama-tp2-dp2-oases", 2, (*LLAMA, *OASES), dp=2),
    Row("gpt2-tp2-pp2", 2, pp=2),
    Row("gpt2-tp2-pp2-sp", 2, (*SP,), pp=2),
    Row("gpt2-tp4-plan-4-2", 4, plan=(4, 2)),
    Row("gpt2-tp4-plan-2-4-oases", 4, (*OASES,), plan=(2, 4)),
    Row("gpt2-atp-2x2", 4, (*_atp(2, 2),)),
    Row("llama-atp-2x2", 4, (*LLAMA, "--num-query-groups", "4", *_atp(2, 2))),
    Row("gpt2-atp-2x2-oases", 4, (*_atp(2, 2), *OASES)),
    Row("gpt2-atp-4x1", 4, (*_atp(4, 1),)),
    Row("gpt2-atp-1x4-full", 4, (*_atp(1, 4), *FULL)),
    Row("gpt2-cube-8", 8, (*CUBE,)),
    Row("llama-cube-8", 8, (*LLAMA, *CUBE)),
    Row("gpt2-cube-8-full", 8, (*CUBE, *FULL)),
]


def _plan_file(tmp_path, row: Row, layers: int) -> str:
    """A plan file as ``megatron-oases plan`` writes it, for ``row``'s per-layer degrees."""
    from megatron_oases.plan.plan_file import PLAN_FORMAT

    path = tmp_path / f"{row.name}-{layers}.json"
    path.write_text(json.dumps({
        "format": PLAN_FORMAT, "tensor_model_parallel_size": row.tp, "num_layers": layers,
        "block_kinds": ["attention", "mlp"], "degrees": list(row.plan) * layers,
        "world_size": row.world, "data_parallel_size": row.dp, "micro_batch_size": B,
        "schedule": "oases" if "oases" in row.flags else "default"}))
    return str(path)


def argv_of(row: Row, layers: int, tmp_path) -> list[str]:
    """The trainer's command line of ``row`` at ``layers`` layers."""
    plan = ["--oases-plan", _plan_file(tmp_path, row, layers)] if row.plan else []
    return [*BASE, "--num-layers", str(layers), "--global-batch-size", str(B * row.dp),
            "--tensor-model-parallel-size", str(row.tp), "--pipeline-model-parallel-size", str(row.pp),
            *row.flags, *plan]


# ---- the three readings ------------------------------------------------------------------------

def _rows_diff(big, small) -> list[tuple]:
    """The collectives ``big`` issues beyond ``small`` (``small`` must be part of ``big``)."""
    more, less = collections.Counter(map(tuple, big)), collections.Counter(map(tuple, small))
    assert not less - more, f"the smaller run issues {less - more} that the larger does not"
    return sorted((more - less).elements())


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's reading on rank 0: collectives per pass, saved bytes, parameters per layer."""

    forward: list
    backward: list
    saved: float
    params: list
    rank_params: int = 0
    """The whole stage's parameters on rank 0 (the larger run's): the layers, embedding, output
    layer and final norm."""


def trainer_layer(big: dict, small: dict) -> Layer:
    return Layer(forward=_rows_diff(big["forward"], small["forward"]),
                 backward=_rows_diff(big["backward"], small["backward"]),
                 saved=big["saved"] - small["saved"], params=big["layer_params"], rank_params=big["params"])


def _sim_chunk(argv: list[str], world: int):
    from megatron_oases.sim.calibrate.profiler import local_topology
    from megatron_oases.sim.core.events import build_stage_events, layer_tensors, stage_layers
    from megatron_oases.sim.core.memory import chunk_activation_bytes
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser

    model, strategy = sim_inputs_from_train_args(build_parser().parse_args(argv), world)

    def rows(segments):
        return sorted((ev.op.kind, len(ev.ranks), ev.nbytes) for evs, chains in segments for ev in evs
                      for _ in range(chains) if ev.kind == "collective" and len(ev.ranks) > 1)

    stage = build_stage_events(model, strategy, local_topology(world))[0]
    chunk = stage.chunks[0]
    params = [sum(layer_tensors(model, strategy, i)) for i in stage_layers(model, strategy, 0)]
    return {"forward": rows(chunk.forward_segments), "backward": rows(chunk.backward_segments),
            "saved": chunk_activation_bytes(model, strategy, chunk)[0], "layer_params": params,
            "params": stage.params_per_rank}


def sim_layer(big_argv, small_argv, world) -> Layer:
    return trainer_layer(_sim_chunk(big_argv, world), _sim_chunk(small_argv, world))


class BytesPricer:
    """A ``plan.pricing.Pricer`` whose collective costs its payload bytes and compute nothing: the
    cost model's communication terms then read as bytes."""

    def compute_ms(self, op, *, shape, dims=()) -> float:
        return 0.0

    def collective_ms(self, op, *, shape, ranks, dims=()) -> float:
        return float(op.payload_bytes) if len(ranks) > 1 else 0.0

    def summary(self) -> dict:
        return {"gpu": "bytes"}


def plan_argv(argv: list[str], world: int) -> list[str]:
    """``plan``'s command line for the trainer's: the trainer's flags as they are (the ones
    ``plan`` does not take are dropped by its parser; the recompute and precision flags it takes),
    plus what ``plan`` reads otherwise: a precision the launch leaves unstated (the trainer then
    trains fp32, while ``plan`` prices bf16: ``precision.priced_dtype``), the launch's world
    (``--nproc-per-node``) and a topology (not read: the pricer prices bytes)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser

    cfg = run_config(build_parser().parse_args(argv))
    unstated = [] if cfg.bf16 or cfg.fp16 else ["--dtype", "fp32"]
    return [*argv, *unstated, "--nproc-per-node", str(world), "--topology", "local"]


def plan_layer(argv: list[str], row: Row) -> Layer:
    """The planner's reading of one layer (at ``row``'s degrees) from its cost model: per block
    its collectives' bytes for one sub-batch times the sub-batches it runs, the reshards into the
    MLP and into the next layer's attention, its saved bytes (with what those two edges keep) and
    its parameters."""
    from megatron_oases.describe.split import sub_batches_at
    from megatron_oases.plan.cost_model import build_cost_model
    from megatron_oases.plan.launch_checks import launch_world
    from megatron_oases.plan.plan_cli import build_parser, model_from_args
    from megatron_oases.run_config import run_config
    from megatron_oases.sim.calibrate.profiler import local_topology
    from megatron_oases.train_args import build_parser as train_parser, validate_config

    cfg = validate_config(run_config(train_parser().parse_args(argv)), row.world, cuda=False)
    a, _ = build_parser().parse_known_args(plan_argv(argv, row.world))
    m = model_from_args(a)
    world, dp = launch_world(a, row.world, "local", m.tp, a.pipeline_model_parallel_size)
    cm = build_cost_model(m, topology=local_topology(world), global_batch_size=a.global_batch_size,
                          pricer=BytesPricer(), data_parallel=dp,
                          families=tuple(dict.fromkeys((cfg.tp_backend, "megatron"))))
    # the run's strategy: its backend's layout (ATP's with d2 = 1 too), else (a per-block plan)
    # Megatron 1-D at each block's degree
    degrees = row.plan or (row.tp, row.tp)
    own = [i for i, s in enumerate(cm.strategies) if s.family == cfg.tp_backend != "megatron"
           and s.layout == cfg.layout]
    k = own * 2 or [next(i for i, s in enumerate(cm.strategies) if s.family == "megatron" and s.degree == d)
                    for d in degrees]
    fwd = bwd = saved = params = 0.0
    for kind, ki in zip(("attention", "mlp"), k):
        c = cm.costs[(kind, ki)]
        chains = sub_batches_at(cm.strategies[ki].degree, oases=m.sub_batches > 1)
        fwd += chains * c.m_fwd
        bwd += chains * c.m_bwd
        saved += c.saved_bytes
        params += c.params
    fwd += cm.reshard_fwd_ms[k[0], k[1]] + cm.reshard_fwd_ms[k[1], k[0]]
    saved += cm.reshard_saved_bytes[k[0], k[1]] + cm.reshard_saved_bytes[k[1], k[0]]
    bwd += cm.reshard_bwd_ms[k[0], k[1]] + cm.reshard_bwd_ms[k[1], k[0]]
    return Layer(forward=fwd, backward=bwd, saved=saved, params=[params])


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The simulator and the planner price the saved bytes of CUDA's kernels
    (``describe.saved.CUDA_KERNELS``: a fused RMSNorm that keeps no normalised input, the flash
    attention's philox seed); the trainer here runs on CPU, whose kernels ``describe.saved``
    also knows (``CPU_KERNELS``, each measured by ``tests/test_saved_bytes_budget.py``): their
    readings are taken with those. The device's kernels are the one input a command line with
    ``--device cpu`` does not hand the simulator."""
    from megatron_oases.describe import saved

    for fn in vars(saved).values():
        if callable(fn) and "kernels" in (getattr(fn, "__kwdefaults__", None) or {}):
            monkeypatch.setitem(fn.__kwdefaults__, "kernels", saved.CPU_KERNELS)


def _bytes(rows) -> int:
    return sum(r[2] for r in rows)


# ---- the test ----------------------------------------------------------------------------------

WORLDS = sorted({r.world for r in GRID})


@pytest.fixture(scope="module")
def trainer_readings(tmp_path_factory):
    """Rank 0's readings of every row at 2 x PP and PP layers: one spawned group per world size."""
    tmp = tmp_path_factory.mktemp("plans")
    out = {}
    for world in WORLDS:
        rows = [r for r in GRID if r.world == world]
        argvs = [argv_of(r, n * r.pp, tmp) for r in rows for n in (2, 1)]
        ranks = run_on_ranks(readings_of, world, args=(argvs,), timeout_s=300)
        rank0 = ranks[0]
        for i, r in enumerate(rows):
            out[r.name] = (rank0[2 * i], rank0[2 * i + 1])
    return out, tmp


CASES = [pytest.param(r, id=r.name) for r in GRID]


def _readings(row: Row, trainer_readings):
    readings, tmp = trainer_readings
    big, small = argv_of(row, 2 * row.pp, tmp), argv_of(row, row.pp, tmp)
    return trainer_layer(*readings[row.name]), sim_layer(big, small, row.world), plan_layer(big, row)


@pytest.mark.parametrize("row", CASES)
def test_parameters_per_layer_and_rank(row, trainer_readings):
    """Each layer's parameters (and, the simulator's, the whole stage's on rank 0: embedding,
    output layer and final norm with the layers)."""
    got, sim, plan = _readings(row, trainer_readings)
    assert (got.params, got.rank_params) == (sim.params, sim.rank_params)
    assert [sum(got.params) / len(got.params)] == plan.params


@pytest.mark.parametrize("row", CASES)
def test_collectives_per_layer(row, trainer_readings):
    """Each pass's collectives (kind, group, bytes) equal the simulator's events; their bytes
    equal the planner's communication terms."""
    got, sim, plan = _readings(row, trainer_readings)
    assert (got.forward, got.backward) == (sim.forward, sim.backward)
    assert (_bytes(got.forward), _bytes(got.backward)) == (plan.forward, plan.backward)


@pytest.mark.parametrize("row", CASES)
def test_saved_bytes_per_layer_as_the_simulator_prices_them(row, trainer_readings, cpu_kernels):
    got, sim, _ = _readings(row, trainer_readings)
    assert got.saved == sim.saved


@pytest.mark.parametrize("row", CASES)
def test_saved_bytes_per_layer_as_the_planner_prices_them(row, trainer_readings, cpu_kernels):
    got, _, plan = _readings(row, trainer_readings)
    assert got.saved == plan.saved
