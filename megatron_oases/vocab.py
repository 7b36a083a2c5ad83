"""The padded vocabulary every consumer builds with (trainer, specs, checkpoints, simulator)."""
from __future__ import annotations

import argparse
import math


def padded_vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary size the model is built with.

    Megatron pads to a multiple of ``--make-vocab-size-divisible-by`` x TP, so the padded size
    grows with TP (1000 -> 1024 at TP 1, 1152 at TP 3) and the extra logits change the softmax:
    two layouts would train different models. With the TP-invariant init (the default) the
    padding is a multiple of ``--make-vocab-size-divisible-by``, raised to a multiple of TP only
    where it is not one already (their least common multiple), so every TP that divides the
    padded size builds the same model. ``--no-tp-invariant-init`` keeps Megatron's rule.
    """
    tp, divisor = args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
    if args.tp_invariant_init:
        multiple = math.lcm(divisor, tp)
    else:
        multiple = divisor * tp
    return ((args.vocab_size + multiple - 1) // multiple) * multiple


def vocab_padding_note(args: argparse.Namespace) -> str | None:
    """A one-line note when this layout's padded vocabulary differs from TP 1's (the layouts
    then train different softmaxes, so their losses are not comparable); else None."""
    if not args.tp_invariant_init or args.tensor_model_parallel_size == 1:
        return None
    here = padded_vocab_size(args)
    at_tp1 = padded_vocab_size(argparse.Namespace(**{**vars(args), "tensor_model_parallel_size": 1}))
    if here == at_tp1:
        return None
    return (f"note: --vocab-size {args.vocab_size} pads to {here} at --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} but to {at_tp1} at TP 1, so losses differ from "
            f"layouts with other TP sizes; pass --vocab-size {here} to make them comparable")
