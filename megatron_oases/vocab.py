"""The padded vocabulary every consumer builds with (trainer, specs, checkpoints, simulator)."""
from __future__ import annotations

import dataclasses
import math


def padded_vocab_size(cfg) -> int:
    """The vocabulary size the model is built with.

    Megatron pads to a multiple of ``--make-vocab-size-divisible-by`` x TP, so the padded size
    grows with TP (1000 -> 1024 at TP 1, 1152 at TP 3) and the extra logits change the softmax:
    two layouts would train different models. With the TP-invariant init (the default) the
    padding is a multiple of ``--make-vocab-size-divisible-by``, raised to a multiple of TP only
    where it is not one already (their least common multiple), so every TP that divides the
    padded size builds the same model. ``--no-tp-invariant-init`` keeps Megatron's rule.
    """
    tp, divisor = cfg.tensor_model_parallel_size, cfg.make_vocab_size_divisible_by
    if cfg.tp_invariant_init:
        multiple = math.lcm(divisor, tp)
    else:
        multiple = divisor * tp
    return ((cfg.vocab_size + multiple - 1) // multiple) * multiple


def vocab_padding_note(cfg) -> str | None:
    """A one-line note when this layout's padded vocabulary differs from TP 1's (the layouts
    then train different softmaxes, so their losses are not comparable); else None."""
    if not cfg.tp_invariant_init or cfg.tensor_model_parallel_size == 1:
        return None
    here = padded_vocab_size(cfg)
    at_tp1 = padded_vocab_size(dataclasses.replace(cfg, tensor_model_parallel_size=1))
    if here == at_tp1:
        return None
    return (f"note: --vocab-size {cfg.vocab_size} pads to {here} at --tensor-model-parallel-size "
            f"{cfg.tensor_model_parallel_size} but to {at_tp1} at TP 1, so losses differ from "
            f"layouts with other TP sizes; pass --vocab-size {here} to make them comparable")
