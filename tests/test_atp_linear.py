"""ATP column-/row-first linears on 2-D meshes: parity with a dense linear (output and every
gradient), the fc1 -> fc2 chain, chunked overlap, traffic per axis, and one-line bad-input errors.

One spawn per world size runs every mesh and layer kind; the reference is computed here, in the
parent, from the same seeded tensors, and weight gradients are reassembled by ``mesh_layout``.
"""
from __future__ import annotations

import pytest
import torch

from megatron_oases.errors import ConfigError
from megatron_oases.parallel.mesh import DeviceMesh, MeshGroups, build_mesh_groups, shard_index
from tests.conftest import max_rel_diff

B, S, H, F = 4, 2, 16, 32  # batch, sequence, hidden, ffn: divisible by every mesh axis up to 8
KINDS = [("col", False, 1), ("col", True, 1), ("row", False, 1), ("row", True, 1),
         ("mlp", True, 1), ("col", True, 2), ("row", True, 2), ("mlp", True, 2), ("mlp", False, 4)]
TOL = 1e-5


def _tensors(kind: str, bias: bool):
    """Full (dense) inputs, weights [out, in], biases and upstream gradient; same on every rank."""
    g = torch.Generator().manual_seed(2 * ["col", "row", "mlp"].index(kind) + int(bias))
    sizes = {"col": [(H, F)], "row": [(F, H)], "mlp": [(H, F), (F, H)]}[kind]
    ws = [torch.randn(o, i, generator=g) / i ** 0.5 for i, o in sizes]
    bs = [torch.randn(o, generator=g) if bias else None for _, o in sizes]
    x = torch.randn(B, S, sizes[0][0], generator=g)
    up = torch.randn(B, S, sizes[-1][1], generator=g)
    return x, ws, bs, up


def _dense(kind: str, bias: bool):
    x, ws, bs, up = _tensors(kind, bias)
    x = x.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in ws]
    bs = [b.clone().requires_grad_() if b is not None else None for b in bs]
    y = torch.nn.functional.linear(x, ws[0], bs[0])
    if kind == "mlp":
        y = torch.nn.functional.linear(torch.nn.functional.gelu(y), ws[1], bs[1])
    (y * up).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": [w.grad for w in ws],
            "db": [b.grad if b is not None else None for b in bs]}


