"""Draft heads end to end: the trees stree drafts from a DraftHead follow the head run sequentially over the target's
own hidden states (a naive reference written here), greedy decoding with a head equals HF's greedy search (heads
stree makes and published MTP heads), sampling with a head is lossless (chi-square against exact enumeration, and a
PIT test over long generations), and the drop-in path takes a head.

The targets are tiny float64 models; the `echo` heads (tests/heads_util.py) follow the target's next-token
distribution closely enough that rounds accept whole paths."""
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import stree
from stree.decoding import Generation
from stree.heads import DraftHead
from stree.models import tiny_model
from stree.sampling import Sampler
from heads_util import echo_pair
from stats import assert_matches, chi_square, chi_square_critical
from test_generate import random_pacing
from test_heads_published import LAYOUTS, layer_model, published_tensors, write_checkpoint
from test_sampling import exact_model_distribution, pit_counts, planted_verify_sampling


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one intra-op thread computes them as fast as two, and on a machine whose cores are
    busy with other processes two threads wait on each other for far longer than the work takes (measured: a
    minute-long test instead of a second). The previous setting is restored after this file's tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# context=0.1: the target's blocks add a tenth of their output, so the echo head agrees with it often (greedy rounds
# average well over 1.3 tokens a pass for every family below; at the default 0.3 bamba's rarely accept).
ECHO_CONTEXT = 0.1


# ---------------------------------------------------------------------------------------------------------------------
# The naive reference: the head run sequentially (DraftHead.forward, no cache) over the target's own hidden states.

def target_features(target, sequence, layers=None):
    """The features a head reading the target's `layers` is fed at every position of `sequence` (1, n), by HF's own
    forward over the whole sequence: the last hidden state (after the final norm) when layers is None, else the
    outputs of those decoder layers concatenated (HF's hidden_states[i + 1]; not the last layer's, which HF's
    hidden_states give after the final norm)."""
    with torch.no_grad():
        out = target.base_model(sequence, output_hidden_states=True)
    if layers is None:
        return out.last_hidden_state
    assert max(layers) < len(out.hidden_states) - 2
    return torch.cat([out.hidden_states[i + 1] for i in layers], -1)


def reference_distribution(target, head, sequence, path):
    """The head's next-token distribution after `path` (draft tokens below the root, possibly empty), with `sequence`
    (1, n) the committed tokens, its last one the root: the head's entries are tokens sequence[1:] fed the target's
    features at the positions before them, then each path token fed the head's own last output hidden state; the
    distribution is the softmax of the last entry's logits (temperature 1)."""
    features = target_features(target, sequence, head.feature_layers)[:, :-1]
    tokens, own = sequence[:, 1:], sequence.new_zeros(1, 0)
    with torch.no_grad():
        logits, hidden = head(tokens, features)
        for token in path:
            tokens = torch.cat([tokens, torch.tensor([[token]])], 1)
            own = hidden[:, -1:] if not own.numel() else torch.cat([own, hidden[:, -1:]], 1)
            logits, hidden = head(tokens, features, own)
    return logits[0, -1].double().softmax(-1)


def path_below_root(drafted, node):
    """The tokens on the path from the drafted tree's root (excluded) down to `node` (included)."""
    path = []
    while drafted.depth[node] > 0:
        path.append(drafted.tokens[node])
        node = drafted.parents[node]
    assert node == drafted.root
    return path[::-1]


def drive(generation, prompt, check):
    """Run `generation` round by round; before each round, S = the prompt and every token emitted so far; after it,
    check(S, round). Returns the rounds."""
    rounds = []
    while not generation.done:
        committed = torch.cat([prompt, torch.tensor([generation.out.generated])], 1)
        result = generation.round()
        check(committed, result)
        rounds.append(result)
    return rounds


# ---------------------------------------------------------------------------------------------------------------------
# 1. Drafted trees follow the sequential head

@pytest.mark.parametrize("family, tree, prompt, seed, feature_layers", [
    ("bamba", (2, 2, 1), [4, 8, 15, 16, 23], 0, None),
    ("bamba", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2), [9], 1, None),
    ("qwen3_next", (2, 2, 1), [9], 2, None),
    ("qwen3_next", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2), [4, 8, 15, 16, 23, 42, 7], 3, None),
    ("bamba", (2, 2, 1), [4, 8, 15], 4, (1, 0)),
    ("qwen3_next", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2), [9], 5, (0, 1)),
])
def test_drafted_distributions_follow_the_sequential_head(family, tree, prompt, seed, feature_layers):
    """Sampling at temperature 1, every draft distribution a round's tree was drawn from (DraftedTree.probs: the
    root's and every expanded node's, in every round, including rounds after catch-ups over accepted paths of 2+
    draft tokens) equals the naive reference's: the head run sequentially with DraftHead.forward over the committed
    tokens S[1:] fed the target's features (HF's forward over S) at the positions before them, then the path's
    draft tokens fed the head's own last output. Also the round's trunk (the tokens the head's cache lacked) is the
    end of S, its root S's last token; and the one-token prompts start the head's cache empty. With feature_layers
    (EAGLE-3-style heads) the features are those layers' outputs (HF's hidden_states), in the order given."""
    target, head = echo_pair(family, context=ECHO_CONTEXT, feature_layers=feature_layers)
    prompt = torch.tensor([prompt])
    generation = Generation(target, prompt, draft_model=head, max_new_tokens=24, temperature=1.0, tree=tree,
                            generator=torch.Generator().manual_seed(seed))
    checked = []

    def check(committed, result):
        drafted = result.drafted
        assert drafted is not None  # a fixed tree with a generator: every round speculates
        root = drafted.root
        assert drafted.tokens[:root + 1] == committed[0, committed.shape[1] - root - 1:].tolist()
        assert drafted.tokens[root] == int(committed[0, -1]) and drafted.depth[root] == 0
        assert set(drafted.probs) >= {root} and all(drafted.depth[n] >= 0 for n in drafted.probs)
        for node, q in drafted.probs.items():
            want = reference_distribution(target, head, committed, path_below_root(drafted, node))
            torch.testing.assert_close(q.double(), want, atol=1e-6, rtol=1e-6)
        checked.append((root + 1, len(result.accepted) - 1))

    drive(generation, prompt, check)
    trunks, accepted = zip(*checked)
    assert len(checked) >= 5 and sum(accepted) >= len(checked) // 2  # drafts are accepted, often
    # some round accepted 2+ draft nodes and was followed by a checked round, whose trunk caught up over them
    assert any(a >= 2 for a in accepted[:-1]) and max(trunks) >= 3
    assert trunks[0] == 1 and all(t == a + 1 for t, a in zip(trunks[1:], accepted))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trees_after_plain_steps_follow_the_sequential_head(temperature, monkeypatch):
    """Adaptive trees whose rounds are paced at random (seeded): plain target steps alternate with speculative
    rounds, so the head catches up on several tokens at once, with the features the target's plain steps returned.
    Every drafted distribution still equals the naive reference's: sampled, DraftedTree.probs (as in
    test_drafted_distributions_follow_the_sequential_head); greedy, each drafted node's draft probability given its
    parent (DraftedTree.draft_q) is the reference distribution at the parent, at the node's token."""
    target, head = echo_pair("bamba", context=ECHO_CONTEXT)
    random_pacing(monkeypatch, seed=3)
    torch.manual_seed(5)  # adaptive trees sample from the global RNG
    prompt = torch.tensor([[4, 8, 15]])
    generation = Generation(target, prompt, draft_model=head, max_new_tokens=30, temperature=temperature,
                            tree=stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, adaptive=True))
    trunks, compared = [], 0

    def check(committed, result):
        nonlocal compared
        drafted = result.drafted
        if drafted is None:  # a plain step
            assert result.tokens == [int(committed[0, -1])]
            return
        root = drafted.root
        trunks.append(root + 1)
        assert drafted.tokens[:root + 1] == committed[0, committed.shape[1] - root - 1:].tolist()
        if temperature > 0:
            for node, q in drafted.probs.items():
                want = reference_distribution(target, head, committed, path_below_root(drafted, node))
                torch.testing.assert_close(q.double(), want, atol=1e-6, rtol=1e-6)
                compared += 1
        else:
            for node in range(root + 1, len(drafted.tokens)):
                parent = drafted.parents[node]
                want = reference_distribution(target, head, committed, path_below_root(drafted, parent))
                assert drafted.draft_q[node] == pytest.approx(float(want[drafted.tokens[node]]), abs=1e-9, rel=1e-6)
                compared += 1

    rounds = drive(generation, prompt, check)
    plain = sum(r.drafted is None for r in rounds)
    assert plain >= 3 and len(trunks) >= 3 and max(trunks) >= 3 and compared >= 10
    if temperature == 0:
        assert torch.equal(generation.out.sequence(), hf_greedy(target, prompt, 30))


