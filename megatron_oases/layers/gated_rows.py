"""SwiGLU's fc1 on a backend that splits its output features: fc1 computes ``[gate; up]``
(Megatron's layout of the full weight, 2 x ffn rows), and a contiguous split of those rows would
give a rank gate rows without their up rows. Each part of the split instead holds
``[gate_i; up_i]`` (``gated_rows_order``), so ``silu(gate) * up`` needs no collective; the
checkpoint stores Megatron's layout (``gated_rows_factory``: two shards per parameter, merged
by concatenation on load), so it loads into stock TP. Used by ATP and the 3-D cube."""
from __future__ import annotations

import torch


def gated_rows_order(rows: int, parts: int) -> torch.Tensor:
    """Row order that puts a gated fc1's ``[gate; up]`` (``rows`` = 2f, Megatron's global
    layout) in mesh order: part i of ``parts`` holds ``[gate_i; up_i]`` (its own gate and up
    rows for the same features, so the activation needs no collective)."""
    f, per = rows // 2, rows // 2 // parts
    return torch.cat([torch.cat([torch.arange(i * per, (i + 1) * per),
                                 torch.arange(f + i * per, f + (i + 1) * per)])
                      for i in range(parts)])


def gated_rows_factory(key, value, sharded_offsets, split, replica_id):
    """A gated fc1 tensor whose local rows are ``[gate_i; up_i]``: two shards of Megatron's
    ``[gate; up]`` global tensor (as Megatron's ``apply_swiglu_sharded_factory``, also keeping the
    split of the other dim), merged back by concatenation on load."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    n_pre = len(sharded_offsets)
    (row_dim, i, parts), others = split[0], split[1:]
    assert row_dim == n_pre, "a gated tensor is split on its rows"

    def build(k, t, rid, flattened_range):
        gate, up = torch.chunk(t, 2, dim=0)
        return [ShardedTensor.from_rank_offsets(k, half, *sharded_offsets, (row_dim, i + j * parts, 2 * parts),
                                                *others, replica_id=rid, prepend_axis_num=n_pre)
                for j, half in enumerate((gate, up))]

    def merge(halves):
        with torch.no_grad():
            return torch.cat(halves)

    return ShardedTensorFactory(key, value, build, merge, replica_id)
