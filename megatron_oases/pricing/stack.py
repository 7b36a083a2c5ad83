"""The software stack a layer runs on, as part of the device (issue 35, item 1).

The same layer description costs different GPU and host time under different software: how many
kernels a segment launches, how much element-wise traffic its unfused pieces move, the precision
of the softmax on the s x s scores and the host's cost per kernel and per layer event. Those
numbers belong to the stack, not to the GPU, so each ``SoftwareStack`` carries its own and none
is shared between stacks by default. Three stacks:

* ``local``: Megatron-Core's local layer without Apex (what our builds, ``megatron-oases train``
  and the H200 measurements ran): the masked softmax falls back to torch's, which upcasts the
  scores to fp32 and adds dtype-conversion copies; every number is measured on an H200
  (``examples/gpu/h200-2026-11-26/``, docs/gpu.md; ``tests/test_sim_stack.py`` recomputes them).
* ``apex-fused``: Megatron-LM with Apex's fused scaled-masked softmax (fp16 / bf16 in one
  kernel), fused LayerNorm and the fused bias-GeLU / bias-dropout-add: the layer description's
  element-wise bytes are this stack's (``describe.megatron_1d`` counts the fused kernels' reads
  and writes). Its host cost per kernel and per layer event is local's, measured (the same
  eager Megatron layer around Apex's kernels; the published table cannot identify it, see below).
* ``transformer_engine``: Megatron-Core's TE layer (LayerNorm fused into the following GEMM,
  GEMM epilogues, fused attention by default): fewer kernels (``kernel_factor``), the description's
  element-wise bytes as apex-fused (TE's LayerNormLinear still writes the norm's output, which
  backward keeps); host cost per layer event fitted by leave-one-source-out cross-validation
  (``scripts/validate_published.py``). With a fused core attention on both, apex-fused and TE
  therefore differ in host cost only: equal on a GPU-bound run, TE's 800 us per event showing on a
  host-bound one.

The core attention (fused kernel or s x s scores) is a separate axis, named once in
``describe.core_attention``: a stack with a fused core attention drops the scores' traffic
whatever its softmax precision. Our trainer with ``--attention-backend flash|fused|auto`` is
therefore ``local`` with a fused core attention, not a fourth stack: its layers are still the
local ones (unfused element-wise work, eager host cost), only the core attention is SDPA.

Which stack a run is on comes from Megatron's own flags (:func:`stack_of`).
"""
from __future__ import annotations

import dataclasses