# ---------------------------------------------------------------------------------------------------------------------
# 2. Greedy decoding with a head is HF's greedy search

def hf_greedy(target, prompt, new_tokens):
    with torch.no_grad():
        return target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=new_tokens)


GREEDY_TREES = [(2, 2, 1), stree.DynamicTree(), (1, 1, 1, 1)]
PROMPTS = [[9], [4, 8, 15, 16, 23], [33, 2, 61, 5, 5, 17, 40, 12, 3, 28, 50]]


@pytest.mark.parametrize("family, feature_layers", [("bamba", None), ("mamba2", None), ("qwen3_next", None),
                                                    ("falcon_h1", None), ("mamba2", (1, 0)), ("bamba", (2,))])
def test_greedy_with_an_echo_head_is_hfs_greedy(family, feature_layers):
    """stree.generate(target, ids, draft_model=head) greedy equals HF's greedy search token for token, for heads of
    the target's own family (bamba, qwen3_next) and Llama heads (mamba2, falcon_h1: no attention blocks of their
    own), reading the last hidden state or other layers' outputs (the last layer's before the final norm), on a
    static tree, a dynamic tree and a chain, from prompts of 1 (the head's prefill is empty), 5 and 11 tokens. The
    echo heads' drafts are accepted: a target pass yields more than 1.3 tokens on average."""
    target, head = echo_pair(family, context=ECHO_CONTEXT, feature_layers=feature_layers)
    per_pass = []
    for prompt in PROMPTS:
        prompt = torch.tensor([prompt])
        want = hf_greedy(target, prompt, 30)
        for tree in GREEDY_TREES:
            got, stats = stree.generate(target, prompt, draft_model=head, max_new_tokens=30, tree=tree,
                                        return_stats=True)
            assert torch.equal(got, want), (prompt, tree)
            per_pass += stats.tokens_per_pass
    assert sum(per_pass) / len(per_pass) > 1.3 and max(per_pass) >= 3


