import pytest
import torch

from stree.models import tiny_model
from stree.search import StepDecoder, candidate_generator
from stree.search.batched import Candidate, Request
from stree.search.policy import Policy
from stats import assert_matches


def full_forward(model, tokens):
    """Next-token logits after `tokens`, one plain forward over the whole sequence (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def candidates(n, seed, parent=None):
    return [Candidate((j,), candidate_generator(seed, (j,)), parent) for j in range(n)]


def decode_all(decoder):
    ended = []
    while decoder.branches:
        ended += decoder.step()
    return ended


def test_merged_siblings_are_distributed_as_independent_samples():
    """Siblings sharing a row while their draws agree are still distributed as independent two-token samples."""
    vocab = 5
    model = tiny_model("bamba", dtype=torch.float64, vocab_size=vocab, seed=4)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    policy = Policy(model, step_max_tokens=2)
    batch, root = policy.prefill([1, 2, 3])
    exact = {}
    first = full_forward(model, [1, 2, 3]).softmax(-1)
    for t1 in range(vocab):
        second = full_forward(model, [1, 2, 3, t1]).softmax(-1)
        for t2 in range(vocab):
            exact[(t1, t2)] = float(first[t1] * second[t2])
    counts = {}
    decoder = StepDecoder(policy, batch)
    # 300 parents (all at the root's state) of 8 candidates each, keys (parent, j), decoded together
    decoder.start([Request(root, [Candidate((p, j), candidate_generator(0, (p, j)), p) for j in range(8)])
                   for p in range(300)])
    ended = decode_all(decoder)
    assert sum(len(branch.candidates) for branch, _ in ended) == 8 * 300
    steps = [(branch.parent, tuple(branch.tokens)) for branch, _ in ended]
    assert len(set(steps)) == len(steps)  # one row per distinct step of a parent
    for branch, _ in ended:
        counts[tuple(branch.tokens)] = counts.get(tuple(branch.tokens), 0) + len(branch.candidates)
    assert_matches(counts, exact)


@pytest.mark.parametrize("family", ["nemotron_h", "zamba2"])
def test_steps_end_at_delimiters_and_carry_their_states(family):
    model = tiny_model(family, dtype=torch.float64)
    policy = Policy(model, step_delimiter_ids=[7, 8], step_max_tokens=6, eos_token_ids=[9])
    prompt = [1, 2, 3, 4]
    batch, root = policy.prefill(prompt)
    decoder = StepDecoder(policy, batch)
    decoder.start([Request(root, candidates(6, 1))])
    ended = decode_all(decoder)
    assert sum(len(branch.candidates) for branch, _ in ended) == 6
    for branch, state in ended:
        tokens = branch.tokens
        assert len(tokens) == 6 or tokens[-1] in (7, 8, 9)
        assert all(t not in (7, 8, 9) for t in tokens[:-1])
        assert state.held == (tokens[-1] != 9)  # a finished step keeps no snapshot
        assert state.length == len(prompt) + len(tokens)
        if state.held:
            torch.testing.assert_close(state.logits, full_forward(model, prompt + tokens), atol=1e-5, rtol=1e-5)
    # every snapshot is its own: feeding one more token to each gives what a full forward gives
    held = [(branch, state) for branch, state in ended if state.held]
    batch.add([state for _, state in held])
    batch.advance([3] * len(held))
    for i, (branch, _) in enumerate(held):
        torch.testing.assert_close(batch.logits[i], full_forward(model, prompt + branch.tokens + [3]),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        Policy(model, temperature=0.0)
    with pytest.raises(ValueError, match="prompt"):
        policy.prefill([])
