"""The CPU layer under Megatron-Core's MoE token dispatcher (``runtime.cpu_moe_compat``): the
upstream functions it wraps keep their signatures, and on gloo the uneven all-to-all, all-gather
and reduce-scatter it relies on give what NCCL's would."""
from __future__ import annotations

import inspect

import torch

from megatron_oases.runtime.cpu_moe_compat import WRAPPED


def test_wrapped_upstream_signatures_unchanged():
    import importlib

    expected = {"maybe_move_tensor_to_cpu": ["tensor", "as_numpy", "record_stream"],
                "_gather_along_first_dim": ["input_", "group", "output_split_sizes", "use_global_buffer"],
                "_reduce_scatter_along_first_dim": ["input_", "group", "input_split_sizes",
                                                    "use_global_buffer"]}
    for modname, name, _ in WRAPPED:
        fn = getattr(importlib.import_module(modname), name)
        fn = getattr(fn, "upstream", fn)  # installed in this process: the function it wraps
        assert list(inspect.signature(fn).parameters) == expected[name]


def uneven_collectives():
    """On 2 gloo ranks: Megatron's uneven gather / reduce-scatter and the dispatcher's all-to-all
    with host split sizes, as the layer installs them."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_oases.runtime import init_distributed, init_runtime
    from megatron_oases.runtime.cpu_moe_compat import install_cpu_moe_compat

    init_distributed(init_runtime("cpu"), timeout_s=60)
    install_cpu_moe_compat()
    rank, group = dist.get_rank(), dist.group.WORLD
    sizes = [2, 3]
    mine = torch.full((sizes[rank], 2), float(rank + 1))
    gathered = mappings._gather_along_first_dim(mine, group, sizes)
    full = torch.arange(10.0).reshape(5, 2) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, sizes)
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, rank + 1]), as_numpy=True)
    received = torch.empty(1 + rank + 1 if rank else 2, 1)
    send = torch.full((int(splits.sum()), 1), float(rank))
    out_splits = [1, 2] if rank else [1, 1]  # rank r receives splits[r] from each peer
    dist.all_to_all_single(received, send, out_splits, list(splits), group=group)
    return gathered, scattered, type(splits).__name__, received


def test_uneven_collectives_on_gloo(on_ranks):
    results = on_ranks(uneven_collectives, 2, timeout_s=60)
    expect_gather = torch.cat([torch.full((2, 2), 1.0), torch.full((3, 2), 2.0)])
    full = torch.arange(10.0).reshape(5, 2) * 3
    for rank, (gathered, scattered, kind, received) in enumerate(results):
        assert torch.equal(gathered, expect_gather)
        assert torch.equal(scattered, full[:2] if rank == 0 else full[2:])
        assert kind == "ndarray"
    assert results[0][3].flatten().tolist() == [0.0, 1.0]
    assert results[1][3].flatten().tolist() == [0.0, 1.0, 1.0]
