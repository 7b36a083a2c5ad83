"""Let Megatron-LM's training loop (``megatron.training.pretrain``) run on CPU + gloo ranks.

An extension of :mod:`megatron_oases.runtime.cpu_compat` (Megatron-Core) to the modules of the
Megatron-LM checkout's ``megatron.training`` package, built the same way: active only when CUDA
is absent, nothing global faked, only

* the ``torch`` name *inside* the ``megatron.training`` modules listed in ``PATCHED_MODULES``
  (and any other loaded one that hard-codes CUDA) becomes a proxy: CUDA tensor factories
  (``device='cuda'``, ``torch.cuda.current_device()``) land on the CPU, RNG state is the CPU
  generator's, streams and events are no-ops, memory counters read 0 (a CPU rank has no device
  allocator to report), and ``torch.cuda.device_count()`` is 1: each rank drives one device,
  its CPU. That last one is what ``initialize._initialize_distributed`` and
  ``initialize._set_random_seed`` branch on to build the model-parallel groups and seed the
  model-parallel RNG tracker; with 0 they would skip both.
* ``training.initialize_megatron`` (the name ``pretrain`` calls) is wrapped to pass Megatron's
  own ``allow_no_cuda=True``, which skips its "Megatron requires CUDA." assertion.
* ``fused_kernels`` inside ``megatron.training.initialize`` loads nothing (``_NoFusedKernels``):
  upstream's ``load`` only runs ``nvcc -V``, which a CPU machine does not have (0.16; from 0.17
  ``initialize`` loads no fused kernels).
* ``get_device_arch_version`` inside ``megatron.training.arguments`` answers 0 (no CUDA
  architecture) instead of querying the GPU's properties; ``validate_args`` then wants
  CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1, set here when unset (only CUDA reads it).
* Megatron-Core's torch_dist checkpoint strategies (loaded lazily) get the Megatron-Core proxy
  (``runtime.dist_ckpt.dist_checkpointing``), so ``--save`` / ``--load`` work.
* ``build_pretraining_data_loader`` inside ``megatron.training.training`` gives each loader its
  own generator (``_loader_keeps_global_rng``): on CPU the global generator stands in for the
  CUDA one that dropout draws from, and only TP rank 0 iterates a loader, so its draws would give
  that rank other dropout masks than its TP peers.

Flags that need the CUDA caching allocator (``--log-memory-to-tensorboard``,
``--record-memory-history``) or CUDA-only machinery (``--cuda-graph-impl``, ``--inprocess-restart``,
``--profile``) are refused up front by ``cpu_training_refusal``, one line naming the flag.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

import torch

from megatron_oases import mcore_compat
from megatron_oases.runtime import cpu_compat

# megatron.training modules (Megatron-LM core_v0.16.1) that hard-code CUDA on the paths
# ``pretrain`` takes: initialize (device count, seeds), training (startup times, loss dicts,
# exit checks, data-iterator flags), utils (memory report, batch broadcast, reductions),
# checkpointing (iteration agreement, RNG state), inprocess_restart.
PATCHED_MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.checkpointing",
    "megatron.training.inprocess_restart",
    "megatron.training.global_vars",
)

# Megatron-LM flags that need CUDA-only machinery, with why; refused on CPU.
CUDA_ONLY_FLAGS = (
    ("log_memory_to_tensorboard", "--log-memory-to-tensorboard", "reads the CUDA allocator"),
    ("record_memory_history", "--record-memory-history", "records the CUDA allocator"),
    ("profile", "--profile", "drives the CUDA profiler"),
    ("inprocess_restart", "--inprocess-restart", "restarts NCCL in process"),
    ("use_torch_fsdp2", "--use-torch-fsdp2", "shards the model with torch FSDP2 on CUDA devices"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "shards the model in Megatron-FSDP's CUDA buffers"),
)

_installed = False


def _training_cuda_namespace():
    ns = cpu_compat._make_cuda_namespace()
    ns.device_count = lambda: 1  # one device per rank: its CPU (see module docstring)
    ns.set_device = lambda device: None
    ns.memory_reserved = lambda device=None: 0
    ns.max_memory_reserved = lambda device=None: 0
    ns.device_memory_used = lambda device=None: 0
    return ns


class _TrainingTorchOnCpu(cpu_compat._TorchOnCpu):
    """``torch`` as the patched ``megatron.training`` modules see it."""

    def __init__(self):
        super().__init__()
        self.cuda = _training_cuda_namespace()


def _allow_no_cuda(initialize_megatron):
    @functools.wraps(initialize_megatron)
    def wrapped(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    wrapped.__cpu_compat_wrapped__ = initialize_megatron
    return wrapped


def _no_jit_warmup(set_jit_fusion_options):
    """``set_jit_fusion_options`` as ``pretrain`` calls it on CPU: nothing. On torch >= 2.2 it
    only warms up the fused bias-GeLU / SwiGLU / bias-dropout-add functions, which
    torch.compile then builds for the CPU whatever the ``--no-*-fusion`` flags say (8-9 s of a
    cold 2-core launch, 75 s under heavy load); a fusion a run uses compiles at its first call
    instead. The
    warm-up's ``torch.rand(..., device="cuda")`` draws would also have come from the CPU generator
    and moved ``--use-cpu-initialization``'s weights (their shapes follow
    ``--sequence-parallel``)."""

    @functools.wraps(set_jit_fusion_options)
    def skipped(*args, **kwargs):
        return None

    skipped.__cpu_compat_wrapped__ = set_jit_fusion_options
    return skipped


class _NoFusedKernels:
    """``megatron.legacy.fused_kernels`` as ``initialize._compile_dependencies`` sees it on CPU.

    Its ``load(args)`` (core_v0.16.1) builds no kernel any more: it reads the CUDA toolkit's
    version (``$CUDA_HOME/bin/nvcc -V``, a TypeError when there is no toolkit) and creates a build
    folder. Nothing of it is used on CPU, so ``load`` does nothing here; every other name is the
    real module's."""

    def __init__(self, module):
        self._module = module

    def load(self, args):
        return None

    def __getattr__(self, name):
        return getattr(self._module, name)


