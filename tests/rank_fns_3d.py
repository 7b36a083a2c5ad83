"""3-D TP checks run on spawned gloo ranks: one spawn runs them all and returns a dict per rank.

Every check compares a cube result with a dense single-process reference computed on every rank
from the same seed: outputs and all gradients, shards gathered back by their layouts.
"""
from __future__ import annotations

M, N, K = 8, 12, 16  # distinct sizes so a transposed block cannot pass by accident


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _dense_grads(fn, *tensors, upstream):
    """Reference output and gradients of sum(fn(*tensors) * upstream)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * upstream).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _gemm_forms(groups, err):
    import torch

    from megatron_oases.layers.linear3d import gemm_3d, gemm_layouts

    c, p = groups.coord, groups.p
    shapes = {"ab": ((M, N), (N, K)), "abt": ((M, N), (K, N)), "atb": ((M, N), (M, K))}
    dense = {"ab": lambda a, b: a @ b, "abt": lambda a, b: a @ b.t(), "atb": lambda a, b: a.t() @ b}
    for form, (sa, sb) in shapes.items():
        for dirs in (("y", "x", "z"), ("z", "x", "y")):
            A, B = torch.randn(sa), torch.randn(sb)
            G = torch.randn(dense[form](A, B).shape)
            ref, (dA, dB) = _dense_grads(dense[form], A, B, upstream=G)
            la, lb, lc = gemm_layouts(form, dirs)
            a = la.take(A, c, p).requires_grad_()
            b = lb.take(B, c, p).requires_grad_()
            out = gemm_3d(a, b, groups, form, dirs)
            (out * lc.take(G, c, p)).sum().backward()
            tag = f"{form}[{''.join(dirs)}]"
            err[f"{tag}.C"] = _rel(lc.gather(out.detach(), groups), ref)
            err[f"{tag}.dA"] = _rel(la.gather(a.grad, groups), dA)
            err[f"{tag}.dB"] = _rel(lb.gather(b.grad, groups), dB)


def _vector_ops(groups, err):
    import torch

    from megatron_oases.layers.linear3d import DIAGONAL, activation_layout, gather_param, vector_op_3d
    from megatron_oases.parallel.cube import other_dir

    c, p = groups.coord, groups.p
    for col_dir in ("y", "z"):
        for op in ("add", "mul"):
            A, v, G = torch.randn(M, N), torch.randn(N), torch.randn(M, N)
            fn = (lambda a, b: a + b) if op == "add" else (lambda a, b: a * b)
            ref, (dA, dv) = _dense_grads(fn, A, v, upstream=G)
            lay = activation_layout(other_dir(col_dir))
            a = lay.take(A, c, p).requires_grad_()
            vec = DIAGONAL.take(v, c, p).requires_grad_()
            out = vector_op_3d(a, vec, groups, col_dir, op)
            (out * lay.take(G, c, p)).sum().backward()
            tag = f"vec_{op}[cols {col_dir}]"
            err[f"{tag}.C"] = _rel(lay.gather(out.detach(), groups), ref)
            err[f"{tag}.dA"] = _rel(lay.gather(a.grad, groups), dA)
            err[f"{tag}.db"] = _rel(gather_param(vec.grad, DIAGONAL, (N,), groups), dv)


def _module_grads(module, groups, x_local, upstream_local):
    """Run a cube module, backprop ``upstream``; return gathered params' grads by name."""
    from megatron_oases.layers.linear3d import gather_param

    out = module(x_local)
    (out * upstream_local).sum().backward()
    return out.detach(), {name: gather_param(prm.grad, prm.cube_layout, prm.global_shape, groups)
                          for name, prm in module.named_parameters()}