def test_greedy_with_a_head_on_the_default_adaptive_tree(monkeypatch):
    """The default tree (an adaptive DynamicTree, which calibrates its costs and may take plain target steps whose
    tokens the head then catches up on as a longer trunk): greedy output equals HF's. The pacing is made random
    (seeded), so that plain steps and speculative rounds alternate whatever this machine's timings."""
    target, head = echo_pair("qwen3_next", context=ECHO_CONTEXT)
    random_pacing(monkeypatch, seed=2)
    for prompt in PROMPTS[:2]:
        prompt = torch.tensor([prompt])
        got, stats = stree.generate(target, prompt, draft_model=head, max_new_tokens=40, return_stats=True)
        assert torch.equal(got, hf_greedy(target, prompt, 40))
        assert stats.draft_passes > 0 and 1 in stats.tree_sizes and max(stats.tokens_per_pass) >= 2
    # and without the random pacing: calibrated on this machine (a fresh pair: costs are kept per target), the
    # measured rule, whatever it decides here
    monkeypatch.undo()
    target, head = echo_pair("qwen3_next", context=ECHO_CONTEXT)
    prompt = torch.tensor([PROMPTS[1]])
    out = stree.generate(target, prompt, draft_model=head, max_new_tokens=40)
    assert torch.equal(out, hf_greedy(target, prompt, 40))


