"""The 3-D cube's layer description against the collectives the runtime issues (contract), and
the simulator and predictor on the backends the runtime runs (3-D, Oases over ATP)."""
from __future__ import annotations

import pytest

from megatron_oases.describe.cube_3d import cube_3d_gpt_layer
from megatron_oases.describe.registry import block_edges, layer_params
from megatron_oases.pricing.device_model import SimError, device_model
from megatron_oases.runtime.spawn import run_on_ranks
from megatron_oases.describe.shapes import GPTShape
from megatron_oases.sim.core.strategy import Strategy
from megatron_oases.sim.core.timeline import simulate
from megatron_oases.topology import load_topology
from megatron_oases.describe.atp_2d import atp_layout
from tests.rank_fns_contract import layer_contract

B, S, H, A = 4, 8, 32, 8
MODEL = ["--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", str(A),
         "--seq-length", str(S), "--vocab-size", "128", "--micro-batch-size", str(B),
         "--global-batch-size", str(B), "--device", "cpu"]


def _check_cube(argv: list[str], *, heads: int, ffn: int, variant=None) -> None:
    """One layer on the cube (TP 8): every collective per pass (with the block's edges) and TP
    position 0's parameters (a diagonal block of every vector) equal the description's."""
    from megatron_oases.describe.ops import GPT2

    variant = variant or GPT2
    outs = run_on_ranks(layer_contract, 8, args=(argv + ["--tp-backend", "3d", "--tensor-model-parallel-size", "8"],
                                                 B, S, H), timeout_s=180)
    desc = cube_3d_gpt_layer(micro_batch=B, seq=S, hidden=H, heads=heads, ffn=ffn, tp=8, bytes_per_element=4,
                             variant=variant)
    leave, enter_b = block_edges(backend="3d", layout=None, micro_batch=B, seq=S, hidden=H, tp=8,
                                 bytes_per_element=4)
    for pass_, edge in (("forward", leave), ("backward", enter_b)):
        want = sorted((c.kind, c.group_size, c.payload_bytes) for c in (*desc.collectives(pass_), *edge))
        for out in outs:
            assert sorted(r for r in out[pass_] if r[1] > 1) == want, (out["rank"], pass_)
    assert outs[0]["params"] == layer_params("3d", H, ffn, 8, None, heads=heads, variant=variant)


def test_3d_layer_issues_what_its_description_says():
    _check_cube(MODEL, heads=A, ffn=4 * H)


def test_3d_llama_layer_issues_what_its_description_says():
    from tests.test_description_contract import LLAMA_F, llama_model

    argv, variant = llama_model(heads=8, groups=2)
    _check_cube(argv, heads=8, ffn=LLAMA_F, variant=variant)


def test_3d_description_divides_the_dense_layer_flops_by_the_cube():
    from megatron_oases.describe.megatron_1d import megatron_1d_gpt_layer

    dense = megatron_1d_gpt_layer(micro_batch=8, seq=64, hidden=256, heads=8, ffn=1024, tp=1)
    cube = cube_3d_gpt_layer(micro_batch=8, seq=64, hidden=256, heads=8, ffn=1024, tp=8)
    for pass_ in ("forward", "backward"):
        assert cube.flops(pass_) * 8 == pytest.approx(dense.flops(pass_))


def test_3d_description_refuses_what_the_cube_cannot_split():
    with pytest.raises(SimError, match="p\\^3"):
        cube_3d_gpt_layer(micro_batch=4, seq=8, hidden=32, heads=8, ffn=128, tp=4)
    with pytest.raises(SimError, match="--micro-batch-size 2 is not a multiple of 4"):
        cube_3d_gpt_layer(micro_batch=2, seq=8, hidden=32, heads=8, ffn=128, tp=8)


@pytest.mark.parametrize("backend, mesh, schedule", [("3d", None, "default"), ("atp", atp_layout(4, 2), "oases")])
def test_simulator_runs_the_backends_the_runtime_runs(backend, mesh, schedule):
    topo = load_topology("dgx-a100")
    model = GPTShape(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=51200,
                     micro_batch_size=4, ffn_hidden_size=4096)
    st = Strategy(tp=8, pp=1, dp=1, num_microbatches=2, backend=backend, layout=mesh, schedule=schedule,
                  recompute=schedule == "oases")
    res = simulate(model, st, device_model(topo))
    assert res.iteration_ms > 0


@pytest.mark.parametrize("backend, mesh, schedule", [("3d", None, "default"), ("atp", atp_layout(4, 2), "oases")])
def test_simulator_prices_llama_layers_on_atp_and_3d(backend, mesh, schedule):
    """GQA, SwiGLU, RMSNorm and no bias are priced from the backend's description: the
    weights a rank holds are the description's parameters (SwiGLU's third matrix outweighs
    GQA's smaller QKV), and the step time changes with them."""
    from megatron_oases.describe.registry import layer_params
    from megatron_oases.describe.ops import LayerVariant

    topo = load_topology("dgx-a100")
    kw = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=51200,
              micro_batch_size=4, ffn_hidden_size=2816, dtype="bf16")
    st = Strategy(tp=8, pp=1, dp=1, num_microbatches=2, backend=backend, layout=mesh, schedule=schedule,
                  recompute=schedule == "oases")
    llama = GPTShape(**kw, variant=LayerVariant(query_groups=8, gated=True, normalization="RMSNorm",
                                                    bias=False))
    gpt = simulate(GPTShape(**kw), st, device_model(topo))
    res = simulate(llama, st, device_model(topo))
    from megatron_oases.describe.head import head_param_tensors

    variant = llama.variant
    extra = 4 * (layer_params(backend, 1024, 2816, 8, mesh, heads=16, variant=variant)
                 - layer_params(backend, 1024, 2816, 8, mesh, heads=16))
    assert extra > 0
    head = dict(v=51200, h=1024, seq=512, t=8, first=True, last=True, output_copy=False)
    extra += sum(head_param_tensors(**head, variant=variant)) - sum(head_param_tensors(**head))  # RMSNorm
    assert res.memory[0].weights - gpt.memory[0].weights == extra * 2  # bf16
    assert res.iteration_ms != gpt.iteration_ms


def test_simulator_refuses_oases_over_the_cube():
    st = Strategy(tp=8, pp=1, dp=1, num_microbatches=2, backend="3d", schedule="oases")
    model = GPTShape(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, padded_vocab_size=51200,
                     micro_batch_size=4, ffn_hidden_size=4096)
    with pytest.raises(SimError, match="no Oases tape for 3d"):
        simulate(model, st, device_model(load_topology("dgx-a100")))
