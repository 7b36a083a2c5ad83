"""scripts/bench_oases_moe.py's model and communication-only row read the described MoE layer
(no ranks, no timing)."""

from tests.script_modules import load_script

S = load_script("scripts/bench_oases_moe.py")


def test_the_comm_row_runs_the_described_moe_collectives():
    """Per MoE layer and sub-batch at TP 1 x EP 2: the token counts' gather, the tokens' and the
    probabilities' dispatch all-to-alls and the combine forward, their three adjoints backward;
    an all-to-all moves the sub-batch's routed copies, tokens x top-k x h (fp32)."""
    a = S.parse_args(["--micro-batch", "4", "--seq", "64", "--hidden", "128", "--layers", "3",
                      "--topk", "2", "--experts", "4"])
    colls = S.step_collectives(a)
    per_layer = len(colls) // (2 * a.layers * a.micro_batches)
    assert per_layer == 7 and len(colls) == 7 * 2 * 3 * 2
    a2a = [b for k, b in colls[:per_layer] if k == "all_to_all"]
    tokens = a.micro_batch // 2 * a.seq
    assert sorted(a2a) == sorted([tokens * 2 * a.hidden * 4] * 4 + [tokens * 2 * 4] * 2)
    assert [k for k, _ in colls[:per_layer]].count("all_gather") == 1


def test_the_trainer_runs_ep_across_the_two_nodes():
    """EP is the world (one rank per emulated node); the global batch counts both replicas."""
    a = S.parse_args([])
    flags = S.trainer_flags(a)
    at = lambda f: flags[flags.index(f) + 1]  # noqa: E731
    assert at("--expert-model-parallel-size") == str(S.EP) and at("--tensor-model-parallel-size") == "1"
    assert int(at("--global-batch-size")) == a.micro_batch * a.micro_batches * S.EP
    assert at("--moe-token-dispatcher-type") == "alltoall" and float(at("--moe-aux-loss-coeff")) > 0


def test_the_grad_row_reduces_the_non_expert_gradients(tmp_path):
    """The DP all-reduce: every fp32 gradient but the experts' (their expert-DP group is one rank):
    per layer the two LayerNorms, QKV, the projection and the router (no biases), then the word
    and position embeddings (tied output layer) and the final norm."""
    a = S.parse_args(["--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128", "--layers", "3"])
    h = a.hidden
    per_layer = 2 * h + 3 * h * h + h * h + 2 * h + a.experts * h
    params = a.layers * per_layer + a.vocab * h + a.seq * h + 2 * h
    topo = S.write_topology(str(tmp_path), "t", S.two_node_yaml(0.1))
    assert S.grad_reduce_bytes(a, topo) == 4 * params
