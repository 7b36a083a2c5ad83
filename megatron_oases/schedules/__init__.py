"""megatron_oases.schedules."""
