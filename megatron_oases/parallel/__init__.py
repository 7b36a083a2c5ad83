"""megatron_oases.parallel."""
