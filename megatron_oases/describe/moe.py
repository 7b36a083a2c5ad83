"""Megatron-Core's MoE layer (``MoELayer``) on Megatron 1-D TP: what it computes, sends and holds.

An MoE layer is Megatron's attention block followed by an MoE block in place of the MLP: the
pre-MLP norm, a router (a linear ``h x E``, replicated over TP, on this rank's tokens), top-k
routing, a token dispatcher that moves each token's k copies to the ranks holding their experts,
``E / EP`` local experts (each an MLP of width ``--moe-ffn-hidden-size``, SwiGLU aware, split
over the experts' TP group, which is TP: Megatron's default ``expert_tensor_parallel_size``),
and the dispatcher's combine. The simulator (``sim.core.moe``, its events and memory) and
``tests/test_moe_description.py`` read this one description, as they read ``megatron_1d`` for
dense layers; so does the planner (``plan.moe_blocks``).

The dispatchers (``megatron/core/transformer/moe/token_dispatcher.py``):

* ``alltoall``: an all-to-all of the routed copies over the EP group (and of their router
  probabilities), then an all-gather over the experts' TP group; the combine is the
  reduce-scatter over TP and the all-to-all back. The payload of an all-to-all is what a rank
  sends and receives in all: ``tokens x topk x h`` elements, of which ``(EP - 1) / EP`` leave
  the rank (``ops.ring_factor``'s gather share) under even routing; before it, the token counts
  per expert are all-gathered over TP x EP (int64, no gradient).
* ``allgather``: the routing map (no gradient), the tokens' probabilities over all experts and
  the tokens are all-gathered over the TP x EP group, each rank runs its experts on the tokens routed to them,
  and the combine reduce-scatters the ``[tokens x EP, h]`` output over TP x EP.

**Assumption: even routing.** Every expert receives the same share of the routed copies, so
each rank computes ``tokens x topk`` copies and each all-to-all sends the same bytes; a real
router is uneven (the aux loss only pulls it towards even), and the busiest rank sets the step.
No flag changes this; ``sim`` prints it. With ``--moe-expert-capacity-factor c`` an expert
takes at most ``c`` times its even share, so below 1 the copies beyond are dropped; Megatron
pads to the capacity only with ``--moe-pad-expert-input-to-capacity``, which we do not take, so
no padded token is described.

Megatron-Core needs ``--sequence-parallel`` with MoE at TP > 1 (the trainer refuses it
otherwise, ``megatron_oases.moe``): the dispatcher starts from this rank's ``s / t`` tokens.
"""
from __future__ import annotations

import dataclasses

from .ops import Collective, Compute, LayerDescription, LayerVariant, ModelingError, backward_of
from .saved_kernels import CUDA_KERNELS, Kernels, norm_beyond_input
from .split import oases_splits

DISPATCHERS = ("allgather", "alltoall")
"""The token dispatchers described (Megatron-Core's ``flex`` needs DeepEP, a CUDA extension)."""
EP_AXIS, TP_EP_AXIS = "ep", "tp_ep"
"""The groups of the MoE collectives besides TP's: the EP group (one rank of each of EP
data-parallel replicas at the same TP position) and the TP x EP group."""
MOE_AXES = (EP_AXIS, TP_EP_AXIS)
ROUTING_ASSUMPTION = ("MoE: even routing assumed (every expert gets the same share of the routed tokens; a "
                      "real router is uneven and its busiest rank sets the step)")
