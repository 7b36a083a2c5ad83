"""The Megatron-LM option table (``megatron_lm.options``) without a checkout: every
``TransformerConfig`` field of the installed megatron-core is classified, and refused options
stop a non-stock parse in one line. tests/test_megatron_lm_checkout.py walks the real parser."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_oases.megatron_lm import options
from megatron_oases.megatron_lm.flags import extra_args_provider
from tests.test_megatron_lm_flags import BASE, megatron_like_parser


def test_every_transformer_config_field_is_classified():
    from megatron.core.transformer import TransformerConfig

    classified = options.classes()  # raises on a name in two classes
    missing = [f.name for f in dataclasses.fields(TransformerConfig) if f.name not in classified]
    assert not missing, f"classify these in megatron_oases/megatron_lm/options.py: {missing}"


def test_gates_are_refused_or_checked():
    """A gated option is inert only while its gate stays off in our builds."""
    checked = {"transformer_impl", "context_parallel_size", "position_embedding_type"}
    for name, gate in options.GATED.items():
        assert gate in options.REFUSED or gate in checked, (name, gate)


def _parser():
    p = megatron_like_parser()
    p.add_argument("--window-size", default=None)
    p.add_argument("--add-qkv-bias", action="store_true")
    p.add_argument("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma",
                   action="store_true")
    p.add_argument("--softmax-type", default="vanilla")
    p.add_argument("--use-torch-fsdp2", action="store_true")
    p.add_argument("--use-megatron-fsdp", action="store_true")
    return extra_args_provider(p)


@pytest.mark.parametrize("run, extra, refused", [
    (["--schedule", "oases"], ["--window-size", "64,0"], "--window-size"),
    (["--schedule", "oases"], ["--softmax-type", "learnable"], "--softmax-type"),
    (["--schedule", "oases"], ["--softmax-type", "vanilla"], None),  # the default, set: fine
    (["--schedule", "oases"], ["--add-qkv-bias"], None),  # Megatron's SelfAttention, called whole
    (["--tp-backend", "atp", "--atp-mesh", "2,2"], ["--add-qkv-bias"], "--add-qkv-bias"),
    (["--tp-backend", "atp", "--atp-mesh", "2,2"], ["--apply-layernorm-1p"], None),
    (["--tp-backend", "3d"], ["--apply-layernorm-1p"], "--apply-layernorm-1p"),
    ([], ["--window-size", "64,0", "--add-qkv-bias"], None),  # stock: Megatron-LM's own layers
    (["--schedule", "oases"], ["--use-torch-fsdp2"], "--use-torch-fsdp2"),
    (["--tp-backend", "atp", "--atp-mesh", "2,2"], ["--use-megatron-fsdp"], "--use-megatron-fsdp"),
    ([], ["--use-torch-fsdp2"], None),  # stock: Megatron-LM's own FSDP, its own checks (GPU)
])
def test_refused_only_where_a_build_drops_it(run, extra, refused, capsys, monkeypatch):
    world = 8 if "3d" in run else 4
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    argv = BASE + ["--tensor-model-parallel-size", str(world), *run, *extra]
    if refused is None:
        _parser().parse_args(argv)
        return
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"does not support {refused}" in err[0], err


def test_builds_of():
    from megatron_oases.run_config import RunConfig

    assert options.builds_of(RunConfig(schedule="oases", oases_plan=None, tp_backend="atp")) == {"oases", "atp"}
    assert options.builds_of(RunConfig(schedule="default", oases_plan="p.json",
                                       tp_backend="megatron")) == {"plan"}


def _backend_parser():
    from megatron.core.transformer.enums import AttnBackend

    p = megatron_like_parser()
    # Megatron-LM's own definitions (megatron.training.arguments, 0.16-0.19)
    p.add_argument("--attention-backend", type=lambda name: AttnBackend[name],
                   default=AttnBackend.auto)
    p.add_argument("--spec", type=str, default=None, nargs="*")
    return extra_args_provider(p)


@pytest.mark.parametrize("extra, refused", [
    (["--attention-backend", "flash"], None),  # CPU here: torch's CPU kernels
    (["--attention-backend", "unfused"], None),
    (["--attention-backend", "local", "--spec", "local"], None),
    (["--attention-backend", "local"], "add --spec local"),  # Megatron-LM would assert
    (["--spec", "my.module", "my_spec"], "does not support --spec"),
])
def test_attention_backend_is_honoured_or_refused(extra, refused, capsys, monkeypatch):
    """``--attention-backend`` picks our builds' core attention (no longer gated by
    ``--transformer-impl``); ``--spec local`` (which Megatron-LM wants with ``local``) passes."""
    from megatron_oases.run_config import run_config

    assert options.classes()["attention_backend"] == "model"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    argv = BASE + ["--tensor-model-parallel-size", "4", "--schedule", "oases", *extra]
    if refused is None:
        args = _backend_parser().parse_args(argv)
        assert run_config(args).attention_backend == (extra[1] if extra[0] != "--spec" else "auto")
        return
    with pytest.raises(SystemExit):
        _backend_parser().parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and refused in err[0], err


@pytest.mark.parametrize("flag", ["--use-torch-fsdp2", "--use-megatron-fsdp"])
def test_fsdp_is_refused_on_cpu(flag):
    """A stock run with a checkout keeps Megatron-LM's FSDP, which needs CUDA: on CPU the entry
    refuses it in one line rather than at Megatron's asserts or the missing NVIDIA driver."""
    from megatron_oases.run_config import run_config
    from megatron_oases.runtime.cpu_training_compat import cpu_training_refusal

    args = _parser().parse_args(BASE + [flag])
    problem = cpu_training_refusal(run_config(args).megatron_lm)
    assert problem.startswith(f"{flag} shards the model") and "\n" not in problem, problem
    assert problem.endswith("it needs CUDA (this run is on CPU): drop it"), problem
