"""Functions that tests run on spawned gloo ranks (importable by the forkserver children)."""
from __future__ import annotations

import os


def train_and_gather(argv: list[str]):
    """Train with the reference trainer; return losses (last rank) and global params/grads."""
    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    tr, records = run(run_config(args))
    params = gather_global(tr.model, what="param")
    rank = int(os.environ["RANK"])
    return {"losses": [r["lm_loss"] for r in records], "params": params if rank == 0 else None}


def init_only(argv: list[str]):
    """Build the model (TP/PP-invariant init) and return the global parameters on rank 0."""
    from megatron_oases.parallel.layout import gather_global
    from megatron_oases.run_config import run_config
    from megatron_oases.train import setup
    from megatron_oases.train_args import build_parser

    args = build_parser().parse_args(argv)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    tr = setup(run_config(args))
    params = gather_global(tr.model, what="param")
    return params if int(os.environ["RANK"]) == 0 else None


def dropout_forward_vs_recompute():
    """Dropout under Megatron's RNG tracker inside full recompute: the recomputed mask must equal
    the forward mask, so checkpointed and plain gradients agree exactly."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_oases.runtime import init_distributed, init_runtime

    rt = init_runtime("cpu")
    init_distributed(rt, timeout_s=60)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)

    w = torch.randn(16, 16, requires_grad=True)

    def block(x):
        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x @ w, p=0.5, training=True)

    x = torch.randn(4, 16, requires_grad=True)
    state = get_cuda_rng_tracker().get_states()
    cpu_state = torch.get_rng_state()
    plain = block(x)
    plain.sum().backward()
    g_plain = w.grad.clone()
    w.grad = None
    get_cuda_rng_tracker().set_states(state)
    torch.set_rng_state(cpu_state)
    ckpt = tensor_parallel.checkpoint(block, False, x)
    ckpt.sum().backward()
    same_out = torch.equal(plain, ckpt)
    mask_fraction = float((plain == 0).float().mean())
    # Forking twice from the same tracker state gives the same mask; a fresh fork gives another.
    return {"same_out": same_out, "same_grad": torch.equal(g_plain, w.grad),
            "zero_fraction": mask_fraction}


def global_memory_buffer_on_cpu():
    import torch
    from megatron.core import parallel_state as ps

    from megatron_oases.runtime import init_distributed, init_runtime

    rt = init_runtime("cpu")
    init_distributed(rt, timeout_s=60)
    ps.initialize_model_parallel(1, 1)
    buf = ps.get_global_memory_buffer().get_tensor((4, 4), torch.float32, "test")
    return str(buf.device)


def raise_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom on rank one")
    return "fine"


def hang_on_rank_zero():
    import time

    if int(os.environ["RANK"]) == 0:
        time.sleep(60)
    return "done"


def env_rank():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def collectives_pairs():
    """Each collective's forward and backward against the dense single-process result."""
    import torch
    import torch.distributed as dist

    from megatron_oases.parallel import collectives as C
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    rank, n, g = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    torch.manual_seed(0)
    full = torch.randn(4 * n, 6)  # the same on every rank
    mine = full.chunk(n, 0)[rank]
    checks = {}
    with C.CommCounter() as counter:
        x = mine.clone().requires_grad_()
        y = C.all_gather_dim(x, 0, g)
        (y * (rank + 1)).sum().backward()  # per-rank upstream grads -> reduce-scatter sums them
        checks["gather_fwd"] = torch.equal(y, full)
        checks["gather_bwd"] = torch.allclose(x.grad, torch.full_like(x, n * (n + 1) / 2))
        x = full.clone().requires_grad_()
        y = C.reduce_scatter_dim(x, 0, g)
        y.sum().backward()
        checks["rs_fwd"] = torch.allclose(y, n * mine)
        checks["rs_bwd"] = torch.allclose(x.grad, torch.ones_like(full))
        x = full.clone().requires_grad_()
        y = C.reduce_from_group(C.copy_to_group(x, g), g)
        y.sum().backward()
        checks["fg_fwd"] = torch.allclose(y, n * full)
        checks["fg_bwd"] = torch.allclose(x.grad, n * torch.ones_like(full))
        x = full.clone().requires_grad_()
        y = C.split_dim(x, 1, g if 6 % n == 0 else None) if 6 % n == 0 else None
        if y is not None:
            C.gather_dim(y, 1, g).sum().backward()
            checks["split_gather"] = torch.allclose(x.grad, torch.ones_like(full))
    checks["kinds"] = sorted({r.kind for r in counter.records})
    checks["ag_payload"] = [r.payload_bytes for r in counter.records if r.kind == "all_gather"][0]
    return checks


def megatron_layer_collectives(tp: int, sequence_parallel: bool):
    """Run one real Megatron-Core TransformerLayer forward + backward with TP and record every
    collective torch.distributed sees (kind, bytes), per pass."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    ps.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            bias_activation_fusion=False, masked_softmax_fusion=False,
                            bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                            persist_layer_norm=False)
    layer = build_module(get_gpt_layer_local_spec(), config=cfg, layer_number=1)
    seen = []
    originals = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor",
                                                "reduce_scatter_tensor", "_all_gather_base",
                                                "_reduce_scatter_base")
                 if hasattr(dist, n)}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            t = args[0] if name == "all_reduce" else (args[1] if "reduce_scatter" in name else args[0])
            kind = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "_all_gather_base": "all_gather"}.get(name, "reduce_scatter")
            seen.append((phase[0], kind, t.numel() * t.element_size()))
            return fn(*args, **kwargs)
        return wrapped

    phase = ["forward"]
    for n, fn in originals.items():
        setattr(dist, n, spy(n, fn))
    try:
        s, b = 8, 2
        s_local = s // tp if sequence_parallel else s
        x = torch.randn(s_local, b, 16, requires_grad=True)
        out = layer(x, attention_mask=None)[0]
        phase[0] = "backward"
        out.sum().backward()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return seen


def watched_torch_distributed():
    """``watch_torch_distributed``: direct torch.distributed calls (as Megatron makes them) are
    recorded once, ours not twice; timed handles still wait."""
    import torch
    import torch.distributed as dist

    from megatron_oases.parallel import collectives as C
    from megatron_oases.runtime import init_distributed, init_runtime

    C.watch_torch_distributed(timed=True)
    init_distributed(init_runtime("cpu"), timeout_s=60)
    n = dist.get_world_size()
    x = torch.ones(8)
    with C.CommCounter() as c:
        dist.all_reduce(x)                          # Megatron-style: recorded by the watcher
        C.all_reduce(x, dist.group.WORLD)           # ours: recorded once, by this module
        outs = [torch.empty(8) for _ in range(n)]
        dist.all_gather(outs, x)                    # list form: one record, full output size
        work = dist.all_reduce(x, async_op=True)
        work.wait()
    return {"records": [(r.kind, r.group_size, r.payload_bytes, r.wire_bytes_per_rank)
                        for r in c.records],
            "by_kind": c.by_kind(), "blocked": c.blocked_s, "x": x.tolist()}


def first_loss(argv: list[str]) -> float | None:
    """Train ``--train-iters`` steps with the reference trainer; the first loss (last rank)."""
    from megatron_oases.run_config import run_config
    from megatron_oases.train import run
    from megatron_oases.train_args import build_parser

    _, records = run(run_config(build_parser().parse_args(argv)))
    return records[0]["lm_loss"] if records else None
