"""Rank functions for the description contract tests: run one layer of a backend through the
trainer's own model and record what the runtime really issues."""
from __future__ import annotations

import os


def layer_contract(argv: list[str], batch: int, seq: int, hidden: int):
    """Forward and backward of decoder layer 0 (of a 1-layer model built by ``train.setup``) under
    a ``CommCounter``: per pass the (kind, group size, payload bytes) of every collective, and
    the layer's parameter count on this rank. Under ``--sequence-parallel`` the layer's input is
    this rank's ``seq / t`` chunk of the sequence."""
    from megatron_oases.parallel.collectives import CommCounter, watch_torch_distributed

    watch_torch_distributed()  # Megatron's own all-gathers / reduce-scatters (sequence parallelism)
    _rebind_megatron_collectives()
    import torch

    from megatron_oases.parallel.layout import _unwrap
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    tr = setup(run_config(build_parser().parse_args(argv)))
    layer = _unwrap(tr.model[0]).decoder.layers[0]
    chunk = seq // layer.config.tensor_model_parallel_size if layer.config.sequence_parallel else seq
    x = torch.randn(chunk, batch, hidden, requires_grad=True)
    with CommCounter() as fwd:
        out = layer(x, attention_mask=None)[0]
    with CommCounter() as bwd:
        out.float().sum().backward()
    rows = lambda c: sorted((r.kind, r.group_size, r.payload_bytes) for r in c.records)  # noqa: E731
    params = sum(p.numel() for p in layer.parameters())
    return {"forward": rows(fwd), "backward": rows(bwd), "params": params,
            "rank": int(os.environ["RANK"])}


def _rebind_megatron_collectives() -> None:
    """Megatron binds ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` at import time; when
    it was imported before the watch was installed, point them at the watched functions."""
    import sys

    import torch.distributed as dist

    names = {"dist_all_gather_func": dist.all_gather_into_tensor,
             "dist_reduce_scatter_func": dist.reduce_scatter_tensor}
    for mod in [m for n, m in sys.modules.items() if n.startswith("megatron.core")]:
        for name, fn in names.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
