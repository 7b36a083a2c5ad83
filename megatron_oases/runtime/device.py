"""Where code runs: cuda + nccl when GPUs are present, cpu + gloo otherwise, decided in one place.

Layers never call ``torch.cuda.current_device()`` themselves; they ask ``current_runtime()``.
Streams and events are real CUDA objects on GPU and no-ops on CPU, so the overlap schedules run
the same code on both (on CPU, async gloo work handles provide the overlap).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

from megatron_oases.runtime.cpu_compat import _NoOpEvent, _NoOpStream, install_cpu_compat


@dataclasses.dataclass(frozen=True, kw_only=True)
class Runtime:
    """The execution target of this process."""

    device: torch.device
    """``cuda:<local_rank>`` or ``cpu``."""
    backend: str
    """torch.distributed backend: ``nccl`` with CUDA, ``gloo`` on CPU."""
    chosen_by: str = ""
    """Why this device (e.g. ``SLURM_LOCALID=3 mod 4 visible GPUs``), for the log."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def stream(self):
        """A new side stream (for async collectives); a no-op object on CPU."""
        return torch.cuda.Stream(device=self.device) if self.is_cuda else _NoOpStream()

    def event(self, enable_timing: bool = False):
        return torch.cuda.Event(enable_timing=enable_timing) if self.is_cuda else _NoOpEvent()

    def use_stream(self, stream):
        """Context manager making ``stream`` current (no-op on CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def max_memory_allocated(self) -> int:
        """Peak bytes allocated on the device (CUDA allocator); on CPU the process's peak RSS."""
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.device)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state of ``device`` (CUDA's per device, else the CPU one)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore what ``get_rng_state(device)`` returned."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


_RUNTIME: Runtime | None = None


def detect_runtime(device: str | None = None) -> Runtime:
    """Choose the runtime: ``device`` ("cuda"/"cpu") when given, else CUDA when available."""
    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False")
        index, why = local_cuda_index(os.environ, torch.cuda.device_count())
        return Runtime(device=torch.device("cuda", index), backend="nccl", chosen_by=why)
    if want != "cpu":
        raise ValueError(f"--device must be 'cuda' or 'cpu' (got {want!r})")
    return Runtime(device=torch.device("cpu"), backend="gloo")


def local_cuda_index(env, visible: int) -> tuple[int, str]:
    """This rank's CUDA device index and why: ``LOCAL_RANK`` (torchrun), else ``SLURM_LOCALID``
    (a plain ``srun`` launch), modulo the visible devices (one GPU visible per task gives 0);
    device 0 when neither is set."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(var) not in (None, ""):
            local = int(env[var])
            return local % max(visible, 1), f"{var}={local} mod {visible} visible GPUs"
    return 0, "neither LOCAL_RANK nor SLURM_LOCALID is set: device 0"


def local_ranks_refusal(nproc: int, visible: int) -> str | None:
    """Why ``nproc`` CUDA ranks started on this machine (``run_on_ranks``: rank r gets
    ``LOCAL_RANK=r``, so device r mod ``visible``) cannot each have a GPU of their own, or None.
    Two ranks on one device is no fallback: NCCL refuses them ("Duplicate GPU detected")."""
    if nproc <= visible:
        return None
    return (f"{nproc} ranks on this machine need {nproc} visible CUDA devices, one each (NCCL "
            f"refuses two ranks on one device), and {visible} {'is' if visible == 1 else 'are'} "
            f"visible")


def current_runtime() -> Runtime:
    """The runtime set up by ``init_runtime`` (detected lazily if nobody set it up)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = detect_runtime()
    return _RUNTIME


def init_runtime(device: str | None = None) -> Runtime:
    """Fix this process's runtime; on CPU install the Megatron-Core compatibility layer."""
    global _RUNTIME
    _RUNTIME = detect_runtime(device)
    if _RUNTIME.is_cuda:
        torch.cuda.set_device(_RUNTIME.device)
        logging.getLogger(__name__).info("using %s (%s)", _RUNTIME.device, _RUNTIME.chosen_by)
    else:
        install_cpu_compat(force=True)
    return _RUNTIME


def init_distributed(runtime: Runtime, timeout_s: float = 600.0) -> None:
    """``init_process_group`` from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    if dist.is_initialized():
        return
    kwargs = {}
    if runtime.is_cuda:
        kwargs["device_id"] = runtime.device
    dist.init_process_group(
        backend=runtime.backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def world_timeout() -> datetime.timedelta:
    """The collective timeout of the default (world) group, i.e. ``--dist-timeout`` (or
    Megatron-LM's ``--distributed-timeout-minutes``). Read from a backend the world group has:
    an ``nccl`` group has only a CUDA one, bound to a device or not (Megatron-LM's
    ``init_process_group`` passes no ``device_id``)."""
    pg = dist.distributed_c10d._get_default_group()
    types = {d.type for d in getattr(pg, "_device_types", [torch.device("cpu")])}
    device = "cuda" if pg.bound_device_id is not None or "cpu" not in types else "cpu"
    return pg._get_backend(torch.device(device)).options._timeout


def new_group(ranks) -> "dist.ProcessGroup":
    """``torch.distributed.new_group`` with the world's timeout: a plain ``new_group`` would get
    torch's 30-minute default, so a stopped peer would outlast ``--dist-timeout``. Collective over
    the world, like ``new_group``."""
    return dist.new_group(list(ranks), timeout=world_timeout())