def published_pair(family, folder):
    """A target of `family` saved with MTP weights (test_heads_published's layout), loaded back by HF (which skips
    the mtp.* tensors), and its MTP head loaded by DraftHead.from_pretrained."""
    overrides, _ = LAYOUTS[family]
    target = tiny_model(family, dtype=torch.float64, seed=1, **overrides)
    write_checkpoint(folder, target, published_tensors(target, family, layer_model(target, family)), sharded=False)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    loaded.generation_config.eos_token_id = None
    return loaded, DraftHead.from_pretrained(folder, target=loaded)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_greedy_with_a_published_mtp_head_is_hfs_greedy(family, tmp_path):
    """A Qwen3.5-like and a Nemotron-H-like target whose MTP head (published layout: attention + MLP for Qwen3.5,
    attention then MoE for Nemotron-H) is loaded from the checkpoint folder: greedy stree.generate equals HF's
    greedy search, on a static and a dynamic tree, from a one-token and a longer prompt (the random head's drafts
    are mostly rejected, so this checks the rounds stay exact whatever the head proposes)."""
    target, head = published_pair(family, tmp_path)
    assert head.kind.startswith(family) and head.kind.endswith("_mtp")
    for prompt in (PROMPTS[0], PROMPTS[2]):
        prompt = torch.tensor([prompt])
        want = hf_greedy(target, prompt, 20)
        for tree in ((2, 2, 1), stree.DynamicTree(budget=8, depth=4)):
            got = stree.generate(target, prompt, draft_model=head, max_new_tokens=20, tree=tree)
            assert torch.equal(got, want), (prompt, tree)


# ---------------------------------------------------------------------------------------------------------------------
# 3. Sampling with a head is lossless

def test_sampling_with_a_head_follows_the_target_distribution():
    """The first 3 tokens sampled by stree.generate with an echo head (vocabulary of 5, so that every continuation
    can be enumerated; a (2, 2, 1) tree, 4 tokens generated so that the first round, after the prefill's token, may
    accept a path of 2 drafts) follow the target's exact joint distribution (chi-square over 600 seeded samples;
    the distribution has many likely outcomes, and the drafts are accepted: rounds emit 1.3+ tokens on average, some
    3). The same samples judged against the target's distribution at temperature 0.6 are rejected: the test has
    power."""
    samples = 600
    target, head = echo_pair("bamba", vocab=5)  # the default context: drafts rejected often enough to matter
    prompt = torch.tensor([[1, 3, 0]])
    exact = exact_model_distribution(target, prompt, 3, Sampler(1.0))
    assert sum(samples * p >= 5 for p in exact.values()) >= 6 and max(exact.values()) < 0.5  # a real test
    g = torch.Generator().manual_seed(0)
    counts, per_pass = {}, []
    for _ in range(samples):
        out, stats = stree.generate(target, prompt, draft_model=head, max_new_tokens=4, temperature=1.0,
                                    tree=(2, 2, 1), generator=g, return_stats=True)
        seq = tuple(out[0, 3:6].tolist())
        counts[seq] = counts.get(seq, 0) + 1
        per_pass += stats.tokens_per_pass
    assert sum(per_pass) / len(per_pass) > 1.3 and per_pass.count(3) >= 50
    assert_matches(counts, exact)
    colder = exact_model_distribution(target, prompt, 3, Sampler(0.6))
    assert chi_square(counts, colder)[0] > chi_square_critical(chi_square(counts, colder)[1])


def head_order(target, head):
    """pit_counts' order_by: for a generated sequence, the head's draft distribution for every next token (the head
    run over the target's own features), so that a verifier leaning towards or away from the head's drafts moves
    the PIT to one end. Row j predicts the token at j + 1 (row 0, which no generated token reads, is zeros)."""
    def order(sequence):
        with torch.no_grad():
            features = target.base_model(sequence).last_hidden_state
            logits, _ = head(sequence[:, 1:], features[:, :-1])
        return types.SimpleNamespace(logits=torch.cat([torch.zeros_like(logits[:, :1]), logits], 1))
    return order


def long_head_generations(family, tree, temperature=1.0, top_p=None, count=40, length=40):
    """(target, head, prompt, outputs, tokens per target pass): `count` seeded sampled generations of `length`
    tokens with an echo head of the default context (drafts accepted often, rejected often enough too)."""
    target, head = echo_pair(family, vocab=8)
    prompt = torch.tensor([[1, 3, 0, 5]])
    g = torch.Generator().manual_seed(3)
    outputs, per_pass = [], []
    for _ in range(count):
        out, stats = stree.generate(target, prompt, draft_model=head, max_new_tokens=length, temperature=temperature,
                                    top_p=top_p, tree=tree, generator=g, return_stats=True)
        outputs.append(out)
        per_pass += stats.tokens_per_pass
    return target, head, prompt, outputs, per_pass


