"""One validated description of how ranks are split: world = TP x PP x DP.

Checked in ``__post_init__`` without any process group, so bad launches fail before
``init_process_group`` with one line that names the flag and the fix.
"""
from __future__ import annotations

import dataclasses

from megatron_oases.describe.megatron_1d import tp_split_refusal
from megatron_oases.describe.shapes import batch_split_refusal
from megatron_oases.errors import ConfigError


def check_sizes(*, tp: int, pp: int, num_layers: int, hidden_size: int,
                num_attention_heads: int) -> None:
    """The degrees and model sizes ``ParallelDims`` splits are >= 1. Validation calls it before
    it derives anything from them (the default ``--ffn-hidden-size`` 4 x hidden, the query groups
    from the heads), so a bad size is named as the flag the user gave."""
    from megatron_oases.flags import option

    for dest, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("num_layers", num_layers), ("hidden_size", hidden_size),
                        ("num_attention_heads", num_attention_heads)):
        if value < 1:
            raise ConfigError(f"{option(dest)} must be >= 1 (got {value})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of parallelism and the model shape facts that must divide by them."""

    world_size: int
    """Number of ranks (``--nproc-per-node`` x nodes, or WORLD_SIZE under torchrun)."""
    tp: int = 1
    """``--tensor-model-parallel-size``."""
    pp: int = 1
    """``--pipeline-model-parallel-size``."""
    vp: int | None = None
    """Virtual pipeline stages per rank (from ``--num-layers-per-virtual-pipeline-stage``)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None

    def __post_init__(self):
        check_sizes(tp=self.tp, pp=self.pp, num_layers=self.num_layers,
                    hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads)
        if self.world_size % (self.tp * self.pp) != 0:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tp} x --pipeline-model-parallel-size {self.pp} = {self.tp * self.pp}; "
                f"launch a multiple of {self.tp * self.pp} ranks or change TP/PP")
        refused = tp_split_refusal(tp=self.tp, hidden=self.hidden_size, heads=self.num_attention_heads,
                                   ffn=self.ffn_hidden_size)
        if refused:
            raise ConfigError(refused)
        stages = self.pp * (self.vp or 1)
        if self.num_layers % stages != 0:
            what = (f"--pipeline-model-parallel-size {self.pp}" if not self.vp else
                    f"--pipeline-model-parallel-size {self.pp} x {self.vp} virtual stages")
            raise ConfigError(
                f"--num-layers {self.num_layers} is not divisible by {what} = {stages}; "
                f"use a multiple of {stages} layers")
        if self.vp is not None and self.pp < 2:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs "
                              "--pipeline-model-parallel-size >= 2")

    @property
    def dp(self) -> int:
        """Data-parallel degree, what is left of the world after TP and PP."""
        return self.world_size // (self.tp * self.pp)

    def check_batch(self, micro_batch_size: int, global_batch_size: int) -> int:
        """Number of micro-batches per rank per step; raises when the global batch does not split."""
        if micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be >= 1 (got {micro_batch_size})")
        refused = batch_split_refusal(global_batch=global_batch_size, micro_batch=micro_batch_size, dp=self.dp)
        if refused:
            raise ConfigError(refused)
        return global_batch_size // (micro_batch_size * self.dp)
