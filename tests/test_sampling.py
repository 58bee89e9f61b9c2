"""Lossless sampling: processed distributions equal HF's, draws are distributed as claimed, and speculative
verification reproduces the target's distribution (chi-square tests on seeded samples, able to fail)."""
import itertools

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import stree
from stree.models import tiny_model
from stree.sampling import Sampler, draw_without_replacement, sample
from stree.verify import children_lists, verify_sampling
from stats import assert_matches, chi_square, chi_square_critical
from test_generate import random_pacing, record_trunks


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                       (0.5, 4, 0.6), (1.0, 1, None), (1.0, None, 0.01)])
def test_sampler_equals_hf_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g)
    logits[:, 7] = logits[:, 3]  # a tie at some rank
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p is not None:
        want = TopPLogitsWarper(top_p)(None, want)
    got = Sampler(temperature, top_k, top_p).scores(logits, 0)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got.softmax(-1), want.double().softmax(-1))


def test_min_new_tokens_bans_eos_like_hf():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    eos = [2, 5]
    sampler = Sampler(min_new_tokens=4, eos_ids=frozenset(eos))
    generated = torch.tensor([2, 4, 3])
    got = sampler.scores(logits, generated)
    for row in range(3):
        hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=0, min_new_tokens=4, eos_token_id=eos)
        want = hf(torch.zeros(1, int(generated[row]), dtype=torch.long), logits[row:row + 1].clone())[0]
        torch.testing.assert_close(got[row], want.double())


def sample_without_replacement(probs, k, g):
    ids, valid = draw_without_replacement(probs, k, g)
    return [t for t, ok in zip(ids.tolist(), valid.tolist()) if ok]


def test_sampling_without_replacement_is_sequential():
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    counts = {}
    for _ in range(20000):
        pair = tuple(sample_without_replacement(probs, 2, g))
        counts[pair] = counts.get(pair, 0) + 1
    exact = {(a, b): float(probs[a] * probs[b] / (1 - probs[a])) for a in range(5) for b in range(5)
             if a != b and probs[a] > 0 and probs[b] > 0}
    assert_matches(counts, exact)
    assert sample_without_replacement(probs, 9, g).__len__() == 4  # only 4 tokens have mass
    rows = draw_without_replacement(torch.stack([probs, probs.flip(0)]), 3, g)[0]  # batched rows draw independently
    assert rows.shape == (2, 3) and set(rows[1].tolist()) <= {1, 2, 3, 4}


