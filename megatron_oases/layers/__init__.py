"""megatron_oases.layers."""
