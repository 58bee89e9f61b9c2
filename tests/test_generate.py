import copy
import time

import pytest
import torch

import stree
from stree.models import TINY_CONFIGS, tiny_model

FAMILIES = sorted(TINY_CONFIGS)


def without_eos(model):
    model.generation_config.eos_token_id = None
    return model


def noisy_copy(model, scale, seed):
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return draft


def hf_greedy(model, prompt, n, **kwargs):
    """HF's own greedy search. The explicit all-ones mask matters: without it HF masks every prompt token that
    equals pad_token_id."""
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                              **kwargs)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (1, n), generator=g) for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family):
    target = without_eos(tiny_model(family, dtype=torch.float64))
    draft = noisy_copy(target, scale=0.01, seed=1)
    per_pass = []
    for prompt in prompts([1, 6, 17]):
        want = hf_greedy(target, prompt, 120)
        got, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=120, return_stats=True,
                                    tree=stree.DynamicTree())  # fixed size: the adaptive default may stay shallow
        assert torch.equal(got, want)
        assert stats.new_tokens == 120 and sum(stats.tokens_per_pass) == 119  # the first token is the prefill's
        per_pass += stats.tokens_per_pass
    # The draft must be both accepted deep into the tree and rejected, or the test exercises too little.
    assert max(per_pass) >= 4 and min(per_pass) == 1, per_pass


@pytest.mark.parametrize("tree", [(1, 1, 1, 1), (3, 2, 2, 1), (2,), (4, 1, 3), stree.DynamicTree(),
                                  stree.DynamicTree(budget=5, depth=8, top_k=2, frontier=1),
                                  stree.DynamicTree(adaptive=True),
                                  stree.BeamTree(), stree.BeamTree(beams=2, steps=6)])
def test_long_output_any_tree(tree):
    target = without_eos(tiny_model("bamba", dtype=torch.float64, seed=3))
    draft = noisy_copy(target, scale=0.01, seed=2)
    prompt = prompts([4], seed=5)[0]
    want = hf_greedy(target, prompt, 300)
    assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=300, tree=tree), want)


def random_pacing(monkeypatch, seed):
    """Make adaptive rounds speculate or take a plain step at random (seeded; a choice made before the round, as
    the measured rule's is), with the cost model frozen at fixed figures so that round shapes do not depend on this
    machine's timings (the tests that count catch-up trunks were flaky under load)."""
    import random

    from stree.adaptive import Pacing, PassTimes
    coin = random.Random(seed)
    monkeypatch.setattr(Pacing, "speculates", lambda self, context: coin.random() < 0.4)
    monkeypatch.setattr(PassTimes, "update", lambda self, *args: None)
    fixed_calibration(monkeypatch, draft=0.01, verify=1.0, verify_node=0.01, other=0.0)


def fixed_calibration(monkeypatch, step=1.0, **times):
    """generate's calibration of an adaptive tree's costs replaced by fixed figures: PassTimes(**times), a plain
    step of `step` seconds."""
    import stree.decoding as decoding
    from stree.adaptive import PassTimes

    def calibrate(costs, *args):
        costs.times, costs.pacing.step = PassTimes(**times), step
        return costs
    monkeypatch.setattr(decoding, "calibrate", calibrate)


def record_trunks(monkeypatch):
    """A list that gets each speculative round's draft trunk length (tokens the draft's first pass takes)."""
    import stree.decoding as decoding
    trunks, original = [], decoding.draft_tree
    monkeypatch.setattr(decoding, "draft_tree", lambda draft, trunk, *a: trunks.append(len(trunk)) or
                        original(draft, trunk, *a))
    return trunks


