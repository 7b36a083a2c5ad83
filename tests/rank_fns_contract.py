"""Rank functions for the description contract tests: run one layer of a backend through the
trainer's own model and record what the runtime really issues."""
from __future__ import annotations

import os


def layer_contract(argv: list[str], batch: int, seq: int, hidden: int):
    """Forward and backward of decoder layer 0 (of a 1-layer model built by ``train.setup``) under
    a ``CommCounter``: per pass the (kind, group size, payload bytes) of every collective, and
    the layer's parameter count on this rank."""
    import torch

    from megatron_oases.parallel.collectives import CommCounter
    from megatron_oases.parallel.layout import _unwrap
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    tr = setup(build_parser().parse_args(argv))
    layer = _unwrap(tr.model[0]).decoder.layers[0]
    x = torch.randn(seq, batch, hidden, requires_grad=True)
    with CommCounter() as fwd:
        out = layer(x, attention_mask=None)[0]
    with CommCounter() as bwd:
        out.float().sum().backward()
    rows = lambda c: sorted((r.kind, r.group_size, r.payload_bytes) for r in c.records)  # noqa: E731
    params = sum(p.numel() for p in layer.parameters())
    return {"forward": rows(fwd), "backward": rows(bwd), "params": params,
            "rank": int(os.environ["RANK"])}
