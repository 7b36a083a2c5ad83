"""Rank functions and fixtures' helpers for tests/test_datasets.py (Megatron-Core datasets)."""
from __future__ import annotations

import os


def make_token_dataset(prefix: str, *, num_docs: int, vocab_size: int, seed: int = 0) -> None:
    """Write PREFIX.bin/.idx with Megatron-Core's IndexedDatasetBuilder: ``num_docs`` documents
    of 20-80 tokens, each an arithmetic sequence x[k+1] = (x[k] + c) mod M (M = vocab - 1, a
    per-document step c in 1..7) ended by the end-of-document id vocab - 1. A model learns which
    tokens occur, then reads c from the context, so the loss visibly falls."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    modulus, eod = vocab_size - 1, vocab_size - 1
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for _ in range(num_docs):
        length, c, x = int(rng.integers(20, 81)), int(rng.integers(1, 8)), int(rng.integers(modulus))
        doc = [(x + c * k) % modulus for k in range(length)] + [eod]
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def write_documents(prefix: str, docs: list[list[int]], *, vocab_size: int) -> None:
    """Write PREFIX.bin/.idx holding ``docs`` as given (any ids, e.g. out of range), with the
    token type ``IndexedDatasetBuilder`` picks for ``vocab_size``."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for doc in docs:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def truncate(path: str, drop: int) -> None:
    """Cut the last ``drop`` bytes off ``path`` (a copy that stopped short)."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - drop)


def train_records(argv: list[str]):
    """Train with the reference trainer; the last rank's records (losses and validation)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    _, records = run(run_config(args))
    return records if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1 else None