@pytest.mark.parametrize("on_device", [False, True])
def test_greedy_adaptive_rounds_learn_agreement_from_every_verified_node(monkeypatch, on_device):
    """Each greedy adaptive round hands Acceptance.note_agreement one (q, agreed) pair per draft node it verified:
    q the draft's probability of the node's token after its parent's path, agreed whether that token is the
    target's greedy choice there, both decided by HF's own forwards over the whole context."""
    import stree.decoding as decoding
    from stree.adaptive import Acceptance, Pacing
    target = without_eos(tiny_model("bamba", dtype=torch.float64, seed=3))
    draft = noisy_copy(target, scale=0.05, seed=2)
    monkeypatch.setattr(Pacing, "speculates", lambda self, context: True)
    fixed_calibration(monkeypatch, draft=1e-6, verify=1.0)
    rounds, noted, original = [], [], decoding.draft_tree
    monkeypatch.setattr(decoding, "draft_tree", lambda draft_model, trunk, spec, sampler, generated, *a: rounds.append(
        (len(trunk), generated, original(draft_model, trunk, spec, sampler, generated, *a))) or rounds[-1][2])
    monkeypatch.setattr(Acceptance, "note_agreement", lambda self, verified: noted.append(list(verified)))
    prompt = prompts([5], seed=7)[0]
    spec = stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, adaptive=True)
    out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=30, tree=spec, draft_on_device=on_device)
    assert len(noted) >= 5 and len(rounds) - len(noted) in (0, 1)  # a last round that ends generation notes nothing
    agreed_and_not = set()
    for (trunk, generated, drafted), verified in zip(rounds, noted):
        context, root = out[0, :prompt.shape[1] + generated].tolist(), trunk - 1
        paths = {root: []}
        for node in range(trunk, len(drafted.tokens)):
            paths[node] = paths[drafted.parents[node]] + [drafted.tokens[node]]
        want = []
        for node in range(trunk, len(drafted.tokens)):
            prefix = torch.tensor([context + paths[drafted.parents[node]]])
            with torch.no_grad():
                q = draft(prefix).logits[0, -1].softmax(-1)[drafted.tokens[node]]
                choice = int(target(prefix).logits[0, -1].argmax())
            want.append((float(q), choice == drafted.tokens[node]))
        assert [a for _, a in verified] == [a for _, a in want]
        assert [q for q, _ in verified] == pytest.approx([q for q, _ in want], rel=1e-6)
        agreed_and_not.update(a for _, a in want)
    assert agreed_and_not == {True, False}


def test_a_stalled_first_round_does_not_stop_speculation(monkeypatch):
    """generate's first speculative round stalls (here: generate's clock jumps 1000 s during its drafting, as a
    compiled call's first rounds compile for seconds): pacing counts it at no more than twice the cost model's
    estimate for the round, so the rounds' pooled mean stays that of real rounds, and the output is HF's."""
    import types

    import stree.decoding as decoding
    target = without_eos(tiny_model("mamba2", dtype=torch.float64, seed=3))
    draft = noisy_copy(target, scale=0.01, seed=2)
    offset, original = [0.0], decoding.draft_tree

    def stalling_draft_tree(*args):
        offset[0] = 1000.0  # from the first speculative round on, generate's clock reads 1000 s later
        return original(*args)
    monkeypatch.setattr(decoding, "draft_tree", stalling_draft_tree)
    monkeypatch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    spec = stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, adaptive=True)
    got = stree.generate(target, prompts([5], seed=7)[0], draft_model=draft, max_new_tokens=40, tree=spec)
    assert torch.equal(got, hf_greedy(target, prompts([5], seed=7)[0], 40))
    (costs,) = stree.adaptive.kept_costs(target).values()
    weight, _, seconds = costs.pacing.paced[None]
    assert seconds / weight < 1.0  # uncapped, the stall alone would make it ~1000 / (rounds' weight)


