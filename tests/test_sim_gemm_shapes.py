"""Shape-dependent GEMM efficiency (docs/sim.md, Device model): the layer descriptions carry each
segment's GEMM shapes, and the device model applies tile and wave quantization to them."""
from __future__ import annotations

import math

import pytest

from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer
from megatron_oases.describe.ops import Compute, backward_of
from megatron_oases.pricing.device_model import GPUS, device_model, gemm_quantization
from megatron_oases.topology import Level, Topology


def topo(device: str = "a100-80gb") -> Topology:
    return Topology(name="t", device=device, levels=(Level(
        name="nvlink", size=8, scope="intra_node", p2p_bandwidth_GBps=300, group_bandwidth_GBps=300),))


def test_wave_quantization_of_known_shapes():
    # 256x128 tiles: 2048 x 6912 -> 8 x 54 = 432 tiles = 4 full waves on 108 SMs
    assert gemm_quantization(2048, 6912, 108) == 1.0
    # 4096 x 6144 on 132 SMs: 16 x 48 = 768 tiles (either orientation) -> 6 waves, the last
    # 108 of 132 full: 768 / 792
    assert gemm_quantization(4096, 6144, 132) == pytest.approx(768 / 792)
    # NVIDIA's guide's example shape class: one tile more than a wave costs a whole wave
    assert gemm_quantization(256 * 109, 128, 108) == pytest.approx(109 / 216)
    # tile quantization: 2304 = 9 x 256 = 18 x 128; 2304 x 2304 has 162 tiles of 256x128 (2 waves
    # of 108: 162 / 216) and no better orientation
    assert gemm_quantization(2304, 2304, 108) == pytest.approx(162 / 216)
    # too small to fill a wave with big tiles: the smaller ones (64x128: 16 x 8 = 128 tiles)
    assert gemm_quantization(1024, 1024, 108) == pytest.approx(1024 * 1024 / (2 * 108 * 64 * 128))
    # a partial tile: 100 x 100 on 64x64 tiles, 4 tiles in one wave of 108
    assert gemm_quantization(100, 100, 108) == pytest.approx(100 * 100 / (108 * 64 * 64))


def test_layer_description_carries_gemm_shapes():
    b, s, h, f, t = 2, 1024, 2048, 8192, 4
    layer = megatron_1d_gpt_layer(micro_batch=b, seq=s, hidden=h, heads=16, ffn=f, tp=t, bytes_per_element=2)
    for c in layer.computes("forward") + layer.computes("backward"):
        assert c.gemms and c.gemm_flops == sum(2 * math.prod(g) for g in c.gemms)
    attn, mlp = layer.computes("forward")
    assert attn.gemms == ((b * s, 3 * h // t, h), (b * s, h, h // t))
    assert mlp.gemms == ((b * s, f // t, h), (b * s, h, f // t))
    # backward: per GEMM the input gradient (M x K over N) and the weight gradient (N x K over M)
    assert backward_of(mlp).gemms[:2] == ((b * s, h, f // t), (f // t, h, b * s))


def test_quantization_slows_the_gemm_by_its_utilisation():
    dm = device_model(topo())
    flat = device_model(topo(), gemm_quantization=False)
    shape = (2304, 2304, 4096)
    c = Compute(name="g", gemm_flops=2.0 * math.prod(shape), gemms=(shape,))
    ideal = c.gemm_flops / (GPUS["a100-80gb"].tensor_tflops * 1e9)
    assert dm.gemm_utilisation(c.gemms) == pytest.approx(0.75)
    ceiling = 0.869 * dm.gemm_shape_factor  # the best-shape ceiling times the fitted shape factor
    assert flat.gpu_compute_ms(c) == pytest.approx((ideal + 0.01) / ceiling)
    assert dm.gpu_compute_ms(c) == pytest.approx((ideal / 0.75 + 0.01) / ceiling)
    # unknown shapes (or an unknown SM count) keep the shape-free price
    assert dm.gpu_compute_ms(Compute(name="g", gemm_flops=c.gemm_flops)) == flat.gpu_compute_ms(c)
    a10 = device_model(topo("a10-24gb"))
    assert a10.gemm_utilisation(c.gemms) == 1.0


def test_nccl_efficiency_slows_a_ring_and_p2p():
    def two_level(eff_nv, eff_ib):
        return Topology(name="t", device="h100-sxm", levels=(
            Level(name="nvswitch", size=8, scope="intra_node", p2p_bandwidth_GBps=450,
                  group_bandwidth_GBps=450, latency_us=0.0, nccl_efficiency=eff_nv),
            Level(name="ib", size=2, scope="inter_node", p2p_bandwidth_GBps=400,
                  group_bandwidth_GBps=400, latency_us=0.0, nccl_efficiency=eff_ib)))
    dm, raw = device_model(two_level(0.822, 0.94)), device_model(two_level(None, None))
    S = 1e9
    node = tuple(range(8))
    # all-reduce over one node's 8 GPUs: 2 (n-1)/n S at 450 x 0.822 GB/s
    assert raw.collective_ms("all_reduce", S, node) == pytest.approx(2 * 7 / 8 * S / 450e6)
    assert dm.collective_ms("all_reduce", S, node) == pytest.approx(2 * 7 / 8 * S / (450e6 * 0.822))
    # a DP ring of one GPU per node: an eighth of the node's NICs, at 0.94 of their rate
    dp = (0, 8)
    assert dm.collective_ms("all_gather", S, dp) == pytest.approx(0.5 * S / (400e6 / 8 * 0.94))
    assert dm.p2p_ms(S, 0, 8) == pytest.approx(S / (400e6 * 0.94))
    assert dm.p2p_ms(S, 0, 1) == pytest.approx(S / (450e6 * 0.822))


def test_shipped_dgx_topologies_carry_nccl_efficiency():
    from megatron_oases.topology import load_topology
    a100, h100 = load_topology("dgx-a100-hdr8"), load_topology("dgx-h100-ndr8")
    assert [lv.nccl_efficiency for lv in a100.levels] == [0.667, 0.91]
    assert [lv.nccl_efficiency for lv in h100.levels] == [0.822, 0.94]
    with pytest.raises(Exception, match="nccl_efficiency"):
        Level(name="x", size=2, scope="intra_node", p2p_bandwidth_GBps=1, group_bandwidth_GBps=1,
              nccl_efficiency=1.5)