def test_three_draws_skip_tokens_without_mass():
    """Triples from a distribution with zeros between its tokens (as top-k / top-p leave it), rows batched."""
    probs = torch.tensor([0.3, 0.0, 0.4, 0.2, 0.0, 0.1], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    counts = {}
    for _ in range(4000):
        ids, valid = draw_without_replacement(torch.stack([probs, torch.zeros(6, dtype=torch.float64)]), 3, g)
        assert valid[1].tolist() == [0.0, 0.0, 0.0] and valid[0].tolist() == [1.0, 1.0, 1.0]
        counts[tuple(ids[0].tolist())] = counts.get(tuple(ids[0].tolist()), 0) + 1
    support = [0, 2, 3, 5]
    exact = {(a, b, c): float(probs[a] * probs[b] / (1 - probs[a]) * probs[c] / (1 - probs[a] - probs[b]))
             for a, b, c in itertools.permutations(support, 3)}
    assert_matches(counts, exact)


class SyntheticLM:
    """Next-token distributions indexed by the prefix (a tuple), random but fixed by the seed; `sparsity` zeros
    some entries (as top-k / top-p do)."""

    def __init__(self, vocab, seed, sparsity=0.0, sharpness=1.5):
        self.vocab, self.seed, self.sparsity, self.sharpness = vocab, seed, sparsity, sharpness
        self.table = {}

    def __call__(self, prefix):
        if prefix not in self.table:
            g = torch.Generator().manual_seed(hash((self.seed,) + prefix) % 2 ** 31)
            logits = torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.sharpness
            drop = torch.rand(self.vocab, generator=g) < self.sparsity
            drop[logits.argmax()] = False
            self.table[prefix] = logits.masked_fill(drop, float("-inf")).softmax(-1)
        return self.table[prefix]


def speculative_tokens(target, draft, branching, n_tokens, g, claimed_draft=None):
    """The first n_tokens of speculative decoding from the empty prefix: draft a static tree by drawing each
    node's children from the draft without replacement, verify with verify_sampling, repeat."""
    out = []
    while len(out) < n_tokens:
        prefix = tuple(out)
        tokens, parents, paths, q = [0], [-1], [prefix], {}
        frontier = [0]
        for width in branching:
            next_frontier = []
            for node in frontier:
                q[node] = draft(paths[node])
                for token in sample_without_replacement(q[node], width, g):
                    tokens.append(token)
                    parents.append(node)
                    paths.append(paths[node] + (token,))
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier
        p = torch.stack([target(path) for path in paths])
        shown = q if claimed_draft is None else {n: claimed_draft(paths[n]) for n in q}
        accepted, bonus = verify_sampling(tokens, parents, p, shown, g)
        out += [tokens[n] for n in accepted[1:]] + [bonus]
    return tuple(out[:n_tokens])


def exact_sequences(target, n_tokens):
    probs = {}
    for seq in itertools.product(range(target.vocab), repeat=n_tokens):
        prob = 1.0
        for i in range(n_tokens):
            prob *= float(target(seq[:i])[seq[i]])
        probs[seq] = prob
    return probs


@pytest.mark.parametrize("branching, sparsity, seed", [((1, 1, 1), 0.0, 0), ((3, 2), 0.0, 1), ((2, 2, 2), 0.3, 2),
                                                      ((4,), 0.5, 3)])
def test_verification_reproduces_target_distribution(branching, sparsity, seed):
    target, draft = SyntheticLM(4, seed, sparsity), SyntheticLM(4, seed + 100, sparsity)
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(6000):
        seq = speculative_tokens(target, draft, branching, 2, g)
        counts[seq] = counts.get(seq, 0) + 1
    assert_matches(counts, exact_sequences(target, 2))


def test_a_wrong_acceptance_rule_is_caught():
    """Verifying with a proposal other than the one the drafts came from breaks losslessness: the test sees it."""
    target, draft = SyntheticLM(4, 7), SyntheticLM(4, 107)
    uniform = lambda prefix: torch.full((4,), 0.25, dtype=torch.float64)  # noqa: E731
    g = torch.Generator().manual_seed(7)
    counts = {}
    for _ in range(6000):
        seq = speculative_tokens(target, draft, (3, 2), 2, g, claimed_draft=uniform)
        counts[seq] = counts.get(seq, 0) + 1
    stat, df = chi_square(counts, exact_sequences(target, 2))
    assert stat > chi_square_critical(df)


def exact_model_distribution(model, prompt, n_tokens, sampler):
    """Exact probability of every continuation of n_tokens under the target's sampling distribution (one that ends
    with one of sampler.eos_ids stops there, shorter)."""
    probs = {(): 1.0}
    for step in range(n_tokens):
        grown = {}
        for seq, prob in probs.items():
            if seq and seq[-1] in sampler.eos_ids:
                grown[seq] = prob
                continue
            ids = torch.cat([prompt, torch.tensor([seq], dtype=torch.long)], dim=1)
            with torch.no_grad():
                dist = sampler.probs(model(ids).logits[0, -1], step)
            for token in range(dist.shape[0]):
                if dist[token] > 0:
                    grown[seq + (token,)] = prob * float(dist[token])
        probs = grown
    return probs


@pytest.mark.parametrize("family, sharpness, tree, temperature, top_k, top_p", [
    ("bamba", 8.0, (2, 2), 1.0, None, None),
    ("mamba2", 2.0, (1, 1, 1), 0.5, 4, 0.9),
    ("zamba2", 4.0, stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2), 0.8, None, 0.95),
])
def test_generate_samples_the_target_distribution(family, sharpness, tree, temperature, top_k, top_p):
    """End to end with HF models and an independently initialised draft: the first 3 tokens of stree.generate
    follow the target's exact distribution, one with many likely outcomes."""
    vocab, samples = 5, 600
    target = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=1)
    draft = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=2)
    with torch.no_grad():  # sharper next-token distributions than the tiny init gives (each family its own)
        target.get_output_embeddings().weight.mul_(sharpness)
        draft.get_output_embeddings().weight.mul_(sharpness)
    target.generation_config.eos_token_id = None
    prompt = torch.tensor([[1, 3, 0]])
    sampler = Sampler(temperature, top_k, top_p)
    exact = exact_model_distribution(target, prompt, 3, sampler)
    assert sum(samples * p >= 5 for p in exact.values()) >= 6 and max(exact.values()) < 0.5  # a real test
    g = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(samples):
        out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=3, temperature=temperature,
                             top_k=top_k, top_p=top_p, tree=tree, generator=g)
        seq = tuple(out[0, 3:].tolist())
        counts[seq] = counts.get(seq, 0) + 1
    assert_matches(counts, exact)


