"""The two objects a Megatron-LM entry script hands to ``pretrain``: our ``extra_args_provider``
and our model provider, each wrapping the stock one.

Used by ``python -m megatron_oases.pretrain_gpt`` and by the patched checkout
(``patches/core_v0.*``), so both launch paths behave the same::

    model_provider_fn, extra_args_fn = wrap_entry(partial(model_provider, gpt_builder),
                                                  add_modelopt_args if has_nvidia_modelopt else None)

Without a stock model provider (``None``: no checkout, ``megatron_lm.wheel_gpt``) our provider
builds stock runs too, with our ``megatron`` spec, so those are validated as one of our builds
(``flags.make_extra_args_provider(stock_model=False)``).
"""
from __future__ import annotations

from typing import Callable

from megatron_oases.megatron_lm.flags import make_extra_args_provider
from megatron_oases.megatron_lm.model_provider import ModelProvider


def wrap_entry(stock_model_provider: Callable | None,
               stock_extra_args_provider: Callable | None = None,
               prog: str | None = None, *, cpu_layer: bool = True,
               ) -> tuple[ModelProvider, Callable]:
    """(model provider, extra_args_provider) for ``megatron.training.pretrain``; ``prog``: the
    command the parser's errors name (``flags.make_extra_args_provider``). ``cpu_layer``: without
    CUDA, install the CPU training layer first (``install_cpu_layer``), so the patched checkout's
    ``pretrain_gpt.py`` trains on CPU ranks as our entry does, and have the parser refuse the
    CUDA-only flags; tests that only parse pass False."""
    on_cpu = cpu_layer and install_cpu_layer()
    return (ModelProvider(stock_model_provider),
            make_extra_args_provider(stock_extra_args_provider,
                                     stock_model=stock_model_provider is not None, prog=prog,
                                     on_cpu=on_cpu))


def install_cpu_layer() -> bool:
    """Without CUDA: ``runtime.cpu_training_compat`` (before Megatron-LM's ``validate_args`` asks
    the GPU its architecture and ``initialize_megatron`` asserts CUDA) and the installed wheel's
    prebuilt dataset helpers; returns whether installed. A no-op with CUDA."""
    import torch

    if torch.cuda.is_available():
        return False
    from megatron_oases.megatron_lm.checkout import use_prebuilt_dataset_helpers
    from megatron_oases.runtime.cpu_training_compat import install_cpu_training_compat

    use_prebuilt_dataset_helpers()
    return install_cpu_training_compat()
