"""A Megatron-Core MoE layer (``MoELayer``, alltoall dispatcher, local experts) as a tape.

The attention part is the dense tape's (``tape.attention_part``). The MoE part calls Megatron's
own router, token dispatcher and experts between the collectives, which the executor launches
async so one sub-batch's dispatch and combine overlap the other sub-batch's compute::

    route        ln2 (s/t)    -> probs, aux_scores   router logits, top-k (Megatron's ``routing``
                                                     with its aux loss off); no collective
    aux.wait     Barrier: every sub-batch has routed (forward only)
    aux          probs, aux_scores -> probs          the switch loss with the micro-batch's counts
    permute      ln2, probs   -> perm_tokens, perm_probs   ``dispatch_preprocess``
    dispatch     AllToAll over EP (tokens; ``dispatch.probs``: probs)
    experts.ag   GatherSequence over TP, uneven (t > 1; tokens and probs)
    experts      ``dispatch_postprocess`` sort, the local experts, ``combine_preprocess`` unsort
    experts.rs   ReduceScatterSequence over TP, uneven (t > 1)
    combine      AllToAll over EP (the dispatch's splits swapped)
    unpermute_bda  ``combine_postprocess`` + dropout + residual -> y

**What survives from forward to recompute and backward.** The dispatcher keeps its routing
metadata (splits, permutation mapping, routing map, tokens per expert) on itself; the executor
has two sub-batches per micro-batch and, under 1F1B, several micro-batches in flight, so each
(micro-batch, sub-batch) gets a shallow copy of the dispatcher, kept in ``BlockInputs.scratch``
(the micro-batch's). Its metadata is computed in forward only: ``preprocess`` all-gathers the
token counts over TP x EP (a small blocking collective, issued by every rank in the same order);
recompute re-runs ``dispatch_preprocess`` on the copy with ``preprocess`` answering the saved
counts, so recompute issues no collective. The dispatcher's own TP gather / reduce-scatter are
switched off (``tp_size`` 1 on a copy) because the executor issues them.

**The load-balancing loss.** Megatron's switch loss multiplies the router scores by the whole
micro-batch's tokens per expert (summed over TP) and divides by its token count: not linear in
the sub-batches. Each sub-batch therefore routes with the aux loss off, waits at a barrier until
both have routed, and attaches its share: Megatron's ``switch_load_balancing_loss_func`` on its
own scores with the micro-batch's counts (the sub-batches' sum, all-reduced over TP once in
forward and kept) and token total, through the router's ``attach_and_log_load_balancing_loss``.
The shares add up to stock's loss, gradient and logged per-layer value (recompute does not log).
"""
from __future__ import annotations

import contextlib
import copy

from megatron_oases.parallel.collectives import all_reduce
from megatron_oases.schedules.oases.steps import (AllToAll, Barrier, GatherSequence, LayerTape, Local,
                                                  ReduceScatterSequence, require)
from megatron_oases.schedules.oases.tape import _explicit_comm, _trainable, attention_part