@pytest.mark.parametrize("family, tree, temperature, top_p", [
    ("mamba2", (2, 2, 1), 1.0, None),
    ("bamba", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, coverage=1.0), 0.8, 0.9),
])
def test_long_generations_with_a_head_follow_the_target_conditionals(family, tree, temperature, top_p):
    """40-token sampled generations with an echo head (many rounds, a good share accepting paths of 2+ drafts, so
    the head keeps catching up over accepted paths): every token's randomised PIT under the target's exact
    conditional (temperature / top-p applied as HF does) is uniform, the vocabulary ordered by the head's own
    distribution at that position. The same samples judged at 0.6 times the temperature are rejected: the test has
    power (and test_a_wrong_verifier_is_caught_with_a_head shows it catches a wrong verifier)."""
    target, head, prompt, outputs, per_pass = long_head_generations(family, tree, temperature, top_p)
    assert all(o.shape[1] == prompt.shape[1] + 40 for o in outputs)
    assert sum(per_pass) / len(per_pass) > 1.3 and sum(n >= 3 for n in per_pass) >= 100
    order = head_order(target, head)
    counts, probs = pit_counts(target, prompt, outputs, Sampler(temperature, None, top_p), order_by=order)
    assert_matches(counts, probs)
    wrong, probs = pit_counts(target, prompt, outputs, Sampler(temperature * 0.6, None, top_p), order_by=order)
    assert chi_square(wrong, probs)[0] > chi_square_critical(9)


def test_a_wrong_verifier_is_caught_with_a_head(monkeypatch):
    """The long-generation PIT test with a head, run with a planted verification bug (the bonus token drawn from
    the target's distribution instead of the residual after rejections: test_sampling's planted "bonus"), rejects
    it."""
    monkeypatch.setattr(stree.decoding, "verify_sampling", planted_verify_sampling("bonus"))
    target, head, prompt, outputs, _ = long_head_generations("mamba2", (2, 2, 1))
    counts, probs = pit_counts(target, prompt, outputs, Sampler(1.0), order_by=head_order(target, head))
    assert chi_square(counts, probs)[0] > chi_square_critical(9)


# ---------------------------------------------------------------------------------------------------------------------
# 4. The drop-in path takes a head

def test_drop_in_generate_with_a_head_is_hfs_greedy():
    """After stree.enable(target), target.generate(ids, attention_mask=..., draft_model=head, do_sample=False,
    max_new_tokens=N) runs tree decoding with the head (default adaptive tree, and a tree= passed through) and
    returns exactly HF's greedy output; without draft_model it is HF's own generate, and stree.disable restores it."""
    target, head = echo_pair("falcon_h1", context=ECHO_CONTEXT)
    prompts = [torch.tensor([p]) for p in PROMPTS[:2]]
    wants = [hf_greedy(target, prompt, 25) for prompt in prompts]
    stree.enable(target)
    try:
        for prompt, want in zip(prompts, wants):
            mask = torch.ones_like(prompt)
            assert torch.equal(target.generate(prompt, attention_mask=mask, draft_model=head, do_sample=False,
                                               max_new_tokens=25), want)
            assert torch.equal(target.generate(prompt, attention_mask=mask, draft_model=head, do_sample=False,
                                               max_new_tokens=25, tree=(2, 2, 1)), want)
            assert torch.equal(hf_greedy(target, prompt, 25), want)  # no draft: HF's own path
    finally:
        stree.disable(target)
    assert "generate" not in vars(target)


def test_a_head_made_for_another_model_is_refused():
    """A head drafts with its target's embedding and LM head: with another model (same vocabulary) it is refused
    before any pass, naming the way to load it for that model."""
    target, head = echo_pair("bamba", context=ECHO_CONTEXT)
    other = tiny_model("bamba", dtype=torch.float64, seed=7)
    with pytest.raises(ValueError, match="made for another model"):
        stree.generate(other, torch.tensor([[4, 8, 15]]), draft_model=head, max_new_tokens=4)


@pytest.mark.parametrize("feature_layers", [None, (0, 1)])
def test_compiled_head_passes_equal_hfs_greedy(feature_layers):
    """compile= runs the head's passes (their features as fixed-shape inputs) and the target's (returning hidden
    states, or layers' outputs stored while the pass runs) through torch.compile: greedy output equals HF's, over
    rounds of different trunk lengths."""
    target, head = echo_pair("bamba", context=ECHO_CONTEXT, feature_layers=feature_layers)
    ids = torch.tensor([[4, 8, 15, 16]])
    want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    out, stats = stree.generate(target, ids, draft_model=head, max_new_tokens=16, tree=(2, 2, 1), return_stats=True,
                                compile={"backend": "aot_eager"})
    assert torch.equal(out, want)
    assert max(stats.tokens_per_pass) >= 2  # a trunk of more than one token came back to the head


