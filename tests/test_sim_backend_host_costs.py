"""ATP's layer on a d1 x 1 mesh computes what Megatron's TP d1 layer computes (the same GEMMs and
collectives; its own norms): the simulator must price its host cost and element-wise traffic
through the same software stack (issue 49), not as kernel-less events."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.describe.atp_2d import atp_2d_gpt_layer, atp_layout
from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.describe.ops import Compute
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.pricing.device_model import device_model
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import load_topology

MODEL = GPTShape(num_layers=4, hidden_size=1536, num_attention_heads=12, seq_length=1024,
                 padded_vocab_size=51200, micro_batch_size=2)
LAYER = dict(micro_batch=2, seq=1024, hidden=1536, heads=12, ffn=6144, bytes_per_element=2)


def _kernels(events) -> int:
    return sum(e.kernels for e in events if isinstance(e, Compute))


@pytest.mark.parametrize("t", [1, 2, 4])
def test_atp_counts_the_kernels_its_layer_launches(t):
    """Every ATP compute event counts its kernels (0 would price it as one kernel with no
    framework cost and the description's bytes unscaled). Beyond Megatron's count, ATP launches
    its eager norms (``layers/atp_norm.ATPNorm``: the statistics, the centring and the affine, in
    separate kernels, where Megatron's norm is one) and its MLP's bias-add (Megatron's fuses it into
    the activation): per forward exactly ``2 * (norm - 1) + 1`` more."""
    from megatron_oases.describe.atp_2d import eager_norm_kernels

    atp = atp_2d_gpt_layer(**LAYER, d1=t, d2=1)
    meg = megatron_1d_gpt_layer(**LAYER, tp=t)
    assert all(c.kernels > 0 for c in atp.forward + atp.backward if isinstance(c, Compute))
    extra = 2 * (eager_norm_kernels("LayerNorm", bytes_per_element=2) - 1) + 1
    assert _kernels(atp.forward) == _kernels(meg.forward) + extra
    assert _kernels(atp.backward) == 2 * _kernels(atp.forward)


def _iteration_ms(t: int, backend: str) -> float:
    dev = device_model(load_topology("2node-ib"))
    stock = Strategy(tp=t, dp=16 // t, num_microbatches=4)
    s = stock if backend == "megatron" else dataclasses.replace(stock, backend="atp", layout=atp_layout(t, 1))
    return simulate(MODEL, s, dev, memory_limit_GB=0, timeline=False).iteration_ms


@pytest.mark.parametrize("t", [1, 2, 4])
def test_atp_d1_by_1_costs_what_megatron_tp_d1_costs_but_its_norms(t, monkeypatch):
    """Same model, topology and parallelism: with ATP's norms counted as Megatron's one fused
    kernel, ATP T x 1 within 3% of Megatron TP T (what is left: the MLP's unfused bias add and
    the segments' element-wise bytes, counted apart); with its eager norms it costs more, by their
    kernels' host time (this model is host-bound on 2node-ib)."""
    from megatron_oases.describe import atp_2d

    stock, atp = _iteration_ms(t, "megatron"), _iteration_ms(t, "atp")
    monkeypatch.setattr(atp_2d, "eager_norm_kernels", lambda *a, **k: 1)
    fused_norms = _iteration_ms(t, "atp")
    assert fused_norms == pytest.approx(stock, rel=0.03)
    assert atp > fused_norms


def test_the_cube_counts_the_kernels_atps_layer_counts():
    """The cube's layer runs the same eager norms, biases and activation as ATP's (``layers.linear3d``):
    each segment counts the same kernels, so its host time is priced, not zero."""
    from megatron_oases.describe.cube_3d import cube_3d_gpt_layer

    shape = {**LAYER, "micro_batch": 4, "heads": 16}  # the cube splits the batch in p^2 = 4, heads in 8
    cube = cube_3d_gpt_layer(**shape, tp=8)
    atp = atp_2d_gpt_layer(**shape, d1=4, d2=2)
    by_part = lambda layer: {c.name.split(".", 1)[1]: c.kernels for c in layer.forward if isinstance(c, Compute)}  # noqa: E731
    assert by_part(cube) == by_part(atp) and all(by_part(cube).values())
    assert sum(c.framework_share for c in cube.forward if isinstance(c, Compute)) == pytest.approx(2)
