#!/usr/bin/env python3
"""A model file of examples/models (the format `megatron-oases plan --model` reads) as the flags of
another tool, one per line, to splice into its command:

    megatron-oases sim --topology dgx-a100 $(python examples/model_flags.py examples/models/atp-m2.yaml --for sim)
    megatron-oases mesh --topology dgx-a100 $(python examples/model_flags.py examples/models/atp-m2.yaml --for mesh)
    megatron-oases train --nproc-per-node 8 $(python examples/model_flags.py MODEL.yaml --for train) ...

``--for train`` also suits Megatron-LM's ``pretrain_gpt.py`` (same flag names). The file is
checked by the planner's own reader, so a field it does not know is an error here too. An
``attention_backend`` the file states becomes ``--attention-backend`` for train and sim; without
it each tool keeps its default (plan and train: auto; sim: Megatron-LM's local attention).
"""
from __future__ import annotations

import argparse
import sys

TOOLS = ("train", "sim", "mesh")


def model_flags(path: str, tool: str) -> list[str]:
    """The flags of ``tool`` (train / Megatron-LM, sim, mesh) for the model in ``path``; ValueError
    (one line naming the field) when the planner's reader refuses the file."""
    from megatron_oases.plan.graph import PlanError, model_from_mapping
    from megatron_oases.plan.model import stated_fields
    from megatron_oases.plan.plan_cli import _load_config

    try:
        raw = _load_config(path)
        m = model_from_mapping(raw, source=f"--model {path}")
    except PlanError as e:
        raise ValueError(str(e)) from None
    dtype = {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(m.dtype, [])
    if tool == "mesh":  # the layer the picker prices, in the trainer's names (no vocabulary, no kernel)
        v = m.variant
        return (["--tensor-model-parallel-size", str(m.tp), "--hidden-size", str(m.hidden_size),
                 "--num-layers", str(m.num_layers), "--num-attention-heads", str(m.num_attention_heads),
                 "--ffn-hidden-size", str(m.ffn_hidden_size), "--micro-batch-size", str(m.micro_batch_size),
                 "--seq-length", str(m.seq_length), *dtype]
                + (["--swiglu"] if v.gated else [])
                + (["--group-query-attention", "--num-query-groups", str(v.query_groups)] if v.query_groups else [])
                + (["--normalization", v.normalization] if v.normalization != "LayerNorm" else [])
                + ([] if v.bias else ["--disable-bias-linear"]))
    out = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
           "--num-attention-heads", str(m.num_attention_heads), "--seq-length", str(m.seq_length),
           "--ffn-hidden-size", str(m.ffn_hidden_size), "--vocab-size", str(m.padded_vocab_size),
           "--micro-batch-size", str(m.micro_batch_size)]
    stated = stated_fields(raw)
    if "attention_backend" in stated:  # the file's value (checked above): every tool runs / prices it
        out += ["--attention-backend", str(stated["attention_backend"])]
    if tool == "sim":
        return out + ["--dtype", m.dtype, "--tp", str(m.tp)]
    out += ["--max-position-embeddings", str(m.seq_length), "--tensor-model-parallel-size", str(m.tp)]
    return out + dtype


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="model_flags.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="YAML/JSON model file (megatron-oases plan --model format)")
    p.add_argument("--for", dest="tool", choices=TOOLS, required=True,
                   help="the tool whose flag names to print (train also suits Megatron-LM)")
    a = p.parse_args(argv)
    try:
        print("\n".join(model_flags(a.model, a.tool)))
    except ValueError as e:
        print(f"model_flags.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