def run_mesh_cases(meshes, megatron_tp: int = 0):
    """Rank function: for each (tp_groups, d1, d2) run every KINDS case; return local results."""
    import torch.distributed as dist

    from megatron_oases.layers.atp_linear import ColumnFirstLinear, RowFirstLinear
    from megatron_oases.parallel import collectives as C
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    out = {"cases": [], "megatron": None}
    for tp_groups, d1, d2 in meshes:
        mg = build_mesh_groups(tp_groups, d1, d2)
        for kind, bias, chunks in KINDS:
            x, ws, bs, up = _tensors(kind, bias)
            kw = dict(bias=bias, chunks=chunks)
            if kind == "row":
                layers = [RowFirstLinear(F, H, mg, init_weight=ws[0], init_bias=bs[0], **kw)]
            else:
                layers = [ColumnFirstLinear(H, F, mg, init_weight=ws[0], init_bias=bs[0], **kw)]
            if kind == "mlp":
                layers.append(RowFirstLinear(F, H, mg, init_weight=ws[1], init_bias=bs[1], **kw))
            first, last = layers[0], layers[-1]
            x_local = x[shard_index(x.shape, (None, None, first.in_axis), mg.coord, mg.mesh)]
            x_local = x_local.clone().requires_grad_()
            with C.CommCounter() as counter:
                y = first(x_local)
                if kind == "mlp":
                    y = last(torch.nn.functional.gelu(y))
                up_local = up[shard_index(up.shape, (None, None, last.out_axis), mg.coord, mg.mesh)]
                (y * up_local).sum().backward()
            out["cases"].append({
                "mesh": (tuple(map(tuple, tp_groups)), d1, d2), "case": (kind, bias, chunks),
                "rank": dist.get_rank(), "coord": mg.coord, "y": y.detach(), "dx": x_local.grad,
                "axes": [(lay.in_axis, lay.out_axis) for lay in layers],
                "params": [[(name, p.detach(), p.grad, p.mesh_layout, p.tensor_model_parallel,
                             p.partition_dim) for name, p in lay.named_parameters()]
                           for lay in layers],
                "comm": [(r.kind, r.group_size, r.payload_bytes) for r in counter.records],
            })
    if megatron_tp:
        from megatron.core import parallel_state as ps

        from megatron_oases.parallel.mesh import mesh_groups_from_megatron

        ps.initialize_model_parallel(megatron_tp, 1)
        mg = mesh_groups_from_megatron(2, megatron_tp // 2)
        out["megatron"] = {"coord": mg.coord, "tp": list(mg.mesh.ranks),
                           "axis1": dist.get_process_group_ranks(mg.axis1_group),
                           "axis2": dist.get_process_group_ranks(mg.axis2_group)}
    return out


def _check(results):
    """Compare every rank's shards with the dense reference; reassemble weight grads by layout."""
    refs, assembled = {}, {}
    for res in results:
        for c in res["cases"]:
            kind, bias, chunks = c["case"]
            ref = refs.setdefault((kind, bias), _dense(kind, bias))
            tp_groups, d1, d2 = c["mesh"]
            tp = next(g for g in tp_groups if c["rank"] in g)
            mesh = DeviceMesh(d1, d2, tp)
            where = f"{kind} bias={bias} chunks={chunks} mesh={d1}x{d2} rank={c['rank']}"
            assert mesh.coord(c["rank"]) == c["coord"], where
            in_axis, out_axis = c["axes"][0][0], c["axes"][-1][1]
            y_ref = ref["y"][shard_index(ref["y"].shape, (None, None, out_axis), c["coord"], mesh)]
            dx_ref = ref["dx"][shard_index(ref["dx"].shape, (None, None, in_axis), c["coord"], mesh)]
            assert max_rel_diff(c["y"], y_ref) < TOL, where
            assert max_rel_diff(c["dx"], dx_ref) < TOL, where
            for li, params in enumerate(c["params"]):
                for name, value, grad, layout, tmp, pdim in params:
                    full_grad = ref["dw"][li] if name == "weight" else ref["db"][li]
                    assert tmp is True and pdim == (0 if name == "bias" else
                                                    (0 if c["axes"][li] == (2, 1) else 1)), where
                    idx = shard_index(full_grad.shape, layout, c["coord"], mesh)
                    assert max_rel_diff(grad, full_grad[idx]) < TOL, (where, name)
                    key = (c["mesh"], c["case"], tuple(tp), li, name)
                    full, seen = assembled.setdefault(key, (torch.zeros_like(full_grad),
                                                            torch.zeros(full_grad.shape, dtype=torch.bool)))
                    full[idx] = grad
                    seen[idx] = True
    for key, (full, seen) in assembled.items():
        kind, bias = key[1][:2]
        li, name = key[3], key[4]
        want = refs[(kind, bias)]["dw" if name == "weight" else "db"][li]
        assert bool(seen.all()), f"{key}: shards do not cover the {name}"
        assert max_rel_diff(full, want) < TOL, key


def _check_comm(results):
    """Column-/row-first traffic: forward all-reduce on the ``in`` axis of size [b, s, out/n_out],
    backward all-reduce of dX on the ``out`` axis of size [b, s, in/n_in] (fp32)."""
    for res in results:
        for c in res["cases"]:
            kind, _, chunks = c["case"]
            if kind == "mlp":
                continue
            _, d1, d2 = c["mesh"]
            (in_axis, out_axis), = c["axes"]
            n = {1: d1, 2: d2}
            size_in, size_out = (H, F) if kind == "col" else (F, H)
            recs = c["comm"]
            assert [r[0] for r in recs] == ["all_reduce"] * (chunks + 1), recs
            assert {r[1] for r in recs[:chunks]} == {n[in_axis]} and recs[-1][1] == n[out_axis], recs
            assert sum(r[2] for r in recs[:chunks]) == B * S * size_out // n[out_axis] * 4, recs
            assert recs[-1][2] == B * S * size_in // n[in_axis] * 4, recs


def test_atp_linear_parity_tp4(on_ranks):
    tp = [[0, 1, 2, 3]]
    results = on_ranks(run_mesh_cases, 4, [(tp, 4, 1), (tp, 2, 2), (tp, 1, 4)], timeout_s=120)
    assert len(results[0]["cases"]) == 3 * len(KINDS)
    _check(results)
    _check_comm(results)


def test_atp_linear_parity_tp8_and_two_tp_groups(on_ranks):
    """TP=8 meshes; two TP=4 groups (contiguous and strided) share one world; Megatron's TP groups."""
    tp8 = [list(range(8))]
    meshes = [(tp8, 8, 1), (tp8, 4, 2), (tp8, 2, 4), (tp8, 1, 8),
              ([[0, 1, 2, 3], [4, 5, 6, 7]], 2, 2), ([[0, 2, 4, 6], [1, 3, 5, 7]], 1, 4)]
    results = on_ranks(run_mesh_cases, 8, meshes, 4, timeout_s=180)
    assert all(len(r["cases"]) == len(meshes) * len(KINDS) for r in results)
    _check(results)
    _check_comm(results)
    for rank, res in enumerate(results):  # Megatron TP=4: TP groups [0..3], [4..7]
        base, local = rank - rank % 4, rank % 4
        assert res["megatron"] == {"coord": divmod(local, 2), "tp": list(range(base, base + 4)),
                                   "axis1": [base + local % 2, base + local % 2 + 2],
                                   "axis2": [base + local - local % 2, base + local - local % 2 + 1]}


def test_mesh_rank_order_axis2_fastest():
    mesh = DeviceMesh(2, 4, tuple(range(8, 16)))
    assert mesh.coord(13) == (1, 1)
    assert mesh.axis2_ranks(1) == [12, 13, 14, 15]  # consecutive: the fastest interconnect level
    assert mesh.axis1_ranks(1) == [9, 13]
    assert shard_index((8, 6), (1, None), (1, 3), mesh) == (slice(4, 8), slice(0, 6))


def _one_line(excinfo, *words):
    text = str(excinfo.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_bad_mesh_sizes_one_line():
    with pytest.raises(ConfigError) as e:
        DeviceMesh(3, 2, (0, 1, 2, 3))
    _one_line(e, "--atp-mesh 3,2", "d1 x d2 = 6", "--tensor-model-parallel-size 4")
    with pytest.raises(ConfigError) as e:
        DeviceMesh(0, 4, (0, 1, 2, 3))
    _one_line(e, "--atp-mesh 0,4", "both mesh axes must be >= 1")
    with pytest.raises(ConfigError) as e:
        build_mesh_groups([[0, 1, 2, 3]], 2, 4)  # validated before any process group is made
    _one_line(e, "--atp-mesh 2,4", "--tensor-model-parallel-size 4")
    with pytest.raises(ConfigError) as e:
        build_mesh_groups([[0, 1], [1, 2]], 1, 2)
    _one_line(e, "overlap")


def test_bad_layer_shapes_one_line():
    from megatron_oases.layers.atp_linear import ColumnFirstLinear, RowFirstLinear

    mg = MeshGroups(None, None, (0, 0), DeviceMesh(1, 4, (0, 1, 2, 3)))  # no groups needed to build
    with pytest.raises(ConfigError) as e:
        ColumnFirstLinear(10, 32, mg)
    _one_line(e, "ColumnFirstLinear", "input_size 10", "--atp-mesh 1x4", "axis 2")
    with pytest.raises(ConfigError) as e:
        RowFirstLinear(16, 6, mg)
    _one_line(e, "RowFirstLinear", "output_size 6", "axis 2")
    with pytest.raises(ConfigError) as e:
        ColumnFirstLinear(16, 32, mg, init_weight=torch.zeros(16, 32))
    _one_line(e, "[out, in]")
    layer = ColumnFirstLinear(16, 32, mg)
    assert layer.weight.shape == (32, 4) and layer.bias.shape == (32,)
    with pytest.raises(ValueError) as e:
        layer(torch.zeros(2, 16))
    _one_line(e, "input hidden dim 16")
