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


@pytest.mark.parametrize("flags, dtype", [(["--dtype", "bf16"], "bf16"), (["--dtype", "fp32"], "fp32"),
                                          (["--bf16", "--dtype", "bf16"], "bf16")])
def test_an_explicit_dtype_still_prices(flags, dtype):
    """``--dtype`` names a run not written as a launch."""
    assert sim_model(sim_parser().parse_args(["--topology", "dgx-a100", *MODEL, *flags])).dtype == dtype


def test_megatron_lm_has_no_fp32_flag():
    """What the refusal below rests on: Megatron-LM's own parser (built here; about 3 s, importing
    megatron.training) has ``--bf16`` and ``--fp16`` but no ``--fp32``."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    assert {"--bf16", "--fp16"} <= set(megatron._option_string_actions)
    assert "--fp32" not in megatron._option_string_actions


def test_fp32_is_refused_alike_by_every_front_end(capsys):
    """Megatron-LM has no ``--fp32`` (``test_megatron_lm_has_no_fp32_flag``): every front end
    refuses it with the one line of the flag table, naming the fix (drop it; sim and plan:
    ``--dtype fp32``). ``sim`` and ``profile`` took it as their own switch until issue 49."""
    import argparse

    from megatron_oases.flags import FLAGS
    from megatron_oases.megatron_lm.flags import add_flags
    from megatron_oases.plan.mesh_cli import _parser as mesh_parser
    from megatron_oases.sim.frontends.profile_cli import build_parser as profile_parser

    parsers = [train_parser(), sim_parser(), profile_parser(), plan_parser(), mesh_parser(),
               add_flags(argparse.ArgumentParser(allow_abbrev=False))]
    said = []
    for p in parsers:
        try:
            p.parse_args(["--fp32"])
        except SystemExit:  # argparse's error: usage, then the line
            said.append(capsys.readouterr().err.strip().splitlines()[-1])
        except Exception as e:  # noqa: BLE001 - plan's parser raises its one line
            said.append(str(e))
        else:
            said.append("accepted")
    want = "--fp32 " + FLAGS["fp32"].refusal
    assert "drop it" in want and "--dtype fp32" in want
    assert all(line.endswith(want) for line in said), said
