"""The Oases executor: two sub-batches, async TP collectives, fine-grained and cross-pass recompute.

A pipeline stage's layers run as one autograd node (``OasesStage``) so Megatron's schedules
(no pipelining, 1F1B, interleaved) see an ordinary module. Inside, each sub-batch's pass is a
generator that yields whenever it has launched a collective; ``interleave`` resumes the other
sub-batch meanwhile and waits on a handle only when its sub-batch needs the result (Algorithm 1).

* Forward: both sub-batches through every layer; layer boundaries are not barriers.
* Backward (one generator per sub-batch over all layers of the stage, last to first): recompute a
  layer's local steps from its saved boundaries, then walk its tape in reverse, all-reducing the
  gradients at the column linears' inputs async. While one sub-batch waits for its all-reduce,
  the other recomputes or runs backward: recompute and backward of the two sub-batches overlap
  across layers (cross-pass). ``cross_pass=False`` puts a barrier between each layer's recompute
  and backward passes instead (Table 3's ablation).
* Fine-grained recompute: the outputs of the forward all-reduces are saved, so recompute starts
  after them and issues no collective; the gradient of an all-reduce's input equals its output's
  (Eq. 1). Without it, recompute repeats the forward all-reduces (tagged "recompute").
* Sequence parallelism: the tape's collectives are all-gathers before the column linears and
  reduce-scatters after the row linears (backward: reduce-scatter, all-gather); they overlap the
  other sub-batch the same way, and fine-grained recompute saves their outputs.
* MoE layers (``moe_tape.py``): the dispatch and combine all-to-alls (``AllToAll``; backward: the
  splits swapped) and the experts' uneven TP gathers / reduce-scatters overlap the same way; a
  ``Barrier`` step waits in forward until both sub-batches have routed (the load-balancing loss
  needs the micro-batch's counts); what a step computes in forward for its recompute and backward
  (routing metadata) lives in the micro-batch's ``BlockInputs.scratch``.

What each collective step kind launches, forward and backward, is ``comm_steps.py``'s; the step
kinds are ``steps.py``'s.

Parameter gradients: the first sub-batch to finish a step's backward adds them straight into
Megatron DDP's ``main_grad`` buffers (no per-sub-batch copies kept); the last one's autograd call
accumulates onto the parameters, so Megatron DDP's per-parameter hooks fire exactly once per
micro-batch, as with stock layers (``--overlap-grad-reduce`` needs that).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from megatron_oases.describe.split import sub_batch_sizes
from megatron_oases.schedules.oases.comm_steps import CommSteps, accumulate, own_chunk
from megatron_oases.schedules.oases.dropout import MicroBatchMasks, active_sub_batch
from megatron_oases.schedules.oases.options import OasesOptions
from megatron_oases.schedules.oases.release import Placeholders, release_unread
from megatron_oases.schedules.oases.steps import (FORWARD_COLLECTIVES, Barrier, BackwardAllGather, BlockInputs,
                                                  LayerTape, Local, UnsupportedLayer)
from megatron_oases.schedules.oases.wgrad import sub_batch_sums

BARRIER = object()
"""Yielded by a program to wait until every other program reached its barrier too."""


def interleave(programs, resume_context) -> None:
    """Run generator ``programs`` round-robin; each yields an async work handle (switch to the
    next program, wait on the handle before resuming this one) or ``BARRIER``."""
    n = len(programs)
    pending = [None] * n
    done = [False] * n
    while not all(done):
        for i in range(n):
            if done[i] or pending[i] is BARRIER:
                continue
            if pending[i] is not None:
                pending[i].wait()
            pending[i] = None
            with resume_context(i):
                try:
                    pending[i] = next(programs[i])
                except StopIteration:
                    done[i] = True
        if all(done[i] or pending[i] is BARRIER for i in range(n)):
            pending = [None] * n


def _leaves(env: dict, names) -> dict:
    return {n: env[n].detach().requires_grad_() for n in names}


def _bytes_of(saved) -> int:
    """Bytes of the distinct tensor storages reachable from nested lists/dicts/tuples."""
    seen, total, todo = set(), 0, [saved]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            ptr = obj.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
    return total


def _split_rows(t, sizes: list[int]) -> list:
    """Each sub-batch's rows of a per-sample ``[b, ...]`` tensor (position ids); a shared one
    (None, or a broadcast first dim) as it is."""
    if t is None or t.dim() == 0 or t.shape[0] != sum(sizes) or len(sizes) == 1:
        return [t] * len(sizes)
    return list(torch.split(t, sizes, dim=0))


def _add_param_grad(param: torch.nn.Parameter, g: torch.Tensor) -> None:
    """Add ``g`` to ``param``'s gradient without autograd: into Megatron DDP's ``main_grad``
    buffer (unless the linear's fused weight-gradient accumulation already wrote it there,
    ``grad_added_to_main_grad``), else into ``param.grad``."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        if not getattr(param, "grad_added_to_main_grad", False):
            main.add_(g)
    elif param.grad is None:
        param.grad = g
    else:
        param.grad.add_(g)


