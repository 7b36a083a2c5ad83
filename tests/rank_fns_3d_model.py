"""Rank functions for tests/test_tp3d_model.py: the 3-D GPT through the reference trainer."""
from __future__ import annotations

import os


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _memory(model) -> dict:
    """Per-rank numel of the decoder layers and the global region of every local layer shard."""
    from megatron_oases.parallel.layout import param_shards

    gpt = _unwrap(model[0])
    local = sum(p.numel() for n, p in gpt.named_parameters() if n.startswith("decoder.layers."))
    replicated = [n for n, p in gpt.named_parameters()
                  if n.startswith("decoder.layers.") and p.dim() == 2
                  and not hasattr(p, "cube_layout")]
    regions = {s.key: (s.global_shape, [(sl.start, sl.stop) for sl in s.index])
               for s in param_shards(model) if ".layers." in s.key}
    return {"layer_numel": local, "regions": regions, "non_cube_matrices": replicated}


def _gemm_bytes(model, args) -> dict:
    """Collectives of each linear's forward in decoder layer 0 (fresh input, no grad)."""
    import torch

    from megatron_oases.parallel.collectives import CommCounter

    layer = _unwrap(model[0]).decoder.layers[0]
    linears = {"qkv": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
               "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}
    out, handles = {}, []
    for name, lin in linears.items():
        counter = CommCounter()

        def pre(_m, _a, c=counter):
            c.__enter__()

        def post(_m, _a, _o, c=counter, name=name, lin=lin):
            c.__exit__(None, None, None)
            out[name] = {"in": lin.weight.global_shape[1], "out": lin.weight.global_shape[0],
                         "records": [(r.kind, r.group_size, r.payload_bytes, r.wire_bytes_per_rank)
                                     for r in c.records]}

        handles += [lin.register_forward_pre_hook(pre), lin.register_forward_hook(post)]
    torch.manual_seed(0)
    hidden = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size)
    with torch.no_grad(), CommCounter() as whole:
        layer(hidden_states=hidden, attention_mask=None)
    for h in handles:
        h.remove()
    out["layer_kinds"] = sorted({r.kind for r in whole.records})
    return out


def train_3d(argv: list[str], ckpt_dir: str | None = None, probe: bool = False):
    """Train with the trainer; return losses (last rank), grad norms, global params (rank 0) and,
    with ``probe``, memory and per-GEMM byte records; with ``ckpt_dir``, save a dist checkpoint
    there and load it back into this model."""
    import torch

    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    tr, records = run(run_config(args))
    params = gather_global(tr.model, what="param")
    rank = int(os.environ["RANK"])
    out = {"losses": [r["lm_loss"] for r in records],
           "grad_norms": [r["grad_norm"] for r in records], "params": params if rank == 0 else None}
    if probe:
        out["memory"] = _memory(tr.model)
        out["bytes"] = _gemm_bytes(tr.model, args)
    if ckpt_dir is not None:
        _save_checkpoint(_unwrap(tr.model[0]).sharded_state_dict(), ckpt_dir)
        reloaded = _load_checkpoint(tr.model, ckpt_dir)  # the 3-D load path, same model
        out["reload_equal"] = rank != 0 or all(torch.equal(reloaded[k], v)
                                               for k, v in params.items())
    return out


def _dist_checkpointing_on_cpu():
    """Megatron's dist_checkpointing on a CPU test rank (test-only shims, this process only).

    The trainer's CPU layer gives Megatron modules loaded at start-up a ``torch`` proxy that maps
    CUDA devices to the CPU; dist_checkpointing is loaded later, so it gets the same proxy here
    (it calls ``torch.cuda.current_device()`` / ``synchronize()``). Its async writer also collects
    results through a ``spawn`` Manager queue and writes from forked workers (test ranks are
    daemonic processes, which may not have children) and logs memory through psutil: buckets are
    written in this process with plain queues instead. Files and metadata are Megatron's own.
    """
    import queue
    import sys

    import torch
    from megatron.core import dist_checkpointing  # noqa: F401 - loads the package
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver  # noqa: F401

    proxy = sys.modules["megatron.core.utils"].torch
    if proxy is not torch:
        for name, module in list(sys.modules.items()):
            if name.startswith("megatron.core.dist_checkpointing") and \
                    getattr(module, "torch", None) is torch:
                module.torch = proxy
    writer = filesystem_async.FileSystemWriterAsync

    def write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue):
        results = {}
        for idx, bucket in enumerate(write_buckets):
            local, count = queue.Queue(), queue.Queue()
            count.put(idx)
            writer.write_preloaded_data(transform_list, idx, bucket, local, count, True,
                                        use_msc=use_msc)
            _, res = local.get()
            if isinstance(res, Exception):
                results = res
                break
            results[idx] = res
        global_results_queue.put(results)

    filesystem_async._results_queue = queue.Queue()
    filesystem_async._process_memory = lambda: 0
    writer.write_preloaded_data_multiproc = staticmethod(write_in_process)


def _save_checkpoint(sharded_state_dict, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    _dist_checkpointing_on_cpu()
    dist_checkpointing.save(sharded_state_dict, ckpt_dir)


def load_into_stock(argv: list[str], ckpt_dir: str):
    """Build the stock (``--tp-backend megatron``) model, load the checkpoint, return its global
    parameters (rank 0)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    tr = setup(run_config(args))
    params = _load_checkpoint(tr.model, ckpt_dir)
    return params if int(os.environ["RANK"]) == 0 else None


def _load_checkpoint(model, ckpt_dir: str) -> dict:
    """NaN every parameter, load ``ckpt_dir`` into ``model[0]``, return the global parameters."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_oases.parallel.layout import gather_global

    _dist_checkpointing_on_cpu()
    gpt = _unwrap(model[0])
    with torch.no_grad():
        for p in gpt.parameters():  # every value must really come from the checkpoint
            p.fill_(float("nan"))
    gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), ckpt_dir))
    return gather_global(model, what="param")
