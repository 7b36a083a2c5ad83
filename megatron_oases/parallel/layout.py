"""Where each local parameter sits in the global (unsharded) model, for any TP/PP/backend.

The mapping comes from Megatron's own ``sharded_state_dict`` (the one dist-checkpointing uses to
reshard), so it is right for every backend that implements that method. Two users:
* TP/PP-invariant initialisation: the same seed gives the same global model whatever the layout,
  which is what makes a TP=2 x PP=2 run comparable with TP=1 (stock Megatron's GPU init is not);
* parity tests: gather the shards of parameters and gradients into dense global tensors.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Iterable, Iterator

import torch


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One local parameter and the region of the global tensor it holds."""

    key: str
    """Global name (layer numbers are global, e.g. ``decoder.layers.3.mlp.linear_fc1.weight``)."""
    param: torch.nn.Parameter
    global_shape: tuple[int, ...]
    """Shape of the whole parameter (without Megatron's prepended layer axis)."""
    index: tuple[slice, ...]
    """Slices of the global tensor this rank holds."""
    is_main_replica: bool
    """True on exactly one rank per region (``replica_id`` all zero)."""
    local_index: tuple[slice, ...] = ()
    """Slices of ``param`` that hold that region (all of it unless Megatron shards the parameter
    in pieces: a SwiGLU fc1 weight is its gate rows and its up rows, each its own region)."""

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the parameter, or a tensor shaped like it) restricted to this region."""
        return tensor[self.local_index] if self.local_index else tensor


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and not hasattr(module, "sharded_state_dict"):
        module = module.module
    while hasattr(module, "module") and type(module).__name__ in ("DistributedDataParallel",
                                                                   "Float16Module"):
        module = module.module
    return module


def param_shards(model_chunks: Iterable[torch.nn.Module]) -> Iterator[ParamShard]:
    """Yield a ``ParamShard`` for every region of every parameter of the (possibly wrapped)
    model chunks: one per parameter, or one per piece where Megatron's ``sharded_state_dict``
    builds the parameter's shards with a ``ShardedTensorFactory`` (SwiGLU's fc1)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for chunk in model_chunks:
        module = _unwrap(chunk)
        by_ptr = {p.data_ptr(): p for p in module.parameters()}
        seen = set()
        for sh in module.sharded_state_dict().values():
            pieces = [sh]
            if isinstance(sh, ShardedTensorFactory):
                param = by_ptr.get(sh.data.data_ptr())
                if param is None or id(param) in seen:
                    continue
                pieces = sh.build()
            if not all(isinstance(x, ShardedTensor) and x.data is not None for x in pieces):
                continue
            param = by_ptr.get(pieces[0].data.data_ptr())
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            for x in pieces:
                yield _shard(x, param)


def _shard(sh, param: torch.nn.Parameter) -> ParamShard:
    """The region one ShardedTensor (the parameter, or a view of part of it) describes."""
    n_pre = sh.prepend_axis_num
    local_shape = tuple(sh.data.shape)
    index = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[n_pre:], local_shape))
    local_index = ()
    if local_shape != tuple(param.shape):  # a contiguous row block of the parameter
        start = (sh.data.data_ptr() - param.data_ptr()) // param.element_size() // max(
            1, math.prod(param.shape[1:]))
        local_index = (slice(start, start + local_shape[0]),)
    return ParamShard(key=_global_key(sh.key, sh.global_offset[:n_pre]), param=param,
                      global_shape=tuple(sh.global_shape[n_pre:]), index=index,
                      is_main_replica=all(r == 0 for r in _as_tuple(sh.replica_id)),
                      local_index=local_index)


def _global_key(key: str, prepended_offsets) -> str:
    """Megatron stacks layers on a prepended axis; name each layer by its global number instead."""
    if not prepended_offsets:
        return key
    head, _, tail = key.partition("layers.")
    return f"{head}layers.{'.'.join(str(o) for o in prepended_offsets)}.{tail}"


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# Megatron's output-layer init (scaled_init_method_normal): sigma / sqrt(2 * num_layers).
_SCALED_INIT_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


@torch.no_grad()
def tp_invariant_init_(model_chunks, *, seed: int, init_method_std: float, num_layers: int) -> None:
    """Re-draw every random parameter from a generator seeded by (seed, global key).

    Constant parameters (norm weights = 1, biases = 0) keep Megatron's values; random ones get
    N(0, init_method_std), scaled by 1/sqrt(2 num_layers) for the output projections exactly as
    Megatron's ``scaled_init_method_normal``. Each full tensor is drawn once, on the CPU, then
    sliced, so every TP/PP layout of the same model starts from identical weights.
    """
    for shard in param_shards(model_chunks):
        p = shard.local(shard.param)
        if p.numel() <= 1 or bool((p == p.reshape(-1)[0]).all()):
            continue  # constants (ones, zeros) are layout-invariant already
        std = init_method_std
        if shard.key.endswith(_SCALED_INIT_SUFFIXES):
            std = init_method_std / math.sqrt(2.0 * num_layers)
        gen = torch.Generator().manual_seed((zlib.crc32(shard.key.encode()) * 1_000_003 + seed)
                                            % (2**63))
        full = torch.empty(shard.global_shape, dtype=torch.float32)
        full.normal_(0.0, std, generator=gen)
        p.copy_(full[shard.index].to(dtype=p.dtype, device=p.device))


def gather_global(model_chunks, *, what: str = "param", group=None) -> dict[str, torch.Tensor]:
    """Assemble dense global tensors of parameters (``what="param"``) or gradients (``"grad"``).

    Every rank contributes its main-replica shards; the result (on every rank) maps global key to
    the full fp32 CPU tensor. Gradients are read from Megatron DDP's ``main_grad`` when present.
    """
    import torch.distributed as dist

    local = []
    for shard in param_shards(model_chunks):
        if not shard.is_main_replica:
            continue
        p = shard.param
        t = p.detach() if what == "param" else getattr(p, "main_grad", None)
        if t is None:
            t = p.grad
        if t is None:
            continue
        local.append((shard.key, shard.global_shape, shard.index,
                      shard.local(t.detach()).float().cpu().clone()))
    everything = [None] * dist.get_world_size(group)
    dist.all_gather_object(everything, local, group=group)
    out: dict[str, torch.Tensor] = {}
    for part in everything:
        for key, shape, index, tensor in part:
            full = out.setdefault(key, torch.zeros(shape))
            full[index] = tensor
    return out


def checkpoint_dp_rank(metadata: dict | None) -> int:
    """The DP rank a sharded_state_dict writes replicas for: from ``metadata["dp_cp_group"]``
    when Megatron passes it (as its own linears read it), else from ``parallel_state``."""
    group = (metadata or {}).get("dp_cp_group")
    if group is not None:
        import torch.distributed as dist

        return dist.get_rank(group)
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(with_context_parallel=True)
