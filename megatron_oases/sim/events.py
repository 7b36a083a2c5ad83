"""Model + strategy -> the events each pipeline stage runs, read from the shared layer description.

DistSim §4.1-4.2: TP maps a layer onto compute and collective events; identical events (same
name, shapes and group class) are priced once. One representative device per stage stands for
its TP peers and DP replicas, which run the same events.
"""
from __future__ import annotations

import dataclasses
from typing import Union

from ..layers.description import Collective, Compute, megatron_1d_gpt_layer
from ..topology import Topology
from .device_model import SimError

SCHEDULES = ("gpipe", "1f1b")
OVERLAPS = ("none", "oases")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A dense GPT; the sizes Megatron's flags give."""

    num_layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    ffn: int = 0
    """FFN size; 0 means 4 * hidden."""
    bytes_per_element: int = 2

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "heads", "seq", "vocab", "micro_batch"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise SimError(f"model {f} must be a positive integer (got {getattr(self, f)!r})")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """How the model is split and scheduled."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    """gpipe | 1f1b"""
    recompute: bool = False
    """Full recompute: each layer's forward is rerun before its backward."""
    overlap: str = "none"
    """none (stock: compute waits on each collective) | oases (two sub-batches cross-overlap)."""

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "num_microbatches"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise SimError(f"strategy {f} must be a positive integer (got {getattr(self, f)!r})")
        if self.schedule not in SCHEDULES:
            raise SimError(f"schedule must be one of {', '.join(SCHEDULES)} (got {self.schedule!r})")
        if self.overlap not in OVERLAPS:
            raise SimError(f"overlap must be one of {', '.join(OVERLAPS)} (got {self.overlap!r})")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, *, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Megatron's default order: TP fastest, then DP, then PP."""
        return tp + self.tp * (dp + self.dp * pp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """One thing a device does; ``key`` names it for dedup and for the profile."""

    key: str
    name: str
    kind: str
    """compute | collective | p2p"""
    op: Union[Compute, Collective, None] = None
    ranks: tuple[int, ...] = ()
    """The collective's group, or (src, dst) for p2p; empty for compute."""
    nbytes: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageEvents:
    """One micro-batch (or sub-batch, under oases) through one stage, in execution order."""

    stage: int
    forward: tuple[Event, ...]
    backward: tuple[Event, ...]
    """Includes the recomputed forward of each layer before its backward when recompute is on."""
    send_forward: Event | None
    send_backward: Event | None
    grad_allreduce: Event | None
    params_per_rank: int
    chains: int
    """Sub-batches that run these events concurrently: 1, or 2 under oases."""


def check(model: ModelConfig, strategy: Strategy, world_size: int) -> None:
    """Validate the split; one line naming the whole product."""
    s = strategy
    if s.world_size != world_size:
        raise SimError(f"TP {s.tp} x PP {s.pp} x DP {s.dp} = {s.world_size} != {world_size} GPUs")
    if model.num_layers % s.pp:
        raise SimError(f"{model.num_layers} layers are not divisible by PP {s.pp}")
    if s.overlap == "oases" and model.micro_batch % 2:
        raise SimError(f"oases overlap splits a micro-batch in two; micro-batch {model.micro_batch} is odd")
    if model.hidden % s.tp or model.heads % s.tp or model.ffn % s.tp or model.vocab % s.tp:
        raise SimError(f"hidden {model.hidden}, heads {model.heads}, ffn {model.ffn}, vocab {model.vocab} "
                       f"must be divisible by TP {s.tp}")


def _group_tag(topo: Topology, ranks: tuple[int, ...]) -> str:
    """Group class: size + the link levels its ring crosses (same class -> same price)."""
    n = len(ranks)
    levels = sorted({topo.levels[topo.level_between(ranks[i], ranks[(i + 1) % n])].name
                     for i in range(n) if ranks[i] != ranks[(i + 1) % n]})
    return f"{n}:{'+'.join(levels) or 'self'}"


def _event(op: Compute | Collective, shape: str, topo: Topology, ranks: tuple[int, ...]) -> Event:
    if isinstance(op, Compute):
        return Event(key=f"compute:{op.name}[{shape}]", name=op.name, kind="compute", op=op)
    key = f"{op.kind}:{op.name}[{shape}]@{op.axis}{_group_tag(topo, ranks)}"
    return Event(key=key, name=op.name, kind="collective", op=op, ranks=ranks, nbytes=op.payload_bytes)


def _layer_params(h: int, f: int, t: int) -> int:
    """Weights + biases of one layer on one TP rank (LayerNorms replicated)."""
    return (4 * h * h + 2 * h * f) // t + (3 * h + f) // t + 2 * h + 4 * h


def build_stage_events(model: ModelConfig, strategy: Strategy, topo: Topology) -> list[StageEvents]:
    """Per-stage event lists for stage representatives (tp rank 0, dp replica 0)."""
    check(model, strategy, topo.world_size)
    s, m = strategy, model
    chains = 2 if s.overlap == "oases" else 1
    b = m.micro_batch // chains
    e = m.bytes_per_element
    layer = megatron_1d_gpt_layer(micro_batch=b, seq=m.seq, hidden=m.hidden, heads=m.heads, ffn=m.ffn,
                                  tp=s.tp, bytes_per_element=e)
    shape = f"b{b}s{m.seq}h{m.hidden}a{m.heads}f{m.ffn}t{s.tp}e{e}"
    act = b * m.seq * m.hidden * e
    per_stage = m.num_layers // s.pp
    out = []
    for st in range(s.pp):
        tp_ranks = tuple(s.rank(tp=i, pp=st) for i in range(s.tp))
        fwd_l = [_event(op, shape, topo, tp_ranks) for op in layer.forward]
        bwd_l = [_event(op, shape, topo, tp_ranks) for op in layer.backward]
        fwd, bwd = fwd_l * per_stage, (fwd_l + bwd_l if s.recompute else bwd_l) * per_stage
        params = per_stage * _layer_params(m.hidden, m.ffn, s.tp)
        if st == 0:  # vocab-parallel embedding: lookup, then all-reduce of the partial sums
            emb = Compute(name="embedding", gemm_flops=0.0, elementwise_bytes=3 * act)
            red = Collective(name="embedding.ar", kind="all_reduce", axis="tp", group_size=s.tp, payload_bytes=act)
            emb_b = Compute(name="embedding.bwd", gemm_flops=0.0, elementwise_bytes=3 * act)
            fwd = [_event(emb, shape, topo, tp_ranks)] + ([_event(red, shape, topo, tp_ranks)] if s.tp > 1 else []) + fwd
            bwd = bwd + [_event(emb_b, shape, topo, tp_ranks)]
            params += m.vocab * m.hidden // s.tp
        if st == s.pp - 1:  # final LN, vocab-parallel logits + cross-entropy; f all-reduces dX
            logits_flops = 2 * b * m.seq * m.hidden * m.vocab / s.tp
            ce_bytes = 4 * b * m.seq * (m.vocab // s.tp) * e
            head = Compute(name="logits", gemm_flops=logits_flops, elementwise_bytes=2 * act + ce_bytes)
            ce = Collective(name="loss.ar", kind="all_reduce", axis="tp", group_size=s.tp,
                            payload_bytes=3 * b * m.seq * 4)
            head_b = Compute(name="logits.bwd", gemm_flops=2 * logits_flops, elementwise_bytes=2 * act + ce_bytes)
            f_b = Collective(name="logits.f.bwd", kind="all_reduce", axis="tp", group_size=s.tp, payload_bytes=act)
            tp_only = s.tp > 1
            fwd = fwd + [_event(head, shape, topo, tp_ranks)] + ([_event(ce, shape, topo, tp_ranks)] if tp_only else [])
            bwd = [_event(head_b, shape, topo, tp_ranks)] + ([_event(f_b, shape, topo, tp_ranks)] if tp_only else []) + bwd
            if s.pp > 1:
                params += m.vocab * m.hidden // s.tp  # untied copy of the output embedding
        me = s.rank(pp=st)
        send_f = send_b = None
        if st < s.pp - 1:
            nxt = s.rank(pp=st + 1)
            send_f = Event(key=f"p2p:activation[{shape}]@pp{_group_tag(topo, (me, nxt))}", name="send_forward",
                           kind="p2p", ranks=(me, nxt), nbytes=act * chains)
        if st > 0:
            prv = s.rank(pp=st - 1)
            send_b = Event(key=f"p2p:activation[{shape}]@pp{_group_tag(topo, (me, prv))}", name="send_backward",
                           kind="p2p", ranks=(me, prv), nbytes=act * chains)
        grad = None
        if s.dp > 1:
            dp_ranks = tuple(s.rank(dp=d, pp=st) for d in range(s.dp))
            gbytes = 4 * params  # fp32 main_grad buffers
            grad_op = Collective(name="grad.ar", kind="all_reduce", axis="dp", group_size=s.dp, payload_bytes=gbytes)
            grad = _event(grad_op, f"p{params}", topo, dp_ranks)
        out.append(StageEvents(stage=st, forward=tuple(fwd), backward=tuple(bwd), send_forward=send_f,
                               send_backward=send_b, grad_allreduce=grad, params_per_rank=params, chains=chains))
    return out


def unique_events(stages: list[StageEvents]) -> dict[str, Event]:
    """Each distinct event once (DistSim's profiling dedup): key -> first occurrence."""
    seen: dict[str, Event] = {}
    for st in stages:
        for ev in (*st.forward, *st.backward, st.send_forward, st.send_backward, st.grad_allreduce):
            if ev is not None and ev.key not in seen:
                seen[ev.key] = ev
    return seen
