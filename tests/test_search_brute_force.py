"""Search against brute force on problems small enough to enumerate every trajectory.

A tiny policy with a vocabulary of 2-5 ids and steps of one or two tokens has a few dozen possible trajectories;
the tests enumerate all of them, score each independently (a random table per prefix, or the sequence's
probability under the policy from one full forward) and check what each strategy claims:

- exhaustive settings (best_of_n; beam, dvts and spec_beam keeping k = width, so nothing is pruned) return every
  sample, and once the samples cover every sequence their best is the brute-force optimum;
- beam, spec_beam and dvts with k < width keep a level's best node; when each level's best node is drawn k times
  or more (copies tie, ties go by key) they follow the greedy path, computed here by enumeration (under the
  policy's own probability: greedy decoding);
- every strategy reports, for every trajectory, the step scores and the aggregated score recomputed from scratch,
  the weighted vote over those, and never a score above the brute-force optimum.

Planted bugs these tests catch (each tried by breaking the code, then restored):
- aggregate_step_scores' "last" returning step_scores[0]: the recomputed-score assertion of
  test_every_strategy_reports_recomputed_scores_and_never_beats_the_optimum, and the greedy test's "last" scoring;
- levels giving the step scores in the wrong order ([score] + parent scores): the step-score assertion of the same
  test; spec_beam dropping the parent's last score (parent.step_scores[:-1] + [score]): that assertion, the
  exhaustive optimum and the greedy path;
- beam's ranking ascending instead of descending (strategies.common.best, which dvts uses too), dvts expanding its
  worst child, or spec_beam ranking by +score: test_kept_best_nodes_follow_the_greedy_path;
- the shared width off by one (config.width - len(answers) - 1): the exhaustive test's same-samples assertion.
"""
import functools
import itertools
import math
import random

import pytest
import torch

from loops import plain_vote
from stree.models import tiny_model
from stree.search import SearchConfig, tree_search
from test_search_speculative import one_thread  # noqa: F401 (fixture)

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def models():
    """Tiny float64 Bamba policies by vocabulary size."""
    return {v: tiny_model("bamba", dtype=torch.float64, vocab_size=v, seed=5) for v in (2, 3, 5)}


def aggregate(scores, how):
    """The naive aggregation of a trajectory's step scores."""
    if how == "last":
        return scores[-1]
    if how == "min":
        return min(scores)
    return math.prod(scores)


def table_verifier(seed):
    """A random score in [0, 1) per trajectory (prefix of steps), fixed by `seed`: the same steps always get the
    same score, whoever asks."""
    def verifier(prompt, steps):
        return random.Random(repr((seed, tuple(map(tuple, steps))))).random()
    return verifier


def probability_verifier(model):
    """The probability of the latest step under `model` at temperature 1, one full forward (no cache) per token: with
    aggregation "prod" a trajectory's score is its probability. Memoised per steps (a verifier may be asked again)."""
    memo = {}

    def verifier(prompt, steps):
        key = (tuple(prompt), tuple(map(tuple, steps)))
        if key not in memo:
            prefix, p = list(prompt) + [t for s in steps[:-1] for t in s], 1.0
            for token in steps[-1]:
                with torch.no_grad():
                    logits = model(torch.tensor([prefix])).logits[0, -1]
                p *= torch.softmax(logits.double(), -1)[token].item()
                prefix.append(token)
            memo[key] = p
        return memo[key]
    return verifier


def sequence_probabilities(model, prompt, vocab, depth):
    """{trajectory of one-token steps: P(its tokens | prompt)} for every trajectory of 1..depth steps, from one batched
    forward over every prompt + sequence of `depth` tokens (independent of the verifier's per-step calls)."""
    sequences = list(itertools.product(range(vocab), repeat=depth))
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(s) for s in sequences])).logits.double()
    logp = torch.log_softmax(logits[:, len(prompt) - 1:-1], -1)
    found = {}
    for row, tokens in enumerate(sequences):
        for d in range(1, depth + 1):
            found[tuple((t,) for t in tokens[:d])] = math.exp(sum(logp[row, i, t].item() for i, t in
                                                                  enumerate(tokens[:d])))
    return found