def _loader_keeps_global_rng(build_pretraining_data_loader):
    """``build_pretraining_data_loader`` whose loader draws from its own generator, a copy of the
    global one: each ``iter(loader)`` draws its workers' base seed (the same value as before), but
    no longer moves the global generator. Only TP rank 0 of a stage builds loaders, and on CPU the
    global generator is also the "CUDA" one hidden dropout draws from, so that draw gave TP rank 0
    other masks than its peers (on a GPU the loader draws from the CPU generator, which dropout
    does not read)."""

    @functools.wraps(build_pretraining_data_loader)
    def wrapped(*args, **kwargs):
        loader = build_pretraining_data_loader(*args, **kwargs)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator()
            loader.generator.set_state(torch.get_rng_state())
        return loader

    wrapped.__cpu_compat_wrapped__ = build_pretraining_data_loader
    return wrapped


def _no_device_arch(get_device_arch_version):
    """``get_device_arch_version`` as ``validate_args`` sees it on CPU: 0, no CUDA architecture
    (upstream reads ``torch.cuda.get_device_properties``). ``validate_args`` then treats the run
    as it treats any GPU before Blackwell: with TP > 1 it asks for CUDA_DEVICE_MAX_CONNECTIONS=1,
    which ``install_cpu_training_compat`` sets when unset (only CUDA reads it)."""

    @functools.wraps(get_device_arch_version)
    def wrapped():
        return 0

    wrapped.__cpu_compat_wrapped__ = get_device_arch_version
    return wrapped


def cpu_training_refusal(mlm) -> str | None:
    """The one-line reason a run with Megatron-LM options ``mlm`` (``RunConfig.megatron_lm``)
    cannot train on CPU, or None."""
    for name, flag, why in CUDA_ONLY_FLAGS:  # fields of MegatronLMOptions
        if getattr(mlm, name):
            return f"{flag} {why}; it needs CUDA (this run is on CPU): drop it"
    if mlm.cuda_graph_impl not in (None, "none"):
        return (f"--cuda-graph-impl {mlm.cuda_graph_impl} captures CUDA graphs; it needs CUDA "
                f"(this run is on CPU)")
    if mlm.distributed_backend != "gloo":
        return (f"--distributed-backend {mlm.distributed_backend} needs CUDA; on CPU use "
                f"--distributed-backend gloo")
    return None


def install_cpu_training_compat(force: bool = False) -> bool:
    """Install the Megatron-Core CPU layer plus the ``megatron.training`` one if CUDA is absent
    (or ``force``); returns whether active. Needs the Megatron-LM checkout importable."""
    global _installed
    if _installed:
        return True
    if not cpu_compat.install_cpu_compat(force=force):
        return False
    # The torch_dist checkpoint strategies load lazily; give them the Megatron-Core proxy now.
    from megatron_oases.runtime.dist_ckpt import dist_checkpointing

    dist_checkpointing()
    proxy = _TrainingTorchOnCpu()
    for modname in PATCHED_MODULES:
        importlib.import_module(modname)
    for modname, module in list(sys.modules.items()):
        if modname.startswith("megatron.training") and getattr(module, "torch", None) is torch:
            module.torch = proxy
    initialize = importlib.import_module("megatron.training.initialize")
    if mcore_compat.initialize_loads_fused_kernels() and \
            not isinstance(initialize.fused_kernels, _NoFusedKernels):
        initialize.fused_kernels = _NoFusedKernels(initialize.fused_kernels)
    arguments = importlib.import_module("megatron.training.arguments")
    if not hasattr(arguments.get_device_arch_version, "__cpu_compat_wrapped__"):
        arguments.get_device_arch_version = _no_device_arch(arguments.get_device_arch_version)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    training = importlib.import_module("megatron.training.training")
    if not hasattr(training.initialize_megatron, "__cpu_compat_wrapped__"):
        training.initialize_megatron = _allow_no_cuda(training.initialize_megatron)
    if not hasattr(training.set_jit_fusion_options, "__cpu_compat_wrapped__"):
        training.set_jit_fusion_options = _no_jit_warmup(training.set_jit_fusion_options)
    loader = getattr(training, "build_pretraining_data_loader", None)
    if loader is not None and not hasattr(loader, "__cpu_compat_wrapped__"):
        training.build_pretraining_data_loader = _loader_keeps_global_rng(loader)
    _installed = True
    return True


def cpu_training_compat_installed() -> bool:
    """Whether the ``megatron.training`` shims are active in this process."""
    return _installed