@pytest.mark.parametrize("family, tree, min_new_tokens", [("bamba", (2, 2), 2), ("mamba2", (1, 1, 1), 1)])
def test_eos_and_min_new_tokens_sample_the_target_distribution(family, tree, min_new_tokens):
    """With an EOS token that is likely, and banned before min_new_tokens: the outputs (up to 4 new tokens, shorter
    when EOS ends them) follow the target's exact distribution, EOS ban included."""
    vocab, eos, samples = 5, 2, 600
    target = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=1)
    draft = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=2)
    with torch.no_grad():
        for model in (target, draft):
            model.get_output_embeddings().weight.mul_(3.0)
            model.get_output_embeddings().weight[eos].add_(0.5 * model.get_output_embeddings().weight.mean(0))
    prompt = torch.tensor([[1, 3, 0]])
    sampler = Sampler(1.0, None, None, min_new_tokens, frozenset([eos]))
    exact = exact_model_distribution(target, prompt, 4, sampler)
    stopped = sum(p for seq, p in exact.items() if len(seq) < 4)
    assert 0.15 < stopped and min(len(seq) for seq in exact) == min_new_tokens + 1  # EOS matters, and is banned
    g = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(samples):
        out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=4, min_new_tokens=min_new_tokens,
                             eos_token_id=eos, temperature=1.0, tree=tree, generator=g)
        seq = tuple(out[0, 3:].tolist())
        counts[seq] = counts.get(seq, 0) + 1
    assert_matches(counts, exact)


def pit_counts(target, prompt, outputs, sampler, order_by=None, bins=10, seed=0):
    """Randomised probability integral transform of every generated token under the target's exact conditional
    distribution given the tokens before it: for a correct sampler these are i.i.d. uniform, however long the
    sequence, whatever order the vocabulary is put in at each position. order_by (a draft model): order it by the
    draft's probability there, so that a verifier leaning towards or away from the draft's tokens moves the PIT to
    one end (ordered by token id such a bias scatters over the bins). Returns (counts per bin, expected probability
    per bin)."""
    g = torch.Generator().manual_seed(seed)
    counts = {b: 0 for b in range(bins)}
    for out in outputs:
        with torch.no_grad():
            logits = target(out[:, :-1]).logits[0]
            order_logits = None if order_by is None else order_by(out[:, :-1]).logits[0]
        for step, position in enumerate(range(prompt.shape[1] - 1, out.shape[1] - 1)):
            probs = sampler.probs(logits[position], step)
            token = int(out[0, position + 1])
            if order_logits is not None:
                order = sampler.probs(order_logits[position], step).argsort(stable=True)
                probs, token = probs[order], int((order == token).nonzero())
            u = float(probs[:token].sum() + torch.rand((), generator=g, dtype=torch.float64) * probs[token])
            counts[min(int(u * bins), bins - 1)] += 1
    return counts, {b: 1.0 / bins for b in range(bins)}


def close_pair(family, vocab=8):
    """A tiny target with sharp next-token distributions and a noisy copy of it as the draft: high acceptance, so
    rounds accept whole paths."""
    return noisy_pair(family, vocab, sharpness=12.0, noise=0.02)


def noisy_pair(family, vocab=8, sharpness=4.0, noise=1.0):
    """A tiny target (its LM head scaled by `sharpness`) and as the draft a copy with seeded noise of scale `noise`
    on every weight. The defaults disagree often: about 1.5 tokens a target pass, rejections in most rounds."""
    target = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=1)
    draft = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(sharpness)
        for mine, theirs in zip(draft.parameters(), target.parameters()):
            mine.copy_(theirs + noise * torch.randn(theirs.shape, generator=g, dtype=theirs.dtype))
    target.generation_config.eos_token_id = None
    return target, draft


