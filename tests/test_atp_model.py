"""ATP norm, attention and MLP inside Megatron's GPTModel: parity with torch norms, with the
stock local spec at TP=4 and with TP=1, for meshes (4,1) and (2,2) of one TP=4 group.

Weights come from ``tp_invariant_init_`` (seeded by global key), so every layout starts from the
same global model; gradients are reassembled by ``gather_global`` through ``sharded_state_dict``.
"""
from __future__ import annotations

import torch

from megatron_oases.parallel.mesh import DeviceMesh, shard_index
from tests import rank_fns_atp as R
from tests.conftest import max_rel_diff

TOL = 1e-5
MESHES = [(4, 1, 1), (2, 2, 1), (2, 2, 2)]  # (d1, d2, chunks)


def _torch_norm(kind: str):
    x, w, b, up = R.norm_tensors(kind)
    x = x.clone().requires_grad_()
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    if kind == "LayerNorm":
        y = torch.nn.functional.layer_norm(x, (R.H,), w, b, 1e-5)
    else:
        y = torch.nn.functional.rms_norm(x, (R.H,), w, 1e-5)
    (y * up).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad if kind == "LayerNorm" else None}


def test_atp_norm_parity_tp4(on_ranks):
    results = on_ranks(R.norm_cases, 4, [(4, 1), (2, 2), (1, 4)], timeout_s=120)
    refs = {k: _torch_norm(k) for k in ("LayerNorm", "RMSNorm")}
    for res in results:
        for c in res:
            d1, d2 = c["mesh"]
            mesh, ref = DeviceMesh(d1, d2, tuple(range(4))), refs[c["kind"]]
            idx = shard_index(ref["y"].shape, (None, None, 2), c["coord"], mesh)
            where = (c["kind"], c["mesh"], c["coord"])
            assert max_rel_diff(c["y"], ref["y"][idx]) < TOL, where
            assert max_rel_diff(c["dx"], ref["dx"][idx]) < TOL, where
            assert max_rel_diff(c["dw"], ref["dw"][idx[-1]]) < TOL, where
            if ref["db"] is not None:
                assert max_rel_diff(c["db"], ref["db"][idx[-1]]) < TOL, where
            assert c["tmp"] == (c["coord"][0] == 0), where  # counted once in the grad norm


def test_atp_gpt_model_parity_tp4(on_ranks):
    ref_loss, ref_grads, ref_params = on_ranks(R.single_rank_reference, 1, timeout_s=120)[0]
    results = on_ranks(R.model_parity, 4, MESHES, timeout_s=240)
    full = results[0]
    for name, (loss, grads, params) in full.items():
        assert abs(loss - ref_loss) < TOL * abs(ref_loss), (name, loss, ref_loss)
        assert sorted(grads) == sorted(ref_grads), name
        for key, want in ref_params.items():
            assert torch.equal(params[key], want), (name, key)
        for key, want in ref_grads.items():
            assert max_rel_diff(grads[key], want) < TOL, (name, key, max_rel_diff(grads[key], want))
    for res in results[1:]:
        for name, loss in res.items():
            assert abs(loss - full[name][0]) < TOL * abs(full[name][0]), name


def test_atp_gpt_training_parity_tp4(on_ranks):
    """Three Adam steps through Megatron DDP with grad clipping: losses and grad norms equal TP=1
    (the norm counts each mesh-replicated bias / norm weight once)."""
    ref = on_ranks(R.train_reference, 1, timeout_s=120)[0]
    results = on_ranks(R.train_parity, 4, MESHES, timeout_s=240)
    for res in results:
        for name, steps in res.items():
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, ref)):
                assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss), (name, step, loss, ref_loss)
                assert abs(norm - ref_norm) < 1e-5 * abs(ref_norm), (name, step, norm, ref_norm)


def test_atp_gpt_dropout_matches_megatron_tp4(on_ranks):
    """With dropout on, the ATP model draws the same attention and hidden masks as stock TP=4."""
    results = on_ranks(R.dropout_parity, 4, MESHES, timeout_s=240)
    for res in results:
        ref_loss, ref_grads = res["megatron"]
        for name, (loss, grads) in res.items():
            assert abs(loss - ref_loss) < TOL * abs(ref_loss), (name, loss, ref_loss)
            for key, want in ref_grads.items():
                assert max_rel_diff(grads[key], want) < TOL, (name, key)
    no_dropout = on_ranks(R.single_rank_reference, 1, timeout_s=120)[0][0]
    assert abs(results[0]["megatron"][0] - no_dropout) > 1e-4  # dropout really was on
