"""Synthetic, learnable GPT data that is identical for every parallel layout.

Sample ``i`` of iteration ``t`` depends only on (seed, t, i), so a TP=2 x PP=2 x DP=2 run sees
exactly the samples a single-rank run sees, split over data-parallel ranks. Each sequence is
x[k+1] = (x[k] + c) mod M with a per-sample step c and M = min(V, 97) tokens in use: a model
learns first which tokens occur, then to read c from the context, so the loss visibly falls.
"""
from __future__ import annotations

import torch


def synthetic_sample(seed: int, iteration: int, index: int, seq_length: int, vocab_size: int):
    """Tokens of length ``seq_length + 1`` (inputs and shifted labels) for one sample."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + iteration * 10_007 + index)
    modulus = min(vocab_size, 97)
    c = int(torch.randint(1, 8, (1,), generator=gen))
    x0 = int(torch.randint(0, modulus, (1,), generator=gen))
    seq = [x0]
    for _ in range(seq_length):
        seq.append((seq[-1] + c) % modulus)
    return torch.tensor(seq, dtype=torch.long)


def micro_batch_indices(*, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                        dp_size: int) -> list[range]:
    """Sample indices (within the global batch) of each micro-batch of this data-parallel rank:
    rank r takes the r-th contiguous block of ``global_batch_size / dp_size`` samples. Shared by
    the synthetic data and ``datasets.py`` so both split a global batch the same way."""
    per_rank = global_batch_size // dp_size
    first = dp_rank * per_rank
    return [range(first + m * micro_batch_size, first + (m + 1) * micro_batch_size)
            for m in range(per_rank // micro_batch_size)]


def micro_batches(*, seed: int, iteration: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int, seq_length: int, vocab_size: int, device):
    """The micro-batches this data-parallel rank processes in ``iteration`` (a list of dicts)."""
    out = []
    for idx in micro_batch_indices(global_batch_size=global_batch_size,
                                   micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                                   dp_size=dp_size):
        seqs = torch.stack([synthetic_sample(seed, iteration, i, seq_length, vocab_size) for i in idx])
        tokens, labels = seqs[:, :-1], seqs[:, 1:]
        out.append({
            "tokens": tokens.to(device),
            "labels": labels.to(device),
            "position_ids": torch.arange(seq_length, device=device).unsqueeze(0).expand_as(tokens),
            "loss_mask": torch.ones(tokens.shape, dtype=torch.float32, device=device),
        })
    return out
