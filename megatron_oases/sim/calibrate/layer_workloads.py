"""Compute events of a Megatron 1-D TP layer, timed on a real Megatron-Core layer.

One rank of a TP-t layer computes what a TP-1 layer with a/t heads (kv_channels h/a) and an f/t
FFN computes, minus the collectives. So the profiler builds that TP-1 layer through the
trainer's own config and spec (``specs.transformer_config_from_args``, ``specs.layer_spec``: its
fusion settings, and the event's core attention, ``dims['attn']``, see ``core_attention_backend``),
with the event's dropout rates, dtype and layer variant (GQA, SwiGLU, RMSNorm, bias, QK-norm, and
under RoPE the rotary table GPTModel hands its layers), on a private one-rank process group, and
times its pieces as the trainer runs them. Synthetic torch ops (``sim.calibrate.workloads``) miss
dropout and Megatron's module work (bias adds, views, the RNG-tracker fork): on this CPU (one
thread, b 4, TP-2 shapes) a real layer cost 14% more than they do at dropout 0.1 and 5% at
dropout 0; through the Oases executor 23% and 15%.

Events (the segmentation ``describe/megatron_1d.py`` uses: each block starts with the residual
add it follows):

* ``attention``: the previous block's bias-dropout-add, the input norm, self-attention
  (QKV, core attention with its dropout, proj); ``mlp``: bias-dropout-add, the pre-MLP norm,
  fc1, activation, fc2;
* ``<block>.bwd``: their backward;
* ``attention.core``: the layer's core attention forward alone (Megatron's ``DotProductAttention``
  or the SDPA module the run's ``--attention-backend`` selects, with grad on, as selective
  recompute reruns it in backward before the attention's backward);
* ``<block>.wgrad``: the weight gradient of the block's column-parallel linear (QKV / fc1) alone,
  Megatron's ``grad_output.t() @ input``: stock Megatron computes it while the input-gradient
  all-reduce is in flight (the simulator overlaps the two).

``dims['sp']`` (sequence parallelism): the residual-side tensors (block inputs, bias-dropout-add,
norms) are this rank's s/t tokens and the linears take an all-gathered ``[s, b, h]`` norm output
(the all-gather and reduce-scatter are collective events): the same Local steps on SP's shapes.
The column weight gradient is the same GEMM on all s tokens as without SP.

``dims['exec']``, the executor as the trainer's ``--schedule`` names it: ``default`` runs the pieces under plain autograd (``TransformerLayer.forward``);
``oases`` runs each piece as the Oases executor runs a ``Local`` step: detached leaves, the
sub-batch's slice of the micro-batch dropout masks, ``torch.autograd.grad`` into inputs and
parameters, and the bytes of the executor's per-sub-batch parameter-gradient sum and delivery
(two half-size adds per gradient: one add each, every second sub-batch). Profile plans written
before the executor took the trainer's names say ``stock`` for ``default`` and still run.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ...describe.core_attention import attention_backend_of, attention_kernels_refusal
from ...describe.split import SUB_BATCHES
from ...pricing.device_model import SimError
from ...run_config import SCHEDULES

LAYER_EVENTS = ("attention", "mlp", "attention.bwd", "mlp.bwd", "attention.wgrad", "mlp.wgrad", "attention.core")
OLD_SCHEDULE_NAMES = {"stock": "default"}
"""``dims['exec']`` values of profile plans written before the executor took the trainer's names."""
_PIECES = {"attention": ("bda", "ln1", "attention"), "mlp": ("bda_ln2", "mlp")}
"""Tape steps (``schedules.oases.tape``) behind each block event, in order."""
def core_attention_backend(d: dict) -> str:
    """The ``--attention-backend`` an event's layer is built with: the inverse of the flags' mapping
    (``describe.core_attention.attention_backend_of``) on the event's core attention kind
    (``dims['attn']``, ``describe.event_key.attention_tag``; absent: ``local``) and, for a fused
    one, its kernels (``dims['sdpa']``; absent: ``auto``, torch's choice, which also stands for
    Transformer Engine's and flash-attn's kernels)."""
    kind, kernels = str(d.get("attn", "local")), str(d.get("sdpa", "auto"))
    if attention_kernels_refusal(kind, kernels):
        raise SimError(f"event dims: {attention_kernels_refusal(kind, kernels)}")
    return attention_backend_of(kind, kernels)


def single_rank_backend(device: str) -> str:
    """The one-rank world's backend on ``device`` (a torch device string): gloo for CPU tensors,
    and NCCL for CUDA ones where the device is a GPU."""
    return "cpu:gloo,cuda:nccl" if str(device).startswith("cuda") else "gloo"


