"""Rank functions for the ATP model tests (importable by the forkserver children)."""
from __future__ import annotations

import os

S, B, H = 8, 2, 32  # sequence, micro-batch, hidden
HEADS, VOCAB, LAYERS = 4, 128, 2


def norm_tensors(kind: str):
    """Full input, weight, bias and upstream gradient for the norm tests (same on every rank)."""
    import torch

    g = torch.Generator().manual_seed(["LayerNorm", "RMSNorm"].index(kind))
    x = torch.randn(S, B, H, generator=g) * 3 + 1.5
    w = torch.randn(H, generator=g)
    b = torch.randn(H, generator=g)
    up = torch.randn(S, B, H, generator=g)
    return x, w, b, up


def norm_cases(meshes):
    """ATPNorm forward/backward on every mesh and kind; returns this rank's local shards."""
    import types

    import torch

    from megatron_oases.layers.atp_norm import ATPNorm
    from megatron_oases.parallel.mesh import build_mesh_groups, shard_index
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    out = []
    for d1, d2 in meshes:
        mg = build_mesh_groups([list(range(d1 * d2))], d1, d2)
        for kind in ("LayerNorm", "RMSNorm"):
            cfg = types.SimpleNamespace(normalization=kind, params_dtype=torch.float32)
            norm = ATPNorm(cfg, H, 1e-5, mesh_groups=mg)
            x, w, b, up = norm_tensors(kind)
            idx = shard_index(x.shape, (None, None, 2), mg.coord, mg.mesh)
            with torch.no_grad():
                norm.weight.copy_(w[idx[-1]])
                if norm.bias is not None:
                    norm.bias.copy_(b[idx[-1]])
            x_local = x[idx].clone().requires_grad_()
            y = norm(x_local)
            (y * up[idx]).sum().backward()
            out.append({"mesh": (d1, d2), "kind": kind, "coord": mg.coord, "y": y.detach(),
                        "dx": x_local.grad, "dw": norm.weight.grad,
                        "db": None if norm.bias is None else norm.bias.grad,
                        "tmp": norm.weight.tensor_model_parallel})
    return out


def _config(tp: int, dropout: float = 0.0):
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=4 * H,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=dropout, attention_dropout=dropout, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)


def _batch():
    import torch

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool)).logical_not().view(1, 1, S, S)
    return tokens, labels, position_ids, mask


def _build(spec, tp: int, seed: int = 1234, dropout: float = 0.0):
    from megatron.core.models.gpt import GPTModel

    from megatron_oases.parallel.layout import tp_invariant_init_

    cfg = _config(tp, dropout)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=S, position_embedding_type="learned_absolute")
    tp_invariant_init_([model], seed=seed, init_method_std=cfg.init_method_std, num_layers=LAYERS)
    return model


def _loss_and_grads(model):
    """Mean LM loss of the fixed batch; gathered global grads (rank-identical dicts)."""
    from megatron_oases.parallel.layout import gather_global

    tokens, labels, position_ids, mask = _batch()
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    return float(loss.detach()), gather_global([model], what="grad"), gather_global([model], what="param")


def model_parity(meshes):
    """Stock local spec at TP=4 and the ATP spec at TP=4 per (d1, d2, chunks): loss, params, grads.
    (TP=1 is computed in the parent with the same global init.)"""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.layers.atp_spec import get_gpt_layer_atp_spec
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=120)
    ps.initialize_model_parallel(4, 1)
    model_parallel_cuda_manual_seed(1234)
    rank0 = int(os.environ["RANK"]) == 0
    results = {}
    torch.manual_seed(0)
    results["megatron"] = _loss_and_grads(_build(get_gpt_layer_local_spec(), 4))
    for d1, d2, chunks in meshes:
        torch.manual_seed(0)
        model = _build(get_gpt_layer_atp_spec(d1, d2, chunks), 4)
        results[f"atp{d1}x{d2}c{chunks}"] = _loss_and_grads(model)
    return results if rank0 else {k: v[0] for k, v in results.items()}


def dropout_parity(meshes):
    """Hidden and attention dropout 0.1 in training mode, same RNG states before each forward:
    the stock TP=4 model and the ATP model per mesh (ATP rank r owns Megatron TP rank r's heads,
    and the ATP bias-dropout-add draws the full-h mask), so losses and grads match on CPU."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.layers.atp_spec import get_gpt_layer_atp_spec
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=120)
    ps.initialize_model_parallel(4, 1)
    specs = {"megatron": get_gpt_layer_local_spec()}
    for d1, d2, chunks in meshes:
        specs[f"atp{d1}x{d2}c{chunks}"] = get_gpt_layer_atp_spec(d1, d2, chunks)
    results = {}
    for name, spec in specs.items():
        model_parallel_cuda_manual_seed(1234)
        model = _build(spec, 4, dropout=0.1)
        torch.manual_seed(99)
        model_parallel_cuda_manual_seed(99)
        loss, grads, _ = _loss_and_grads(model)
        results[name] = (loss, grads)
    return results


def single_rank_reference():
    """The TP=1 stock model with the same global init: loss, grads, params."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(0)
    return _loss_and_grads(_build(get_gpt_layer_local_spec(), 1))


def _train(spec, tp: int, steps: int):
    """``steps`` Adam steps through Megatron DDP, the schedule and finalize_model_grads (clip 1.0):
    per-step (loss, grad norm)."""
    import torch
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    torch.manual_seed(0)
    chunk = _build(spec, tp)
    config = chunk.config
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), chunk)
    model.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0,
                        params_dtype=torch.float32), [model], use_gloo_process_groups=True)
    config.finalize_model_grads_func = finalize_model_grads
    tokens, labels, position_ids, mask = _batch()

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(_, m):
        return m(tokens, position_ids, mask, labels=labels), loss_func

    out = []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=model,
            num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        out.append((float(losses[0]["lm loss"]), float(grad_norm)))
    return out


def train_parity(meshes, steps: int = 3):
    """Per-step (loss, grad norm) of the stock TP=4 model and the ATP model per mesh."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.layers.atp_spec import get_gpt_layer_atp_spec
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=120)
    ps.initialize_model_parallel(4, 1)
    model_parallel_cuda_manual_seed(1234)
    results = {"megatron": _train(get_gpt_layer_local_spec(), 4, steps)}
    for d1, d2, chunks in meshes:
        results[f"atp{d1}x{d2}c{chunks}"] = _train(get_gpt_layer_atp_spec(d1, d2, chunks), 4, steps)
    return results


def train_reference(steps: int = 3):
    """The TP=1 stock model trained the same way."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    return _train(get_gpt_layer_local_spec(), 1, steps)
