"""megatron_oases.plan."""