@pytest.mark.parametrize("family", ["bamba", "mamba2", "jamba", "qwen3_next", "lfm2", "kimi_linear"])
def test_paced_rounds_equal_hf_greedy(family, monkeypatch):
    """Adaptive rounds that take plain steps instead (the draft then catches up on several tokens in one pass, up to
    a pass's width) still give HF's greedy output, for every mixer kind."""
    target = without_eos(tiny_model(family, dtype=torch.float64))
    draft = noisy_copy(target, scale=0.01, seed=1)
    spec = stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2, adaptive=True)  # a pass adds <= 4 nodes
    trunks = record_trunks(monkeypatch)
    random_pacing(monkeypatch, seed=0)
    for prompt in prompts([1, 9, 4]):
        got, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=60, tree=spec,
                                    return_stats=True)
        assert torch.equal(got, hf_greedy(target, prompt, 60))
        assert stats.tree_sizes.count(1) > 10  # plain steps taken ...
    assert max(trunks) == 4  # ... up to 4 - 2 in a row, the draft's next pass taking them all


@pytest.mark.parametrize("family, tree", [
    ("bamba", stree.DynamicTree()), ("bamba", (3, 2, 2, 1)), ("mamba2", (1, 1, 1, 1)),
    ("qwen3_next", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2)),
    ("jamba", stree.DynamicTree(adaptive=True)), ("lfm2", stree.DynamicTree(budget=9, depth=4))])
def test_trees_grown_on_the_device_equal_hf_greedy(family, tree):
    """Greedy trees chosen level by level on the device (the default for compiled passes; here eager) give HF's
    greedy output, with one copy to the host per round for drafting (adaptive trees: one, or two when the root's
    children say that more levels pay; a round may draft and keep nothing) besides verification's."""
    target = without_eos(tiny_model(family, dtype=torch.float64))
    draft = noisy_copy(target, scale=0.01, seed=1)
    for prompt in prompts([1, 9]):
        got, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=60, tree=tree,
                                    return_stats=True, draft_on_device=True)
        assert torch.equal(got, hf_greedy(target, prompt, 60))
        speculative = sum(size > 1 for size in stats.tree_sizes)
        drafting = stats.transfers - 1 - stats.rounds  # the prefill's pick, one verification per round
        assert drafting == speculative if not getattr(tree, "adaptive", False) else \
            speculative <= drafting <= min(stats.draft_passes, 2 * stats.rounds)


@pytest.mark.parametrize("family, compile", [("bamba", False), ("mamba2", {"backend": "aot_eager"})])
def test_device_grown_trees_ban_eos_before_min_new_tokens(family, compile):
    """The same with EOS banned for the first min_new_tokens tokens (the ban depends on each level's depth), and
    with compiled passes (aot_eager: dynamo traces each level's choice and top-k with its pass): a second prompt
    compiles nothing new (no graph per level or per count of new tokens)."""
    import torch._dynamo
    target = tiny_model(family, dtype=torch.float64, seed=2)
    draft = noisy_copy(target, 0.01, 1)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    first_prompt, second_prompt = prompts([5, 7], seed=4)
    reference = hf_greedy(without_eos(copy.deepcopy(target)), first_prompt, 30)[0, 5:].tolist()
    eos = [reference[3], reference[9]]  # met early: min_new_tokens pushes the stop later
    target.generation_config.eos_token_id = eos  # (the EOS ids are constants of a compiled pass)
    for n, prompt in enumerate((first_prompt, second_prompt)):
        got = stree.generate(target, prompt, draft_model=draft, max_new_tokens=30, tree=stree.DynamicTree(),
                             min_new_tokens=12, compile=compile, draft_on_device=True)
        want = hf_greedy(target, prompt, 30, min_new_tokens=12, eos_token_id=eos)
        assert torch.equal(got, want) and got.shape[1] - prompt.shape[1] >= 12
        if not compile:
            break
        first = graphs["unique_graphs"] if n == 0 else first
    assert not compile or graphs["unique_graphs"] == first


@pytest.mark.parametrize("draft_family", ["mamba2", "llama", "qwen2"])
def test_other_draft_families(draft_family):
    """The draft may be any supported causal LM with the same vocabulary: SSM, hybrid or Transformer."""
    target = without_eos(tiny_model("nemotron_h", dtype=torch.float64))
    if draft_family == "mamba2":
        draft = tiny_model("mamba2", dtype=torch.float64, seed=7)
    else:
        import transformers
        config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[draft_family]
        model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[draft_family]
        torch.manual_seed(0)
        draft = model_cls(config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).double().eval()
    for prompt in prompts([3, 9], seed=6):
        want = hf_greedy(target, prompt, 60)
        assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=60), want)


