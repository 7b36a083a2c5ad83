"""megatron_oases: overlapped and planned tensor parallelism for Megatron-Core.

Layers of the package (dependencies point downwards):
cli / megatron_lm -> specs -> schedules / layers -> parallel -> runtime; plan and sim read topology.
"""

__version__ = "0.1.0"