@pytest.mark.parametrize("tree", [(2, 2, 1), stree.DynamicTree(budget=8, depth=4, top_k=2, frontier=2)])
def test_head_trees_grown_on_the_device_equal_hfs_greedy(tree):
    """draft_on_device=True grows a greedy head tree's levels in one call (each level's nodes read their parents'
    outputs inside it) instead of one host round trip a level: the output is still HF's greedy."""
    target, head = echo_pair("qwen3_next", context=ECHO_CONTEXT)
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
    out, stats = stree.generate(target, ids, draft_model=head, max_new_tokens=24, tree=tree, draft_on_device=True,
                                return_stats=True)
    assert torch.equal(out, want)
    assert stats.tau > 1.3 and stats.transfers <= 3 * stats.rounds  # accepted drafts; no copy per level


# ---------------------------------------------------------------------------------------------------------------------
# 5. Batches: every row drafts from its own features

def batch_drafts(monkeypatch, check):
    """Make every Batch round call check(row index, the row's committed sequence (1, n) before the round, its
    DraftedTree or None for a plain step)."""
    from stree.batch import Batch
    original = Batch._draft_trees

    def drafting(self, spec):
        committed = [row.out.sequence() for row in self.rows]
        drafted = original(self, spec)
        for b, (sequence, d) in enumerate(zip(committed, drafted)):
            check(b, sequence, d)
        return drafted
    monkeypatch.setattr(Batch, "_draft_trees", drafting)


