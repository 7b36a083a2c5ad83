"""CUDA_DEVICE_MAX_CONNECTIONS: set to 1 on CUDA before init, warn once on another value, no-op
on CPU. CUDA is simulated by monkeypatching torch.cuda (no GPU needed)."""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_oases.runtime import cuda_env
from megatron_oases.runtime.cuda_env import ENV_VAR, ensure_cuda_device_max_connections


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA available and not yet initialised; a fresh once-only warning state."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda_env, "_warned", set())
    monkeypatch.setenv(ENV_VAR, "unset-me")  # recorded, so teardown restores the real state
    monkeypatch.delenv(ENV_VAR)
    return monkeypatch


def test_sets_one_when_unset(fake_cuda):
    import os

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ensure_cuda_device_max_connections() == "1"
    assert os.environ[ENV_VAR] == "1"


def test_explicit_environ_mapping(fake_cuda):
    env = {}
    assert ensure_cuda_device_max_connections("cuda", environ=env) == "1"
    assert env == {ENV_VAR: "1"}


def test_user_value_kept_with_one_warning(fake_cuda):
    env = {ENV_VAR: "8"}
    with pytest.warns(RuntimeWarning, match=f"{ENV_VAR}=8: .*overlap") as record:
        assert ensure_cuda_device_max_connections(environ=env) == "8"
        assert ensure_cuda_device_max_connections(environ=env) == "8"  # second call: silent
    assert len(record) == 1
    assert env[ENV_VAR] == "8"


def test_one_already_set_is_silent(fake_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ensure_cuda_device_max_connections(environ={ENV_VAR: "1"}) == "1"


def test_too_late_after_cuda_init_warns_and_does_not_set(fake_cuda):
    fake_cuda.setattr(torch.cuda, "is_initialized", lambda: True)
    env = {}
    with pytest.warns(RuntimeWarning, match=f"{ENV_VAR} is unset and CUDA is already initialised"):
        assert ensure_cuda_device_max_connections(environ=env) is None
    assert env == {}


@pytest.mark.parametrize("device, available", [("cpu", True), (None, False), ("cuda", False)])
def test_cpu_is_a_no_op(fake_cuda, device, available):
    fake_cuda.setattr(torch.cuda, "is_available", lambda: available)
    env = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ensure_cuda_device_max_connections(device, environ=env) is None
        assert ensure_cuda_device_max_connections(device, environ={ENV_VAR: "4"}) is None
    assert env == {}