@contextlib.contextmanager
def single_rank_world(device: str = "cpu"):
    """A one-rank world while none exists: Megatron-Core's linears take their process group only
    when ``torch.distributed`` is initialised (the profiling ranks already have a world). On a
    ``cuda`` device its CUDA tensors go through NCCL (``single_rank_backend``): the trainer's
    gradient all-reduce in the loop-overhead runs is one (gloo refuses CUDA tensors there)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group(single_rank_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tp1_layer(d: dict, device: torch.device, dtype: torch.dtype):
    """The TP-1 TransformerLayer doing one TP-t rank's local work, on a private one-rank group."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from ...run_config import RunConfig
    from ...runtime import init_runtime
    from ...specs import layer_spec, transformer_config_from_args

    if not dist.is_initialized():
        raise SimError("layer workloads need torch.distributed initialised (wrap them in single_rank_world())")
    init_runtime(device.type)
    h, a, f, t = (int(d[k]) for k in ("h", "a", "f", "t"))
    variant = variant_of(d)
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    one = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    # the trainer's config and spec (specs.py: its fusion choices, the run's core attention) for
    # one layer with this rank's heads and FFN; kv_channels stays the model's h / a
    run = RunConfig(num_layers=1, hidden_size=h, num_attention_heads=a // t, ffn_hidden_size=f // t,
                    group_query_attention=variant.query_groups is not None,
                    num_query_groups=variant.query_groups // t if variant.query_groups else None,
                    swiglu=variant.gated, add_bias_linear=variant.bias, normalization=variant.normalization,
                    qk_layernorm=variant.qk_norm, hidden_dropout=float(d.get("hd", 0.0)),
                    attention_dropout=float(d.get("ad", 0.0)), bf16=dtype == torch.bfloat16,
                    fp16=dtype == torch.float16, attention_backend=core_attention_backend(d))
    config = dataclasses.replace(transformer_config_from_args(run, cuda=device.type == "cuda"), kv_channels=h // a)
    spec = layer_spec(run)
    layer = build_module(spec, config=config, layer_number=1,
                         pg_collection=ProcessGroupCollection(tp=one, cp=one, pp=one))
    return layer.to(device=device, dtype=dtype).train()


def _rotary_table(d: dict, device: torch.device):
    """The rotary embeddings ``[s, 1, 1, dim]`` GPTModel hands every layer under RoPE (Megatron's
    ``RotaryEmbedding``; the base changes the values, not the work), else None."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    variant = variant_of(d)
    if not variant.rotary:
        return None
    rope = RotaryEmbedding(kv_channels=int(d["h"]) // int(d["a"]), rotary_percent=variant.rotary_percent,
                           use_cpu_initialization=device.type == "cpu")
    return rope(int(d["s"])).to(device)


def _with_memory_buffer(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with a Megatron global memory buffer of its own in place while it runs (Megatron's
    attention core takes its score buffer from there; ``initialize_model_parallel`` later in the
    process must still find none)."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    mine = GlobalMemoryBuffer()

    def run():
        before = parallel_state._GLOBAL_MEMORY_BUFFER
        parallel_state._GLOBAL_MEMORY_BUFFER = before or mine
        try:
            return fn()
        finally:
            parallel_state._GLOBAL_MEMORY_BUFFER = before
    return run


def variant_of(d: dict):
    """The layer variant an event's dims name (``describe.event_key.layer_shape`` adds them)."""
    from ...describe.ops import GPT2, LayerVariant

    if "groups" not in d:
        return GPT2
    groups, rope = int(d["groups"]), float(d.get("rope", 0.0))
    return LayerVariant(query_groups=groups if groups != int(d["a"]) else None, gated=bool(int(d["gated"])),
                        normalization=str(d["norm"]), bias=bool(int(d["bias"])), rotary=rope > 0,
                        rotary_percent=rope or 1.0, qk_norm=bool(int(d.get("qkn", 0))))


def _wgrad(name: str, d: dict, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """Megatron's weight gradient of the QKV / fc1 linear (``LinearWithGradAccumulationAndAsync
    Communication.backward`` without gradient-accumulation fusion)."""
    b, s, h, a, f, t = (int(d[k]) for k in ("b", "s", "h", "a", "f", "t"))
    variant = variant_of(d)
    out = (variant.qkv_rows(h, a) if name == "attention.wgrad" else variant.fc1_rows(f)) // t
    g = torch.Generator(device="cpu").manual_seed(0)
    grad_output = torch.randn(s * b, out, generator=g).to(device=device, dtype=dtype)
    total_input = torch.randn(s * b, h, generator=g).to(device=device, dtype=dtype)

    def wgrad():
        grad_output.t().matmul(total_input)
        grad_output.sum(dim=0)  # the bias gradient
    return wgrad


def _core_attention(d: dict, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """The real layer's core attention forward on this rank's queries, keys and values, building
    its graph as the recompute of a checkpointed core attention does."""
    b, s, h, a, t = (int(d[k]) for k in ("b", "s", "h", "a", "t"))
    variant = variant_of(d)
    layer = _tp1_layer(d, device, dtype)
    attn = layer.self_attention
    head_dim, heads = h // a, a // t
    groups = (variant.query_groups or a) // t
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(s, b, n, head_dim, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for n in (heads, groups, groups))
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)

    def core():
        with torch.enable_grad():
            return attn.core_attention(q, k, v, mask, attn_mask_type=attn.attn_mask_type)
    return _with_memory_buffer(core)


def megatron_layer_workload(name: str, d: dict, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """A no-argument function running compute event ``name`` of a Megatron 1-D layer once."""
    if name not in LAYER_EVENTS:
        raise SimError(f"no Megatron layer workload for {name!r} (known: {', '.join(LAYER_EVENTS)})")
    if name.endswith(".wgrad"):
        return _wgrad(name, d, device, dtype)
    if name == "attention.core":
        return _core_attention(d, device, dtype)
    from ...schedules.oases.dropout import MicroBatchMasks, active_sub_batch
    from ...schedules.oases.tape import BlockInputs, Local, megatron_layer_tape

    schedule = str(d.get("exec", "default"))
    schedule = OLD_SCHEDULE_NAMES.get(schedule, schedule)
    if schedule not in SCHEDULES:
        raise SimError(f"layer workload executor (dims exec) must be one of {', '.join(SCHEDULES)} (got {schedule!r})")
    b, s, h = int(d["b"]), int(d["s"]), int(d["h"])
    sp = bool(int(d.get("sp", 0)))
    chunk = s // int(d["t"]) if sp else s  # the residual side's tokens (sequence parallelism)
    layer = _tp1_layer(d, device, dtype)
    steps = {st.name: st for st in megatron_layer_tape(layer, 0).steps if isinstance(st, Local)}
    block = name.split(".")[0]
    pieces = [steps[p] for p in _PIECES[block]]
    params = [p for p in layer.parameters() if p.requires_grad]
    g = torch.Generator(device="cpu").manual_seed(0)
    env = {n: torch.randn(chunk, b, h, generator=g).to(device=device, dtype=dtype)
           for n in ("x", "h1", "mlp_sum", "attn_sum")}
    inputs = BlockInputs(attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1),
                         rotary_pos_emb=_rotary_table(d, device))
    oases = schedule == "oases"
    gathered = {n: torch.randn(s, b, h, generator=g).to(device=device, dtype=dtype) for n in ("ln1", "ln2")}

    def dropout_scope():
        # the executor's sub-batch 0 of the Oases split (describe.split; masks drawn at full size)
        masks = MicroBatchMasks([b] * SUB_BATCHES)
        return active_sub_batch(masks, 0, recompute=False) if oases else contextlib.nullcontext()

    def forward() -> list[tuple[dict, dict]]:
        """The block's pieces in order; per piece (input leaves, outputs) for the backward."""
        local = {n: v.requires_grad_() for n, v in env.items()} if not oases else dict(env)
        graphs = []
        with dropout_scope(), torch.enable_grad():
            for st in pieces:
                ins = {n: local[n].detach().requires_grad_() if oases else local[n] for n in st.inputs}
                got = st.fn(ins, inputs)
                graphs.append((ins, got))
                local.update({k: v.detach() for k, v in got.items()} if oases else got)
                if sp:  # the all-gathered norm output the linears take (the gather is a collective event)
                    local.update({k: gathered[k].requires_grad_(not oases) for k in got if k in gathered})
                if "y" in got:  # the previous layer's output is this layer's input
                    local["x"] = local["y"]
        return graphs

    if not name.endswith(".bwd"):
        return _with_memory_buffer(forward)
    graphs = _with_memory_buffer(forward)()
    seeds = [{k: torch.randn_like(v) for k, v in outs.items()} for _, outs in graphs]
    if not oases:  # one autograd graph through the block (its residual outputs get gradients too)
        roots = [v for _, outs in graphs for v in outs.values()]
        grads = [v for sd in seeds for v in sd.values()]
        return lambda: torch.autograd.backward(roots, grads, retain_graph=True)

    halves = {id(p): torch.zeros(p.numel() // 2, device=device, dtype=dtype) for p in params}

    def executor_backward():  # ``OasesRunner._local_backward`` per piece, last to first
        for (ins, outs), sd in zip(reversed(graphs), reversed(seeds)):
            got = torch.autograd.grad(list(outs.values()), list(ins.values()) + params, list(sd.values()),
                                      retain_graph=True, allow_unused=True)
            # ``_collect_param_grads``: the second sub-batch adds its parameter gradients to the
            # first's, then they are delivered (one more add into the gradient buffer); per
            # sub-batch on average that is half of both adds
            for prm, gr in zip(params, got[len(ins):]):
                if gr is not None:
                    half = halves[id(prm)]
                    half.add_(gr.reshape(-1)[:half.numel()])
                    half.add_(gr.reshape(-1)[half.numel():2 * half.numel()])
    return executor_backward
