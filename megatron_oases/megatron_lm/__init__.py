"""Megatron-LM integration: our flags on its parser (``flags.extra_args_provider``), a model
provider for every backend and schedule (``model_provider.ModelProvider``), the entry
``python -m megatron_oases.pretrain_gpt`` and the hooks the patched checkout calls (``hooks``)."""