class _StepState:
    """What the forward leaves for the backward of one micro-batch."""

    def __init__(self, n_sub: int, n_layers: int, masks: MicroBatchMasks, inputs):
        self.masks = masks
        self.inputs = inputs
        """Each sub-batch's ``BlockInputs`` (its attention mask, the block's rotary embeddings)."""
        self.saved = [[{} for _ in range(n_layers)] for _ in range(n_sub)]
        self.outputs = [None] * n_sub
        self.grad_inputs = [None] * n_sub
        self.sizes: list[int] = []
        """Each sub-batch's size (the outputs are released once concatenated)."""
        self.stage_grads: dict = {}
        """id(stage parameter) -> its gradient summed over the sub-batches (``LayerTape.stage_params``)."""


class OasesRunner:
    """Executes the layers of one model chunk (their ``LayerTape``s) with the Oases schedule."""

    def __init__(self, tapes: list[LayerTape], options: OasesOptions,
                 placeholders: Placeholders | None = None):
        """``placeholders``: where released step boundaries point (``release.Placeholders``);
        the runners of one model chunk share one, so a chunk cut into several runners (a plan's
        degrees) keeps one placeholder element, not one per runner."""
        self.tapes = tapes
        self.options = options
        self._arrivals: dict = {}
        """(layer, step) -> sub-batches whose backward passed the step in this micro-batch."""
        self._step_params: dict = {}
        """(layer, step) -> the parameters the step's graph reaches (found on its first backward)."""
        self._last_saved_bytes = 0
        self._placeholders = placeholders or Placeholders()
        self._comm = CommSteps(options.skip_collectives)

    # ----- forward -------------------------------------------------------------------------
    def stage_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients ``backward`` returns (``LayerTape.stage_params``)."""
        return [get() for tape in self.tapes for _, get in tape.stage_params]

    def forward(self, stage_input: torch.Tensor, inputs: BlockInputs) -> tuple[torch.Tensor, _StepState]:
        dim = self.tapes[0].in_batch_dim
        sizes = sub_batch_sizes(stage_input.shape[dim], self.options.sub_batches)
        subs = [s.contiguous() for s in torch.split(stage_input, sizes, dim=dim)]
        masks = MicroBatchMasks(sizes, redraw=self.options.recompute)
        scratch = {"sub_batches": len(sizes)}
        state = _StepState(len(subs), len(self.tapes), masks,
                           [dataclasses.replace(inputs, attention_mask=m, position_ids=p, sub_batch=i,
                                                scratch=scratch)
                            for i, (m, p) in enumerate(zip(self._split_mask(inputs.attention_mask, sizes),
                                                           _split_rows(inputs.position_ids, sizes)))])
        programs = [self._forward_program(i, x, state) for i, x in enumerate(subs)]
        with self._collectives_off():
            interleave(programs, lambda i: active_sub_batch(masks, i, recompute=False))
        self._last_saved_bytes = _bytes_of([[kept for kept, tape in zip(sub, self.tapes) if tape.recompute]
                                            for sub in state.saved])
        out = torch.cat(state.outputs, dim=1)
        self._share_output(state, out)
        state.sizes, state.outputs = sizes, None
        return out, state

    def _share_output(self, state: _StepState, out: torch.Tensor) -> None:
        """Where the last tape keeps its graph, point each sub-batch's output (its graph's root)
        at its slice of the concatenated ``out``, so the two copies do not both stay alive until
        backward (the logits of the output layer are the largest activation)."""
        tape = self.tapes[-1]
        last = tape.steps[-1]
        if self._recomputes(tape) or not isinstance(last, Local) or tape.output not in last.outputs:
            return
        start = 0
        for i, sub in enumerate(state.outputs):
            root = state.saved[i][-1][last.name][1][tape.output]
            if root._base is None and root.shape == sub.shape:
                root.data = out.narrow(1, start, sub.shape[1])
            start += sub.shape[1]

    def _recomputes(self, tape: LayerTape) -> bool:
        """Whether ``tape``'s local steps are recomputed in backward (else their graphs are kept)."""
        return self.options.recompute and tape.recompute

    def _forward_program(self, i: int, x: torch.Tensor, state: _StepState):
        for li, tape in enumerate(self.tapes):
            saved = state.saved[i][li]
            keep_graph = not self._recomputes(tape)
            keep = set() if keep_graph else set(tape.saved_boundaries(self.options.fine_grained_recompute))
            env = {tape.input: x}
            for step in tape.steps:
                if isinstance(step, Local):
                    if keep_graph:
                        leaves = _leaves(env, step.inputs)
                        with torch.enable_grad():
                            graph = step.fn(leaves, state.inputs[i])
                        saved[step.name] = (leaves, graph)
                        outs = {k: v.detach() for k, v in graph.items()}
                        release_unread(leaves, graph, self._placeholders)
                    else:
                        outs = step.fn({n: env[n] for n in step.inputs}, state.inputs[i])
                    env.update(outs)
                elif isinstance(step, FORWARD_COLLECTIVES):
                    yield from self._comm.forward(step, env, tape, state.inputs[i], recompute=False)
                elif isinstance(step, BackwardAllGather):
                    env[step.dst] = own_chunk(env[step.src], step.dim, step.group)
                elif isinstance(step, Barrier):
                    yield BARRIER
            for name in keep:
                saved[name] = env[name]
            x = env[tape.output]
        state.outputs[i] = x

    # ----- backward ------------------------------------------------------------------------
    def backward(self, state: _StepState, grad_output: torch.Tensor):
        """The gradient of the stage input, and of each of ``stage_params()`` (None if unused)."""
        grads = [g.contiguous() for g in torch.split(grad_output, state.sizes, dim=1)]
        programs = [self._backward_program(i, g, state) for i, g in enumerate(grads)]
        with self._collectives_off(), sub_batch_sums(self.options.sub_batches):
            interleave(programs, lambda i: active_sub_batch(state.masks, i, recompute=True))
        assert not self._arrivals, "parameter gradients left undelivered"
        stage = [state.stage_grads.pop(id(p), None) for p in self.stage_params()]
        return torch.cat(state.grad_inputs, dim=self.tapes[0].in_batch_dim), stage

    def _recompute(self, i: int, li: int, state: _StepState):
        """Rebuild layer ``li``'s local graphs for sub-batch ``i`` from its saved boundaries."""
        tape, saved = self.tapes[li], state.saved[i][li]
        env, graphs = {tape.input: saved[tape.input]}, {}
        for step in tape.recompute_steps:
            if isinstance(step, Local):
                leaves = _leaves(env, step.inputs)
                with torch.enable_grad():
                    outs = step.fn(leaves, state.inputs[i])
                graphs[step.name] = (leaves, outs)
                env.update({k: v.detach() for k, v in outs.items()})
            elif isinstance(step, FORWARD_COLLECTIVES):
                if step.dst in saved:
                    env[step.dst] = saved[step.dst]
                else:
                    yield from self._comm.forward(step, env, tape, state.inputs[i], recompute=True)
            elif isinstance(step, BackwardAllGather):
                env[step.dst] = own_chunk(env[step.src], step.dim, step.group)
        return graphs

    def _backward_program(self, i: int, grad: torch.Tensor, state: _StepState):
        for li in reversed(range(len(self.tapes))):
            tape = self.tapes[li]
            if self._recomputes(tape):
                graphs = yield from self._recompute(i, li, state)
                if not self.options.cross_pass:
                    yield BARRIER
            else:
                graphs = state.saved[i][li]
            grads = {tape.output: grad}
            for step in reversed(tape.steps):
                if isinstance(step, Local):
                    self._local_backward(li, step, graphs.pop(step.name), grads, tape, state)
                else:  # a collective (CommSteps.backward); a Barrier is forward only
                    yield from self._comm.backward(step, grads, tape, state.inputs[i])
            state.saved[i][li] = None
            grad = grads.pop(tape.input)
            if not self.options.cross_pass:
                yield BARRIER
        state.grad_inputs[i] = grad

    def _local_backward(self, li: int, step: Local, graph, grads: dict, tape: LayerTape,
                        state: _StepState) -> None:
        """One autograd call for a local step of one sub-batch. Every sub-batch but the last to
        reach the step adds its parameter gradients straight into the gradient buffers; the
        last one runs ``autograd.backward`` onto the parameters, so Megatron DDP's hooks fire
        exactly once per micro-batch (``--overlap-grad-reduce``) with the whole sum. A step with
        stage parameters (``LayerTape.stage_params``) returns theirs to the stage instead."""
        leaves, outs = graph
        roots = [(outs[n], grads.pop(n)) for n in step.outputs if n in grads]
        names = list(leaves)
        key = (li, step.name)
        arrived = self._arrivals.get(key, 0) + 1
        step_params = self._step_params.get(key, tape.params)
        extra = tuple(get() for name, get in tape.stage_params if name == step.name)
        if extra:
            self._stage_param_backward(key, roots, leaves, step_params, extra, grads, state,
                                       last=arrived == self.options.sub_batches)
            return
        if arrived == self.options.sub_batches:
            self._arrivals.pop(key, None)
            torch.autograd.backward([r for r, _ in roots], [g for _, g in roots],
                                    inputs=[leaves[n] for n in names] + list(step_params))
            for n in names:
                if leaves[n].grad is not None:
                    accumulate(grads, n, leaves[n].grad)
            return
        self._arrivals[key] = arrived
        got = torch.autograd.grad([r for r, _ in roots], [leaves[n] for n in names] + list(step_params),
                                  [g for _, g in roots], allow_unused=True)
        for n, g in zip(names, got):
            if g is not None:
                accumulate(grads, n, g)
        used = []
        for prm, g in zip(step_params, got[len(names):]):
            if g is not None:
                _add_param_grad(prm, g)
                used.append(prm)
        self._step_params[key] = tuple(used)

    def _stage_param_backward(self, key, roots, leaves: dict, step_params, extra, grads: dict,
                              state: _StepState, last: bool) -> None:
        """``autograd.grad`` for a step whose ``extra`` parameters' gradients go back through the
        stage's autograd edge (summed over the sub-batches), so a parameter the model also uses
        outside the stage (the tied output weight) has its DDP hook fire once, after both uses."""
        if last:
            self._arrivals.pop(key, None)
        else:
            self._arrivals[key] = self._arrivals.get(key, 0) + 1
        names = list(leaves)
        got = torch.autograd.grad([r for r, _ in roots], [leaves[n] for n in names]
                                  + list(step_params) + list(extra),
                                  [g for _, g in roots], allow_unused=True)
        for n, g in zip(names, got):
            if g is not None:
                accumulate(grads, n, g)
        for prm, g in zip(step_params, got[len(names):]):
            if g is not None:
                raise UnsupportedLayer(f"step {key[1]}: returns a stage parameter's gradient and "
                                       f"delivers another parameter's; give it its own step")
        self._step_params[key] = ()
        for prm, g in zip(extra, got[len(names) + len(step_params):]):
            if g is None:
                continue
            if getattr(prm, "grad_added_to_main_grad", False):
                state.stage_grads[id(prm)] = g  # a placeholder: the GEMM accumulated into main_grad
            else:
                accumulate(state.stage_grads, id(prm), g)

    # ----- helpers -------------------------------------------------------------------------
    def saved_bytes(self) -> int:
        """Bytes the last forward kept for backward, one micro-batch, for the layers. With
        recompute that is all the layers hold between the passes; without, only the step
        boundaries (the autograd graphs' own saved tensors are not counted). The head's tapes
        (``LayerTape.recompute`` False) keep what stock keeps for the embedding and the logits
        and are not counted."""
        return self._last_saved_bytes

    def _collectives_off(self):
        stack = contextlib.ExitStack()
        for tape in self.tapes:
            stack.enter_context(tape.collectives_off())
        return stack

    @staticmethod
    def _split_mask(mask, sizes):
        batch = sum(sizes)
        if mask is None or mask.dim() == 0 or mask.shape[0] != batch or batch == 1:
            return [mask] * len(sizes)
        from megatron_oases.layers.core_attention import split_batch

        return split_batch(mask, sizes)


class OasesStage(torch.autograd.Function):
    """The stage's layers as one autograd node whose backward runs the Oases backward."""

    @staticmethod
    def forward(ctx, hidden_states, runner: OasesRunner, inputs: BlockInputs, *stage_params):
        """``stage_params``: ``runner.stage_params()``, inputs so that their gradients flow back
        through this node."""
        out, state = runner.forward(hidden_states, inputs)
        ctx.runner, ctx.state = runner, state
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad, stage = ctx.runner.backward(ctx.state, grad_output)
        ctx.state = None
        return (grad, None, None, *stage)
