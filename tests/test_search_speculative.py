import itertools
from dataclasses import replace

import pytest
import torch

from loops import plain_vote
from stree.models import tiny_model
from stree.search import (BeamOptions, PRMVerifier, RowBatch, SearchConfig, VerificationQueue, candidate_generator,
                          score_batch, tree_search, tree_search_batch)
from stree.search.batched import StepDecoder, shared_batch
from stree.search.beam import BeamRun, run_together
from stree.search.policy import Policy


def hashed(prompt, steps):
    """A scripted verifier: a fixed pseudo-random score in [0, 1) per trajectory."""
    return hash(tuple(map(tuple, steps))) % 997 / 997


def salted(salt):
    """Another scripted verifier per salt."""
    def verifier(prompt, steps):
        return hash((salt,) + tuple(map(tuple, steps))) % 997 / 997
    return verifier


class BatchedHashed:
    """The same scores, offered in batches; records the batch sizes."""

    def __init__(self):
        self.sizes = []

    def __call__(self, prompt, steps):
        return hashed(prompt, steps)

    def batch(self, prompt, steps_list):
        self.sizes.append(len(steps_list))
        return [hashed(prompt, steps) for steps in steps_list]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and OpenMP threads can stall for seconds per call when the
    two cores are shared with another job."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy_model():
    return tiny_model("bamba", dtype=torch.float64, vocab_size=16, seed=3)


def beam_config(**switches):
    """A spec_beam SearchConfig; switches: SearchConfig fields, or BeamOptions fields (speculative, early_pruning,
    lazy_verification, verify_*). Steps end at 4, 5 or 6 or after 5 tokens, so candidates of one level finish at
    different times."""
    options = {k: switches.pop(k) for k in list(switches) if k in BeamOptions.__dataclass_fields__}
    return SearchConfig(**{**dict(strategy="spec_beam", width=6, beam_width=2, max_steps=4,
                                  step_delimiter_ids=(4, 5, 6), step_max_tokens=5, eos_token_ids=(0,),
                                  spec_beam=BeamOptions(**options)), **switches})


def run_beam(model, config, verifier=hashed, prompt=(1, 2, 3)):
    policy = Policy(model, step_delimiter_ids=config.step_delimiter_ids, step_max_tokens=config.step_max_tokens,
                    eos_token_ids=config.eos_token_ids)
    batch, [root] = shared_batch(policy, [list(prompt)])
    run = BeamRun(policy, list(prompt), verifier, config, StepDecoder(policy, batch, dedup=config.dedup), root)
    run_together([run])
    completed = run.completed
    survivors = {(tuple(map(tuple, t.steps)), t.step_scores[-1] if t.steps else None) for t in run.survivors}
    return run, completed, survivors


