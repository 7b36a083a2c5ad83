"""``sim --predict`` / ``megatron-oases sim`` with ``--sequence-parallel`` (Megatron 1-D, stock and
Oases): the layers' collectives are the SP description's all-gathers and reduce-scatters with its
bytes, the compute events carry the ``_sp`` key (norms and residual on s/t tokens), a small run
profiles here and predicts, and ATP / 3-D / per-block plans stay refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_oases.describe.registry import layer_description
from megatron_oases.pricing.device_model import SimError
from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.calibrate.profiler import local_topology
from megatron_oases.describe.atp_2d import atp_layout
from tests.test_sim_plan import OASES, TINY_PROFILE, _args, _stages

SP = ["--sequence-parallel"]
B, S, H = 4, 16, 32


def _layer_collectives(events, tp_events=("attention.", "mlp.")):
    return sorted((e.op.kind, e.nbytes) for e in events if e.kind == "collective" and e.name.startswith(tp_events))


@pytest.mark.parametrize("schedule", [[], OASES], ids=["stock", "oases"])
def test_the_simulated_step_issues_the_sp_description_s_collectives(tmp_path: Path, schedule):
    model, strategy, stages = _stages(_args(tmp_path, None, SP + schedule))
    assert strategy.sequence_parallel
    oases = bool(schedule)
    desc = layer_description(backend="megatron", layout=None, micro_batch=B // 2 if oases else B, seq=S, hidden=H,
                             heads=4, ffn=4 * H, tp=2, bytes_per_element=4, sequence_parallel=True,
                             schedule="oases" if oases else "stock")
    per_layer = {p: sorted((c.kind, c.payload_bytes) for c in desc.collectives(p)) for p in ("forward", "backward")}
    layers = model.num_layers
    assert _layer_collectives(stages[0].forward) == sorted(per_layer["forward"] * layers)
    assert _layer_collectives(stages[0].backward) == sorted(per_layer["backward"] * layers)
    assert not [e for e in stages[0].forward + stages[0].backward
                if e.kind == "collective" and e.op.kind == "all_reduce" and e.name.startswith(("attention", "mlp"))]
    assert all(k.endswith("_sp") for e in stages[0].forward if e.name == "attention"
               for k in [e.key.split("[")[1].rstrip("]")])
    # stock: the input gradient's reduce-scatter runs beside the column weight gradient
    rs = [e for e in stages[0].backward if e.name in ("attention.ag.bwd", "mlp.ag.bwd")]
    assert rs and all((e.beside is not None) != oases for e in rs)


@pytest.mark.parametrize("schedule", [[], OASES], ids=["stock", "oases"])
def test_a_sequence_parallel_run_profiles_and_predicts_here(tmp_path: Path, schedule):
    from megatron_oases.sim.frontends.predict import predict_train_step, profile_train_args

    args = _args(tmp_path, None, SP + schedule)
    db = profile_train_args(args, settings=TINY_PROFILE)
    assert any(k.startswith("all_gather:attention.ag") for k in db.events_ms)
    assert any(k.startswith("reduce_scatter:mlp.rs") for k in db.events_ms)
    r = predict_train_step(args, db)
    assert r.iteration_ms > 0 and r.strategy.sequence_parallel


def test_sequence_parallel_is_refused_off_megatron_layers_in_one_line():
    for kw in (dict(tp=4, backend="atp", layout=atp_layout(2, 2)), dict(tp=8, backend="3d"), dict(tp=2, block_degrees=(1, 2))):
        with pytest.raises(SimError, match="--sequence-parallel is modeled for --tp-backend megatron"):
            Strategy(sequence_parallel=True, **kw)


def test_sim_cli_takes_megatron_s_flag():
    from megatron_oases.sim.frontends.cli import build_parser, strategy_from_args

    a = build_parser().parse_args(["--tp", "2", "--sequence-parallel"])
    assert strategy_from_args(a, 2).sequence_parallel


def test_the_memory_model_prices_the_sp_inventory():
    """The memory model prices the SP inventory (``describe.saved``): less than without SP."""
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.memory import chunk_activation_bytes

    m = GPTShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=128,
                 micro_batch_size=4)
    topo = local_topology(2)
    got = {}
    for sp in (False, True):
        s = Strategy(tp=2, sequence_parallel=sp)
        got[sp] = chunk_activation_bytes(m, s, build_stage_events(m, s, topo)[0].chunks[0])[0]
    assert got[True] < got[False]
