"""CPU twins of what only a GPU would reveal (issue 24), for tests on gloo ranks.

* ``nan_until_wait``: async collectives (``async_op=True``) write NaN into their outputs until
  ``wait()``, and fail if an input is changed before then. Gloo finishes many collectives before
  their handle is even looked at, which hides a read before the wait that NCCL, running on its
  own stream, would punish with stale or partial data. Each handle keeps every tensor of its
  call alive until ``wait()`` (nothing freed early).
* ``sync_guard``: ``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()`` and device
  synchronisations raise while an async collective is in flight: on a GPU they would stall the
  host until the collective finished, and the overlap would be gone.
* ``fake_gradient_accumulation_fusion``: an extension with the contract of Apex's
  ``fused_weight_gradient_mlp_cuda`` (the weight gradient is added into ``main_grad``), so
  Megatron's fused path, its dummy ``grad`` and ``grad_added_to_main_grad`` run on CPU.
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist

_IN_FLIGHT = [0]
_COALESCING: list = []
"""Deferred works launched inside each open ``_coalescing_manager`` (innermost last)."""
_LAUNCHED: dict = {}
"""id(handle) -> where an in-flight collective was launched (for the guard's message)."""


class _DeferredWork:
    """A work handle whose ``wait()`` waits the real one, then publishes the result."""

    def __init__(self, work, publish, keep):
        self._work, self._publish, self._keep = work, publish, keep
        self._done = False
        _IN_FLIGHT[0] += 1
        self._coalesced = bool(_COALESCING)  # then the manager's wait() waits the real op
        if self._coalesced:
            _COALESCING[-1].append(self)
        import traceback

        _LAUNCHED[id(self)] = "".join(traceback.format_stack(limit=8)[:-2])

    def wait(self, *args, **kwargs):
        if not self._done:
            if self._work is not None and not self._coalesced:
                self._work.wait()
            self._publish()
            self._done = True
            self._keep = None
            _IN_FLIGHT[0] -= 1
            _LAUNCHED.pop(id(self), None)
        return True

    def is_completed(self) -> bool:
        return self._done


def _check_unchanged(name: str, tensor: torch.Tensor, snapshot: torch.Tensor) -> None:
    same = (tensor == snapshot) | (tensor.isnan() & snapshot.isnan())
    if not bool(same.all()):
        raise AssertionError(f"the input of an async {name} changed before its wait()")


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))


def _deferred_all_reduce(real):
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op:
            return real(tensor, op=op, group=group, async_op=False)
        buf = tensor.detach().clone()
        work = real(buf, op=op, group=group, async_op=True)
        _poison(tensor)
        return _DeferredWork(work, lambda: tensor.copy_(buf), (tensor, buf))

    return all_reduce


def _deferred_into(real, name: str):
    """``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (output, input, ...)."""

    def collective(output, input, *args, async_op=False, **kwargs):
        if not async_op:
            return real(output, input, *args, async_op=False, **kwargs)
        buf = torch.empty_like(output)
        snapshot = input.detach().clone()
        work = real(buf, snapshot.clone(), *args, async_op=True, **kwargs)
        _poison(output)

        def publish():
            _check_unchanged(name, input, snapshot)
            output.copy_(buf)

        return _DeferredWork(work, publish, (output, input, buf, snapshot))

    return collective


def _deferred_coalescing(real):
    """Megatron's DDP waits the coalescing manager, not each op: its ``wait()`` then publishes
    the deferred ops launched inside it (at once for a synchronous one)."""

    @contextlib.contextmanager
    def coalescing_manager(*args, **kwargs):
        children: list = []
        _COALESCING.append(children)
        try:
            with real(*args, **kwargs) as cm:
                yield cm
        finally:
            _COALESCING.pop()
        if not kwargs.get("async_ops", False):
            for child in children:
                child.wait()
            return
        real_wait = cm.wait

        def wait(*a, **k):
            out = real_wait(*a, **k)
            for child in children:
                child.wait()
            return out

        cm.wait = wait

    return coalescing_manager


def _patch(stack: contextlib.ExitStack, owner, name: str, value) -> None:
    old = getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, old)


@contextlib.contextmanager
def nan_until_wait():
    """Async collectives in this process publish their results only at ``wait()``."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers

    with contextlib.ExitStack() as stack:
        _patch(stack, dist, "all_reduce", _deferred_all_reduce(dist.all_reduce))
        gather = _deferred_into(dist.all_gather_into_tensor, "all-gather")
        scatter = _deferred_into(dist.reduce_scatter_tensor, "reduce-scatter")
        _patch(stack, dist, "all_gather_into_tensor", gather)
        _patch(stack, dist, "reduce_scatter_tensor", scatter)
        for module in (layers, param_and_grad_buffer):  # bound at their import
            _patch(stack, module, "dist_all_gather_func", gather)
            _patch(stack, module, "dist_reduce_scatter_func", scatter)
        _patch(stack, param_and_grad_buffer, "_coalescing_manager",
               _deferred_coalescing(param_and_grad_buffer._coalescing_manager))
        yield


def in_flight() -> int:
    """Async collectives launched under ``nan_until_wait`` and not yet waited on."""
    return _IN_FLIGHT[0]


_HOST_ONLY_CALLERS = ("megatron/core/tensor_parallel/random.py",)
"""Callers whose tensors are CPU tensors in a GPU run too (the RNG tracker compares CPU
generator states in ``fork()``): their ``.item()`` does not synchronise the device."""


def _on_host_in_a_gpu_run(frame) -> bool:
    return frame.f_code.co_filename.endswith(_HOST_ONLY_CALLERS)


@contextlib.contextmanager
def sync_guard():
    """Host synchronisations raise while an async collective is in flight (use inside
    ``nan_until_wait``, which counts them)."""
    from megatron_oases.runtime.device import Runtime

    def guarded(name, real):
        def call(*args, **kwargs):
            if _IN_FLIGHT[0] and not _on_host_in_a_gpu_run(sys._getframe(1)):
                where = "\n".join(_LAUNCHED.values())
                raise AssertionError(f"{name} while {_IN_FLIGHT[0]} async collective(s) are in "
                                     "flight: on a GPU this blocks the host until they finish; "
                                     f"launched at:\n{where}")
            return real(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in ("item", "cpu", "tolist", "numpy"):
            _patch(stack, torch.Tensor, name, guarded(f"Tensor.{name}()", getattr(torch.Tensor, name)))
        _patch(stack, Runtime, "synchronize", guarded("Runtime.synchronize()", Runtime.synchronize))
        _patch(stack, torch.cuda, "synchronize", guarded("torch.cuda.synchronize()", torch.cuda.synchronize))
        yield


def install_fake_gradient_accumulation_fusion() -> None:
    """Make Megatron's fused weight-gradient path available with a CPU implementation of
    ``fused_weight_gradient_mlp_cuda`` (``main_grad += grad_output^T @ input``)."""
    from megatron.core.tensor_parallel import layers

    def accumulate(total_input, grad_output, main_grad):
        fake.calls += 1
        x = total_input.reshape(-1, total_input.shape[-1])
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.add_((dy.t().float() @ x.float()).to(main_grad.dtype))

    fake = types.ModuleType("fused_weight_gradient_mlp_cuda")
    fake.wgrad_gemm_accum_fp32 = accumulate
    fake.wgrad_gemm_accum_fp16 = accumulate
    fake.calls = 0
    sys.modules[fake.__name__] = fake
    layers.fused_weight_gradient_mlp_cuda = fake
    layers._grad_accum_fusion_available = True
