"""``megatron_oases.mcore_compat`` on every supported megatron-core release.

Unit checks of the helpers on the installed release, and one training step of a stock, an ATP, a
3-D and a per-block-plan model (the layer APIs that changed: 0.17's ``pp_layer_offset``, 0.18's
``MlpBuilder`` and ``name=``), whose first loss must equal stock TP's (the trainer starts every
layout from the same weights). ``test_layers_train_on_release`` repeats those steps on each other
supported release found under ``.mcore/<version>`` (``pip install --no-deps --target
.mcore/<version> megatron-core==<version>``; ``.ci/run`` makes them), in a subprocess with that
release first on ``PYTHONPATH``, so the next API change fails here first.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys

import pytest

from megatron_oases import mcore_compat as mc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""One release of each supported minor (CI checks each)."""
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "8",
         "--seq-length", "16", "--vocab-size", "512", "--make-vocab-size-divisible-by", "64",
         "--micro-batch-size", "4", "--global-batch-size", "4", "--seed", "3", "--lr", "1e-3",
         "--train-iters", "1", "--device", "cpu"]


def test_versions_parse_and_range():
    assert mc.parse_version("0.19.2") == (0, 19, 2)
    assert mc.parse_version("0.19.0rc1") == (0, 19, 0)
    assert mc.parse_version("0.20") == (0, 20, 0)
    assert mc.supported((0, 16, 1)) and mc.supported((0, 19, 9))
    assert not mc.supported((0, 16, 0)) and not mc.supported((0, 20, 0))
    assert mc.supported(mc.mcore_version()), "the installed megatron-core is outside the range"


def test_submodule_kwargs_are_the_known_ones():
    mc.accept_submodule_kwargs("X", {"name": "decoder.layers.0.mlp", "pp_layer_offset": 0,
                                     "pg_collection": None, "is_mtp_layer": False})
    with pytest.raises(TypeError, match="X.__init__.*'bogus'"):
        mc.accept_submodule_kwargs("X", {"bogus": 1})


def test_dense_mlp_parts_reads_both_spec_forms():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    local = get_gpt_layer_local_spec().submodules.mlp  # ModuleSpec before 0.18, a partial after
    cls, submodules, params = mc.dense_mlp_parts(local)
    assert cls is MLP and submodules is not None and "submodules" not in params
    as_spec = ModuleSpec(module=MLP, submodules=submodules, params={"input_size": 8})
    assert mc.dense_mlp_parts(as_spec) == (MLP, submodules, {"input_size": 8})
    if hasattr(MLP, "as_mlp_submodule"):  # 0.18+: the builder TransformerLayer rewraps to
        rewrapped = functools.partial(MLP.as_mlp_submodule, submodules=submodules)
        assert mc.dense_mlp_parts(rewrapped) == (MLP, submodules, {})
    assert mc.dense_mlp_parts(ModuleSpec(module=object)) is None
    assert mc.dense_mlp_parts(functools.partial(print, sep="")) is None


def test_gpt_model_deprecation_is_dropped_and_nothing_else(caplog):
    mc.quiet_gpt_model_deprecation()
    mc.quiet_gpt_model_deprecation()  # idempotent
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    assert sum(getattr(f, "oases_drops", None) == "GPTModel IS DEPRECATED"
               for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def _plan(tmp_path) -> str:
    path = tmp_path / "plan.json"  # attention and MLP at different degrees: the MLP is rebuilt
    path.write_text(json.dumps({"format": "megatron-oases-plan/1", "tensor_model_parallel_size": 4,
                                "num_layers": 2, "degrees": [4, 2, 2, 4]}))
    return str(path)


def _first_loss(n: int, argv: list[str]) -> float:
    from megatron_oases.runtime.spawn import run_on_ranks
    from tests.rank_fns import first_loss

    return run_on_ranks(first_loss, n, args=(MODEL + argv,), timeout_s=240)[-1]


def test_layers_train_on_installed_release(tmp_path):
    """Stock TP 4, ATP (2,2) under the Oases schedule, a plan with attention != MLP degrees, and
    the 3-D cube (8 ranks): one step each, the same first loss as stock."""
    stock = _first_loss(4, ["--tensor-model-parallel-size", "4"])
    runs = {
        "atp (2,2) + oases": _first_loss(4, ["--tensor-model-parallel-size", "4", "--tp-backend",
                                             "atp", "--atp-mesh", "2,2", "--schedule", "oases"]),
        "plan": _first_loss(4, ["--tensor-model-parallel-size", "4", "--oases-plan", _plan(tmp_path)]),
        "3d": _first_loss(8, ["--tensor-model-parallel-size", "8", "--tp-backend", "3d"]),
    }
    for what, loss in runs.items():
        assert abs(loss - stock) <= 1e-5 * abs(stock), f"{what}: first loss {loss} vs stock {stock}"


@pytest.mark.parametrize("release", RELEASES)
def test_layers_train_on_release(release):
    """The same steps with another supported release first on PYTHONPATH."""
    if mc.mcore_version() == mc.parse_version(release):
        pytest.skip("the installed release: test_layers_train_on_installed_release")
    if sys.version_info[:2] < mc.python_for(mc.parse_version(release)):
        pytest.skip(f"megatron-core {release} needs Python {mc.python_for(mc.parse_version(release))}")
    target = os.path.join(ROOT, ".mcore", release)
    if not os.path.isdir(os.path.join(target, "megatron", "core")):
        pytest.skip(f"megatron-core {release} not under .mcore/ (scripts/setup.sh with "
                    f"MCORE_RELEASES=\"{release}\" installs it there)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [target, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # One interpreter prints the megatron-core it imports, then runs the tests on it (a separate
    # probe cost another torch + Megatron import per release).
    tests = [f"{__file__}::test_layers_train_on_installed_release",
             f"{__file__}::test_dense_mlp_parts_reads_both_spec_forms"]
    code = ("import sys, megatron.core as m, pytest; print(m.__version__, flush=True); "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *{tests!r}]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    found = out.stdout.split("\n", 1)[0].strip()  # 0.18+ may append "+<git hash>" of the cwd
    assert mc.parse_version(found) == mc.parse_version(release), out.stdout[-2000:] + out.stderr[-2000:]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_router_gemm_without_te_binds_the_name_0_16_reads():
    """megatron-core 0.16's router reads ``moe_utils.te_general_gemm``, bound there only with
    Transformer Engine; after the shim every release has the name (None without TE)."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_oases.mcore_compat import router_gemm_without_te

    router_gemm_without_te()
    assert hasattr(moe_utils, "te_general_gemm")
    if not moe_utils.HAVE_TE:
        assert moe_utils.te_general_gemm is None