def is_moe_layer(layer) -> bool:
    """Whether ``layer``'s MLP is Megatron-Core's ``MoELayer``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(getattr(layer, "mlp", None), MoELayer)


def moe_layer_tape(layer, index: int) -> LayerTape:
    """The tape of a Megatron-Core ``TransformerLayer`` whose MLP is an ``MoELayer``."""
    moe = layer.mlp
    _require_supported(moe, index)
    part = attention_part(layer, index, split=True)
    steps = part.steps + _moe_steps(layer, moe, index, part)
    return LayerTape(steps=steps, group=part.linears[1].tp_group, params=_trainable(layer.parameters()),
                     collectives_off=_explicit_comm(part.linears))


def _require_supported(moe, index: int) -> None:
    """What the executor cannot make equal to stock, as the parse refuses it (here for a model
    built another way): the dispatcher, capacity factor and load balancing in
    ``describe.moe.moe_refusal``; Megatron-LM's router and expert options the trainer has no flag
    for (z-loss, jitter, expert bias, forced routing, shared experts, latent) in
    ``megatron_lm.options.REFUSED``."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    cfg, router = moe.config, moe.router
    where = f"layer {index}: MoE"
    require(isinstance(moe.token_dispatcher, MoEAlltoAllTokenDispatcher),
            f"{where} needs --moe-token-dispatcher-type alltoall")
    require(cfg.moe_expert_capacity_factor is None and not cfg.moe_pad_expert_input_to_capacity,
            f"{where}: --moe-expert-capacity-factor drops tokens over the whole micro-batch; drop it")
    require(router.routing_type in ("aux_loss", "none"),
            f"{where}: --moe-router-load-balancing-type {router.routing_type}; use aux_loss or none")
    require(not moe.use_shared_expert and not cfg.moe_latent_size, f"{where}: no shared experts or latent projections")
    require(not cfg.moe_z_loss_coeff and not cfg.moe_input_jitter_eps
            and not cfg.moe_router_enable_expert_bias and not cfg.moe_router_force_load_balancing
            and cfg.moe_router_force_biased is None and not cfg.moe_router_padding_for_quantization,
            f"{where}: z-loss, input jitter, expert bias and forced routing are not split by sub-batch")


@contextlib.contextmanager
def _overriding(obj, name: str, value):
    """``obj.name`` is ``value`` on this instance inside (Megatron's method again after): the
    router's ``is_aux_loss_enabled`` off (the executor attaches the aux loss per sub-batch), the
    MoE metrics tracker's ``record`` a no-op (recompute attaches without logging twice), the
    dispatcher's ``preprocess`` answering the forward's counts (recompute, no count gather)."""
    setattr(obj, name, value)
    try:
        yield
    finally:
        delattr(obj, name)


