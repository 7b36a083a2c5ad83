"""Process-group layout: validated parallel degrees and the mesh / cube / per-block groups."""
from megatron_oases.parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