def full_forward(model, tokens):
    """Next-token logits after `tokens`, one plain forward over the whole sequence (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("family", ["mamba2", "bamba", "zamba2"])
def test_batched_rows_equal_full_forwards(family):
    model = tiny_model(family, dtype=torch.float64, seed=1)
    prompt = [3, 1, 4, 1, 5]
    batch, root = RowBatch.prefill(model, prompt)
    batch.add([root])
    sequences = [[]]

    def feed(tokens):
        batch.advance(tokens)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)

    def keep(index):
        nonlocal sequences
        batch.select(torch.tensor(index))
        sequences = [list(sequences[i]) for i in index]

    def check():
        for i, sequence in enumerate(sequences):
            # the HF Mamba2 cache keeps its recurrent state in float32: a step-by-step decode differs from the
            # chunked full pass by float32 rounding
            torch.testing.assert_close(batch.logits[i], full_forward(model, prompt + sequence), atol=1e-5, rtol=1e-5)
            assert batch.row(i).length == 5 + len(sequence)

    feed([2])
    keep([0, 0, 0])                              # fork one row into three
    feed([1, 2, 3])
    parked = batch.row(1)                        # a snapshot that re-enters later, shorter than the batch
    for step in range(12):                       # rows 0-2 grow long
        feed([(7 * step + i) % 10 + 1 for i in range(len(batch))])
        if step == 8:
            batch.add([root])                    # a fresh row of a different length
            sequences.append([])
    keep([3, 1])
    batch.add([parked])
    sequences.append([2, 2])
    feed([4, 5, 6])
    assert sorted(len(s) for s in sequences) == [3, 4, 15]
    if family != "mamba2":
        assert not batch.mask.all()              # rows with holes in their K/V columns
    check()
    width = batch.mask.shape[1]
    keep([0, 2, 2])                              # drop the long row: the K/V get re-packed
    if family != "mamba2":
        assert batch.mask.shape[1] == 5 + 4 < width
    feed([7, 8, 9])
    feed([1, 1, 2])
    check()
    torch.testing.assert_close(root.logits, full_forward(model, prompt), atol=1e-5, rtol=1e-5)  # root undisturbed
    # extend: snapshots of different lengths (K/V widths) rebuilt in one pass; each equals its full forward
    snapshots = [(root, []), (batch.row(0), sequences[0]), (parked, [2, 2])]
    forced = [[5, 6, 7], [1, 9, 2], [3, 3, 8]]
    rows_before = len(batch)
    for (state, sequence), tokens, got in zip(snapshots, forced, batch.extend([s for s, _ in snapshots], forced)):
        assert got.length == state.length + 3
        torch.testing.assert_close(got.logits, full_forward(model, prompt + sequence + tokens), atol=1e-5, rtol=1e-5)
        batch.add([got])                         # and decoding goes on from it
        sequences.append(sequence + tokens)
    assert len(batch) == rows_before + 3
    feed([4] * len(batch))
    check()
    with pytest.raises(ValueError, match="one length"):
        batch.extend([root, root], [[1, 2], [3]])


SWITCHES = [dict(speculative=s, early_pruning=e, dedup=d, lazy_verification=lv, verify_token_budget=24)
            for s, e, d, lv in itertools.product([False, True], repeat=4) if s or not (e or lv)]
SWITCHES += [dict(speculative=True, early_pruning=e, lazy_verification=True, verify_sibling_completion=True,
                  verify_token_budget=24) for e in (False, True)]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(k for k, v in s.items() if v is True) or "sync")
def test_every_switch_combination_selects_what_synchronous_beam_selects(policy_model, switches):
    _, reference, chosen = run_beam(policy_model, beam_config(dedup=False, seed=4))
    run, completed, survivors = run_beam(policy_model, beam_config(seed=4, **switches))
    assert survivors == chosen                   # the same top-k at every level (scores < 1, so no perfect stop)
    assert sorted(t.tokens for t in completed) == sorted(t.tokens for t in reference)
    assert 1 <= len(completed) and run.stats["steps"] <= 4
    result = tree_search(policy_model, [1, 2, 3], hashed, beam_config(seed=4, **switches))
    assert sorted(result.scores) == sorted(t.step_scores[-1] for t in completed)
    # nothing is left holding a row state: the batch copies a state when it expands it; pruned and completed
    # candidates drop theirs
    assert all(t.state is None for level in run.levels.values() for t in level.verified + [run.root])
    assert all(a.state is None for t in completed for a in t.lineage())


# cases where a rule that also counted candidates of not-yet-decided parents would drop a final top-k candidate
@pytest.mark.parametrize("salt, seed, k", [(0, 5, 2), (1, 0, 2), (2, 0, 2), (9, 5, 2), (0, 0, 3), (0, 3, 3),
                                           (1, 3, 3), (4, 3, 3)])
def test_early_pruning_never_drops_a_final_top_k_candidate(policy_model, salt, seed, k):
    config = dict(speculative=True, seed=seed, max_steps=5, width=3 * k, beam_width=k)
    naive, _, chosen = run_beam(policy_model, beam_config(**config), salted(salt))
    pruning, _, survivors = run_beam(policy_model, beam_config(early_pruning=True, **config), salted(salt))
    assert survivors == chosen
    assert pruning.stats["step_tokens"] <= naive.stats["step_tokens"]
    assert pruning.stats["pruned"] >= naive.stats["pruned"]


def test_early_pruning_saves_work(policy_model):
    def tokens(**switches):
        return sum(run_beam(policy_model, beam_config(speculative=True, seed=s, max_steps=5, **switches))[0]
                   .stats["step_tokens"] for s in range(4))
    assert tokens(early_pruning=True) < tokens()


def test_perfect_scores_close_a_level_early(policy_model):
    def perfect(prompt, steps):
        return 1.0
    naive, _, _ = run_beam(policy_model, beam_config(speculative=True, seed=2), perfect)
    _, _, want = run_beam(policy_model, beam_config(seed=2), perfect)  # synchronous: every tie goes by key
    pruning, completed, survivors = run_beam(policy_model, beam_config(speculative=True, early_pruning=True, seed=2),
                                             perfect)
    assert pruning.queue.calls < naive.queue.calls and pruning.stats["step_tokens"] < naive.stats["step_tokens"]
    assert completed and all(t.step_scores == [1.0] * len(t.steps) for t in completed)
    assert survivors == want
    # SpecScale's literal rule stops a level at the first k perfect candidates: less work, other survivors
    first, completed, survivors = run_beam(policy_model, beam_config(speculative=True, early_pruning=True, seed=2,
                                                                     perfect_ties="first_verified"), perfect)
    assert first.stats["step_tokens"] < pruning.stats["step_tokens"] and first.queue.calls <= pruning.queue.calls
    assert completed and survivors != want


def test_lazy_verification_batches_requests_and_keeps_scores(policy_model):
    eager_verifier, lazy_verifier = BatchedHashed(), BatchedHashed()
    eager, _, chosen = run_beam(policy_model, beam_config(speculative=True, seed=5), eager_verifier)
    lazy, _, survivors = run_beam(policy_model, beam_config(speculative=True, lazy_verification=True, seed=5,
                                                            verify_token_budget=10 ** 6, verify_max_deferrals=3),
                                  lazy_verifier)
    assert survivors == chosen
    assert lazy.queue.batches < eager.queue.batches and max(lazy_verifier.sizes) > max(eager_verifier.sizes)


def test_sibling_completion_flushes_complete_families_and_keeps_scores(policy_model):
    """With token and deferral limits out of reach, lazy verification flushes only when decoding idles; the
    sibling-completion rule also flushes as soon as one parent's children have all finished, so there are more,
    earlier flushes, and still the same top-k at every level as eager verification."""
    unreachable = dict(verify_token_budget=10 ** 6, verify_max_deferrals=10 ** 6)
    for seed in (5, 6):
        eager, _, chosen = run_beam(policy_model, beam_config(speculative=True, seed=seed), BatchedHashed())
        idle, _, idle_survivors = run_beam(policy_model, beam_config(speculative=True, lazy_verification=True,
                                                                     seed=seed, **unreachable), BatchedHashed())
        sibling, _, survivors = run_beam(policy_model, beam_config(speculative=True, lazy_verification=True, seed=seed,
                                                                   verify_sibling_completion=True, **unreachable),
                                         BatchedHashed())
        assert survivors == chosen == idle_survivors
        assert idle.queue.batches < sibling.queue.batches < eager.queue.batches
    with pytest.raises(ValueError, match="lazy_verification=True"):
        BeamOptions(speculative=True, verify_sibling_completion=True)


def test_verification_queue_sibling_completion():
    queue = VerificationQueue(lambda prompt, steps: 0.5, [1], flush_tokens=None, max_deferrals=None,
                              sibling_completion=True)
    queue.submit("a1", [[3]], family="a")
    assert not queue.due(idle=False, decoding={"a", "b"})   # a sibling of a1 is still decoding
    queue.submit("b1", [[3]], family="b")
    assert queue.due(idle=False, decoding={"a"})             # b's children are all done
    assert not VerificationQueue(lambda prompt, steps: 0.5, [1], flush_tokens=None, max_deferrals=None).due(
        idle=False, decoding=set())                          # the rule is off by default


def reference_beam(model, prompt, verifier, config):
    """Plain beam search, one candidate at a time, written from the beam rules in stree.search.beam's docstring:
    every token re-reads the prompt and the candidate's tokens through the model (no cache, no batching, no
    speculation) and is drawn from the candidate's own generator (candidate_generator(seed, key)). Level 1 is
    `width` children of the prompt; level d's k best by (score descending, key) survive; survivors that ended (EOS)
    or reached max_steps are completed, the others get width / k children each; it stops when no survivor is live.
    Returns the survivors (as run_beam reports them, prompt included) and the completed trajectories' tokens."""
    k, stops = config.kept, set(config.step_delimiter_ids) | set(config.eos_token_ids)

    def draw_step(steps, generator):
        step = []
        while not step or (step[-1] not in stops and len(step) < config.step_max_tokens):
            tokens = list(prompt) + [t for s in steps for t in s] + step
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            step.append(int(torch.multinomial(torch.softmax(logits.double(), -1), 1, generator=generator)))
        return step

    live, survivors, completed = [((), [])], {((), None)}, []
    for depth in range(1, config.max_steps + 1):
        level = []
        for key, steps in live:
            for j in range(config.width if depth == 1 else config.width // k):
                child = steps + [draw_step(steps, candidate_generator(config.seed, key + (j,)))]
                level.append((key + (j,), child, verifier(prompt, child)))
        top = sorted(level, key=lambda c: (-c[2], c[0]))[:k]
        survivors |= {(tuple(map(tuple, steps)), score) for _, steps, score in top}
        done = [c for c in top if c[1][-1][-1] in config.eos_token_ids or depth == config.max_steps]
        completed += [[t for s in steps for t in s] for _, steps, _ in done]
        live = [(key, steps) for key, steps, _ in top if (key, steps, _) not in done]
        if not live:
            break
    return survivors, sorted(completed)


@pytest.mark.parametrize("seed", [0, 3, 4])
@pytest.mark.parametrize("verifier", [hashed, salted(1), lambda prompt, steps: len(steps[-1]) % 3 / 4,
                                      lambda prompt, steps: 1.0 if len(steps[-1]) % 2 else 0.25],
                         ids=["hashed", "salted", "ties", "perfect-ties"])
def test_speculative_beam_with_early_pruning_equals_a_plain_reference_beam_search(policy_model, seed, verifier):
    """Speculative beam search with early pruning (with and without dedup, lazy verification and sibling
    completion) keeps at every level the top-k of an independent plain beam search over the same candidates, and
    completes the same trajectories; the "ties" verifier scores many candidates equally (ties go by key), the
    "perfect-ties" one gives many the maximum score, so levels close early (only candidates that k perfect ones
    with smaller keys outrank are dropped unverified)."""
    config = beam_config(seed=seed, max_steps=4, width=6, beam_width=2)
    want, want_completed = reference_beam(policy_model, [1, 2, 3], verifier, config)
    for switches in [dict(dedup=False), dict(), dict(lazy_verification=True, verify_sibling_completion=True,
                                                     verify_token_budget=30)]:
        run, completed, survivors = run_beam(policy_model, beam_config(seed=seed, speculative=True,
                                                                       early_pruning=True, **switches), verifier)
        assert survivors == want, switches
        assert sorted(t.tokens for t in completed) == want_completed, switches
        # the longest chain of surviving steps, in tokens: no schedule decodes it in fewer passes
        critical = max(sum(map(len, steps)) for steps, _ in want)
        assert run.stats["critical_path"] == critical <= run.stats["forwards"], switches


@pytest.mark.parametrize("switches", [dict(), dict(speculative=True, early_pruning=True),
                                      dict(speculative=True, early_pruning=True, perfect_ties="first_verified"),
                                      dict(speculative=True, early_pruning=True, lazy_verification=True,
                                           verify_sibling_completion=True, verify_token_budget=30)],
                         ids=["sync", "EP", "EP-first", "EP-LV-SC"])
def test_spec_beam_of_several_problems_in_one_batch_equals_each_alone(policy_model, switches):
    """tree_search_batch runs spec_beam searches of problems with different prompts and seeds on one batch: each
    problem completes what it completes alone and what the plain reference beam search completes (exact switches),
    with its own counts equal to a lone search's."""
    prompts, seeds = [[1, 2, 3], [7, 3, 5, 2, 6, 1], [2]], [0, 7, 3]
    verifier = lambda prompt, steps: 1.0 if (len(steps[-1]) + sum(prompt)) % 2 else 0.25  # noqa: E731
    config = beam_config(max_steps=4, width=6, beam_width=2, **switches)
    results = tree_search_batch(policy_model, prompts, verifier, config, seeds=seeds)
    for prompt, seed, result in zip(prompts, seeds, results):
        alone = tree_search(policy_model, prompt, verifier, replace(config, seed=seed))
        assert [(t.key, t.steps, t.step_scores) for t in result.trajectories] == \
            [(t.key, t.steps, t.step_scores) for t in alone.trajectories]
        for key in ("verifier_calls", "verifier_batches", "steps", "step_tokens", "forwards", "pruned",
                    "peak_tree_bytes"):
            assert result.stats[key] == alone.stats[key], key
        if switches.get("perfect_ties") != "first_verified":
            _, want = reference_beam(policy_model, prompt, verifier, replace(config, seed=seed))
            assert sorted(t.tokens for t in result.trajectories) == want
    assert results[0].stats["peak_held_bytes"] >= max(r.stats["peak_tree_bytes"] for r in results)


def test_verification_queue_flushes_on_tokens_deferrals_or_idle():
    seen = []

    def verifier(prompt, steps):
        seen.append(len(steps))
        return 0.5

    queue = VerificationQueue(verifier, [1, 2], flush_tokens=6, max_deferrals=2)
    queue.submit("a", [[3]])                     # 3 tokens
    assert not queue.due(idle=False) and queue.due(idle=True)
    queue.defer()
    queue.defer()
    assert queue.due(idle=False)                 # waited max_deferrals decode steps
    queue.submit("b", [[3], [4, 5]])             # 5 tokens: 8 in all, two verifier batches of <= 6
    queue.drop(lambda item: item == "nothing")
    assert queue.flush() == [("a", 0.5), ("b", 0.5)] and queue.calls == 2 and queue.batches == 2
    queue.submit("c", [[3], [4]])
    queue.submit("d", [[3], [4]])
    queue.drop(lambda item: item == "c")
    assert queue.items() == ["d"] and queue.due(idle=False) is False
    queue.submit("e", [[9]])
    assert queue.due(idle=False)                 # 4 + 3 tokens >= 6
    with pytest.raises(ValueError, match="flush_tokens"):
        VerificationQueue(verifier, [1], flush_tokens=0)


def test_prm_batch_equals_single_calls():
    prm = PRMVerifier(tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=8), step_tag_id=15,
                      good_token_id=13, bad_token_id=14)
    trajectories = [[[3, 4]], [[3, 4], [5]], [[7, 8, 9, 10], [11], [12, 2]]]
    scores = score_batch(prm, [1, 2], trajectories)
    assert scores == pytest.approx([prm([1, 2], steps) for steps in trajectories], abs=1e-9)
    assert score_batch(hashed, [1], trajectories) == [hashed([1], steps) for steps in trajectories]