def test_self_draft_accepts_every_level():
    target = without_eos(tiny_model("zamba2", dtype=torch.float64))
    prompt = prompts([5])[0]
    got, stats = stree.generate(target, prompt, draft_model=target, max_new_tokens=41, tree=(2, 2, 1, 1),
                                return_stats=True)
    assert torch.equal(got, hf_greedy(target, prompt, 41))
    assert stats.tokens_per_pass == [5] * 8 and stats.target_passes == 8 and stats.draft_passes == 32


@pytest.mark.parametrize("family", ["mamba2", "falcon_h1"])
def test_eos_inside_an_accepted_path(family):
    target = without_eos(tiny_model(family, dtype=torch.float64))
    prompt = prompts([4], seed=8)[0]
    reference = hf_greedy(target, prompt, 60)[0, 4:].tolist()
    # With the target as its own draft, 4 of every 5 tokens come from accepted draft nodes: pick such a token
    # that appears for the first time there.
    k = next(k for k in range(6, 60) if k % 5 not in (0,) and reference[k] not in reference[:k])
    eos = reference[k]
    want = hf_greedy(target, prompt, 60, eos_token_id=eos)
    got = stree.generate(target, prompt, draft_model=target, max_new_tokens=60, eos_token_id=eos, tree=(1, 1, 1, 1))
    assert torch.equal(got, want) and got.shape[1] == 4 + k + 1
    # The target's own generation_config.eos_token_id is the default, as in HF.
    target.generation_config.eos_token_id = [eos]
    assert torch.equal(stree.generate(target, prompt, draft_model=target, max_new_tokens=60), want)


def test_max_new_tokens_zero_and_one_and_one_token_prompt():
    target = without_eos(tiny_model("granitemoehybrid", dtype=torch.float64))
    draft = noisy_copy(target, 0.02, 0)
    prompt = prompts([1])[0]
    assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=0), prompt)
    assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=1), hf_greedy(target, prompt, 1))
    assert torch.equal(stree.generate(target, prompt[0], draft_model=draft, max_new_tokens=7),
                       hf_greedy(target, prompt, 7))


def test_float32_matches_hf():
    """float32: equal to HF unless two top logits tie within rounding (documented tie policy); none here."""
    target = without_eos(tiny_model("bamba", dtype=torch.float32, seed=11))
    draft = noisy_copy(target, 0.02, 3)
    for prompt in prompts([2, 12], seed=12):
        assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=80),
                           hf_greedy(target, prompt, 80))


def test_autoregressive_loop_equals_hf():
    """draft_model=None: stree's own autoregressive decoding on the same engine, one single-node pass per token."""
    target = without_eos(tiny_model("zamba2", dtype=torch.float64, seed=4))
    for prompt in prompts([3, 9], seed=5):
        out, stats = stree.generate(target, prompt, draft_model=None, max_new_tokens=40, return_stats=True)
        assert torch.equal(out, hf_greedy(target, prompt, 40))
        assert stats.target_passes == 39 and stats.tau == 1.0 and stats.draft_passes == 0


