"""One validated description of how ranks are split: world = TP x PP x DP.

Checked in ``__post_init__`` without any process group, so bad launches fail before
``init_process_group`` with one line that names the flag and the fix.
"""
from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the flag and the fix."""


def check_sizes(*, tp: int, pp: int, num_layers: int, hidden_size: int,
                num_attention_heads: int) -> None:
    """The degrees and model sizes ``ParallelDims`` splits are >= 1. Validation calls it before
    it derives anything from them (the default ``--ffn-hidden-size`` 4 x hidden, the query groups
    from the heads), so a bad size is named as the flag the user gave."""
    for flag, value in (("--tensor-model-parallel-size", tp),
                        ("--pipeline-model-parallel-size", pp),
                        ("--num-layers", num_layers), ("--hidden-size", hidden_size),
                        ("--num-attention-heads", num_attention_heads)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")


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
        if self.hidden_size % self.tp != 0:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by "
                f"--tensor-model-parallel-size {self.tp}; pick a hidden size that is a multiple of {self.tp}")
        if self.num_attention_heads % self.tp != 0:
            raise ConfigError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {self.tp}; use a multiple of {self.tp} heads")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size % self.tp != 0:
            raise ConfigError(
                f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                f"--tensor-model-parallel-size {self.tp}")
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
        per_step = micro_batch_size * self.dp
        if global_batch_size % per_step != 0:
            raise ConfigError(
                f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                f"{micro_batch_size} x data-parallel size {self.dp} = {per_step}")
        return global_batch_size // per_step
