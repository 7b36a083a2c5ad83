"""megatron_oases.runtime."""
