"""Per-block TP degrees from a plan (``--oases-plan``) as a Megatron ``TransformerLayer`` spec.

``PlannedTransformerLayer`` is Megatron's layer whose attention block runs on a TP sub-group of
the degree the plan gives it and whose MLP block (pre-MLP norm + MLP) on the sub-group of its own
degree, so each holds ``1 / degree`` of its weights; each of the ``T / degree`` replicas computes
its slice of the micro-batch. Hidden states enter and leave the layer in the previous / next
block's layout and move between the two blocks when their degrees differ
(``parallel/degree_groups.reshard_batch``); the block edges are degree ``T``, so pipeline stages
exchange Megatron's usual ``[s, b, h]`` tensors.

Replicas see different samples, so their parameter gradients are partial sums: ``
finalize_with_replica_grads`` wraps Megatron's ``finalize_model_grads`` and sums them over each
replica group after Megatron's own DP reduction. For the grad-norm, only the first replica's
shards count as tensor-parallel (Megatron counts TP-duplicated parameters on TP rank 0 only).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                         get_transformer_layer_offset)

from megatron_oases.layers.sharded_dropout import sharded_bias_dropout_add_builder
from megatron_oases.parallel.degree_groups import (DegreeGroups, narrow_batch_mask,
                                                   reshard_batch)

_BATCH_KWARGS = ("attention_mask", "padding_mask")
MLP_BLOCK_PREFIXES = ("mlp.", "pre_mlp_layernorm.")
"""Parameters of the MLP block (its degree); everything else belongs to the attention block."""


def _dense_mlp_parts(submodules):
    """``mcore_compat.dense_mlp_parts`` of the layer's MLP; ValueError (the plan needs it) if it
    is not Megatron's dense MLP."""
    from megatron_oases.mcore_compat import dense_mlp_parts

    parts = dense_mlp_parts(submodules.mlp)
    if parts is None:
        raise ValueError(f"--oases-plan with different attention and MLP degrees needs Megatron's "
                         f"dense MLP (got {submodules.mlp})")
    return parts


def block_degrees(entry) -> tuple[int, int]:
    """(attention, mlp) degrees of one plan entry (an int means both)."""
    if isinstance(entry, (tuple, list)):
        a, m = entry
        return int(a), int(m)
    return int(entry), int(entry)


