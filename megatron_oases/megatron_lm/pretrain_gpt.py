"""``python -m megatron_oases.pretrain_gpt <Megatron-LM args> <our flags>``: Megatron-LM's GPT
pretraining with our backends and schedules, without patching the checkout.

``MEGATRON_LM_PATH`` names a Megatron-LM checkout (tag core_v0.16.1). Its ``pretrain_gpt.py``
supplies the forward step, the dataset provider, ``get_embedding_ranks`` and the stock model
provider; we add our ``extra_args_provider`` and wrap the model provider
(``megatron_lm.hooks.wrap_entry``), then call ``megatron.training.pretrain`` as that script does.
Arguments are parsed once up front, so ``--help`` and bad flags answer before any GPU work.
Without CUDA, ``runtime.cpu_training_compat`` lets ``pretrain`` run on CPU + gloo ranks (flags
that need CUDA-only machinery are refused first, in one line).
"""
from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()

import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from megatron_oases.parallel.dims import ConfigError  # noqa: E402

PROG = "megatron_oases.pretrain_gpt"


def entry_objects(stock):
    """(model provider, extra_args_provider) built from the checkout's pretrain_gpt module."""
    from megatron_oases.megatron_lm.hooks import wrap_entry

    modelopt = stock.add_modelopt_args if getattr(stock, "has_nvidia_modelopt", False) else None
    return wrap_entry(functools.partial(stock.model_provider, stock.gpt_builder), modelopt)


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from megatron_oases.megatron_lm.checkout import import_stock_pretrain_gpt

    try:
        stock = import_stock_pretrain_gpt()
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    model_provider, extra_args_provider = entry_objects(stock)

    from megatron.training.arguments import parse_args

    args = parse_args(extra_args_provider)  # --help, and our one-line errors (exit 2), before CUDA
    import torch

    if not torch.cuda.is_available():
        from megatron_oases.runtime.cpu_training_compat import (
            check_cpu_training_args,
            install_cpu_training_compat,
        )

        problem = check_cpu_training_args(args)
        if problem:
            if os.environ.get("RANK", "0") == "0":
                print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
            return 2
        install_cpu_training_compat()
    from megatron_oases.megatron_lm.checkout import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain

    try:
        from megatron.training import set_startup_timestamps

        set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    except ImportError:
        pass
    stock.train_valid_test_datasets_provider.is_distributed = True
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    pretrain(
        stock.train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        stock.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=extra_args_provider,
        store=store,
        get_embedding_ranks=stock.get_embedding_ranks,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