def all_trajectories(vocab, max_steps, step_max_tokens, delimiters=(), eos=()):
    """Every trajectory (a tuple of steps, each a tuple of tokens) a search can return: a step ends at a delimiter,
    an EOS or step_max_tokens tokens; a trajectory ends after an EOS or at max_steps steps (every prefix included:
    a search returns unfinished trajectories when none finished)."""
    stops = set(delimiters) | set(eos)
    steps = [s for n in range(1, step_max_tokens + 1) for s in itertools.product(range(vocab), repeat=n)
             if not stops & set(s[:-1]) and (len(s) == step_max_tokens or s[-1] in stops)]
    found, frontier = [], [()]
    for _ in range(max_steps):
        frontier = [t + (s,) for t in frontier if not (t and t[-1][-1] in eos) for s in steps]
        found += frontier
    return found


@functools.cache
def brute_table(seed, how):
    """{trajectory: its aggregated score under table_verifier(seed)} for every trajectory of
    test_every_strategy_reports_recomputed_scores_and_never_beats_the_optimum's setting (shared by its strategies)."""
    verifier = table_verifier(seed)
    return {t: aggregate([verifier(None, t[:d + 1]) for d in range(len(t))], how)
            for t in all_trajectories(5, 3, 2, delimiters=(1,), eos=(0,))}


def steps_of(trajectory):
    return tuple(map(tuple, trajectory.steps))


def scoring(kind, model, prompt, seed, vocab, depth):
    """(verifier, aggregation, brute-force score of a trajectory of one-token steps) for one of the scorings."""
    if kind == "probability":
        return probability_verifier(model), "prod", sequence_probabilities(model, prompt, vocab, depth).__getitem__
    how = kind.split("-")[1]
    verifier = table_verifier(seed)
    return verifier, how, lambda t: aggregate([verifier(None, t[:d + 1]) for d in range(len(t))], how)


EXHAUSTIVE = [("best_of_n", 0), ("beam", 64), ("dvts", 64), ("spec_beam", 64)]


@pytest.mark.parametrize("vocab, depth", [(3, 2), (2, 3)])
@pytest.mark.parametrize("kind", ["probability", "table-min"])
def test_exhaustive_settings_return_the_brute_force_best(models, vocab, depth, kind):
    """best_of_n, and beam / dvts / spec_beam with k = width (each of the width trajectories keeps one child, none
    is pruned), return the same width samples; the policy is sampled at temperature 50 (near uniform) so 64
    samples cover all vocab**depth sequences, and then the best returned score is the brute-force optimum over
    every sequence, reached by a brute-force best sequence."""
    model = models[vocab]
    for seed in SEEDS:
        prompt = random.Random(seed).choices(range(vocab), k=3)
        verifier, how, brute_score = scoring(kind, model, prompt, seed, vocab, depth)
        brute = {t: brute_score(t) for t in all_trajectories(vocab, depth, 1)}
        full = [t for t in brute if len(t) == depth]
        optimum = max(brute[t] for t in full)
        samples = {}
        for strategy, k in EXHAUSTIVE:
            config = SearchConfig(strategy=strategy, width=64, beam_width=k, max_steps=depth, step_max_tokens=1,
                                  temperature=50.0, aggregation=how, seed=seed)
            result = tree_search(model, prompt, verifier, config)
            got = {t.key: steps_of(t) for t in result.trajectories}
            samples.setdefault("best_of_n", got)
            assert got == samples["best_of_n"], (strategy, seed)  # nothing pruned: the same samples
            assert set(got.values()) == set(full), "setup: 64 near-uniform samples should cover every sequence"
            best = max(range(len(result.scores)), key=result.scores.__getitem__)
            assert result.scores[best] == pytest.approx(optimum, rel=1e-9, abs=1e-12), (strategy, seed)
            assert brute[steps_of(result.trajectories[best])] == pytest.approx(optimum, rel=1e-9, abs=1e-12)


def greedy_path(vocab, depth, score):
    """The path that, level by level, extends the best node so far by its best child under score(trajectory)."""
    path = ()
    for _ in range(depth):
        path = max((path + ((t,),) for t in range(vocab)), key=score)
    return path


