"""A fused core attention in the memory model: which flags select it (``describe.core_attention``),
and that the simulator's peak and the planner's memory constraint drop by what the local
attention keeps and the fused kernel does not (the s x s tensors, the causal mask, the keys and
values repeated to the heads under GQA), read from the one inventory (``describe.saved``)."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.describe.core_attention import core_attention_of
from megatron_oases.describe.saved import CUDA_KERNELS, layer_saved_bytes
from megatron_oases.plan.memory import block_memory
from megatron_oases.plan.model import PlanModel
from megatron_oases.sim.frontends.cli import build_parser, sim_main, simulation_inputs
from megatron_oases.sim.core.timeline import simulate

LLAMA2_70B = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--group-query-attention",
              "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--swiglu", "--normalization", "RMSNorm",
              "--disable-bias-linear", "--position-embedding-type", "rope", "--seq-length", "4096",
              "--micro-batch-size", "1", "--vocab-size", "32000", "--untie-embeddings-and-output-weights",
              "--tp", "8", "--pp", "8", "--global-batch-size", "64", "--bf16"]
LOCAL = ("--attention-backend", "local")
"""Megatron's local attention (``sim``'s default is the trainer's, ``auto``: a fused kernel)."""


@pytest.mark.parametrize("flags, kind", [
    (dict(), "local"),
    (dict(use_flash_attn=True), "fused"),
    (dict(transformer_impl="transformer_engine"), "fused"),
    (dict(attention_backend="auto"), "fused"),
    (dict(attention_backend="flash"), "fused"),
    (dict(attention_backend="fused", transformer_impl="transformer_engine"), "fused"),
    (dict(attention_backend="unfused"), "unfused"),  # our builds: SDPA's math kernel
    (dict(attention_backend="unfused", transformer_impl="transformer_engine"), "local"),
    (dict(attention_backend="local"), "local"),
])
def test_the_flags_that_run_a_fused_attention(flags, kind):
    assert core_attention_of(**flags) == kind