from ..describe.ops import Compute


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoftwareStack:
    """Per-stack costs the device model applies to a compute event (``DeviceModel.compute_ms``)."""

    name: str
    dispatch_us: float
    """Host time to issue one kernel (dispatcher + launch), us."""
    layer_framework_us: float
    """Host time per multi-kernel compute event beyond its kernels (module call, hooks,
    autograd), us."""
    elementwise_factor: tuple[float, float] = (1.0, 1.0)
    """Traffic moved per byte the description counts for the non-score element-wise work
    (norms, bias, activation, dropout, residual), (forward, backward)."""
    score_factor: tuple[float, float] = (1.0, 1.0)
    """The same for the s x s scores' traffic (mask, softmax, dropout on the scores), (forward,
    backward); 1 for a fused scale-mask-softmax in the layer's dtype."""
    kernel_factor: float = 1.0
    """Kernels per kernel of the description's count (``describe.megatron_1d`` counts the local
    layer's)."""
    adam_bytes_per_param: float = 28.0
    """HBM bytes one Adam step moves per fp32 parameter (``Compute.optimizer_params``): 28 for a
    fused multi-tensor Adam (Apex's or Transformer Engine's ``FusedAdam``: read p, g, m, v, write
    p, m, v in one kernel), which Megatron imports when either is installed."""
    source: str = ""
    """Where the numbers come from (measured on what, or fitted how)."""
    fused_grad_accumulation: bool = False
    """The weight-gradient GEMM accumulates into DDP's fp32 ``main_grad`` itself (Megatron's
    ``--gradient-accumulation-fusion``, on by default where Apex's ``fused_weight_gradient_mlp_cuda``
    or Transformer Engine is present): no separate add kernel (its fp32 epilogue, inside the GEMM,
    is not priced apart)."""
    host_measured_on: tuple[str, ...] = ()
    """The cards (``pricing.device_model.GPUS`` names) this stack's host costs were measured on;
    on any other card the simulator says it borrows them (``DeviceModel.pricing_notes``)."""

    def kernels(self, c: Compute) -> int:
        """Kernels the event launches under this stack (at least one)."""
        return max(1, round(max(1, c.kernels) * self.kernel_factor))

    def elementwise_bytes(self, c: Compute, *, scores_on_chip: bool) -> float:
        """Element-wise bytes the event moves under this stack; ``scores_on_chip``: a fused core
        attention keeps the scores on chip (their bytes dropped). The factors apply to the layer's
        segments, the events whose kernels the description counts (``Compute.kernels`` > 0: what
        was measured); other events (embedding, logits, optimizer) keep their bytes, plus the
        optimizer's Adam traffic at this stack's bytes per parameter."""
        scores = 0.0 if scores_on_chip else c.score_bytes
        adam = c.optimizer_params * self.adam_bytes_per_param
        if c.kernels <= 0:
            return c.elementwise_bytes - c.score_bytes + scores + adam
        backward = is_backward(c)
        rest = (c.elementwise_bytes - c.score_bytes) * self.elementwise_factor[backward]
        return rest + scores * self.score_factor[backward] + adam

    def host_ms(self, c: Compute) -> float:
        """Host time to issue the event: kernels x ``dispatch_us`` (+ the framework cost for a
        multi-kernel event, its block's share of it: ``Compute.framework_share``)."""
        k = self.kernels(c)
        return (k * self.dispatch_us + (self.layer_framework_us * c.framework_share if k > 1 else 0.0)) / 1e3


def is_backward(c: Compute) -> bool:
    """A backward event (``describe.ops.backward_of`` names it ``<forward>.bwd``)."""
    return c.name.endswith(".bwd")


# ---- the stacks --------------------------------------------------------------------------------
# local, measured on one H200 (torch 2.11, Megatron-Core 0.16.1 local layer, no Apex; docs/gpu.md):
#  dispatch_us 42.1, layer_framework_us 287: the least-squares line through the host time of the
#    16 host-bound layer events (hidden 256, sequence 256; 5 to 24 kernels; gpu_tiny_run{1,2}.json)
#    against their kernel counts: inside Megatron's layer a kernel costs 42 us of host time (module
#    calls, autograd, the launch), against 9.05 us for a bare eager add (gpu_dispatch_run{1,2}.json);
#  elementwise_factor: the MLP events' non-GEMM kernel time (torch.profiler, gpu_kernels.json)
#    over the description's bytes at 80% of the H200's 4,800 GB/s: forward 3.74 / 3.65 / 3.55
#    (a100-1.7B, h100-1.7B, zb-1.5B shapes), backward 3.06 / 2.34 / 2.14;
#  score_factor: the attention events' non-GEMM time less the non-score part (at the factor
#    above) over the score bytes: forward 4.31 / 4.59 / 4.17, backward 3.10 / 2.94 / 3.12 (torch's
#    fp32 softmax fallback, the dtype copies around it and the unfused mask and dropout).
#  adam_bytes_per_param 80: without Apex or TE Megatron-Core falls back to torch.optim.AdamW, whose
#    default on CUDA is the foreach implementation (torch/optim/adam.py, _multi_tensor_adam), one
#    pass per line, fp32: decoupled weight decay p *= (8), m.lerp_(g) (12), v *= beta2 (8),
#    v.addcmul_(g, g) (12), sqrt(v) (8), / bias correction (8), + eps (8), p.addcdiv_(m, denom)
#    (16). Checked against the optimizer events measured on an H100 and an H200
#    (tests/test_optimizer_traffic.py). With Apex present (``stack_of``) ``local`` keeps its fused Adam.
LOCAL = SoftwareStack(
    name="local", dispatch_us=42.1, layer_framework_us=287.0, elementwise_factor=(3.65, 2.51),
    score_factor=(4.36, 3.05), adam_bytes_per_param=80.0, host_measured_on=("h200-sxm",),
    source="measured on an H200 (examples/gpu/h200-2026-11-26/, docs/gpu.md): Megatron-Core's local layer "
           "without Apex")

