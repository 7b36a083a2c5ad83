"""megatron_oases.topology."""