def test_bfloat16_tracks_hf_greedy():
    """bf16 (the bundled pair): rounding differs between a tree pass and HF's decode step, so equality is not
    promised; measured, tree and autoregressive decoding agree with HF's bf16 greedy output on all 48 tokens here.
    The test allows 40."""
    from stree.demo import demo_pair, held_out_prompts
    target, draft, tokenizer = demo_pair(dtype=torch.bfloat16)
    without_eos(target)
    for prompt in held_out_prompts(tokenizer, 2, 32, seed=3):
        want = hf_greedy(target, prompt, 48)[0, 32:]
        for draft_model in (draft, None):
            got = stree.generate(target, prompt, draft_model=draft_model, max_new_tokens=48)[0, 32:]
            differs = (got != want).nonzero()
            assert (int(differs[0]) if len(differs) else 48) >= 40


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "prompt_length >= 1"),
    (dict(input_ids=torch.zeros(2, 3, dtype=torch.long), draft_on_device=True), ValueError, "drafts on the host"),
    (dict(input_ids=torch.zeros(1, 3)), ValueError, "integer tensor"),
    (dict(max_new_tokens=-1), ValueError, "non-negative"),
    (dict(max_new_tokens=2.5), ValueError, "non-negative"),
    (dict(tree=(2, 0)), ValueError, "positive ints"),
    (dict(tree=5), ValueError, "sequence of positive ints"),
    (dict(tree="32"), ValueError, "positive ints"),
    (dict(tree=[]), ValueError, "positive ints"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "finite"),
    (dict(temperature=float("inf")), ValueError, "finite"),
    (dict(temperature=1.0, top_p=float("nan")), ValueError, "top_p"),
    (dict(input_ids=torch.tensor([[1, 2, 999]])), ValueError, "token id 999, outside the model's vocabulary"),
    (dict(input_ids=torch.tensor([[1, -3, 2]])), ValueError, "token id -3, outside"),
    (dict(temperature=1.0, tree=stree.BeamTree()), ValueError, "BeamTree"),
    (dict(temperature=1.0, top_p=1.5), ValueError, "top_p"),
    (dict(temperature=1.0, top_k=0), ValueError, "top_k"),
    (dict(min_new_tokens=-2), ValueError, "min_new_tokens"),
    (dict(top_k=5), ValueError, "top_k"),
    (dict(temperature="1"), ValueError, "temperature must be a finite number"),
    (dict(temperature=1.0, top_p="0.9"), ValueError, "top_p"),
    (dict(temperature=1.0, generator=5), TypeError, "generator must be a torch.Generator, got int"),
    (dict(draft_model="draft"), TypeError, "draft_model must be an HF causal LM"),
    (dict(costs=3), TypeError, "costs must be a stree.adaptive.RoundCosts"),
])
def test_bad_input(kwargs, error, message):
    target = tiny_model("mamba2")
    args = dict(input_ids=torch.zeros(1, 3, dtype=torch.long), draft_model=target, max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        stree.generate(target, **args)


def test_vocab_mismatch():
    target = tiny_model("mamba2")
    draft = tiny_model("mamba2", vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary"):
        stree.generate(target, torch.zeros(1, 3, dtype=torch.long), draft_model=draft, max_new_tokens=4)


def test_bad_tree_specs():
    with pytest.raises(ValueError, match="budget"):
        stree.DynamicTree(budget=0)
    with pytest.raises(ValueError, match="beams"):
        stree.BeamTree(beams=1.5)
    with pytest.raises(ValueError, match="positive ints"):
        stree.StaticTree((1, -1))


@pytest.mark.parametrize("tree, most_nodes", [(stree.DynamicTree(budget=7, depth=5, top_k=3, frontier=2), 8),
                                              (stree.BeamTree(beams=3, steps=4), 13)])
def test_dynamic_and_beam_tree_sizes(tree, most_nodes):
    target = without_eos(tiny_model("mamba2", dtype=torch.float64))
    _, stats = stree.generate(target, prompts([3])[0], draft_model=noisy_copy(target, 0.01, 4), max_new_tokens=40,
                              tree=tree, return_stats=True)
    assert max(stats.tree_sizes) <= most_nodes and min(stats.tree_sizes) > 1


def test_dynamic_tree_budget_must_hold_the_roots_children():
    with pytest.raises(ValueError, match="top_k"):
        stree.DynamicTree(budget=2, top_k=3)
    target = without_eos(tiny_model("mamba2", dtype=torch.float64))
    prompt = prompts([3])[0]
    out = stree.generate(target, prompt, draft_model=noisy_copy(target, 0.01, 4), max_new_tokens=12,
                         tree=stree.DynamicTree(budget=2, top_k=2, frontier=1))
    assert torch.equal(out, hf_greedy(target, prompt, 12))


def test_compiled_passes_follow_the_models_train_eval_mode():
    """Compiled passes are kept on the model, and a pass traces the modules' train / eval mode as a constant (their
    attributes are not guarded in the pass's own frame), so a mode change must not replay the other mode's graphs:
    after a call in train mode (attention dropout on), an eval-mode call still equals HF's greedy search."""
    import torch._dynamo
    target = without_eos(tiny_model("bamba", dtype=torch.float32, seed=2, attention_dropout=0.9))
    torch._dynamo.reset()
    prompt = prompts([5], seed=3)[0]
    target.train()
    stree.generate(target, prompt, draft_model=None, max_new_tokens=8, compile={"backend": "eager"})
    target.eval()
    out = stree.generate(target, prompt, draft_model=None, max_new_tokens=8, compile={"backend": "eager"})
    assert torch.equal(out, hf_greedy(target, prompt, 8))


def test_fixed_shape_compiled_passes_equal_hf(monkeypatch):
    """compile= runs every pass through torch.compile (here the aot_eager backend: dynamo's
    tracing and functionalisation without inductor's C++ build, to keep the test fast): greedy output equal to HF,
    the traced graphs reused across calls (no recompilation for a second prompt), and sampling still runs. The
    adaptive default drafted on the device (the default for compiled passes on CUDA) adds at most a graph per number
    of levels a round grows in one call."""
    import torch._dynamo
    target = without_eos(tiny_model("bamba", dtype=torch.float32, seed=2))
    draft = noisy_copy(target, 0.02, 1)
    torch._dynamo.reset()
    options = {"backend": "aot_eager", "options": {}}  # nested (inductor's options= dict) as users may pass it
    counts = torch._dynamo.utils.counters
    counts.clear()  # reset() leaves the counters of earlier tests
    for prompt in prompts([5, 9], seed=3):
        out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=24, compile=options,
                             draft_on_device=False)
        assert torch.equal(out, hf_greedy(target, prompt, 24))
        if prompt.shape[1] == 5:
            frames = counts["stats"]["unique_graphs"]
    # Per model (target, draft): a graph with the node count dynamic (a first one-node pass specialises on it); on a
    # CPU the pending commit runs eagerly before a pass, so no graph carries one.
    assert 2 <= frames <= 4
    assert counts["stats"]["unique_graphs"] == frames  # the second prompt compiled nothing new
    from stree.adaptive import PassTimes
    # costs frozen so that levels pay whatever this machine's load (real timings may make every round one level)
    fixed_calibration(monkeypatch, draft=1e-3, verify=1.0)
    monkeypatch.setattr(PassTimes, "update", lambda self, *args: None)
    for prompt in prompts([5, 9, 7], seed=3):
        out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=24, compile=options,
                             draft_on_device=True)
        assert torch.equal(out, hf_greedy(target, prompt, 24))
    assert frames < counts["stats"]["unique_graphs"] <= frames + stree.DynamicTree().depth - 1
    # Sampled: the same draws as the eager passes make from the same seed (the graphs compute what eager ops do).
    sampled, eager = (stree.generate(target, prompts([4])[0], draft_model=draft, max_new_tokens=16, temperature=1.0,
                                     compile=compile, generator=torch.Generator().manual_seed(0))
                      for compile in (options, False))
    assert torch.equal(sampled, eager)