# apex-fused: the description's bytes (fused kernels). Its host cost is local's, measured: Apex
# replaces a few kernels inside the same eager Megatron layer, not the Python module calls and
# autograd that make a kernel cost 42 us of host time there against 9 us for a bare launch; the
# kernel count (the description's, without the fallback's copies) carries the difference. Not
# fitted: the published table cannot tell 0 from 300 us per event for this stack (its rows are
# GEMM-bound, the host issues ahead and never shows; sim/calibrate/crossval.py takes the measured prior on
# such ties), while host-bound runs need it (DistSim Table 2, docs/sim_seeds.md: with the bare
# launch and 0 us the best strategy ran +125% too fast, with these -5%).
# transformer_engine: host cost per event not measured (no TE on the lent GPU): the
# cross-validated fit of docs/sim_validation.md (median over its folds; the spread is there);
# dispatch_us the bare eager launch measured on the H200 (9.5 / 8.6 us, gpu_dispatch_run*.json).
# Kernel counts from the code paths, not measured: Apex's layer launches what the description
# counts for the local layer less the softmax fallback's copies (the description's 12 / 5 are
# Megatron's fused-softmax path already); TE's LayerNormLinear and LayerNormMLP fold each norm
# into its GEMM and the bias into the GEMM epilogue (attention 12 -> 7, MLP 5 -> 3: 0.6).
APEX_FUSED = SoftwareStack(
    name="apex-fused", dispatch_us=LOCAL.dispatch_us, layer_framework_us=LOCAL.layer_framework_us,
    fused_grad_accumulation=True,
    source="host cost: local's, measured on an H200 (the same eager Megatron layer; the published table "
           "cannot identify it); kernels and bytes: the description's")
TRANSFORMER_ENGINE = SoftwareStack(  # fitted: 800 us in the 3 folds that see a TE row
    name="transformer_engine", dispatch_us=9.05, layer_framework_us=800.0, kernel_factor=0.6,
    fused_grad_accumulation=True,
    source="fitted (leave-one-source-out, docs/sim_validation.md); kernels from TE's fused modules")

STACKS: dict[str, SoftwareStack] = {s.name: s for s in (LOCAL, APEX_FUSED, TRANSFORMER_ENGINE)}


def stack_of(*, transformer_impl: str = "local", masked_softmax_fusion: bool = True,
             apex: bool = True, error: type[Exception] = ValueError) -> SoftwareStack:
    """The stack Megatron's flags run: ``--transformer-impl transformer_engine`` -> TE; the local
    layer with Megatron's default fusions and Apex present -> ``apex-fused``; the local layer with
    ``--no-masked-softmax-fusion`` or without Apex (``apex=False``: our trainer, whose builds carry
    no Apex) -> ``local`` (torch's fp32 softmax). With Apex present, that ``local`` keeps Apex's
    fused Adam (Megatron imports it whatever the softmax flag), so only its Adam bytes differ. TE
    with ``--no-masked-softmax-fusion`` is refused: TE's attention takes no such flag here."""
    if transformer_impl == "transformer_engine":
        if not masked_softmax_fusion:
            raise error("--no-masked-softmax-fusion applies to --transformer-impl local only")
        return TRANSFORMER_ENGINE
    if transformer_impl != "local":
        raise error(f"--transformer-impl must be local or transformer_engine (got {transformer_impl!r})")
    if not apex:
        return LOCAL
    if masked_softmax_fusion:
        return APEX_FUSED
    return dataclasses.replace(LOCAL, adam_bytes_per_param=APEX_FUSED.adam_bytes_per_param, fused_grad_accumulation=True,
                               source=LOCAL.source + "; Adam: Apex's fused Adam")
