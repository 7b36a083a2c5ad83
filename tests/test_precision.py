"""One command line, one precision: ``sim``, ``plan`` and the trainer read a launch's ``--bf16`` /
``--fp16`` alike, and neither of them means fp32, as in Megatron-LM (``precision.priced_dtype``;
``sim`` and ``plan`` priced bf16 then until issue 49's session of 07:00 UTC)."""
from __future__ import annotations

import pytest

from megatron_oases.plan.plan_cli import build_parser as plan_parser
from megatron_oases.plan.plan_cli import model_from_args as plan_model
from megatron_oases.run_config import dtype_name, run_config
from megatron_oases.sim.frontends.cli import build_parser as sim_parser
from megatron_oases.sim.frontends.cli import model_from_args as sim_model
from megatron_oases.train_args import build_parser as train_parser

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--attention-backend", "local"]


@pytest.mark.parametrize("flags", [[], ["--bf16"], ["--fp16"]])
def test_sim_plan_and_trainer_price_what_the_launch_trains(flags):
    trained = dtype_name(run_config(train_parser().parse_args(MODEL + flags)))
    simulated = sim_model(sim_parser().parse_args(["--topology", "dgx-a100", *MODEL, *flags])).dtype
    planned = plan_model(plan_parser().parse_args(["--topology", "dgx-a100", *MODEL, *flags])).dtype
    assert simulated == planned == trained == (flags[0][2:] if flags else "fp32")


@pytest.mark.parametrize("flags, dtype", [(["--dtype", "bf16"], "bf16"), (["--fp32"], "fp32"),
                                          (["--bf16", "--dtype", "bf16"], "bf16")])
def test_an_explicit_dtype_still_prices(flags, dtype):
    """``--dtype`` (and ``sim``'s ``--fp32``) name a run not written as a launch."""
    assert sim_model(sim_parser().parse_args(["--topology", "dgx-a100", *MODEL, *flags])).dtype == dtype