@pytest.mark.parametrize("strategy", ["beam", "dvts", "spec_beam"])
@pytest.mark.parametrize("kind", ["probability", "table-last", "table-prod"])
def test_kept_best_nodes_follow_the_greedy_path(models, strategy, kind):
    """k = 2 of width 48, 3 ids, 3 one-token steps, near-uniform sampling: a level's best node is drawn far more
    than k times, so beam and spec_beam keep k copies of it (top-k by score, ties by key) and each dvts subtree
    expands it; every returned trajectory then extends the greedy path's first two steps, and the best returned one
    is the greedy path (under the probability scoring: greedy decoding). Its score is never above the brute-force
    optimum."""
    vocab, depth, model = 3, 3, models[3]
    for seed in SEEDS:
        prompt = random.Random(seed).choices(range(vocab), k=3)
        verifier, how, brute_score = scoring(kind, model, prompt, seed, vocab, depth)
        greedy = greedy_path(vocab, depth, brute_score)
        optimum = max(brute_score(t) for t in all_trajectories(vocab, depth, 1) if len(t) == depth)
        config = SearchConfig(strategy=strategy, width=48, beam_width=2, max_steps=depth, step_max_tokens=1,
                              temperature=50.0, aggregation=how, seed=seed)
        result = tree_search(model, prompt, verifier, config)
        assert all(steps_of(t)[:-1] == greedy[:-1] for t in result.trajectories), (seed, greedy)
        best = max(range(len(result.scores)), key=result.scores.__getitem__)
        assert steps_of(result.trajectories[best]) == greedy, seed
        assert result.scores[best] == pytest.approx(brute_score(greedy), rel=1e-9, abs=1e-12)
        assert result.scores[best] <= optimum * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("strategy", ["best_of_n", "beam", "dvts", "rebase", "ets", "spec_beam"])
def test_every_strategy_reports_recomputed_scores_and_never_beats_the_optimum(models, strategy):
    """Steps of one or two tokens ending at a delimiter (1), an EOS (0) or the budget, up to three steps, width 8,
    each seed with another aggregation: every returned trajectory is one of the enumerated ones, its step scores
    are the verifier's scores of its prefixes, its reported score is their aggregation recomputed here, the answer
    is the weighted vote over those, and no score exceeds the brute-force optimum over every trajectory."""
    vocab, model = 5, models[5]
    for seed, how in zip(SEEDS, ("last", "min", "prod")):
        verifier = table_verifier(seed)
        brute = brute_table(seed, how)
        prompt = random.Random(seed).choices(range(2, vocab), k=2)
        config = SearchConfig(strategy=strategy, width=8, beam_width=2 if strategy == "spec_beam" else 0, max_steps=3,
                              step_max_tokens=2, step_delimiter_ids=(1,), eos_token_ids=(0,), aggregation=how,
                              seed=seed)
        answer = lambda tokens: tokens[-1] % 2  # noqa: E731
        result = tree_search(model, prompt, verifier, config, answer_fn=answer)
        assert result.trajectories and len(result.scores) == len(result.trajectories)
        for t, score in zip(result.trajectories, result.scores):
            steps = steps_of(t)
            assert steps in brute, steps
            assert t.step_scores == [verifier(None, steps[:d + 1]) for d in range(len(steps))], (seed, steps)
            assert score == pytest.approx(brute[steps], rel=1e-12, abs=0), (seed, steps)
            assert score <= max(brute.values())
        assert result.answer == plain_vote([answer(t.tokens) for t in result.trajectories],
                                           [brute[steps_of(t)] for t in result.trajectories])


def test_enumeration_counts():
    """The enumeration itself, counted by hand: 3 ids, one-token steps, 2 steps: 3 + 9 trajectories; 5 ids with
    delimiter 1 and EOS 0, steps of at most two tokens: [0], [1] and the 3 * 5 two-token steps starting with 2-4
    make 17 steps, of which 13 do not end with EOS and can be continued."""
    assert len(all_trajectories(3, 2, 1)) == 3 + 9
    assert len(all_trajectories(5, 1, 2, delimiters=(1,), eos=(0,))) == 17
    assert len(all_trajectories(5, 2, 2, delimiters=(1,), eos=(0,))) == 17 + 13 * 17
