"""The one-GPU overlap benchmark over MoE layers: rank 0 of a TP x EP fake world (issue 51 item 2).

``scripts/bench_gpu_overlap.py --tp T --ep E`` builds rank 0 of a fake world of ``T x E`` ranks
(Megatron carves EP out of data parallelism, so DP = E): its attention is rank 0's TP shard, its
MoE layers hold rank 0's ``num_experts / E`` local experts, and every collective of the layer's
groups (TP, EP, TP x EP) becomes a stand-in of priced duration, the expert-parallel
``all_to_all_single`` of the dispatch and the combine included (``standins``,
``parallel.collectives`` watches it). Three things a dense fake world does not need:

* **Routing metadata.** The dispatcher all-gathers its token counts per expert over TP x EP and
  sizes the all-to-alls and the expert GEMMs from them; a stand-in moves no data, so the counts
  would be uninitialised memory. Every integer all-gather's output is therefore filled with
  replicas of rank 0's input: every fake rank routes as rank 0, so the splits are consistent
  (what rank 0 sends and receives adds up) and rank 0 computes exactly what it receives.
* **Routing that no garbage steers.** The values in the fake world are meaningless (a
  stand-in's output is uninitialised), and the router would route them: every MoE router's
  logits are replaced by Megatron's own benchmark-mode random logits (``RandomSTE``, what
  ``--moe-router-force-load-balancing`` does inside ``TopKRouter.forward``), applied at the
  gating both schedules call, so both route about evenly (a fresh random draw each step).
* **What is priced.** The all-to-alls are priced from the run's actual payload (the rows rank 0
  sends, about ``tokens x topk x h`` under the random routing), of which ``(EP - 1) / EP`` go
  over the link, as ``describe.moe`` prices them on a link (``DeviceModel.collective_ms``). The
  data-parallel gradient reduction over DP = E (``finalize_model_grads``) runs as a stand-in of
  zero duration: a real run reduces once per global batch, the benchmark's step is one
  micro-batch, and stock and Oases issue the same one. Every group's collective runs on the one
  link (``--link-gbps``): EP is not priced on a slower level than TP.
"""
from __future__ import annotations

import dataclasses


def is_moe_run(trainer_flags: list[str]) -> bool:
    """Whether the trainer's flags build MoE layers (``--num-experts``): then the benchmark runs
    in an ``ExpertWorld``, at EP 1 too (its count gather over TP sizes the expert GEMMs)."""
    return any(tok.split("=", 1)[0] == "--num-experts" for tok in trainer_flags)


def moe_layers(model) -> list:
    """The ``MoELayer`` modules of ``model`` (a list of model chunks or one module)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def random_router_logits(router) -> None:
    """``router.gating`` returns Megatron's benchmark-mode random logits (``apply_random_logits``:
    a normal draw of the logits' shape from the expert-parallel RNG, gradient passed straight
    through) on this instance: stock's ``TopKRouter.forward`` and the Oases tape's route step
    both call ``gating``, so both schedules route the same way whatever the activations hold."""
    from megatron.core.transformer.moe.moe_utils import apply_random_logits

    if getattr(router.gating, "_random_logits", False):
        return
    gating = router.gating

    def random_gating(x):
        return apply_random_logits(gating(x))

    random_gating._random_logits = True
    router.gating = random_gating


class _Done:
    """The handle of a collective replaced by nothing (compute only): already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def fill_routing_metadata(call) -> bool:
    """When ``call`` is an integer all-gather (the dispatcher's token counts), fill its output with
    replicas of its input: every fake rank routes as rank 0. Returns whether it filled."""
    if call.kind != "all_gather" or not call.tensors or call.tensors[-1].is_floating_point():
        return False
    inp, outs = call.tensors[-1], call.tensors[:-1]
    if len(outs) == 1:  # all_gather_into_tensor(output, input): group_size pieces along dim 0
        outs[0].view(call.group_size, *inp.shape).copy_(inp.unsqueeze(0).expand(call.group_size, *inp.shape))
    else:  # all_gather(list of outputs, input)
        for out in outs:
            out.copy_(inp)
    return True


@dataclasses.dataclass
class ExpertWorld:
    """Rank 0 of a ``tp x ep`` fake world running an MoE model: which groups are priced and the
    replacement every measurement installs (``Bench``, ``measure``)."""

    tp: int
    ep: int
    priced_groups: tuple = ()
    """The layers' process groups (TP, the routers' TP x CP, the dispatchers' EP, expert TP and
    TP x EP): their collectives are priced, every other group's (DP) lasts zero."""

    @property
    def world_size(self) -> int:
        return self.tp * self.ep

    def prepare(self, tr) -> dict:
        """Random router logits on every MoE layer of the trainer's model; the layers' groups
        become the priced ones. Returns what the JSON states about the MoE layers."""
        from megatron.core import parallel_state as ps

        layers = moe_layers(tr.model)
        if not layers:
            raise SystemExit("bench_gpu_overlap.py: --num-experts built no MoE layer; check --moe-layer-freq")
        groups = [ps.get_tensor_model_parallel_group()]
        for moe in layers:
            random_router_logits(moe.router)
            d = moe.token_dispatcher
            groups += [getattr(moe.router, "tp_cp_group", None), d.ep_group, d.tp_group,
                       getattr(d, "tp_ep_group", None)]
        self.priced_groups = tuple({id(g): g for g in groups if g is not None}.values())
        d = layers[0].token_dispatcher
        return {"moe_layers": len(layers), "num_experts": layers[0].config.num_moe_experts,
                "local_experts": len(d.local_expert_indices), "topk": layers[0].router.topk,
                "dispatcher": type(d).__name__,
                "routing": "random logits (Megatron's RandomSTE), every fake rank routing as rank 0"}

    def priced(self, call) -> bool:
        return any(call.group is g for g in self.priced_groups)

    def replacement(self, stand=None, seen: list | None = None):
        """The ``replace_watched_collectives`` function of a measurement: fill the routing
        metadata, then ``stand`` (a ``StandIns`` made with ``priced=self.priced``; None: compute
        only, a completed handle); ``seen`` collects (kind, group size, payload bytes, priced)."""
        def replace(call):
            fill_routing_metadata(call)
            if seen is not None:
                seen.append((call.kind, call.group_size, call.payload_bytes, self.priced(call)))
            if stand is not None:
                return stand(call)
            return _Done() if call.async_op else None

        return replace

    def calls(self, step) -> tuple[list, list]:
        """One ``step``'s collectives as (kind, group size, payload bytes): the priced ones (what
        the link is matched to) and the others."""
        from megatron_oases.parallel.collectives import replace_watched_collectives

        seen: list = []
        with replace_watched_collectives(self.replacement(None, seen)):
            step()
        return [c[:3] for c in seen if c[3]], [c[:3] for c in seen if not c[3]]