def test_pure_ssm_policy_runs_speculative_beam():
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=2)
    config = beam_config(speculative=True, early_pruning=True, lazy_verification=True, seed=1)
    result = tree_search(model, [1, 2, 3], hashed, config, answer_fn=lambda tokens: tokens[-1] % 3)
    assert 1 <= len(result.trajectories) <= 2 * 4
    assert result.scores == [hashed(None, t.steps) for t in result.trajectories]
    assert result.answer == plain_vote([t.tokens[-1] % 3 for t in result.trajectories], result.scores)
    assert result.stats["forwards"] >= result.stats["steps"] and result.stats["peak_tree_bytes"] > 0


def test_bad_config():
    with pytest.raises(ValueError, match="strategy='spec_beam'"):
        SearchConfig(strategy="rebase", spec_beam=BeamOptions(speculative=True))
    with pytest.raises(ValueError, match="multiple of k"):
        SearchConfig(strategy="spec_beam", width=8)
    with pytest.raises(ValueError, match="leaf_states"):
        SearchConfig(strategy="spec_beam", width=9, leaf_states="replay")
    with pytest.raises(ValueError, match="BeamOptions"):
        SearchConfig(strategy="spec_beam", width=9, spec_beam=dict(speculative=True))
    with pytest.raises(ValueError, match="speculative=True"):
        BeamOptions(early_pruning=True)
    with pytest.raises(ValueError, match="speculative=True"):
        BeamOptions(lazy_verification=True)
    with pytest.raises(ValueError, match="verify_token_budget"):
        BeamOptions(speculative=True, verify_token_budget=0)
    with pytest.raises(ValueError, match="early_pruning=True"):
        BeamOptions(speculative=True, perfect_ties="first_verified")
    with pytest.raises(ValueError, match="perfect_ties must be one of"):
        BeamOptions(speculative=True, early_pruning=True, perfect_ties="first")


def test_early_pruning_rejects_scores_above_the_maximum(policy_model):
    with pytest.raises(ValueError, match="at most 1.0"):
        run_beam(policy_model, beam_config(speculative=True, early_pruning=True), lambda prompt, steps: 1.5)
    run_beam(policy_model, beam_config(speculative=True), lambda prompt, steps: 1.5)  # without pruning: any scale
