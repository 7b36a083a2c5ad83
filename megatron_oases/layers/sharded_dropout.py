"""Hidden dropout on a shard of the tensor the stock layer would drop out.

When a layer holds one of ``shards`` equal slices of a dimension of Megatron's ``[s, b, h]``
hidden states (ATP: the hidden dim on mesh axis 2; a planned block's replica: the batch), a plain
bias-dropout-add would draw a mask for its slice from the default generator, which is equal on
all TP ranks, so every slice would get the *same* pattern. These helpers draw the mask of the
whole tensor (as the stock layer does) and keep this rank's slice: statistically right, and on
CPU bit-equal to the stock mask; the cost is ``shards`` times the random numbers of the slice.
"""
from __future__ import annotations

import torch


def sharded_bias_dropout_add_builder(dim: int, shards: int, index: int):
    """A ``get_bias_dropout_add`` replacement for hidden states holding slice ``index`` of
    ``shards`` along ``dim``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    def get_sharded_bias_dropout_add(training: bool, fused: bool):
        stock = get_bias_dropout_add(training, fused)

        def bias_dropout_add(x_with_bias, residual, prob: float):
            if not training or prob == 0.0 or shards == 1:
                return stock(x_with_bias, residual, prob)
            x, bias = x_with_bias
            x = x + bias if bias is not None else x
            local = x.shape[dim]
            shape = list(x.shape)
            shape[dim] = local * shards
            full = torch.empty(shape, dtype=x.dtype, device=x.device)
            keep = full.bernoulli_(1.0 - prob).narrow(dim, index * local, local)
            return residual + x * (keep / (1.0 - prob))  # torch's CPU dropout order

        return bias_dropout_add

    return get_sharded_bias_dropout_add
