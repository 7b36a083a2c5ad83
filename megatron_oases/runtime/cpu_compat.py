"""Let Megatron-Core 0.16 run on CPU + gloo, without touching the global ``torch`` module.

Megatron-Core hard-codes CUDA in tensor factories (``device="cuda"``,
``device=torch.cuda.current_device()``), in the RNG tracker (``torch.cuda.get_rng_state``) and in a
few stream calls. On a machine without CUDA we swap the ``torch`` name *inside those Megatron
modules only* for a proxy whose ``cuda`` namespace maps devices to CPU, RNG state to the CPU
generator and streams/events to no-ops; everything else is the real ``torch``. The RNG helpers of
``megatron.core.tensor_parallel.random`` are replaced by CPU versions, so the model-parallel RNG
tracker (dropout, recompute) works on the CPU generator exactly as it does on the CUDA one.

Active only when CUDA is absent (``install_cpu_compat`` is a no-op otherwise) and idempotent.
``Tensor.cuda()`` becomes the identity (it could only raise on a CPU-only build).

Mixed precision and the distributed optimizer: Megatron's Float16OptimizerWithFloat16Params
(``--bf16``/``--fp16``) and DistributedOptimizer sort parameters by
``param.type() == 'torch.cuda.FloatTensor'`` and friends in their constructors. A method call on
a tensor cannot be reached through a module's ``torch``, so those two constructors are wrapped
(``cuda_type_names``): for the duration of the call only the parameters they sort answer
``type()`` with the CUDA name of their dtype. Everything else they use is covered by the proxy
(``device='cuda'`` scalars of the loss scaler, ``torch.cuda.empty_cache``) or already runs on
CPU (Megatron's local multi-tensor fallbacks when Apex/TE are absent, the gloo process groups
the trainer asks for with ``use_gloo_process_groups``). Gloo (torch 2.13) all-reduces,
all-gathers and reduce-scatters bf16 and fp16 tensors itself, so no collective needs a shim.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import types

import torch

# Megatron modules that hard-code CUDA and get the proxy (see module docstring).
PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.transformer.utils",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.module",
    "megatron.core.models.gpt.gpt_model",
    # dist-checkpoint: the torch_dist writer synchronizes and allocates its failure flag on
    # ``torch.cuda.current_device()`` (state_dict_saver). From 0.19 the torch strategy imports
    # state_dict_saver lazily, at its first save, after the layer was installed: imported here,
    # it gets the proxy on every release (runtime/dist_ckpt.py proxies any later one).
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
)

_CPU = torch.device("cpu")
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace")
_installed = False


def _cpu_device(device):
    """Map any CUDA device spec (``"cuda"``, ``"cuda:0"``, ``0``, torch.device) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if str(device).startswith("cuda"):
        return _CPU
    return device


class _NoOpStream:
    """A CUDA stream stand-in: on CPU every op is already ordered on the calling thread."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NoOpEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoOpEvent:
    """A CUDA event stand-in (timing events report 0 ms on CPU; use wall clock there)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


@contextlib.contextmanager
def _stream_ctx(stream=None):
    yield


def _make_cuda_namespace() -> types.SimpleNamespace:
    real = torch.cuda
    random_ns = types.SimpleNamespace(
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=_cpu_manual_seed,
    )
    ns = types.SimpleNamespace(
        current_device=lambda: _CPU,
        device_count=lambda: 0,
        is_available=lambda: False,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=_cpu_manual_seed,
        manual_seed_all=_cpu_manual_seed,
        random=random_ns,
        Stream=_NoOpStream,
        Event=_NoOpEvent,
        stream=_stream_ctx,
        current_stream=lambda device=None: _NoOpStream(),
        default_stream=lambda device=None: _NoOpStream(),
        memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0,
        reset_peak_memory_stats=lambda device=None: None,
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None),
    )
    # Everything not overridden (amp decorators, tensor type names, OutOfMemoryError, ...) is real.
    for name in ("amp", "FloatTensor", "HalfTensor", "BFloat16Tensor", "OutOfMemoryError",
                 "CUDAGraph", "graphs", "_lazy_call", "_lazy_init", "default_generators"):
        if hasattr(real, name):
            setattr(ns, name, getattr(real, name))
    return ns


