"""megatron_oases.megatron_lm."""