@pytest.mark.parametrize("temperature, seeded", [(0.0, False), (1.0, True), (1.0, False)])
def test_calls_after_warmup_compile_nothing(temperature, seeded):
    """After stree.warmup with a setting (greedy adaptive, seeded sampling on fixed trees, sampling on adaptive
    trees), generate calls with that setting on prompts of other lengths and contents compile no new graph (dynamo's
    count of unique graphs is unchanged), because the passes' varying sizes are dynamic from their first
    compilation; and their output is still HF's (greedy). (Before that, a seeded call after the first recompiled
    its passes when the pass tensor first changed size.)"""
    import torch._dynamo
    target = without_eos(tiny_model("bamba", dtype=torch.float32, seed=2))
    draft = noisy_copy(target, 0.05, 1)
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    options = dict(compile={"backend": "eager"}, temperature=temperature)
    seconds = stree.warmup(target, draft, prompt_lengths=(6,), max_new_tokens=24,
                           **options, **({"generator": torch.Generator().manual_seed(0)} if seeded else {}))
    assert len(seconds) == 1 and seconds[0] > 0
    graphs = counts["stats"]["unique_graphs"]
    assert graphs >= 2
    for n, prompt in enumerate(prompts([9, 3, 14], seed=5)):
        generator = torch.Generator().manual_seed(n + 1) if seeded else None
        out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=24, generator=generator, **options)
        if temperature == 0:
            assert torch.equal(out, hf_greedy(target, prompt, 24))
    assert counts["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("commit_in_pass", [True, False])
def test_compiled_passes_are_dynamic_in_their_node_count_from_the_first(commit_in_pass):
    """A compiled TreeModel without a fixed pass width compiles each pass variant (with and without a pending commit,
    where the commit rides in the pass's graph as on CUDA; a CPU runs it eagerly first: one variant) once, with the
    node count dynamic from its first compilation: passes of 3, then 5 and 2 nodes compile two graphs in all (one),
    and the logits equal the eager TreeModel's. (Specialised on its first size, each variant compiled again when the
    size first changed: mid-way through some later call.)"""
    import torch._dynamo
    from stree.models import TreeModel
    target = tiny_model("bamba", dtype=torch.float32, seed=3)
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()  # reset() leaves the counters of earlier tests
    compiled = TreeModel(target, nodes=16).compile(backend="eager")
    compiled._static_buffers = commit_in_pass  # as on CUDA, where the commit rides in the pass's graph
    eager = TreeModel(target, nodes=16)
    prompt = prompts([6], seed=6)[0]
    graphs = None
    for n, width in enumerate((3, 3, 5, 5, 2, 2)):
        tokens = torch.randint(0, 64, (1, width), generator=torch.Generator().manual_seed(n))
        parents = [[-1] + list(range(width - 1))]
        if n % 2 == 0:  # the first pass after a prefill has no commit to run
            outs = [m.prefill(prompt) for m in (compiled, eager)]
        outs = [m.tree_forward(tokens, parents) for m in (compiled, eager)]
        torch.testing.assert_close(outs[0], outs[1])
        for m in (compiled, eager):
            m.commit([width - 1])
        graphs = counts["stats"]["unique_graphs"] if n == 1 else graphs
    assert graphs == (2 if commit_in_pass else 1) and counts["stats"]["unique_graphs"] == graphs


def test_warmup_checks_its_prompt_lengths_and_batch_sizes():
    target = tiny_model("bamba", dtype=torch.float32, seed=2)
    for bad in ((), (0,), (3.0,), (True,)):
        with pytest.raises(ValueError, match="prompt_lengths"):
            stree.warmup(target, prompt_lengths=bad)
        if bad:
            with pytest.raises(ValueError, match="batch_sizes"):
                stree.warmup(target, batch_sizes=bad)


def test_inductor_compiled_passes_equal_hf():
    """compile=True on a CPU: every pass through inductor's generated C++ (a hybrid, attention + Mamba2), greedy
    output equal to HF's greedy search. (The slowest test: inductor compiles the target's and the draft's passes.)"""
    target = without_eos(tiny_model("bamba", dtype=torch.float32, seed=2))
    prompt = prompts([7], seed=3)[0]
    out = stree.generate(target, prompt, draft_model=noisy_copy(target, 0.02, 1), max_new_tokens=24, compile=True,
                         tree=(2, 2, 1))
    assert torch.equal(out, hf_greedy(target, prompt, 24))
