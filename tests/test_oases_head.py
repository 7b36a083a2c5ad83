"""The head's TP collectives under the Oases split, as the description and the simulator see
them (the runtime's side is in tests/test_oases_schedule.py: parity, and no collective of the
whole micro-batch): per sub-batch, in the layers' sub-batch chains, at one sub-batch's payload;
the loss's all-reduces and the head's compute stay on the whole micro-batch."""
from __future__ import annotations

import pytest

from megatron_oases.describe.head import head_ops

B, S, H, V, T, E = 4, 64, 256, 512, 2, 2
ACT = B * S * H * E  # one micro-batch's hidden states


@pytest.mark.parametrize("sp,rope", [(False, False), (True, False), (True, True)],
                         ids=["tp", "sp", "sp-rope"])
def test_description_moves_the_head_collectives_to_the_sub_batches(sp, rope):
    stock = head_ops(b=B, s=S, h=H, v=V, t=T, e=E, first=True, last=True, sequence_parallel=sp,
                     learned_positions=not rope)
    split = head_ops(b=B, s=S, h=H, v=V, t=T, e=E, first=True, last=True, sequence_parallel=sp,
                     learned_positions=not rope, sub_batches=2)
    moved = [c for f in ("split_pre_forward", "split_post_forward", "split_pre_backward",
                         "split_post_backward") for c in getattr(split, f)]
    whole = [c.name for f in ("pre_forward", "post_forward", "pre_backward", "post_backward")
             for c in getattr(stock, f) if getattr(c, "payload_bytes", 0) == ACT]
    assert sorted(c.name for c in moved) == sorted(n for n in whole if n != "logits.ag.wgrad")
    assert {c.payload_bytes for c in moved} == {ACT // 2}
    left = [c for f in ("pre_forward", "post_forward", "pre_backward", "post_backward")
            for c in getattr(split, f) if hasattr(c, "payload_bytes")]
    assert [c.name for c in left] == ["loss.ar"]


def _chunk(schedule: str, sp: bool):
    from megatron_oases.describe.shapes import GPTShape
    from megatron_oases.sim.core.events import build_stage_events
    from megatron_oases.sim.core.strategy import Strategy
    from megatron_oases.topology import load_topology

    shape = GPTShape(num_layers=2, hidden_size=H, num_attention_heads=8, seq_length=S,
                     padded_vocab_size=V, micro_batch_size=B, dtype="bf16")
    assert shape.bytes_per_element == E
    (stage,) = build_stage_events(shape, Strategy(tp=T, dp=4, schedule=schedule,
                                                  sequence_parallel=sp, recompute=True), load_topology("pcie-3090-2node"))
    return stage.chunks[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_simulator_runs_the_head_collectives_in_the_sub_batch_chains(sp):
    """Stock: the embedding's and the output layer's collectives move the whole micro-batch in
    one-chain segments; Oases: every TP collective moves one sub-batch, in the 2-chain segment
    with the layers (so one sub-batch's overlaps the other's compute)."""
    head = ("embedding.", "logits.")

    def sizes(chunk):
        return {(ev.name, chains, ev.nbytes) for segs in (chunk.forward_segments, chunk.backward_segments)
                for evs, chains in segs for ev in evs
                if ev.kind == "collective" and ev.name.startswith(head)}

    stock, oases = sizes(_chunk("default", sp)), sizes(_chunk("oases", sp))
    assert {(c, n) for _, c, n in stock} == {(1, ACT)}
    assert {(c, n) for _, c, n in oases} == {(2, ACT // 2)}
    assert {name for name, _, _ in oases} == {name for name, _, _ in stock} - {"logits.ag.wgrad"}
    chunk = _chunk("oases", sp)
    assert len(chunk.forward_segments) == 3  # embedding | its collective, layers (2 chains) | logits, loss
