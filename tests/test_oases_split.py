"""Contract of the Oases split (``describe/split.py``): the executor cuts a micro-batch into the
sub-batches the description names and keeps the boundaries it counts, and the runtime's flag
validation, the simulator and the planner treat a micro-batch the split cannot take (an odd one)
the same way: refused, with the same line."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from megatron_oases.describe.ops import ModelingError
from megatron_oases.describe.saved import layer_saved_bytes
from megatron_oases.describe.split import (SUB_BATCHES, recompute_boundaries, split_refusal,
                                           sub_batch_sizes, sub_batches_at)
from megatron_oases.schedules.oases.executor import OasesRunner, OasesStage
from megatron_oases.schedules.oases.options import OasesOptions
from megatron_oases.schedules.oases.tape import BlockInputs, ForwardAllReduce, LayerTape, Local

S, H, LAYERS = 4, 8, 2


def _tape(weights, seen: list) -> LayerTape:
    """A Megatron 1-D layer's shape of tape: attention, its all-reduce, dropout-add, MLP, its
    all-reduce, dropout-add (the collectives skipped: one process, no group). ``seen`` records
    the batch size each forward / recompute pass of the first local step receives."""
    w1, w2 = weights

    def attn(t, inp):
        seen.append(t["x"].shape[1])
        return {"attn_p": t["x"] @ w1}

    steps = (Local("attn", ("x",), ("attn_p",), attn),
             ForwardAllReduce("attn.g", "attn_p", "attn_sum"),
             Local("bda1", ("attn_sum", "x"), ("h1",), lambda t, i: {"h1": torch.tanh(t["attn_sum"]) + t["x"]}),
             Local("mlp", ("h1",), ("mlp_p",), lambda t, i: {"mlp_p": t["h1"] @ w2}),
             ForwardAllReduce("mlp.g", "mlp_p", "mlp_sum"),
             Local("bda2", ("mlp_sum", "h1"), ("y",), lambda t, i: {"y": torch.tanh(t["mlp_sum"]) + t["h1"]}))
    return LayerTape(steps=steps, group=None, params=(w1, w2), collectives_off=contextlib.nullcontext)


def _dense(x, layers):
    for w1, w2 in layers:
        h1 = torch.tanh(x @ w1) + x
        x = torch.tanh(h1 @ w2) + h1
    return x


def _layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.nn.Parameter(torch.randn(H, H, generator=g) / H) for _ in range(2)) for _ in range(LAYERS)]


@pytest.mark.parametrize("micro_batch", [2, 3, 4])
@pytest.mark.parametrize("recompute,fine_grained", [(True, True), (True, False), (False, True)])
def test_executor_sub_batches_and_boundaries_follow_the_description(micro_batch, recompute, fine_grained):
    """Sub-batch shapes, saved boundaries (names and bytes) and the gradients of a one-rank
    executor against the description and a dense reference; micro-batch 3 is refused."""
    layers, seen = _layers(), []
    runner = OasesRunner([_tape(w, seen) for w in layers],
                         OasesOptions(recompute=recompute, fine_grained_recompute=fine_grained,
                                      skip_collectives=True))
    x = torch.randn(S, micro_batch, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    if split_refusal(micro_batch):
        with pytest.raises(ModelingError, match="--micro-batch-size"):
            OasesStage.apply(x, runner, BlockInputs())
        return
    y = OasesStage.apply(x, runner, BlockInputs())
    sizes, n = sub_batch_sizes(micro_batch), LAYERS * SUB_BATCHES
    assert sorted(seen) == sorted(b for b in sizes for _ in range(LAYERS))  # each sub-batch, every layer
    if recompute:
        assert all(len(t.saved_boundaries(fine_grained)) == recompute_boundaries(fine_grained=fine_grained, tp=2)
                   for t in runner.tapes)
        hidden = S * micro_batch * H * 4
        assert runner.saved_bytes() == LAYERS * hidden * recompute_boundaries(fine_grained=fine_grained, tp=2)
        assert runner.saved_bytes() == LAYERS * layer_saved_bytes(
            schedule="oases", recompute=True, fine_grained=fine_grained, b=micro_batch, s=S, h=H, a=1, f=H,
            t=2, e=4, hidden_dropout=False, attention_dropout=False)
    y.square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref = [tuple(torch.nn.Parameter(w.detach().clone()) for w in pair) for pair in layers]
    _dense(xr, ref).square().sum().backward()
    torch.testing.assert_close(y, _dense(x.detach(), ref))
    torch.testing.assert_close(x.grad, xr.grad)
    for pair, pair_ref in zip(layers, ref):
        for w, w_ref in zip(pair, pair_ref):
            torch.testing.assert_close(w.grad, w_ref.grad)
    assert sorted(seen[n:]) == (sorted(seen[:n]) if recompute else [])  # recompute: the same sub-batches


def test_the_split_itself():
    assert SUB_BATCHES == 2 and sub_batch_sizes(4) == (2, 2) and sub_batch_sizes(3, 1) == (3,)
    assert sub_batches_at(2) == sub_batches_at(4) == SUB_BATCHES
    assert sub_batches_at(1) == 1 and sub_batches_at(8, oases=False) == 1
    # at degree 1 only an MoE model over EP > 1 splits (its all-to-alls); never off the Oases schedule
    assert sub_batches_at(1, expert_parallel=2) == SUB_BATCHES and sub_batches_at(1, oases=False, expert_parallel=2) == 1
    assert split_refusal(2) == split_refusal(4) == ""
    assert "--micro-batch-size 2 or 4" in split_refusal(3) and "--micro-batch-size 2," in split_refusal(1)
    assert recompute_boundaries(fine_grained=True, sequence_parallel=True, tp=2) == 3.5
    assert recompute_boundaries(fine_grained=False, sequence_parallel=True, tp=4) == 0.25
    # a one-rank collective keeps no output (the tape's saved_boundaries): at TP 1 the input only
    assert recompute_boundaries(fine_grained=True, tp=2) == 3
    assert recompute_boundaries(fine_grained=True, tp=1) == recompute_boundaries(fine_grained=False, tp=1) == 1


@pytest.mark.parametrize("micro_batch", [2, 3, 4])
def test_runtime_simulator_and_planner_agree_on_a_micro_batch(micro_batch):
    """Each accepts an even micro-batch and refuses micro-batch 3 with ``split_refusal``'s line."""
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.errors import ConfigError
    from megatron_oases.plan.cost_model import build_cost_model
    from megatron_oases.plan.graph import PlanError, PlanModel
    from megatron_oases.pricing.device_model import SimError
    from megatron_oases.sim.core.strategy import Strategy, check
    from megatron_oases.topology import Level, Topology
    from megatron_oases.run_config import run_config
    from megatron_oases.train_args import build_parser, validate_config

    why = split_refusal(micro_batch)

    def expect():
        return pytest.raises(Exception, match="^" + re.escape(why) + "$") if why else contextlib.nullcontext()
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--vocab-size", "128", "--micro-batch-size", str(micro_batch), "--global-batch-size",
            str(2 * micro_batch), "--tensor-model-parallel-size", "2", "--schedule", "oases"]
    with expect() as runtime:
        validate_config(run_config(build_parser().parse_args(argv)), world_size=2, cuda=False)
    model = GPTShape(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=128,
                     micro_batch_size=micro_batch)
    with expect() as sim:
        check(model, Strategy(tp=2, pp=1, dp=1, num_microbatches=2, schedule="oases"), 2)
    topo = Topology(name="flat", device="a100-80gb", levels=(Level(
        name="nvlink", size=2, scope="intra_node", p2p_bandwidth_GBps=100, group_bandwidth_GBps=100, latency_us=2),))
    plan = PlanModel(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, micro_batch_size=micro_batch,
                     tp=2, sub_batches=SUB_BATCHES)
    with expect() as planner:
        build_cost_model(plan, topology=topo, global_batch_size=2 * micro_batch)
    if why:
        assert (runtime.type, sim.type, planner.type) == (ConfigError, SimError, PlanError)
        # the stock executor (the planner's --sub-batches 1) takes any micro-batch
        build_cost_model(PlanModel(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                                   micro_batch_size=micro_batch, tp=2, sub_batches=1),
                         topology=topo, global_batch_size=2 * micro_batch)