def test_contradicting_attention_flags_are_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match="--use-flash-attn contradicts --attention-backend unfused"):
        core_attention_of(attention_backend="unfused", use_flash_attn=True)
    small = ["--topology", "local", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "1"]
    assert sim_main(small + ["--use-flash-attn", "--attention-backend", "local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --use-flash-attn contradicts --attention-backend local; give one"]


def _llama2_70b(*extra: str):
    model, strategy, dm = simulation_inputs(build_parser().parse_args(
        ["--topology", "dgx-a100-hdr8", "--nodes", "8", *LLAMA2_70B, *extra]))
    return model, strategy, dm, simulate(model, strategy, dm)


def _dropped_per_layer(b: int, s: int, h: int, a: int, g: int, t: int, e: int) -> float:
    """What one Llama layer (GQA with g groups, RoPE, no dropout) keeps under Megatron's local
    attention and not under a fused one, per micro-batch, written out: the fp32 softmax output
    and its e-byte cast (the attention-over-V GEMM's input), the causal mask; the keys and values
    repeated to the heads (3 h / t) against the kernel's inputs (QKV's output and the rotated
    queries and keys); less the kernel's fp32 logsumexp and CUDA flash's philox seed and offset."""
    d = h // a
    scores = (4 + e) * a * s * s * b / t + s * s
    local_qkv = e * b * s * 3 * h / t
    fused_qkv = e * b * s * (d * (a + 2 * g) + d * (a + g)) / t
    return scores + local_qkv - fused_qkv - 4 * b * (a / t) * s - 24


def test_llama2_70b_peak_drops_by_what_the_local_attention_keeps():
    """TP 8 x PP 8 on 64 A100s, micro-batch 1, sequence 4096, no recompute: stage 0 keeps 8
    micro-batches of 10 layers; without fused attention 113.5 GB (infeasible on 80 GB), with it
    51.9 GB. Every flag that selects the fused kernel gives the same peak."""
    local, strategy, _, unfused = _llama2_70b(*LOCAL)
    assert local.core_attention == "local"
    per_layer = _dropped_per_layer(b=1, s=4096, h=8192, a=64, g=8, t=8, e=2)
    for flags in (["--attention-backend", "flash"], ["--use-flash-attn"], ["--transformer-impl", "transformer_engine"]):
        model, _, dm, fused = _llama2_70b(*flags)
        assert model.fused_attention and dm.fused_attention  # the time model reads the same fact
        for u, f in zip(unfused.memory, fused.memory, strict=True):
            layers = 80 // strategy.pp
            assert (u.weights, u.optimizer, u.in_flight) == (f.weights, f.optimizer, f.in_flight)
            assert u.activations - f.activations == pytest.approx(u.in_flight * layers * per_layer, rel=1e-12)
    assert unfused.peak_memory_GB == pytest.approx(113.50, abs=0.01) and not unfused.fits
    assert fused.peak_memory_GB == pytest.approx(51.87, abs=0.01) and fused.fits


def test_the_planner_and_the_simulator_read_the_same_bytes():
    """The planner's blocks (attention + MLP, stock executor, no recompute) keep what the
    simulator's layer keeps, with and without the fused attention, and drop by the same bytes."""
    model, _, _, _ = _llama2_70b()
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    fields.pop("tied_embeddings")
    per_layer = {}
    for fused in (False, True):
        m = PlanModel(**{**fields, "core_attention": "fused" if fused else "local"}, tp=8, recompute=False,
                      sub_batches=1)
        planned = sum(block_memory(m, kind, 1, 8)[0] for kind in ("attention", "mlp"))
        layer = layer_saved_bytes(b=1, s=4096, h=8192, a=64, f=28672, t=8, e=2, hidden_dropout=False,
                                  attention_dropout=False, kernels=CUDA_KERNELS, variant=model.variant,
                                  core_attention="fused" if fused else "local")
        assert planned == pytest.approx(layer, rel=1e-12)
        per_layer[fused] = planned
    assert per_layer[False] - per_layer[True] == pytest.approx(
        _dropped_per_layer(b=1, s=4096, h=8192, a=64, g=8, t=8, e=2), rel=1e-12)


@pytest.mark.parametrize("mode", [dict(), dict(recompute=True), dict(schedule="oases"),
                                  dict(selective_recompute=True)])
def test_fused_attention_never_keeps_more(mode):
    """Full recompute keeps each layer's input either way (only the recomputed layer's working set
    shrinks); selective recompute keeps the same checkpoint inputs; without recompute the stock and
    Oases schedules keep less (the Oases schedule also builds no causal mask per sub-batch)."""
    model, strategy, dm, _ = _llama2_70b(*LOCAL)
    model = dataclasses.replace(model, micro_batch_size=2)  # the Oases schedule splits it in two
    s = dataclasses.replace(strategy, num_microbatches=32, **mode)
    unfused = simulate(model, s, dm)
    fused = simulate(dataclasses.replace(model, core_attention="fused"), s, dm)
    assert all(f.activations < u.activations for u, f in zip(unfused.memory, fused.memory, strict=True))


@pytest.mark.parametrize("backend, kind", [("local", "local"), ("unfused", "unfused"), ("auto", "fused")])
def test_predict_reads_the_trainers_attention_backend(backend, kind):
    """``sim --predict`` prices the trainer run's core attention (its ``--attention-backend``)."""
    from megatron_oases.sim.frontends.predict import sim_inputs_from_train_args
    from megatron_oases.train_args import build_parser as train_parser

    args = train_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                      "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2",
                                      "--global-batch-size", "4", "--device", "cpu", "--tensor-model-parallel-size",
                                      "2", "--attention-backend", backend])
    model, _ = sim_inputs_from_train_args(args, world_size=2)
    assert model.core_attention == kind