def _with_tp(pg_collection, tp_group):
    """A copy of a ``ProcessGroupCollection`` whose TP group is ``tp_group``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    have = {f.name: getattr(pg_collection, f.name) for f in dataclasses.fields(pg_collection)
            if hasattr(pg_collection, f.name)}
    have["tp"] = tp_group
    if "tp_cp" in have and getattr(pg_collection, "cp", None) is not None and pg_collection.cp.size() == 1:
        have["tp_cp"] = tp_group
    return ProcessGroupCollection(**have)


class PlannedTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` at the TP degree the plan gives it (see the module docstring)."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, *, layer_degrees: Sequence[int],
                 degree_groups: DegreeGroups):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import get_pg_rank

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        number = layer_number + get_transformer_layer_offset(config, vp_stage,
                                                             get_pg_rank(pg_collection.pp))
        degree, mlp_degree = block_degrees(layer_degrees[number - 1])
        mlp_parts = _dense_mlp_parts(submodules) if mlp_degree != degree else None
        built = dataclasses.replace(submodules, mlp=IdentityOp) if mlp_parts else submodules
        super().__init__(config, built, layer_number, hidden_dropout,
                         _with_tp(pg_collection, degree_groups.sub[degree]), vp_stage)
        if mlp_parts:
            self.submodules_config = submodules
            self._build_mlp(mlp_parts, degree_groups.sub[mlp_degree])
        self.tp_degree = degree
        """The attention block's degree (the layer's input side)."""
        self.mlp_degree = mlp_degree
        self.degree_groups = degree_groups
        self.input_degree = degree_groups.tp_size
        """Layout of the incoming hidden states (the previous layer's degree; T at block entry)."""
        self.output_degree = degree_groups.tp_size
        """Layout the output leaves in (T for the block's last layer, else the MLP's degree)."""
        # Replicas of a block see different samples: each keeps its slice of the whole batch's
        # hidden-dropout mask (as at degree T) instead of drawing the same mask for its slice.
        self.self_attn_bda = sharded_bias_dropout_add_builder(1, *replica_batch_shard(self, "attention"))
        self.mlp_bda = sharded_bias_dropout_add_builder(1, *replica_batch_shard(self, "mlp"))
        for name, p in self.named_parameters():
            if self.config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
                # Megatron's finalize_model_grads already sums these over the whole TP group,
                # which is this block's sub-group times its replicas: a replica sum would add twice.
                continue
            d = self._degree_of(name)
            p.oases_replica_group = degree_groups.replica_group(d)
            if degree_groups.replica_index(d) > 0 and getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel = False  # another replica's copy: not in the grad norm

    def _build_mlp(self, mlp_parts, tp_group) -> None:
        """The MLP block on its own TP sub-group, built once, where Megatron's ``TransformerLayer``
        builds it (last, nothing after it draws): its initial weights are then the draws stock
        Megatron makes for it (``--use-cpu-initialization`` splits the same master weights), and
        later draws stay in stock order. Building it a second time, after the layer, drew the
        next layer's weights instead (issue 48)."""
        mlp_cls, mlp_submodules, mlp_params = mlp_parts
        self.mlp = mlp_cls(config=self.config, submodules=mlp_submodules, tp_group=tp_group,
                           **mlp_params)
        if hasattr(self.mlp, "set_layer_number"):
            self.mlp.set_layer_number(self.layer_number)

    def _degree_of(self, name: str) -> int:
        """The degree of the block a parameter (or state-dict key, relative to the layer) is in."""
        return self.mlp_degree if name.startswith(MLP_BLOCK_PREFIXES) else self.tp_degree

    def _forward_mlp(self, hidden_states, *args, **kwargs):
        """Megatron's MLP block, on its own degree's layout when that differs from attention's."""
        hidden_states = reshard_batch(hidden_states, self.degree_groups, self.tp_degree, self.mlp_degree)
        return super()._forward_mlp(hidden_states, *args, **kwargs)

    def forward(self, *args, **kwargs):
        g = self.degree_groups
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        batch = hidden.shape[1] * (g.tp_size // self.input_degree)  # the whole micro-batch
        for name in _BATCH_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = narrow_batch_mask(kwargs[name], g, self.tp_degree, batch)
        hidden = reshard_batch(hidden, g, self.input_degree, self.tp_degree)
        output, context = super().forward(hidden, *args, **kwargs)
        return reshard_batch(output, g, self.mlp_degree, self.output_degree), context

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's, with replicas other than the first marked as such (one main copy).

        The TP part of Megatron's replica id is the rank in the sub-group the module was built
        on: the layer's (attention) degree, or the MLP's for a rebuilt ``mlp``. The replica index
        is taken at that degree, so (replica, rank in sub-group) names one TP rank even for the
        pre-MLP norm, which belongs to the MLP block but is built on the attention's sub-group.
        """
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for key, sh in out.items():
            built_on = self.mlp_degree if key[len(prefix):].startswith("mlp.") else self.tp_degree
            r = self.degree_groups.replica_index(built_on)
            if r and hasattr(sh, "replica_id"):
                rid = sh.replica_id
                sh.replica_id = (r, *(rid if isinstance(rid, (tuple, list)) else (rid,)))
        return out


def replica_batch_shard(layer, block: str) -> tuple[int, int]:
    """(replicas, this replica) of ``layer``'s ``block`` ("attention" or "mlp"): (1, 0) for a
    layer without a plan or a block at the full TP degree."""
    groups = getattr(layer, "degree_groups", None)
    if groups is None:
        return 1, 0
    degree = layer.tp_degree if block == "attention" else layer.mlp_degree
    return groups.tp_size // degree, groups.replica_index(degree)


def planned_layer_spec(base_spec, layer_degrees: Sequence, degree_groups: DegreeGroups):
    """``base_spec`` (a ``TransformerLayer`` ModuleSpec) with each layer at its planned degrees
    (``layer_degrees[i]``: one degree, or the (attention, mlp) pair of layer i)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if base_spec.module is not TransformerLayer:
        raise ValueError(f"--oases-plan needs Megatron's TransformerLayer spec (got {base_spec.module})")
    params = dict(base_spec.params or {})
    params.update(layer_degrees=tuple(block_degrees(d) for d in layer_degrees), degree_groups=degree_groups)
    return ModuleSpec(module=PlannedTransformerLayer, submodules=base_spec.submodules, params=params)


def connect_planned_layers(block) -> None:
    """Set each planned layer's input/output layouts from its neighbours in ``block`` (a
    ``TransformerBlock``): no reshard between equal degrees, degree T at the block's edges."""
    layers = [l for l in block.layers if isinstance(l, PlannedTransformerLayer)]
    if not layers:
        return
    tp = layers[0].degree_groups.tp_size
    prev = tp
    for i, layer in enumerate(layers):
        layer.input_degree = prev
        layer.output_degree = layer.mlp_degree if i + 1 < len(layers) else tp
        prev = layer.mlp_degree


def replica_grad_groups(model_chunks) -> list:
    """(group, [params]) of every replicated planned layer, in a rank-independent order."""
    found: dict = {}
    for chunk in model_chunks:
        for p in chunk.parameters():
            g = getattr(p, "oases_replica_group", None)
            if g is not None and p.requires_grad:
                found.setdefault(id(g), (g, []))[1].append(p)
    return list(found.values())


@torch.no_grad()
def all_reduce_replica_grads(model_chunks) -> None:
    """Sum the gradients of replicated layers over their replica groups (one flat call each)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from megatron_oases.parallel.collectives import all_reduce

    for group, params in replica_grad_groups(model_chunks):
        grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None
                 else p.grad for p in params]
        grads = [g for g in grads if g is not None]
        if not grads:
            continue
        flat = _flatten_dense_tensors(grads)
        all_reduce(flat, group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


@torch.no_grad()
def sync_replica_params(model_chunks) -> None:
    """Make every replica of a planned layer start from the first replica's weights (Megatron's
    GPU init seeds each TP rank differently)."""
    import torch.distributed as dist

    for group, params in replica_grad_groups(model_chunks):
        src = dist.get_global_rank(group, 0)
        for p in params:
            dist.broadcast(p.data, src=src, group=group)


def finalize_with_replica_grads(finalize_fn):
    """Wrap Megatron's ``finalize_model_grads``: its DP / embedding reductions, then the replica
    sums of planned layers (the sums commute with Megatron's averaging)."""

    def finalize(model, *args, **kwargs):
        out = finalize_fn(model, *args, **kwargs)
        all_reduce_replica_grads(model)
        return out

    finalize.oases_replicas = True
    return finalize