"""The stated assumption, printed by ``sim`` with an MoE model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEShape:
    """The MoE flags of a model (Megatron-LM's names; ``RunConfig``'s fields)."""

    num_experts: int
    """``--num-experts``"""
    ffn: int
    """``--moe-ffn-hidden-size`` as Megatron-LM fills it (default ``--ffn-hidden-size``)."""
    topk: int = 2
    """``--moe-router-topk``"""
    layer_freq: int = 1
    """``--moe-layer-freq N``: layers 0, N, 2N, ... are MoE, the others dense (Megatron-Core's
    ``moe_layer_pattern``)."""
    capacity_factor: float | None = None
    """``--moe-expert-capacity-factor`` (None: dropless)."""
    dispatcher: str = "allgather"
    """``--moe-token-dispatcher-type``"""
    grouped_gemm: bool = False
    """``--moe-grouped-gemm``: the local experts' GEMMs as one grouped kernel (same FLOPs, fewer
    launches)."""
    aux_loss: bool = False
    """Whether the router adds the ``aux_loss`` load-balancing loss (:func:`aux_loss_coeff` > 0 of
    ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff``; Megatron-LM's default
    coefficient 0: off), which under the Oases executor makes the sub-batches join after routing
    (:func:`moe_layer`)."""
    load_balancing: str | tuple[str, ...] = "aux_loss"
    """``--moe-router-load-balancing-type`` (several: a tuple), which :func:`moe_refusal` reads."""
    aux_loss_coeffs: float | tuple[float, ...] = 0.0
    """``--moe-aux-loss-coeff`` as given (several: a tuple), so that a plan file writes the flags back."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "ffn", "topk", "layer_freq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelingError(f"--{_flag(name)} must be a positive integer (got {v!r})")
        if self.topk > self.num_experts:
            raise ModelingError(f"--moe-router-topk {self.topk} must be at most --num-experts {self.num_experts}")
        if self.dispatcher not in DISPATCHERS:
            raise ModelingError(f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHERS)} "
                                f"(got {self.dispatcher!r})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ModelingError(f"--moe-expert-capacity-factor must be > 0 (got {self.capacity_factor!r}); "
                                f"omit it for dropless MoE")

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` (of the whole model, from 0) is an MoE layer."""
        return layer % self.layer_freq == 0

    @property
    def kept_share(self) -> float:
        """The share of the routed copies the experts compute under even routing: 1 dropless or
        with a capacity factor >= 1, the factor below 1 (the rest dropped)."""
        return 1.0 if self.capacity_factor is None else min(1.0, self.capacity_factor)

    def key(self, ep: int) -> str:
        """The suffix of an MoE event's key: what its work depends on beyond the dense layer's."""
        cf = "" if self.capacity_factor is None else f"c{self.capacity_factor:g}"
        return f"_moe{self.num_experts}k{self.topk}f{self.ffn}ep{ep}{self.dispatcher[:2]}{cf}" + \
            ("gg" if self.grouped_gemm else "")


MOE_SHAPE_FLAGS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
                   "moe_expert_capacity_factor", "moe_token_dispatcher_type", "moe_grouped_gemm",
                   "moe_router_load_balancing_type", "moe_aux_loss_coeff")
"""The MoE flags :func:`moe_shape` reads (Megatron-LM's names: ``RunConfig``'s fields, the flag
table's dests, a plan ``--model`` file's keys); ``ffn_hidden_size`` fills the expert width."""


def moe_shape(*, num_experts: int | None, moe_ffn_hidden_size: int | None, ffn_hidden_size: int,
              moe_router_topk: int, moe_layer_freq: int, moe_expert_capacity_factor: float | None,
              moe_token_dispatcher_type: str, moe_grouped_gemm: bool,
              moe_aux_loss_coeff: float | tuple[float, ...] = 0.0,
              moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss") -> MoEShape | None:
    """The MoE flags under Megatron-LM's names (``RunConfig``'s fields) as a :class:`MoEShape`;
    None without ``--num-experts`` (or with 0, as Megatron-LM reads it). ``--moe-ffn-hidden-size``
    defaults to ``ffn_hidden_size`` (filled), as Megatron-LM fills it; the aux loss is
    :func:`aux_loss_coeff`'s. ``sim``'s flags, ``sim --predict``'s trainer run and the trainer
    (``megatron_oases.moe.moe_shape_of``) all map through here."""
    if not num_experts:
        return None
    def one(v):  # one listed value as itself, as Megatron-LM's validate_args
        return (v[0] if len(v) == 1 else tuple(v)) if isinstance(v, (list, tuple)) else v

    types, coeffs = one(moe_router_load_balancing_type), one(moe_aux_loss_coeff)
    return MoEShape(num_experts=num_experts, ffn=moe_ffn_hidden_size or ffn_hidden_size, topk=moe_router_topk,
                    layer_freq=moe_layer_freq, capacity_factor=moe_expert_capacity_factor,
                    dispatcher=moe_token_dispatcher_type, grouped_gemm=moe_grouped_gemm,
                    aux_loss=aux_loss_coeff(types, coeffs) > 0, load_balancing=types,
                    aux_loss_coeffs=coeffs)


def aux_loss_coeff(load_balancing: str | tuple[str, ...], coeff: float | tuple[float, ...],
                   kind: str = "aux_loss") -> float:
    """The coefficient of the ``kind`` load-balancing loss, 0 where the router adds none: Megatron's
    ``TopKRouter.get_aux_loss_coeff`` (``--moe-aux-loss-coeff`` pairs with
    ``--moe-router-load-balancing-type`` by position; a type not listed, ``none`` say, has no loss
    whatever the coefficient). The Oases executor reads the router's own method
    (``schedules/oases/moe_tape.py``); ``tests/test_moe_description.py`` pins this one to it. Pure
    Python: ``sim`` and the trainer's parse import no torch."""
    types = tuple(load_balancing) if isinstance(load_balancing, (list, tuple)) else (load_balancing,)
    coeffs = tuple(coeff) if isinstance(coeff, (list, tuple)) else (coeff,)
    if len(types) != len(coeffs):
        raise ModelingError(f"--moe-aux-loss-coeff takes one coefficient per --moe-router-load-balancing-type "
                            f"({len(types)} given, {len(coeffs)} coefficients)")
    return float(coeffs[types.index(kind)]) if kind in types else 0.0


_FLAGS = {"num_experts": "num-experts", "ffn": "moe-ffn-hidden-size", "topk": "moe-router-topk",
          "layer_freq": "moe-layer-freq"}


def _flag(name: str) -> str:
    return _FLAGS[name]


def without_experts(flag: str) -> str:
    """The one line for an MoE flag given without ``--num-experts`` (trainer, ``sim``, ``plan``)."""
    return f"{flag} takes effect with MoE layers only; add --num-experts N or drop it"


def flops_ffn_width(pattern, *, dense_ffn: int, moe_ffn: int, topk: int) -> float:
    """The FFN width Megatron-LM's model-FLOPs formula sees per layer (``flops``, linear in it),
    averaged over the layers of ``pattern`` (True: an MoE layer): an MoE layer counts its top-k
    experts' ``topk x --moe-ffn-hidden-size`` (Megatron-LM's ``num_floating_point_operations``,
    the router's h x E left out as there), a dense one ``--ffn-hidden-size``. The trainer's and
    the simulator's MFU both read it."""
    pattern = list(pattern)
    return sum(topk * moe_ffn if moe else dense_ffn for moe in pattern) / len(pattern)


def moe_refusal(moe: MoEShape | None, *, tp: int, ep: int, dp: int | None, sequence_parallel: bool,
                megatron_modules: bool = True, bias: bool = False, per_block_plan: bool = False,
                oases: bool = False) -> str:
    """Why an MoE model does not run at this layout ("" when it does), in the trainer's words, one
    home for the trainer (``megatron_oases.moe``), ``sim`` and ``plan``: EP only with MoE layers;
    EP divides the experts and, the experts' TP being TP's, the data-parallel size (Megatron's
    ``world % (ETP x EP x PP)``); TP > 1 needs SP and, with ``bias`` (linears with biases), is
    refused as the trainer refuses it; Megatron's own modules only; no ``per_block_plan``
    (``--oases-plan``); the Oases executor (``oases``: ``--schedule oases``) only
    where it equals stock (``schedules/oases/moe_tape.py``): the alltoall dispatcher, dropless,
    ``MoEShape.load_balancing`` (``--moe-router-load-balancing-type``) aux_loss or none.
    ``dp`` None: not known yet (a search checks it per candidate)."""
    if moe is None:
        return without_experts("--expert-model-parallel-size") if ep > 1 else ""
    if not megatron_modules:
        return "--num-experts builds Megatron-Core's MoE layers, which only --tp-backend megatron runs"
    if ep < 1 or moe.num_experts % ep:
        return (f"--expert-model-parallel-size {ep} must divide --num-experts {moe.num_experts} "
                f"(each expert-parallel rank holds whole experts)")
    if dp is not None and dp % ep:
        return (f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} (the experts' TP "
                f"size is --tensor-model-parallel-size's, so an expert-parallel group spans data-parallel ranks)")
    if tp > 1 and not sequence_parallel:
        return (f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                f"(as Megatron-Core's MoE layer requires); add it")
    if tp > 1 and bias:
        return (f"--num-experts with --tensor-model-parallel-size {tp} needs --disable-bias-linear "
                f"(Megatron-Core's experts take biases only at expert TP size 1); add it")
    if moe.ffn % tp:
        return f"--moe-ffn-hidden-size {moe.ffn} is not divisible by --tensor-model-parallel-size {tp}"
    if per_block_plan:
        return "--num-experts: --oases-plan's per-block degrees are for dense MLPs; drop one of them"
    # The Oases executor over MoE layers (schedules/oases/moe_tape.py), where it runs (TP > 1, or
    # EP > 1: describe.split.oases_splits; else the layers are stock ones): only what equals stock.
    oases = oases_splits(tp, oases=oases, expert_parallel=ep)
    if oases and moe.dispatcher != "alltoall":
        return (f"--schedule oases overlaps MoE layers' all-to-alls; use --moe-token-dispatcher-type "
                f"alltoall (not {moe.dispatcher}) or the default schedule")
    if oases and moe.capacity_factor is not None:
        return ("--moe-expert-capacity-factor: with --schedule oases the sub-batches would drop tokens "
                "each on its own, not over the micro-batch as stock does; drop it (dropless) or use "
                "the default schedule")
    types = moe.load_balancing if isinstance(moe.load_balancing, tuple) else (moe.load_balancing,)
    other = [t for t in types if t not in ("aux_loss", "none")]
    if oases and other:
        return (f"--moe-router-load-balancing-type {other[0]} is not split by sub-batch under "
                f"--schedule oases; use aux_loss or none, or the default schedule")
    return ""


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The token counts of one MoE block on one rank (even routing)."""

    chunk: int
    """Tokens this rank routes: its s/t under SP, all b s at TP 1."""
    routed: float
    """Routed copies this rank's experts compute: b s x topk x kept share (TP group's tokens)."""
    local: int
    """Experts on this rank: E / EP."""


def _sizes(*, b: int, s: int, t: int, moe: MoEShape, ep: int) -> _Sizes:
    return _Sizes(chunk=b * s // t, routed=b * s * moe.topk * moe.kept_share, local=moe.num_experts // ep)


def moe_block(*, micro_batch: int, seq: int, hidden: int, moe: MoEShape, tp: int, ep: int,
              bytes_per_element: int, variant: LayerVariant, hidden_dropout: bool = False,
              oases: bool = False) -> tuple[tuple, tuple]:
    """(forward ops, backward ops) of the MoE block on TP rank 0 of EP rank 0: ``moe.router``
    (the pre-MLP norm, the router GEMM, softmax / top-k, the permutation into expert order), the
    dispatch collectives, ``moe.experts`` (the local experts' GEMMs and activation, and the
    product with the router probabilities), the combine collectives, ``moe.unpermute`` (back to
    token order, summed over the k copies, residual add). Backward: each segment's
    ``backward_of`` and each collective's adjoint, in reverse (an all-to-all's adjoint is an
    all-to-all; an all-gather's a reduce-scatter).

    ``oases``: the block as the Oases executor's tape runs it (``schedules/oases/moe_tape.py``,
    alltoall dispatcher), on one sub-batch: the router is two steps, ``moe.route`` (norm, router
    GEMM, top-k; the sub-batches join after it when the load-balancing loss is on,
    :func:`moe_layer`) and ``moe.permute`` (the copies into expert order), with the blocking
    gather of the token counts between them; the collectives, the experts and the unpermute as
    stock's. The two router steps' work is stock's router's."""
    b, s, h, t, e = micro_batch, seq, hidden, tp, bytes_per_element
    if s % t:
        raise ModelingError(f"sequence parallelism needs seq {s} divisible by TP {t}")
    z = _sizes(b=b, s=s, t=t, moe=moe, ep=ep)
    E, k, f = moe.num_experts, moe.topk, moe.ffn
    fc1, per_expert = variant.fc1_rows(f), max(1, round(z.routed / z.local))
    mask = z.chunk * h if hidden_dropout else 0
    # the norm and the router GEMM, softmax / top-k (route); the k copies in expert order (permute)
    route = Compute(name="moe.route", gemm_flops=2.0 * z.chunk * h * E,
                    elementwise_bytes=e * (2 * z.chunk * h + 3 * z.chunk * E), kernels=6, gemms=((z.chunk, E, h),))
    permute = Compute(name="moe.permute", gemm_flops=0.0, elementwise_bytes=e * (z.chunk * h + z.chunk * k * h),
                      kernels=2)
    gemms = ((per_expert, fc1 // t, h), (per_expert, h, f // t)) * z.local
    experts = Compute(name="moe.experts", gemm_flops=2.0 * z.routed * h * (fc1 + f) / t,
                      elementwise_bytes=e * z.routed * ((variant.mlp_saved_per_ffn + 2) * f / t + 1),
                      kernels=(5 if moe.grouped_gemm else 5 * z.local), gemms=gemms)
    unpermute = Compute(name="moe.unpermute", gemm_flops=0.0,
                        elementwise_bytes=e * (z.chunk * k * h + z.chunk * h + 3 * z.chunk * h) + mask, kernels=4)
    dispatch, combine = dispatch_collectives(b=b, s=s, h=h, t=t, ep=ep, e=e, moe=moe)
    counts = [c for c, a in dispatch if a is None]  # the routing bookkeeping, before the permutation
    moved = [(c, a) for c, a in dispatch if a is not None]
    tail = (*(c for c, _ in moved), experts, *(c for c, _ in combine), unpermute)
    bwd_tail = (*(a for _, a in reversed(moved)),)
    if oases:  # the executor's steps: route, (join), the counts, permute
        return (route, *counts, permute, *tail), (*_bwd_head(unpermute, combine, experts), *bwd_tail,
                                                  backward_of(permute), backward_of(route))
    router = _merged("moe.router", route, permute)
    return (router, *counts, *tail), (*_bwd_head(unpermute, combine, experts), *bwd_tail, backward_of(router))


def _bwd_head(unpermute: Compute, combine, experts: Compute) -> tuple:
    """The MoE block's backward up to the dispatch's adjoints: unpermute's, the combine's adjoints,
    the experts'."""
    return (backward_of(unpermute), *(a for _, a in reversed(combine) if a), backward_of(experts))


def _merged(name: str, *parts: Compute) -> Compute:
    """One segment of consecutive local ``parts`` (the stock router: route and permute in one)."""
    return Compute(name=name, gemm_flops=sum(p.gemm_flops for p in parts),
                   elementwise_bytes=sum(p.elementwise_bytes for p in parts),
                   kernels=sum(p.kernels for p in parts), gemms=tuple(g for p in parts for g in p.gemms))


def dispatch_collectives(*, b: int, s: int, h: int, t: int, ep: int, e: int, moe: MoEShape
                         ) -> tuple[list[tuple[Collective, Collective]], list[tuple[Collective, Collective]]]:
    """(dispatch, combine) as (forward collective, its backward adjoint) pairs, in forward order;
    payloads as ``Collective.payload_bytes`` (all-to-all: what one rank sends and receives in all;
    all-gather: its output; reduce-scatter: its input); none where the group has one rank. The
    routing bookkeeping has no gradient, so no adjoint: the alltoall dispatcher's all-gather of
    each rank's token counts per expert (int64) over TP x EP (blocking: Megatron reads the counts
    on the host to size the all-to-alls), the allgather dispatcher's of the routing map (one byte a
    token and expert)."""
    z = _sizes(b=b, s=s, t=t, moe=moe, ep=ep)
    k = moe.topk
    adjoint = {"all_to_all": "all_to_all", "all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}

    def pair(name: str, kind: str, axis: str, n: int, payload: float, grad: bool = True, blocking: bool = False):
        fwd = Collective(name=name, kind=kind, axis=axis, group_size=n, payload_bytes=int(payload), blocking=blocking)
        return fwd, (dataclasses.replace(fwd, name=f"{name}.bwd", kind=adjoint[kind]) if grad else None)

    dispatch, combine = [], []
    if moe.dispatcher == "alltoall":
        copies = z.chunk * k  # the routed copies this rank sends (and, evenly, receives)
        if t * ep > 1:
            dispatch.append(pair("moe.ag.counts", "all_gather", TP_EP_AXIS, t * ep, t * ep * moe.num_experts * 8,
                                 grad=False, blocking=True))
        if ep > 1:
            dispatch += [pair("moe.dispatch", "all_to_all", EP_AXIS, ep, copies * h * e),
                         pair("moe.dispatch.probs", "all_to_all", EP_AXIS, ep, copies * e)]
        if t > 1:  # the experts' TP group gathers the copies every TP rank received
            dispatch += [pair("moe.ag", "all_gather", "tp", t, copies * t * h * e),
                         pair("moe.ag.probs", "all_gather", "tp", t, copies * t * e)]
            combine.append(pair("moe.rs", "reduce_scatter", "tp", t, copies * t * h * e))
        if ep > 1:
            combine.append(pair("moe.combine", "all_to_all", EP_AXIS, ep, copies * h * e))
    elif t * ep > 1:  # allgather: every token of the TP x EP group, its probabilities over all experts
        tokens = z.chunk * t * ep
        dispatch += [pair("moe.ag.map", "all_gather", TP_EP_AXIS, t * ep, tokens * moe.num_experts, grad=False),
                     pair("moe.ag.probs", "all_gather", TP_EP_AXIS, t * ep, tokens * moe.num_experts * e),
                     pair("moe.ag", "all_gather", TP_EP_AXIS, t * ep, tokens * h * e)]
        combine.append(pair("moe.rs", "reduce_scatter", TP_EP_AXIS, t * ep, tokens * h * e))
    return dispatch, combine


def moe_layer(dense: LayerDescription, *, micro_batch: int, seq: int, hidden: int, moe: MoEShape, tp: int,
              ep: int, bytes_per_element: int, variant: LayerVariant, hidden_dropout: bool = False,
              oases: bool = False) -> LayerDescription:
    """An MoE layer: the attention block of Megatron's ``dense`` layer (``planned.megatron_blocks``;
    the Oases tape's when ``dense`` is) followed by :func:`moe_block`. ``oases``: as the Oases
    executor runs it, whose sub-batches join after ``moe.route`` when the load-balancing loss is on
    (``MoEShape.aux_loss``: the loss needs the whole micro-batch's counts; ``LayerDescription.joins``)."""
    from .planned import megatron_blocks

    attn_f, attn_b = megatron_blocks(dense)["attention"]
    moe_f, moe_b = moe_block(micro_batch=micro_batch, seq=seq, hidden=hidden, moe=moe, tp=tp, ep=ep,
                             bytes_per_element=bytes_per_element, variant=variant, hidden_dropout=hidden_dropout,
                             oases=oases)
    joins = tuple(len(attn_f) + j for j in moe_block_joins(moe, oases=oases))
    return LayerDescription(backend=dense.backend, forward=(*attn_f, *moe_f), backward=(*moe_b, *attn_b),
                            joins=joins)


def moe_block_joins(moe: MoEShape, *, oases: bool) -> tuple[int, ...]:
    """Where the Oases executor's sub-batches join in :func:`moe_block`'s forward (``oases``):
    after ``moe.route`` (index 0) when the load-balancing loss is on (``MoEShape.aux_loss``: the
    loss needs the whole micro-batch's counts), else nowhere. ``sim`` (through :func:`moe_layer`)
    and ``plan`` (``plan.moe_blocks``) read it here."""
    return (0,) if oases and moe.aux_loss else ()


def moe_block_param_tensors(*, h: int, moe: MoEShape, t: int, ep: int, variant: LayerVariant) -> tuple[int, ...]:
    """Sizes of the MoE block's parameter tensors on one rank: the pre-MLP norm's weight and bias
    (0: none), the router's weight ``E x h`` and bias (replicated over TP), then per local expert
    fc1's weight and bias, fc2's weight and bias (fc2's bias whole: a row-parallel linear's)."""
    bias = 1 if variant.bias else 0
    norm_bias = 1 if variant.normalization == "LayerNorm" else 0
    fc1 = variant.fc1_rows(moe.ffn)
    expert = (h * fc1 // t, bias * fc1 // t, moe.ffn // t * h, bias * h)
    return (h, norm_bias * h, moe.num_experts * h, bias * moe.num_experts) + expert * (moe.num_experts // ep)


EXPERT_TENSORS_FROM = 4
"""Position in :func:`moe_block_param_tensors` of the first expert tensor: those after it are the
experts', whose gradients Megatron reduces over the expert-data-parallel group (DP / EP ranks)
instead of DP, and which its distributed optimizer shards over that group."""


def moe_block_saved_bytes(*, b: int, s: int, h: int, moe: MoEShape, t: int, ep: int, e: int,
                          variant: LayerVariant, hidden_dropout: bool = False,
                          kernels: Kernels = CUDA_KERNELS) -> float:
    """Bytes the MoE block keeps for backward per micro-batch (stock, no recompute), Megatron-Core
    0.19's ``MoELayer`` as ``tests/test_moe_description.py`` measures it (the ranks' mean: what a
    rank's experts keep follows its routing): the pre-MLP norm's input and statistics and the
    router's input (this rank's tokens), the router's top-k indices (int64) and probabilities;
    the dispatcher's bookkeeping (alltoall: an int64 per token and expert of the routing map and
    per routed copy; allgather: the gathered tokens' probabilities and routing map for the local
    experts and an int64 per received copy); per received copy each expert's fc1 input, its
    activation's kept tensors (``variant.mlp_saved_per_ffn``), the probability product's input
    and the probability; and the hidden dropout mask."""
    z = _sizes(b=b, s=s, t=t, moe=moe, ep=ep)
    E, k = moe.num_experts, moe.topk
    mask = e if kernels.dropout_mask is None else kernels.dropout_mask
    norm = z.chunk * e * h + norm_beyond_input(z.chunk, h, e=e, kernels=kernels, variant=variant)
    router = z.chunk * e * h + z.chunk * k * (8 + e)
    if moe.dispatcher == "alltoall":
        bookkeeping = 8 * z.chunk * (E + k)
    else:
        bookkeeping = z.chunk * t * ep * z.local * (e + 1) + 8 * z.routed
    experts = z.routed * e * (h + (variant.mlp_saved_per_ffn + 1) * moe.ffn / t + 1)
    return norm + router + bookkeeping + experts + (z.chunk * h * mask if hidden_dropout else 0)


def is_moe_op(name: str) -> bool:
    """An op of the MoE block (its events' keys carry ``MoEShape.key``)."""
    return name.startswith("moe.")


def moe_axis_ranks(axis: str, tp_ranks: tuple[int, ...], *, tp: int, ep: int) -> tuple[int, ...]:
    """The group of TP rank 0 of a stage on an MoE axis: EP (stride TP over data-parallel
    replicas 0..EP-1, Megatron's expert rank order tp-ep-dp-pp) or TP x EP; the simulator and the
    planner place the MoE collectives here."""
    if axis == EP_AXIS:
        return tuple(tp_ranks[0] + tp * j for j in range(ep))
    if axis == TP_EP_AXIS:
        return tuple(r + tp * j for j in range(ep) for r in tp_ranks)
    raise ModelingError(f"unknown MoE axis {axis!r} (expected one of {', '.join(MOE_AXES)})")


def moe_block_saved_delta(*, b: int, s: int, h: int, a: int, f: int, moe: MoEShape, t: int, ep: int, e: int,
                          variant: LayerVariant, hidden_dropout: bool, sequence_parallel: bool) -> float:
    """One MoE block's saved bytes (:func:`moe_block_saved_bytes`) minus the dense MLP block's of
    width ``f`` (``describe.saved.block_saved_bytes``; stock, CUDA kernels): what an MoE layer keeps
    beyond its dense twin, in the simulator's memory and the planner's alike."""
    from .saved import block_saved_bytes

    kw = dict(b=b, s=s, h=h, t=t, e=e, variant=variant, hidden_dropout=hidden_dropout)
    dense = block_saved_bytes("mlp", a=a, f=f, sequence_parallel=sequence_parallel, **kw)
    return moe_block_saved_bytes(moe=moe, ep=ep, **kw) - dense
