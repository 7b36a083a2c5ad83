"""The one model-shape type (``describe.shapes.GPTShape``): its defaults, its one validation (one
line naming the flag, whichever consumer builds it), the Llama flags -> LayerVariant mapping, the
planner's file layout, and a guard against a second shape type growing back."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from megatron_oases.describe.ops import GPT2, LayerVariant, ModelingError
from megatron_oases.describe.shapes import DTYPES, GPTShape, dtype_of, variant_flags, variant_from_flags
from megatron_oases.plan.mesh_cli import mesh_main
from megatron_oases.plan.model import FILE_FIELDS, PlanError, PlanModel, model_from_mapping

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=4)
PKG = pathlib.Path(__file__).resolve().parents[1] / "megatron_oases"


def test_defaults_and_derived_sizes():
    import argparse

    from megatron_oases.precision import priced_dtype

    m = GPTShape(**BASE)
    # unstated precision is fp32 in every reading (issue 49): the shape's default is the flags' rule
    assert m.dtype == priced_dtype(argparse.Namespace(), ValueError) == "fp32"
    assert (m.ffn_hidden_size, m.padded_vocab_size, m.variant) == (256, 51200, GPT2)
    assert (m.bytes_per_element, m.grad_dtype, m.num_query_groups, m.tied_embeddings) == (4, "fp32", 4, True)
    assert [GPTShape(**BASE, dtype=d).bytes_per_element for d in DTYPES] == [2, 2, 4]
    assert GPTShape(**BASE, dtype="fp16", grad_reduce_bytes=2).grad_dtype == "fp16"
    assert GPTShape(**BASE, variant=LayerVariant(query_groups=2)).num_query_groups == 2
    assert (dtype_of(2), dtype_of(4)) == ("bf16", "fp32")


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", 0, "--num-layers must be a positive integer (got 0)"),
    ("hidden_size", 1.5, "--hidden-size must be a positive integer (got 1.5)"),
    ("num_attention_heads", True, "--num-attention-heads must be a positive integer (got True)"),
    ("seq_length", -1, "--seq-length must be a positive integer"),
    ("micro_batch_size", 0, "--micro-batch-size must be a positive integer"),
    ("ffn_hidden_size", -4, "--ffn-hidden-size must be a positive integer"),
    ("padded_vocab_size", 0, "--vocab-size (padded) must be a positive integer"),
    ("dtype", "int8", "model dtype must be one of bf16, fp16, fp32 (got 'int8')"),
    ("hidden_dropout", 1.0, "--hidden-dropout must be in [0, 1) (got 1.0)"),
    ("attention_dropout", -0.1, "--attention-dropout must be in [0, 1)"),
    ("grad_reduce_bytes", 8, "gradient reduction bytes must be 2 or 4 (got 8)"),
    ("variant", LayerVariant(query_groups=3), "--num-query-groups 3 must divide --num-attention-heads 4"),
])
def test_one_validation_one_line_for_every_consumer(field, value, message):
    """The simulator's and the ATP mesh picker's GPTShape raise ModelingError (the simulator's
    SimError); the planner's PlanModel raises PlanError with the same words."""
    with pytest.raises(ModelingError) as sim:
        GPTShape(**{**BASE, field: value})
    with pytest.raises(PlanError) as plan:
        PlanModel(**{**BASE, field: value}, tp=2)
    assert str(sim.value) == str(plan.value) and message in str(sim.value)
    assert "\n" not in str(sim.value)


def test_plan_model_is_the_shape_plus_the_planning_setup():
    m = PlanModel(**BASE, tp=2)
    assert isinstance(m, GPTShape)
    shape_fields = {f.name for f in dataclasses.fields(GPTShape)}
    own = [f.name for f in dataclasses.fields(PlanModel) if f.name not in shape_fields]
    assert own == ["tp", "recompute", "fine_grained_recompute", "selective_recompute", "sub_batches", "distributed_optimizer", "sequence_parallel", "ep"]
    # ATP plans TP 6 (its meshes 3x2, 2x3, 1x6); the megatron family refuses it (test_planner)
    assert PlanModel(**{**BASE, "hidden_size": 96, "num_attention_heads": 6}, tp=6).tp == 6
    with pytest.raises(PlanError, match="--untie-embeddings-and-output-weights is not priced by the planner"):
        PlanModel(**BASE, tp=2, tied_embeddings=False)
    with pytest.raises(PlanError, match="grad_reduce_bytes must be 4"):
        PlanModel(**BASE, tp=2, dtype="fp16", grad_reduce_bytes=2)


def test_the_plan_file_layout_round_trips():
    """``inputs.model`` of a plan file keeps its flat Megatron-flag keys, and reads back."""
    m = model_from_mapping({**BASE, "tp": 2, "vocab_size": 1024, "swiglu": True, "num_query_groups": 2,
                            "normalization": "RMSNorm", "position_embedding_type": "rope", "rotary_percent": 0.5})
    assert m.padded_vocab_size == 1024 and m.variant == LayerVariant(
        query_groups=2, gated=True, normalization="RMSNorm", rotary=True, rotary_percent=0.5)
    d = m.to_dict()
    assert tuple(d) == FILE_FIELDS and d["vocab_size"] == 1024 and d["num_query_groups"] == 2
    assert model_from_mapping(d) == m
    with pytest.raises(PlanError, match="unknown field 'variant'"):
        model_from_mapping({**BASE, "tp": 2, "variant": "llama"})


def test_variant_flags_round_trip_and_name_their_flag():
    v = variant_from_flags(num_query_groups=2, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                           position_embedding_type="rope", rotary_percent=0.5, qk_layernorm=True)
    assert variant_from_flags(**variant_flags(v)) == v
    assert variant_from_flags() == GPT2 and variant_flags(GPT2)["num_query_groups"] == 0
    for kw, flag in ((dict(normalization="BatchNorm"), "--normalization"),
                     (dict(position_embedding_type="alibi"), "--position-embedding-type"),
                     (dict(rotary_percent=0.5), "--rotary-percent"),
                     (dict(num_query_groups=-1), "--num-query-groups")):
        with pytest.raises(PlanError, match=flag):
            variant_from_flags(**kw, error=PlanError)


def test_mesh_cli_refuses_an_element_size_without_a_dtype(capsys):
    argv = ["--topology", "pcie-3090x4", "--tp", "4", "--hidden", "64", "--layers", "2",
            "--micro-batch-size", "2", "--seq-length", "32"]
    assert mesh_main(argv + ["--bytes-per-element", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "argument --bytes-per-element: invalid choice: 3 (choose from 2, 4)" in err
    assert mesh_main(argv + ["--bytes-per-element", "4"]) == 0


def _shape_like_classes() -> dict[str, str]:
    """module:class of every class that declares both a hidden size and a layer count field."""
    found = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                         and isinstance(s.target, ast.Name)}
                if names & {"hidden", "hidden_size"} and names & {"layers", "num_layers"}:
                    found[node.name] = str(path.relative_to(PKG.parent))
    return found


def test_no_second_model_shape_type():
    """One fact, one place: besides GPTShape only the runtime's parallel layout (which checks the
    sizes against the degrees) and the argparse mirror declare model sizes."""
    assert _shape_like_classes() == {"GPTShape": "megatron_oases/describe/shapes.py",
                                     "ParallelDims": "megatron_oases/parallel/dims.py",
                                     "RunConfig": "megatron_oases/run_config.py"}
