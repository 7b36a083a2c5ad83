"""``python -m megatron_oases.pretrain_gpt <Megatron-LM args> <our flags>``: Megatron-LM's GPT
pretraining with our backends and schedules, without patching a checkout.

The four things a GPT entry script hands to ``megatron.training.pretrain`` (forward step, dataset
provider, ``get_embedding_ranks``, stock model provider) come from

* the Megatron-LM checkout named by ``MEGATRON_LM_PATH`` (any supported tag, the installed
  megatron-core's MAJOR.MINOR): its own ``pretrain_gpt.py``, imported as a module; or
* without a checkout, from megatron-core 0.17 on (its wheel ships ``megatron.training``):
  ``megatron_lm.wheel_gpt``, where our ``ModelProvider`` builds every model.

We add our ``extra_args_provider`` and wrap the model provider (``megatron_lm.hooks.wrap_entry``),
then call ``pretrain`` the way the installed release takes it (``mcore_compat.run_pretrain``).
Arguments are parsed once up front, so ``--help`` and bad flags answer before any GPU work;
what our flags decide alone is refused even before torch and Megatron import
(``flags.early_refusal``). Without CUDA, ``runtime.cpu_training_compat`` lets ``pretrain`` run on
CPU + gloo ranks (installed by ``wrap_entry`` before the parse; flags that need CUDA-only
machinery are refused there, in one line).
"""
from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()

import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from megatron_oases.errors import ConfigError  # noqa: E402

PROG = "python -m megatron_oases.pretrain_gpt"
"""The command our errors and Megatron-LM's parser (``--help``, argparse's errors) name."""


def entry_objects(stock, cpu_layer: bool = False):
    """(model provider, extra_args_provider) built from a ``pretrain_gpt`` module: the
    checkout's, or ``wheel_gpt`` (no stock model provider); ``cpu_layer`` as ``wrap_entry``'s
    (the entry installs it; tests that only parse do not)."""
    from megatron_oases.megatron_lm.hooks import wrap_entry

    modelopt = stock.add_modelopt_args if getattr(stock, "has_nvidia_modelopt", False) else None
    stock_provider = (functools.partial(stock.model_provider, stock.gpt_builder)
                      if stock.model_provider is not None else None)
    return wrap_entry(stock_provider, modelopt, prog=PROG, cpu_layer=cpu_layer)


def stock_module():
    """The checkout's ``pretrain_gpt`` module, or ``wheel_gpt`` without ``MEGATRON_LM_PATH`` on
    megatron-core 0.17+; ConfigError (one line) otherwise."""
    from megatron_oases import mcore_compat
    from megatron_oases.megatron_lm.checkout import ENV, import_stock_pretrain_gpt

    checkout = bool(os.environ.get(ENV))
    if not checkout:
        import warnings

        with warnings.catch_warnings():  # megatron.core's import-time notes (Apex, TE): an
            warnings.simplefilter("ignore")  # error below is then the only line
            checkout = not mcore_compat.megatron_training_in_wheel()
    if checkout:  # ConfigError: not a (supported) checkout, or 0.16 without one
        return import_stock_pretrain_gpt()
    from megatron_oases.megatron_lm import wheel_gpt

    return wheel_gpt


def _error(message: str) -> int:
    if os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from megatron_oases.megatron_lm.flags import early_refusal

    refused = early_refusal(sys.argv[1:])  # before torch and Megatron import (20-30 s loaded)
    if refused:
        return _error(refused)
    try:
        stock = stock_module()
    except ConfigError as exc:
        return _error(str(exc))
    model_provider, extra_args_provider = entry_objects(stock, cpu_layer=True)  # CPU layer first

    from megatron.training.arguments import parse_args

    args = parse_args(extra_args_provider)  # --help, and our one-line errors (exit 2), before CUDA
    if hasattr(stock, "refusal") and stock.refusal(args):
        return _error(stock.refusal(args))
    from megatron_oases.describe.backends import backend
    from megatron_oases.run_config import run_config

    cfg = run_config(args)
    if backend(cfg.tp_backend).empty_local_params:  # the cube's ranks off its diagonal: empty vectors
        import megatron.training.training as training

        from megatron_oases.runtime.dist_ckpt import with_empty_params_local

        training.save_checkpoint = with_empty_params_local(training.save_checkpoint, 2)
        training.load_checkpoint = with_empty_params_local(training.load_checkpoint, 1)
    if cfg.use_distributed_optimizer and cfg.load is not None:
        import megatron.training.training as training

        from megatron_oases.runtime.dist_ckpt import with_torch_adam_state

        training.load_checkpoint = with_torch_adam_state(training.load_checkpoint)
    from megatron_oases.megatron_lm.checkout import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    from megatron.training import inprocess_restart, pretrain, set_startup_timestamps

    from megatron_oases import mcore_compat

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    stock.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    mcore_compat.run_pretrain(
        pretrain, datasets_provider=stock.train_valid_test_datasets_provider,
        model_provider=model_provider, forward_step=stock.forward_step,
        extra_args_provider=extra_args_provider,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        stock_model_config=model_provider.uses_stock, store=store,
        get_embedding_ranks=stock.get_embedding_ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