def long_generations(target, draft, tree, temperature=1.0, top_p=None, count=60, length=40):
    prompt = torch.tensor([[1, 3, 0, 5]])
    g = torch.Generator().manual_seed(3)
    return prompt, [stree.generate(target, prompt, draft_model=draft, max_new_tokens=length, temperature=temperature,
                                   top_p=top_p, tree=tree, generator=g) for _ in range(count)]


@pytest.mark.parametrize("family, tree, temperature, top_p", [
    ("bamba", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, coverage=1.0), 1.0, None),  # default: 0.8
    ("mamba2", (2, 2, 1), 0.7, 0.9),
])
def test_long_generations_follow_the_target_conditionals(family, tree, temperature, top_p, monkeypatch):
    """40-token generations (many rounds; some rounds start with a two-token draft trunk, i.e. an accepted node the
    draft had not seen) with a draft that is often rejected: every token's PIT under the target's exact conditional
    is uniform. The same samples judged against another temperature are rejected, so the test has power (and
    test_planted_verification_bugs_are_caught shows it catches wrong verifiers)."""
    target, draft = noisy_pair(family)
    trunks = record_trunks(monkeypatch)
    prompt, outputs = long_generations(target, draft, tree, temperature, top_p)
    assert max(trunks) == 2 and all(o.shape[1] == prompt.shape[1] + 40 for o in outputs)
    counts, probs = pit_counts(target, prompt, outputs, Sampler(temperature, None, top_p), order_by=draft)
    assert_matches(counts, probs)
    wrong, probs = pit_counts(target, prompt, outputs, Sampler(temperature / 2, None, top_p), order_by=draft)
    assert chi_square(wrong, probs)[0] > chi_square_critical(9)


def planted_verify_sampling(bug):
    """verify_sampling with one bug planted: "residual" (p is not replaced by the normalised max(p - q, 0) after a
    rejection), "bonus" (the bonus is drawn from p, not from the residual), "renormalise" (q is not renormalised
    after a rejected token is removed from it)."""
    def verify(tokens, parents, target_probs, draft_probs, generator=None, root=0):
        children = children_lists(parents)
        accepted = [root]
        while True:
            node = accepted[-1]
            p = residual = target_probs[node].double().cpu()
            proposal = None
            for child in children[node]:
                if proposal is None:
                    proposal = draft_probs[node].double().cpu().clone()
                x = tokens[child]
                if float(torch.rand((), generator=generator, dtype=torch.float64)) * proposal[x] < residual[x]:
                    accepted.append(child)
                    break
                leftover = (residual - proposal).clamp_(min=0.0)
                if leftover.sum() > 0 and bug != "residual":
                    residual = leftover / leftover.sum()
                proposal[x] = 0.0
                if bug != "renormalise":
                    proposal /= proposal.sum().clamp(min=1e-300)
            else:
                return accepted, sample(p if bug == "bonus" else residual, generator)
    return verify


@pytest.mark.parametrize("bug", ["residual", "bonus", "renormalise"])
def test_planted_verification_bugs_are_caught(bug, monkeypatch):
    """The long-generation PIT test, run with a wrong verification rule, rejects it."""
    monkeypatch.setattr(stree.decoding, "verify_sampling", planted_verify_sampling(bug))
    target, draft = noisy_pair("mamba2")
    prompt, outputs = long_generations(target, draft, (2, 2, 1))
    counts, probs = pit_counts(target, prompt, outputs, Sampler(1.0), order_by=draft)
    assert chi_square(counts, probs)[0] > chi_square_critical(9)


def test_paced_generations_follow_the_target_conditionals(monkeypatch):
    """Adaptive rounds (the global RNG, no generator) that take plain steps at random instead of speculating: every
    token's PIT under the target's exact conditional stays uniform, and a wrong temperature is rejected."""
    target, draft = close_pair("bamba")
    trunks = record_trunks(monkeypatch)
    random_pacing(monkeypatch, seed=1)
    spec = stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, adaptive=True)
    prompt = torch.tensor([[1, 3, 0, 5]])
    torch.manual_seed(4)
    outputs = [stree.generate(target, prompt, draft_model=draft, max_new_tokens=40, temperature=1.0, tree=spec)
               for _ in range(60)]
    assert max(trunks) == 4
    counts, probs = pit_counts(target, prompt, outputs, Sampler(1.0))
    assert_matches(counts, probs)
    wrong, probs = pit_counts(target, prompt, outputs, Sampler(3.0))
    assert chi_square(wrong, probs)[0] > chi_square_critical(9)