class _TorchOnCpu(types.ModuleType):
    """The ``torch`` that patched Megatron modules see: CUDA devices become CPU, rest is real."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, self._wrap_factory(getattr(torch, name)))

    @staticmethod
    def _wrap_factory(fn):
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        factory.__name__ = fn.__name__
        factory.__doc__ = fn.__doc__
        return factory

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _tensor_stays_on_cpu(self, device=None, non_blocking=False, memory_format=None):
    return self


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's clip-by-total-norm without its ``torch.cuda.FloatTensor`` type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _type_with_cuda_name(tensor):
    """``tensor.type()`` as a CUDA tensor of the same dtype would answer (``torch.cuda.X``); any
    other use of ``.type(...)`` (a conversion) goes to the real method."""
    real = torch.Tensor.type

    def type_(dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and tensor.device.type == "cpu":
            return "torch.cuda." + real(tensor)[len("torch."):]
        return real(tensor, dtype, non_blocking, **kwargs)

    return type_


@contextlib.contextmanager
def cuda_type_names(tensors):
    """Within the block, ``t.type()`` of each CPU tensor in ``tensors`` reports the CUDA name.

    Megatron's mixed-precision and distributed optimizers sort parameters by
    ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` /
    ``== 'torch.cuda.FloatTensor'`` and raise otherwise. The method is looked up on the tensor, so
    no module-scoped proxy can reach it; instead each parameter gets an instance attribute
    ``type`` (which shadows the class method) for the duration of the optimizer's constructor,
    and loses it afterwards. Nothing global changes, and no other tensor is affected.
    """
    marked = []
    try:
        for t in tensors:
            if isinstance(t, torch.Tensor) and "type" not in t.__dict__:
                t.type = _type_with_cuda_name(t)
                marked.append(t)
        yield
    finally:
        for t in marked:
            del t.type


def _optimizer_params(bound: inspect.BoundArguments) -> list:
    """The parameters a Megatron optimizer constructor sorts by type: those of its wrapped torch
    optimizer and (distributed optimizer) of its model chunks."""
    params = []
    opt = bound.arguments.get("optimizer")
    if opt is not None:
        params += [p for group in opt.param_groups for p in group["params"]]
    for chunk in bound.arguments.get("model_chunks") or ():
        params += list(chunk.parameters())
    return params


def _with_cuda_type_names(init):
    """Wrap a Megatron optimizer ``__init__`` so its parameters' ``type()`` names are CUDA's."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        with cuda_type_names(_optimizer_params(bound)):
            return init(*args, **kwargs)

    wrapped.__cpu_compat_wrapped__ = init
    return wrapped


# Megatron constructors that check ``param.type()`` against torch.cuda names (see cuda_type_names).
CUDA_TYPE_CHECKING_INITS = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
)


def cuda_available() -> bool:
    """True when this process can use CUDA (then no compatibility layer is needed)."""
    return torch.cuda.is_available()


def install_cpu_compat(force: bool = False) -> bool:
    """Install the CPU shims into Megatron-Core if CUDA is absent (or ``force``); returns whether active."""
    global _installed
    if _installed:
        return True
    if cuda_available() and not force:
        return False
    proxy = _TorchOnCpu()
    for modname in PATCHED_MODULES:
        try:
            importlib.import_module(modname)
        except ImportError:  # a module missing in this Megatron version needs no shim
            continue
    # The known offenders are imported above; any other loaded Megatron-Core module gets the proxy
    # too, so a CUDA literal on a path we did not list still lands on the CPU.
    for modname, module in list(sys.modules.items()):
        if modname.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = proxy
    # ``tensor.cuda()`` (e.g. the tied-embedding sync in LanguageModule) can only raise on a
    # CPU-only build; here it keeps the tensor where it is.
    torch.Tensor.cuda = _tensor_stays_on_cpu
    optim = importlib.import_module("megatron.core.optimizer.optimizer")
    optim.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    for modname, clsname in CUDA_TYPE_CHECKING_INITS:
        cls = getattr(importlib.import_module(modname), clsname)
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    from megatron_oases.runtime.cpu_moe_compat import install_cpu_moe_compat

    install_cpu_moe_compat()  # the MoE all-to-all's split sizes (its own module)
    rng = importlib.import_module("megatron.core.tensor_parallel.random")
    rng._get_cuda_rng_state = _cpu_get_rng_state
    rng._set_cuda_rng_state = _cpu_set_rng_state
    # On CPU the tracker's "CUDA" state *is* the CPU generator, so its check that the CPU state is
    # untouched inside fork() always fires; that one message is noise here.
    logging.getLogger(rng.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage())
    _installed = True
    return True


def cpu_compat_installed() -> bool:
    """Whether the shims are active in this process."""
    return _installed