def _moe_steps(layer, moe, index: int, part) -> tuple:
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         get_moe_metrics_tracker,
                                                         switch_load_balancing_loss_func)

    router, dispatcher, cfg = moe.router, moe.token_dispatcher, moe.config
    n2, experts_tp = part.ln2, dispatcher.tp_size
    coeff = router.get_aux_loss_coeff("aux_loss")
    aux = coeff > 0

    def mine(inp) -> dict:
        """This (micro-batch, sub-batch)'s state of the layer."""
        return inp.scratch.setdefault(("moe", index, inp.sub_batch), {})

    def route(t, inp):
        st = mine(inp)
        logits = router.gating(router.apply_input_jitter(t[n2]))
        with _overriding(router, "is_aux_loss_enabled", lambda: False):
            probs, st["routing_map"] = router.routing(logits)
        if not aux:
            return {"probs": probs}
        aux_map, scores = compute_routing_scores_for_aux_loss(
            logits.view(-1, cfg.num_moe_experts), router.topk, router.score_function,
            fused=cfg.moe_router_fusion)
        st["aux_counts"], st["tokens"] = aux_map.sum(dim=0), aux_map.shape[0]
        return {"probs_raw": probs, "aux_scores": scores}

    def aux_loss(t, inp):
        shared = inp.scratch.setdefault(("moe", index), {})
        if "tokens_per_expert" not in shared:  # forward, first sub-batch: the micro-batch's counts
            subs = [inp.scratch[("moe", index, j)] for j in range(inp.scratch["sub_batches"])]
            counts = sum(s["aux_counts"] for s in subs).clone()
            all_reduce(counts, router.tp_cp_group)
            shared.update(tokens_per_expert=counts, tokens=sum(s["tokens"] for s in subs))
        loss = switch_load_balancing_loss_func(
            probs=t["aux_scores"], tokens_per_expert=shared["tokens_per_expert"],
            total_num_tokens=shared["tokens"] * router.tp_cp_group.size(), topk=router.topk,
            num_experts=cfg.num_moe_experts, moe_aux_loss_coeff=coeff, fused=cfg.moe_router_fusion)
        st = mine(inp)
        with (_overriding(get_moe_metrics_tracker(), "record", lambda *a, **k: None) if st.get("logged")
              else contextlib.nullcontext()):
            probs = router.attach_and_log_load_balancing_loss(
                t["probs_raw"], coeff, loss, "load_balancing_loss", router.tp_cp_group,
                valid_token_count=shared["tokens"])
        st["logged"] = True
        return {"probs": probs}

    def permute(t, inp):
        st = mine(inp)
        if "dispatcher" not in st:  # forward: Megatron's preprocess, its count gather included
            st["dispatcher"] = d = copy.copy(dispatcher)
            tokens, probs = d.dispatch_preprocess(t[n2], st["routing_map"], t["probs"])
        else:  # recompute: the forward's metadata, no collective
            d = st["dispatcher"]
            with _overriding(d, "preprocess", lambda routing_map: st["tokens_per_expert"]):
                tokens, probs = d.dispatch_preprocess(t[n2], st["routing_map"], t["probs"])
        # What token_dispatch does before its all-to-all: on a GPU the splits were copied to the
        # host on a side stream, and the all-to-all steps read them next.
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_ep_alltoall", d.tokens_per_expert)
        st["tokens_per_expert"] = d.tokens_per_expert
        return {"perm_tokens": tokens, "perm_probs": probs}

    def ep_splits(inp):
        d = mine(inp)["dispatcher"]
        return d.output_splits, d.input_splits

    def ep_splits_back(inp):
        out, into = ep_splits(inp)
        return into, out

    def tp_sizes(inp):
        return mine(inp)["dispatcher"].output_splits_tp

    def run_experts(t, inp):
        st = mine(inp)
        d = copy.copy(st["dispatcher"])
        d.tp_size, d.tokens_per_expert = 1, st["tokens_per_expert"]  # the executor gathers / scatters
        tokens, tokens_per_expert, probs = d.dispatch_postprocess(t[a2a_tokens], t[a2a_probs])
        out, bias = moe.experts(tokens, tokens_per_expert, probs)
        require(bias is None, f"layer {index}: MoE experts with a bias")
        out = d.combine_preprocess(out)
        # Megatron reduce-scatters over TP in the router's dtype, as here (cast back after combine)
        return {expert_out: out.to(d.probs.dtype) if experts_tp > 1 else out}

    def unpermute_bda(t, inp):
        d = mine(inp)["dispatcher"]
        out = d.combine_postprocess(t["combined"].to(t["h1"].dtype))
        return {"y": part.bda(out, None, t["h1"], "mlp_bda")}

    ep = dispatcher.ep_group
    steps = [Local("route", (n2,), ("probs_raw", "aux_scores") if aux else ("probs",), route)]
    if aux:
        steps += [Barrier("aux.wait"), Local("aux", ("probs_raw", "aux_scores"), ("probs",), aux_loss)]
    steps += [Local("permute", (n2, "probs"), ("perm_tokens", "perm_probs"), permute),
              AllToAll("dispatch", "perm_tokens", "a2a_tokens", ep_splits, ep),
              AllToAll("dispatch.probs", "perm_probs", "a2a_probs", ep_splits, ep)]
    a2a_tokens, a2a_probs, expert_out = "a2a_tokens", "a2a_probs", "expert_out"
    if experts_tp > 1:
        tp = dispatcher.tp_group
        steps += [GatherSequence("experts.ag", "a2a_tokens", "tokens_tp", group=tp, sizes=tp_sizes),
                  GatherSequence("experts.ag.probs", "a2a_probs", "probs_tp", group=tp, sizes=tp_sizes)]
        a2a_tokens, a2a_probs, expert_out = "tokens_tp", "probs_tp", "expert_out_tp"
    steps.append(Local("experts", (a2a_tokens, a2a_probs), (expert_out,), run_experts))
    if experts_tp > 1:
        steps.append(ReduceScatterSequence("experts.rs", "expert_out_tp", "expert_out",
                                           group=dispatcher.tp_group, sizes=tp_sizes))
    steps += [AllToAll("combine", "expert_out", "combined", ep_splits_back, ep),
              Local("unpermute_bda", ("combined", "h1"), ("y",), unpermute_bda)]
    return tuple(steps)
