"""Process-group layout: validated parallel degrees and (later) mesh / cube / per-block groups."""
from megatron_oases.parallel.dims import ConfigError, ParallelDims

__all__ = ["ConfigError", "ParallelDims"]
