"""megatron_oases.sim."""
