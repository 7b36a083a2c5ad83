"""3-D tensor parallelism (Bian et al. 2021): cube mapping, GEMM forms, vectors, Linear3D, bytes.

The multi-rank checks share ONE spawn of 8 gloo ranks (p = 2, see ``rank_fns_3d.cube3d_checks``);
each test below asserts one part of its per-rank result dict.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_oases.describe.gemm_3d import gemm_3d_bytes
from megatron_oases.layers.linear3d import Linear3D, LayerNorm3D, gemm_layouts
from megatron_oases.parallel.cube import Cube, CubeGroups, build_cube_groups, other_dir
from megatron_oases.errors import ConfigError
from megatron_oases.runtime.spawn import run_on_ranks
from tests import rank_fns_3d

P = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def cube_results():
    return run_on_ranks(rank_fns_3d.cube3d_checks, P ** 3, args=(P,), timeout_s=180)


# --- no process group needed ---

@pytest.mark.parametrize("p", [2, 3, 4])
def test_cube_mapping_is_a_bijection_with_consecutive_fast_direction(p):
    cube = Cube(tp_size=p ** 3)
    coords = [cube.coord(t) for t in range(p ** 3)]
    assert sorted(coords) == list(itertools.product(range(p), repeat=3))
    assert all(cube.index(cube.coord(t)) == t for t in range(p ** 3))
    for d in "xyz":
        lines = cube.lines(d)
        assert len(lines) == p * p and sorted(sum(lines, [])) == list(range(p ** 3))
    # the first direction of ``order`` (z by default) is p consecutive tp indices
    assert all(line == list(range(line[0], line[0] + p)) for line in cube.lines("z"))
    assert cube.coord(1) == (0, 0, 1)
    x_first = Cube(tp_size=p ** 3, order="xzy")
    assert all(line == list(range(line[0], line[0] + p)) for line in x_first.lines("x"))


@pytest.mark.parametrize("tp", [0, 2, 4, 6, 12, 26])
def test_non_cube_tp_size_is_one_clear_line(tp):
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size = p\^3") as e:
        Cube(tp_size=tp)
    assert "\n" not in str(e.value) and str(tp) in str(e.value)


def test_bad_cube_inputs_before_any_process_group():
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        build_cube_groups(list(range(6)), 2)
    with pytest.raises(ConfigError, match="p = 3 needs --tensor-model-parallel-size 27"):
        build_cube_groups(list(range(8)), 3)
    with pytest.raises(ConfigError, match="ascending"):
        build_cube_groups([0, 1, 2, 3, 4, 5, 7, 6], 2)
    with pytest.raises(ConfigError, match="permutation"):
        Cube(tp_size=8, order="xxy")
    with pytest.raises(ValueError, match="permutation of x, y, z"):
        gemm_layouts("ab", ("y", "y", "z"))
    with pytest.raises(ValueError, match="'y' or 'z'"):
        other_dir("x")


def test_indivisible_dims_are_one_clear_line():
    groups = CubeGroups(None, None, None, (0, 0, 0), Cube(tp_size=8))  # checks run before any comm
    with pytest.raises(ConfigError, match=r"in_features 6 is not divisible by p\^2 = 4") as e:
        Linear3D(6, 16, groups)
    assert "\n" not in str(e.value) and "--tensor-model-parallel-size 8" in str(e.value)
    with pytest.raises(ConfigError, match="out_features 10"):
        Linear3D(16, 10, groups)
    with pytest.raises(ConfigError, match="hidden size 6"):
        LayerNorm3D(6, groups)


def test_predicted_bytes_formula():
    pred = gemm_3d_bytes(8, 12, 16, 2)
    assert pred["shard_bytes_per_rank"] == (96 + 192 + 128) / 8 * 4
    assert pred["wire_bytes_per_rank"] == pred["shard_bytes_per_rank"]  # (p - 1) = 1 at p = 2
    assert gemm_3d_bytes(8, 12, 16, 4)["wire_bytes_per_rank"] == 3 * (96 + 192 + 128) / 64 * 4


# --- one spawn of 8 ranks ---

def test_groups_follow_the_cube_mapping(cube_results):
    cube = Cube(tp_size=P ** 3)
    for r in cube_results:
        assert r["coord"] == cube.coord(r["rank"])
        for d in "xyz":
            assert r["group_ranks"][d] == cube.line(d, r["coord"])  # group rank == coordinate


def _errors(cube_results, prefix):
    errs = {k: max(r["errors"][k] for r in cube_results)
            for k in cube_results[0]["errors"] if k.startswith(prefix)}
    assert errs, prefix
    return errs


@pytest.mark.parametrize("form", ["ab", "abt", "atb"])
def test_gemm_form_matches_dense_outputs_and_grads(cube_results, form):
    errs = _errors(cube_results, form + "[")
    assert len(errs) == 6  # (C, dA, dB) x two direction triples
    assert max(errs.values()) < TOL, errs


def test_vector_ops_match_dense(cube_results):
    errs = _errors(cube_results, "vec_")
    assert len(errs) == 12  # add/mul x cols in y/z x (C, dA, db)
    assert max(errs.values()) < TOL, errs


def test_linear3d_with_and_without_bias(cube_results):
    errs = _errors(cube_results, "linear[")
    assert len(errs) == 14
    assert max(errs.values()) < TOL, errs
    for r in cube_results:
        assert r["linear[y].output_dir"] == "z" and r["linear[z,bias].output_dir"] == "y"


def test_mlp_direction_exchange_returns_to_input_layout(cube_results):
    errs = _errors(cube_results, "mlp.")
    assert len(errs) == 6 and max(errs.values()) < TOL, errs
    assert all(r["mlp.dirs"] == ("y", "z", "z", "y") for r in cube_results)


def test_layernorm3d_matches_dense(cube_results):
    errs = _errors(cube_results, "layernorm.")
    assert len(errs) == 4 and max(errs.values()) < TOL, errs


def test_memory_balance_and_no_replicated_weight(cube_results):
    per_rank = [r["regions"] for r in cube_results]
    for name, (shape, _, _) in per_rank[0].items():
        total = torch.Size(shape).numel()
        cover = torch.zeros(shape, dtype=torch.int32)
        counts = []
        for regions in per_rank:
            _, numel, reg = regions[name]
            counts.append(numel)
            if reg is not None:
                cover[tuple(slice(a, b) for a, b in reg)] += 1
        assert torch.all(cover == 1), f"{name}: every element held by exactly one rank"
        if len(shape) == 2:  # weights: exactly total / P on every rank
            assert counts == [total // P ** 3] * P ** 3, (name, counts)
        else:  # vectors: N / p^2 on the p^2 diagonal ranks (j == l), nothing elsewhere
            assert sorted(set(counts)) == [0, total // P ** 2] and sum(counts) == total, (name, counts)


def test_forward_gemm_bytes_match_paper_formula(cube_results):
    m, n, k = rank_fns_3d.M, rank_fns_3d.N, rank_fns_3d.K
    pred = gemm_3d_bytes(m, n, k, P)
    for r in cube_results:
        for key in ("bytes.gemm_fwd", "bytes.linear_fwd"):
            recs = r[key]
            assert sorted(kind for kind, *_ in recs) == ["all_gather", "all_gather", "reduce_scatter"]
            assert all(size == P for _, size, _, _ in recs)
            assert sum(payload for _, _, payload, _ in recs) / P == pred["shard_bytes_per_rank"]
            assert sum(wire for *_, wire in recs) == pred["wire_bytes_per_rank"]
        # backward = two GEMMs of the same three shapes: twice the forward traffic
        bwd = r["bytes.linear_bwd"]
        assert len(bwd) == 6 and sum(w for *_, w in bwd) == 2 * pred["wire_bytes_per_rank"]
