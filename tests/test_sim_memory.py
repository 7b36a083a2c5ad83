"""Memory per device: model states, activations per schedule and recompute mode, infeasibility."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.describe.ops import LayerVariant
from megatron_oases.describe.registry import layer_activation_bytes, layer_input_bytes
from megatron_oases.describe.saved import checkpoint_rng_state_bytes
from megatron_oases.pricing.device_model import device_model
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.events import build_stage_events
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.memory import GiB, model_state_bytes
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import Level, Topology
from megatron_oases.describe.atp_2d import atp_layout

MODEL = GPTShape(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=8192,
                 micro_batch_size=4, dtype="bf16")


def _topo(n: int = 8) -> Topology:
    return Topology(name="flat", device="a100-80gb", levels=(Level(
        name="nvswitch", size=n, scope="intra_node", p2p_bandwidth_GBps=300, group_bandwidth_GBps=300),))


def test_korthikanti_formula():
    """Korthikanti et al.'s bf16 count plus what Megatron's local layer also keeps (measured:
    tests/test_saved_bytes_budget.py): fp32 norm statistics (16 bytes a token on CUDA), the
    causal mask built per call (s^2 bools) and the softmax output in fp32 (+2 a s^2 b / t)."""
    b, s, h, a, t = 4, 2048, 4096, 32, 8
    got = layer_activation_bytes("megatron", b=b, s=s, h=h, a=a, f=4 * h, t=t, e=2, layout=None)
    korthikanti = s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t
    assert got == pytest.approx(korthikanti + 16 * s * b + s * s + 2 * a * s * s * b / t)
    assert layer_input_bytes("megatron", b=b, s=s, h=h, e=2, layout=None) == 2 * s * b * h
    atp = {m: layer_activation_bytes("atp", b=b, s=s, h=h, a=a, f=4 * h, t=t, e=2, layout=atp_layout(*m))
           for m in ((4, 2), (8, 1))}
    # d2 = 2 halves the residual side (norms, QKV and fc1 inputs), more than the FFN's d1 = 4 costs
    assert atp[4, 2] < atp[8, 1]


def test_model_states_bytes_per_param():
    p = 1000
    assert sum(model_state_bytes(p, MODEL, Strategy())) == 18 * p  # bf16 + fp32 grad + master + Adam
    fp32 = GPTShape(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=8192,
                    micro_batch_size=4, dtype="fp32")
    assert sum(model_state_bytes(p, fp32, Strategy())) == 16 * p
    w, g, o = model_state_bytes(p, MODEL, Strategy(dp=4, distributed_optimizer=True))
    assert (w, g, o) == (2 * p, 4 * p, 12 * p / 4)


def _mem(**kw):
    s = Strategy(**{"tp": 2, "pp": 4, "dp": 1, "num_microbatches": 8, **kw})
    return simulate(MODEL, s, device_model(_topo()), memory_limit_GB=0)


def test_in_flight_micro_batches_per_schedule():
    one = _mem()
    assert [m.in_flight for m in one.memory] == [4, 3, 2, 1]  # 1F1B: pp - stage
    assert [m.in_flight for m in _mem(pipeline_schedule="gpipe").memory] == [8] * 4
    inter = _mem(virtual_stages=2)
    # Megatron's interleaved warm-up: 2 (pp - s - 1) + (v - 1) pp forwards, plus the steady one
    assert [m.in_flight for m in inter.memory] == [2 * (4 - s - 1) + 4 + 1 for s in range(4)]
    # stage 0 keeps more chunk-micro-batches, each of half the layers: more activations than 1F1B
    assert inter.memory[0].activations > one.memory[0].activations


def test_recompute_and_oases_fine_grained():
    b, s, h, e = MODEL.micro_batch_size, MODEL.seq_length, MODEL.hidden_size, 2
    inp = b * s * h * e
    full = layer_activation_bytes("megatron", b=b, s=s, h=h, a=MODEL.num_attention_heads, f=MODEL.ffn_hidden_size, t=2,
                                  e=e, layout=None,
                                  hidden_dropout=False, attention_dropout=False)  # MODEL's dropout is 0
    none, rc = _mem().memory[1], _mem(recompute=True).memory[1]
    oases = _mem(recompute=True, schedule="oases").memory[1]
    coarse = _mem(recompute=True, schedule="oases", fine_grained_recompute=False).memory[1]
    layers, alive = 2, 3  # stage 1 of 4: 2 layers, 3 micro-batches in flight
    # Megatron's checkpoint keeps its generator states too (the Oases executor's recompute does not)
    states = checkpoint_rng_state_bytes(sequence_parallel=False, attention_dropout=False,
                                        core_attention=MODEL.core_attention)
    assert none.activations == pytest.approx(alive * layers * full)
    assert rc.activations == pytest.approx(alive * layers * (inp + states) + full)  # + the recompute working set
    assert oases.activations - coarse.activations == pytest.approx(alive * layers * 2 * inp)  # 3 tensors, not 1
    assert coarse.activations == pytest.approx(rc.activations - alive * layers * states)
    block = _mem(recompute=True, recompute_layers=1).memory[1]
    assert block.activations == pytest.approx(alive * (inp + states + full) + full)
    assert none.weights == rc.weights


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_full_recompute_keeps_what_describe_saved_says(sp):
    """A layer under Megatron's full recompute keeps what ``describe.saved.layer_saved_bytes`` says,
    with and without sequence parallelism (under SP sim reads it whole: ``_sp_layer_bytes``; its
    input is the 1/t chunk and its checkpoint forks no tracker state)."""
    from megatron_oases.describe.saved import layer_saved_bytes

    none, rc = _mem(sequence_parallel=sp).memory[1], _mem(recompute=True, sequence_parallel=sp).memory[1]
    layers, alive = 2, 3  # stage 1 of 4: 2 layers, 3 micro-batches in flight
    working_set = none.activations / (alive * layers)  # one layer's full activations
    kept = (rc.activations - working_set) / (alive * layers)
    assert kept == pytest.approx(layer_saved_bytes(
        recompute=True, b=MODEL.micro_batch_size, s=MODEL.seq_length, h=MODEL.hidden_size, a=MODEL.num_attention_heads,
        f=MODEL.ffn_hidden_size, t=2, e=2, hidden_dropout=False, attention_dropout=False, sequence_parallel=sp,
        core_attention=MODEL.core_attention))


def test_selective_recompute_keeps_the_inventory_without_score_tensors():
    """Each layer keeps its inventory without the core attention's s^2 tensors; the one layer
    running its backward has them again (the working set)."""
    m = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)
    b, s, h, a, t = m.micro_batch_size, m.seq_length, m.hidden_size, m.num_attention_heads, 2
    kw = dict(b=b, s=s, h=h, a=a, f=m.ffn_hidden_size, t=t, e=2, layout=None)
    full = layer_activation_bytes("megatron", **kw)
    kept = layer_activation_bytes("megatron", recompute_core_attention=True, **kw)
    # fp32 softmax output, the dropped-out probabilities and their 1-byte mask, the causal mask; + 4
    assert full - kept == pytest.approx((4 + 2 + 1) * a * s * s * b / t + s * s - 4)
    topo = _topo()
    dm = device_model(topo, bytes_per_element=2)
    sel = simulate(m, Strategy(tp=2, pp=4, num_microbatches=8, selective_recompute=True), dm).memory[1]
    none = simulate(m, Strategy(tp=2, pp=4, num_microbatches=8), dm).memory[1]
    layers, alive = 2, 3  # stage 1 of 4: 2 layers, 3 micro-batches in flight
    assert none.activations - sel.activations == pytest.approx(alive * layers * (full - kept) - (full - kept))


def test_infeasible_strategies_are_marked(capsys):
    r = simulate(MODEL, Strategy(tp=2, pp=4, num_microbatches=8), device_model(_topo()), memory_limit_GB=0.1)
    assert not r.fits and r.infeasible_reason.startswith("memory ")
    assert "> 0.1 GB" in r.infeasible_reason
    ok = simulate(MODEL, Strategy(tp=2, pp=4, num_microbatches=8), device_model(_topo()))
    assert ok.fits and ok.memory_limit_GB == 80 and 0 < ok.peak_memory_GB < 80
    assert max(x.memory_GB for x in ok.stages) == pytest.approx(ok.peak_memory_GB)
    from megatron_oases.sim.frontends.cli import sim_main

    base = ["--topology", "dgx-a100", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "512", "--micro-batch-size", "4", "--vocab-size", "8192", "--num-microbatches", "8",
            "--tp", "2", "--pp", "4"]
    assert sim_main(base + ["--memory-gb", "0.1"]) == 0
    assert "INFEASIBLE: memory" in capsys.readouterr().out


def test_params_count_embeddings_once_per_copy():
    st = build_stage_events(MODEL, Strategy(tp=2, pp=4, num_microbatches=8), _topo())
    mid = st[1].params_per_rank
    v, h = MODEL.padded_vocab_size, MODEL.hidden_size
    assert st[0].params_per_rank - mid == v * h // 2 + MODEL.seq_length * h
    assert st[3].params_per_rank - mid == MODEL.padded_vocab_size * MODEL.hidden_size // 2 + 2 * MODEL.hidden_size
    assert st[0].tie_allreduce is not None and st[3].tie_allreduce is not None and st[1].tie_allreduce is None
    assert GiB == 2 ** 30
    rope = dataclasses.replace(MODEL, variant=LayerVariant(rotary=True))  # no learned position embeddings
    st = build_stage_events(rope, Strategy(tp=2, pp=4, num_microbatches=8), _topo())
    assert st[0].params_per_rank - st[1].params_per_rank == MODEL.padded_vocab_size * MODEL.hidden_size // 2


def test_oases_without_recompute_prices_its_second_sub_batch_mask():
    """The Oases executor without recompute keeps a causal mask for its second sub-batch beyond
    stock's inventory, no step boundary (measured in tests/test_saved_bytes_budget.py and
    tests/test_round_trip.py)."""
    s = MODEL.seq_length
    stock, oases = _mem().memory[1], _mem(schedule="oases").memory[1]
    layers, alive = 2, 3
    assert oases.activations - stock.activations == pytest.approx(alive * layers * s * s)