def _linears(groups, err, out):
    import torch
    import torch.nn.functional as F

    from megatron_oases.layers.linear3d import Linear3D, activation_layout

    c, p = groups.coord, groups.p
    for input_dir in ("y", "z"):
        for bias in (False, True):
            X, W, b = torch.randn(2, M // 2, N), torch.randn(K, N), torch.randn(K)
            G = torch.randn(2, M // 2, K)
            fn = (lambda x, w, bb: F.linear(x, w, bb)) if bias else (lambda x, w, bb: F.linear(x, w))
            ref, (dX, dW, db) = _dense_grads(fn, X, W, b, upstream=G)
            lin = Linear3D(N, K, groups, input_dir=input_dir, bias=bias, full_weight=W, full_bias=b)
            lin_in, lin_out = activation_layout(input_dir), activation_layout(lin.output_dir)
            x = lin_in.take(X.reshape(M, N), c, p).reshape(2, -1, N // p).requires_grad_()
            g = lin_out.take(G.reshape(M, K), c, p).reshape(2, -1, K // p)
            y, grads = _module_grads(lin, groups, x, g)
            tag = f"linear[{input_dir}{',bias' if bias else ''}]"
            err[f"{tag}.Y"] = _rel(lin_out.gather(y.reshape(-1, K // p), groups), ref.reshape(M, K))
            err[f"{tag}.dX"] = _rel(lin_in.gather(x.grad.reshape(-1, N // p), groups), dX.reshape(M, N))
            err[f"{tag}.dW"] = _rel(grads["weight"], dW)
            if bias:
                err[f"{tag}.db"] = _rel(grads["bias"], db)
            out[f"{tag}.output_dir"] = lin.output_dir

    # fc1 -> gelu -> fc2: the direction exchange brings the activation back to its layout
    H = 2 * K
    X, W1, b1, W2, b2 = (torch.randn(M, K), torch.randn(H, K), torch.randn(H), torch.randn(K, H),
                         torch.randn(K))
    G = torch.randn(M, K)
    ref, dense_grads = _dense_grads(lambda x, w1, c1, w2, c2: F.linear(F.gelu(F.linear(x, w1, c1)), w2, c2),
                                    X, W1, b1, W2, b2, upstream=G)
    fc1 = Linear3D(K, H, groups, input_dir="y", full_weight=W1, full_bias=b1)
    fc2 = Linear3D(H, K, groups, input_dir=fc1.output_dir, full_weight=W2, full_bias=b2)
    mlp = torch.nn.Sequential(fc1, torch.nn.GELU(), fc2)
    lay = activation_layout("y")
    x = lay.take(X, c, p).requires_grad_()
    y, grads = _module_grads(mlp, groups, x, lay.take(G, c, p))
    out["mlp.dirs"] = (fc1.input_dir, fc1.output_dir, fc2.input_dir, fc2.output_dir)
    err["mlp.Y"] = _rel(lay.gather(y, groups), ref)
    err["mlp.dX"] = _rel(lay.gather(x.grad, groups), dense_grads[0])
    for name, ref_g in zip(("0.weight", "0.bias", "2.weight", "2.bias"), dense_grads[1:]):
        err[f"mlp.d{name}"] = _rel(grads[name], ref_g)
    _memory(mlp, groups, out)


def _memory(module, groups, out):
    """Per-rank parameter counts and the global region each shard covers (for the tiling check)."""
    regions = {}
    for name, prm in module.named_parameters():
        reg = prm.cube_layout.region(prm.global_shape, groups.coord, groups.p)
        regions[name] = (prm.global_shape, prm.numel(),
                         None if reg is None else [(s.start, s.stop) for s in reg])
    out["regions"] = regions


def _layernorm(groups, err):
    import torch
    import torch.nn.functional as F

    from megatron_oases.layers.linear3d import LayerNorm3D, activation_layout

    c, p = groups.coord, groups.p
    X, w, b, G = torch.randn(M, N) * 3 + 1, torch.randn(N), torch.randn(N), torch.randn(M, N)
    ref, (dX, dw, db) = _dense_grads(lambda x, ww, bb: F.layer_norm(x, (N,), ww, bb, 1e-5),
                                     X, w, b, upstream=G)
    ln = LayerNorm3D(N, groups, input_dir="y", full_weight=w, full_bias=b)
    lay = activation_layout("y")
    x = lay.take(X, c, p).requires_grad_()
    y, grads = _module_grads(ln, groups, x, lay.take(G, c, p))
    err["layernorm.Y"] = _rel(lay.gather(y, groups), ref)
    err["layernorm.dX"] = _rel(lay.gather(x.grad, groups), dX)
    err["layernorm.dgamma"] = _rel(grads["weight"], dw)
    err["layernorm.dbeta"] = _rel(grads["bias"], db)


def _bytes(groups, out):
    import torch

    from megatron_oases.layers.linear3d import Linear3D, activation_layout, gemm_3d, gemm_layouts
    from megatron_oases.parallel.collectives import CommCounter

    c, p = groups.coord, groups.p

    def records(counter):
        return [(r.kind, r.group_size, r.payload_bytes, r.wire_bytes_per_rank) for r in counter.records]

    la, lb, _ = gemm_layouts("ab", ("y", "x", "z"))
    a, b = la.take(torch.randn(M, N), c, p), lb.take(torch.randn(N, K), c, p)
    with CommCounter() as fwd:
        gemm_3d(a, b, groups, "ab")
    out["bytes.gemm_fwd"] = records(fwd)
    lin = Linear3D(N, K, groups, bias=False)
    x = activation_layout("y").take(torch.randn(M, N), c, p).requires_grad_()
    with CommCounter() as lin_fwd:
        y = lin(x)
    with CommCounter() as lin_bwd:
        y.sum().backward()
    out["bytes.linear_fwd"] = records(lin_fwd)
    out["bytes.linear_bwd"] = records(lin_bwd)


def cube3d_checks(p: int = 2):
    """Everything the 3-D unit tests assert, on one spawn of p^3 ranks."""
    import torch
    import torch.distributed as dist

    from megatron_oases.parallel.cube import build_cube_groups
    from megatron_oases.runtime import init_distributed, init_runtime

    init_distributed(init_runtime("cpu"), timeout_s=60)
    groups = build_cube_groups(list(range(dist.get_world_size())), p)
    out = {"coord": groups.coord, "rank": dist.get_rank(),
           "group_ranks": {d: dist.get_process_group_ranks(groups.group(d)) for d in "xyz"}}
    err: dict[str, float] = {}
    torch.manual_seed(1234)  # the same dense tensors on every rank
    _gemm_forms(groups, err)
    _vector_ops(groups, err)
    _linears(groups, err, out)
    _layernorm(groups, err)
    _bytes(groups, out)
    out["errors"] = err
    return out