def random_batch_arms(monkeypatch, seed):
    """Make an adaptive batch choose its arm at random (seeded), plain steps included, whatever this machine's
    timings."""
    import random

    from stree.adaptive.batch_sizes import BatchSizes
    coin = random.Random(seed)
    monkeypatch.setattr(BatchSizes, "choose", lambda self, rows: coin.randrange(len(self.arms)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_head_drafts_follow_the_sequential_head(temperature, monkeypatch):
    """A batch of prompts of 1, 5 and 3 tokens (the first starts the head's row empty) drafted by one echo head: every
    row's tree follows the naive reference run over that row alone. Sampled (a fixed tree, one generator per row):
    each DraftedTree.probs equals the reference distribution. Greedy (an adaptive tree whose arms, plain steps
    included, are chosen at random, so rows catch up over trunks of plain steps' tokens with the features those
    steps returned): each node's children are the reference's most probable tokens at it, and dynamic trees'
    draft_q the reference's probabilities. Rows accept different paths, so trunks differ in length within a
    round; the greedy rows equal HF's greedy search."""
    target, head = echo_pair("bamba", context=ECHO_CONTEXT)
    prompts = [torch.tensor(p) for p in ([9], [4, 8, 15, 16, 23], [33, 2, 61])]
    seen = {"nodes": 0, "trunks": set(), "plain": 0}

    def check(b, committed, drafted):
        if drafted is None:
            seen["plain"] += 1
            return
        root = drafted.root
        seen["trunks"].add(root + 1)
        assert drafted.tokens[:root + 1] == committed[0, committed.shape[1] - root - 1:].tolist()
        children = {}
        for node in range(root + 1, len(drafted.tokens)):
            children.setdefault(drafted.parents[node], []).append(drafted.tokens[node])
        for node, q in drafted.probs.items():
            want = reference_distribution(target, head, committed, path_below_root(drafted, node))
            torch.testing.assert_close(q.double(), want, atol=1e-6, rtol=1e-6)
            seen["nodes"] += 1
        if temperature == 0:
            for parent, tokens in children.items():
                want = reference_distribution(target, head, committed, path_below_root(drafted, parent))
                assert sorted(tokens) == sorted(want.topk(len(tokens)).indices.tolist())
                seen["nodes"] += len(tokens)
            for node in range(root + 1, len(drafted.tokens)):
                if drafted.draft_q is not None and drafted.draft_q[node] is not None:
                    want = reference_distribution(target, head, committed, path_below_root(drafted,
                                                                                           drafted.parents[node]))
                    assert drafted.draft_q[node] == pytest.approx(float(want[drafted.tokens[node]]), rel=1e-6)

    batch_drafts(monkeypatch, check)
    if temperature == 0:
        random_batch_arms(monkeypatch, seed=4)
        tree, generators = stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, adaptive=True), None
    else:
        tree, generators = (2, 2, 1), [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    out, stats = stree.generate(target, prompts, draft_model=head, max_new_tokens=20, temperature=temperature,
                                tree=tree, generator=generators, pad_token_id=0, return_stats=True)
    assert seen["nodes"] >= 30 and max(seen["trunks"]) >= 3 and len(seen["trunks"]) >= 2
    assert max(stats.tokens_per_pass) >= 3
    if temperature == 0:
        assert seen["plain"] >= 3
        for b, p in enumerate(prompts):
            assert out[b, 5:].tolist() == hf_greedy(target, p[None], 20)[0, p.numel():].tolist()


@pytest.mark.parametrize("family, feature_layers", [("qwen3_next", None), ("mamba2", (1, 0)), ("falcon_h1", None)])
def test_batched_greedy_with_a_head_is_hfs_greedy_per_row(family, feature_layers):
    """Continuous batching with an echo head: prompts of 1, 11 and 5 tokens, the last joining after two rounds with
    its own budget of 7 tokens (it leaves first, and the head's rows are compacted after it): each output equals
    HF's greedy search of that prompt alone, on a static tree, a dynamic tree and a chain; drafts are accepted."""
    from stree.batch import Batch
    target, head = echo_pair(family, context=ECHO_CONTEXT, feature_layers=feature_layers)
    prompts = [torch.tensor(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[1])]
    per_pass = []
    for tree in GREEDY_TREES:
        batch = Batch(target, draft_model=head, max_new_tokens=24, tree=tree)
        ids, outputs = batch.add(prompts[:2]), {}
        for step in range(40):
            if step == 2:
                ids.append(batch.add(prompts[2], max_new_tokens=7))
            if batch.active:
                batch.step()
            outputs.update(batch.finished())
        assert sorted(outputs) == sorted(ids)
        for i, p, n in zip(ids, prompts, [24, 24, 7]):
            assert torch.equal(outputs[i], hf_greedy(target, p[None], n)[0]), (tree, i)
        per_pass += batch.stats.tokens_per_pass
    assert sum(per_pass) / len(per_pass) > 1.3 and max(per_pass) >= 3


def scripted_arms(monkeypatch, arms):
    """Make an adaptive batch's rounds take arms[k] in round k (-1: the spec's own tree), the last one after."""
    from stree.adaptive.batch_sizes import BatchSizes
    rounds = iter(arms)
    last = [arms[-1]]

    def choose(self, rows):
        last[0] = next(rounds, last[0])
        return last[0] % len(self.arms)
    monkeypatch.setattr(BatchSizes, "choose", choose)


def test_a_batched_head_is_prefilled_at_the_first_speculative_round(monkeypatch):
    """A head holds no row until a round speculates: a batch of plain steps alone never prefills it. After three
    plain steps the head takes each row's prompt and those steps' tokens, fed the target's features (a 1-token
    prompt's row starts empty); a row joining later is handed to it at once, with a budget of its own larger than
    the batch's. Every output equals HF's greedy search of that prompt alone, and drafts are accepted."""
    from stree.batch import Batch
    from stree.models.head_model import HeadTreeModel
    from test_batch import continuous_batch
    target, head = echo_pair("bamba", context=ECHO_CONTEXT)
    prompts = [torch.tensor(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[1])]
    prefilled = []
    add_rows = HeadTreeModel.add_rows
    monkeypatch.setattr(HeadTreeModel, "add_rows",
                        lambda self, held, **options: prefilled.append(len(held)) or add_rows(self, held, **options))
    tree = stree.DynamicTree(budget=6, depth=4, adaptive=True)
    scripted_arms(monkeypatch, [0])
    out = stree.generate(target, prompts[:2], draft_model=head, max_new_tokens=10, tree=tree, pad_token_id=0)
    assert prefilled == [] and out.shape[1] == 11 + 10
    scripted_arms(monkeypatch, [0, 0, 0, -1])
    batch = Batch(target, draft_model=head, max_new_tokens=12, tree=tree)
    outputs = continuous_batch(batch, prompts, [12, 12, 30], join_at=5)
    assert prefilled == [2, 1]  # two rows at the first tree round (round 4), the third as it joins
    for output, p, n in zip(outputs, prompts, [12, 12, 30]):
        assert torch.equal(output, hf_greedy(target, p[None], n)[0])
    assert max(batch.stats.tokens_per_pass) >= 3


def test_compiled_batches_with_a_head_are_hfs_greedy_per_row():
    """A head's batches with compiled passes (dynamo's graphs, eager backend): the target's passes return features,
    the head's first pass per round takes each row's own, rows join and leave: each output equals HF's greedy
    search of that prompt alone. Rows padded to powers of two as on CUDA (three rows run as four: the spare row's
    first head pass takes no features)."""
    from stree.batch import Batch
    from test_batch import continuous_batch
    target, head = echo_pair("bamba", context=ECHO_CONTEXT)
    prompts = [torch.tensor(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[1])]
    batch = Batch(target, draft_model=head, max_new_tokens=24, tree=stree.DynamicTree(budget=6, depth=4),
                  compile={"backend": "eager"})
    batch.pad_batch = True
    outputs = continuous_batch(batch, prompts, [24, 24, 7])
    batch.close()
    for output, p, n in zip(outputs, prompts, [24, 24, 7]):
        assert torch.equal(output, hf_greedy(target, p[None], n)[0])
    assert batch.stats.tau > 1.3


def test_batched_greedy_with_a_published_mtp_head_is_hfs_greedy(tmp_path):
    """A Nemotron-H-like target with its published MTP head (attention then MoE), left-padded prompts through the
    drop-in's padded batch: each row equals HF's greedy search of that prompt alone."""
    from test_batch import left_padded
    target, head = published_pair("nemotron_h", tmp_path)
    prompts = [torch.tensor(p) for p in (PROMPTS[1], PROMPTS[0], PROMPTS[2])]
    ids, mask = left_padded(prompts)
    stree.enable(target)
    try:
        out = target.generate(ids, attention_mask=mask, draft_model=head, do_sample=False, max_new_tokens=16,
                              tree=stree.DynamicTree(budget=8, depth=4))
    finally:
        stree.disable(target)
    for b, p in enumerate(prompts):
        assert out[b, ids.shape[1]:].tolist() == hf_greedy(target, p[None], 16)[0, p.numel():].tolist()


def test_batched_sampling_with_a_head_follows_each_rows_distribution():
    """Two prompts sampled together with an echo head (vocabulary of 5): each row's first 3 new tokens follow the
    target's exact distribution for that prompt (chi-square against enumeration, 300 batched calls)."""
    from test_batch import batched_sample_counts
    target, head = echo_pair("bamba", vocab=5)
    prompts = [torch.tensor([1, 3, 0]), torch.tensor([4, 2, 2, 1, 3])]
    exact = [exact_model_distribution(target, p[None], 3, Sampler(1.0)) for p in prompts]
    assert all(max(e.values()) < 0.5 for e in exact)
    for counts, probs in zip(batched_sample_counts(target, head, prompts, 300, (2, 2, 1)), exact):
        assert_matches(counts, probs)


def test_a_heads_bad_batched_features_are_refused():
    """HeadTreeModel's batched inputs: features per row of the wrong size, a list of the wrong length, and
    add_rows without features raise ValueErrors that name the expected shapes."""
    from stree.models.head_model import HeadTreeModel
    target, head = echo_pair("bamba", context=ECHO_CONTEXT)
    model = HeadTreeModel(head)
    size = head.feature_size
    with pytest.raises(ValueError, match="one feature tensor"):
        model.add_rows([torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="one feature tensor"):
        model.add_rows([torch.tensor([1, 2])], features=[torch.zeros(3, size, dtype=torch.float64)])
    model.add_rows([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)],
                   features=[torch.zeros(2, size, dtype=torch.float64), torch.zeros(0, size, dtype=torch.float64)])
    assert model.cache.lengths.tolist() == [2, 0]
    with pytest.raises(ValueError, match="list of 2 tensors"):
        model.tree_forward([[1], [2]], [[-1], [-1]], features=[torch.zeros(1, size, dtype=torch.float64)])
    with pytest.raises(ValueError, match="list of 2 tensors"):
        model.tree_forward([[1], [2]], [[-1], [-1]], features=[torch.zeros(2, size, dtype=torch.float64), None])
