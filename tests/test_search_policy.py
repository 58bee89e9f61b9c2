import pytest
import torch

from stree.models import tiny_model
from stree.search.policy import Policy
from stats import assert_matches


@pytest.mark.parametrize("family", ["mamba2", "bamba", "zamba2"])
def test_forked_continuation_equals_reprefill(family):
    model = tiny_model(family, dtype=torch.float64)
    policy = Policy(model)
    prompt = [3, 1, 4, 1, 5, 9]
    root = policy.prefill(prompt)
    before = root.logits.clone()
    a = policy.extend(root, [2, 6, 5])
    b = policy.extend(root, [3, 5])  # the root was not disturbed by the first fork
    torch.testing.assert_close(a.logits, policy.prefill(prompt + [2, 6, 5]).logits)
    torch.testing.assert_close(b.logits, policy.prefill(prompt + [3, 5]).logits)
    torch.testing.assert_close(root.logits, before)
    assert a.length == 9 and b.length == 8


def test_merged_siblings_are_distributed_as_independent_samples():
    vocab = 5
    model = tiny_model("bamba", dtype=torch.float64, vocab_size=vocab, seed=4)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    policy = Policy(model, step_max_tokens=2)
    root = policy.prefill([1, 2, 3])
    exact = {}
    first = root.logits.softmax(-1)
    for t1 in range(vocab):
        second = policy.extend(root, [t1]).logits.softmax(-1)
        for t2 in range(vocab):
            exact[(t1, t2)] = float(first[t1] * second[t2])
    g = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(300):
        steps = list(policy.sample_steps(root, 8, g))
        assert sum(s.count for s in steps) == 8
        for s in steps:
            counts[tuple(s.tokens)] = counts.get(tuple(s.tokens), 0) + s.count
    assert_matches(counts, exact)


def test_steps_end_at_delimiters_and_carry_their_states():
    model = tiny_model("nemotron_h", dtype=torch.float64)
    policy = Policy(model, step_delimiter_ids=[7, 8], step_max_tokens=6, eos_token_ids=[9])
    root = policy.prefill([1, 2, 3, 4])
    steps = list(policy.sample_steps(root, 6, torch.Generator().manual_seed(1)))
    for step in steps:
        assert len(step.tokens) == 6 or step.tokens[-1] in (7, 8, 9)
        assert all(t not in (7, 8, 9) for t in step.tokens[:-1])
        assert step.finished == (step.tokens[-1] == 9)
        torch.testing.assert_close(step.state.logits, policy.extend(root, step.tokens).logits)
    # every yielded state is its own: feeding one more token to each gives what re-feeding from the root gives
    for step in steps:
        torch.testing.assert_close(policy.extend(step.state, [3]).logits, policy.extend(root, step.tokens + [3]).logits)
    assert sum(step.count for step in steps) == 6
    with pytest.raises(ValueError):
        Policy(model, temperature=0.0)
    with pytest.raises(ValueError, match="n must be"):
        policy.sample_steps(root, 0)
