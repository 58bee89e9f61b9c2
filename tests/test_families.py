"""The mixer kinds beyond Mamba2 (Mamba1 selective scan, Gated DeltaNet, Kimi's KDA, LFM2's short conv) through the same
TreeModel / stree.generate / stree.enable API.

test_tree_model.py and test_generate.py run every family of TINY_CONFIGS through the generic checks (one-pass logits
and commits against HF's sequential decoding, extends, greedy output against HF with a noisy draft). Here: the Gated
DeltaNet and KDA tree forms against naive per-node loops, tree passes against stree's own one-node passes to float64
precision (HF's Mamba1 decode step and gated delta rule compute in fp32 even in float64 models, so comparisons with
HF hold at fp32 tolerance only), long greedy outputs with an EOS inside an accepted path, drafts of other families,
lossless sampling, the drop-in API, the VLM wrapper of Qwen3.5, bf16, fixed-shape compiled passes, and errors.
"""
import copy

import pytest
import torch
import transformers

import stree
from loops import gated_delta_loop, kda_loop, path_to, random_rows
from stats import assert_matches, chi_square, chi_square_critical
from stree.models import TreeModel, tiny_model
from stree.models.gated_delta import PathSums, delta_rule_rows, delta_rule_states
from stree.sampling import Sampler
from stree.triton_kernels import TreeIndex, ancestor_mask
from test_generate import hf_greedy, noisy_copy, prompts, without_eos
from test_sampling import pit_counts

ONE_PER_KIND = ["jamba", "qwen3_next", "lfm2"]  # Mamba1, Gated DeltaNet, short conv; each with attention and MoE
FP32_TOL = 2e-5  # HF computes the Mamba1 / gated delta recurrences in fp32 even in float64 models


# ---- the delta-rule tree forms against the naive loops -----------------------------------------------------------

@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
@pytest.mark.parametrize("kind", ["chain", "star", "random", "deep"])
def test_delta_rule_tree_forms_equal_the_loops(kind, rule):
    """The Gated DeltaNet and KDA tree forms over passes that extend the tree (a new pass's nodes may hang anywhere,
    also under each other) give every node's output of the per-node loop, and their commit forms the state after
    any node's path; two trees in a batch, a committed state, float64 (GDN: grouped value heads, Hv = 2 Hk; beta in
    OLMo-Hybrid's [0, 2])."""
    from stree.models.kimi_delta import kda_rows, kda_states
    batch, T, Hk, Dk, Dv = 2, 11, 2, 8, 6
    Hv = 2 * Hk if rule == "gated_delta" else Hk
    g = torch.Generator().manual_seed(hash((kind, rule)) % 1000)
    parents = torch.tensor(random_rows(kind, T, batch, seed=hash(kind) % 1000))
    q, k = (torch.randn(batch, T, Hk, Dk, generator=g, dtype=torch.float64) for _ in range(2))
    q, k = (t / t.norm(dim=-1, keepdim=True) for t in (q, k))
    v = torch.randn(batch, T, Hv, Dv, generator=g, dtype=torch.float64)
    gates = -torch.rand(batch, T, Hv, *((Dk,) if rule == "kda" else ()), generator=g, dtype=torch.float64) * 2
    beta = torch.rand(batch, T, Hv, generator=g, dtype=torch.float64) * 2
    state = torch.randn(batch, Hv, Dk, Dv, generator=g, dtype=torch.float64)
    if rule == "gated_delta":
        want, states = gated_delta_loop(q, k, v, gates, beta, parents.tolist(), initial_state=state)
        rows_fn, states_fn = delta_rule_rows, delta_rule_states
    else:
        want, states = kda_loop(q, k, v, gates, beta, parents.tolist(), initial_state=state)  # q scaled by Dk^-0.5
        rows_fn, states_fn = kda_rows, kda_states
    mask = ancestor_mask(parents)
    index = TreeIndex.prebuilt(parents, mask)
    keys = torch.zeros(batch, T, Hk, Dk, dtype=torch.float64)
    decay = torch.zeros(batch, *gates.shape[1:], dtype=torch.float64)
    updates = torch.zeros(batch, T, Hv, Dv, dtype=torch.float64)
    got = []
    for a, b in [(0, 1), (1, 5), (5, 6), (6, T)]:
        rows = torch.arange(a, b)
        paths = PathSums(mask.index_select(1, rows), mask, torch.float64)
        got.append(rows_fn(q[:, a:b] * Dk ** -0.5, k[:, a:b], v[:, a:b], gates[:, a:b], beta[:, a:b], state, paths,
                           rows, keys, decay, updates))
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-10, atol=1e-10)
    for nodes in ([T - 1, 3], [0, -1], [-1, -1]):
        got = states_fn(state[None], index, torch.tensor(nodes), keys[None], decay[None], updates[None])[0]
        for b, node in enumerate(nodes):
            torch.testing.assert_close(got[b], state[b] if node < 0 else states[b, node], rtol=1e-10, atol=1e-10)


# ---- tree passes against stree's own one-node passes, to float64 precision ---------------------------------------

def one_node_logits(tm, prompt, path):
    """stree's own sequential decoding of prompt + path: one single-node pass and commit per token."""
    tm.prefill(prompt)
    logits = []
    for token in path:
        logits.append(tm.tree_forward([[token]], [[-1]])[0, 0])
        tm.commit([0])
    return logits


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba", "zamba", "qwen3_5", "olmo_hybrid", "kimi_linear",
                                    "lfm2_moe"])
def test_tree_pass_equals_one_node_passes_exactly(family):
    """Extending a random tree over three passes (the last one several levels deep) gives every node the logits of
    stree's own one-node decoding of its path, and after the commit of a deep node the states equal the one-node
    decoding's: to 1e-10, or 1e-6 where HF's cache keeps the state in fp32 (Gated DeltaNet: the one-node decoding
    rounds it at every commit). Both agree with HF at fp32 tolerance (test_tree_model.py)."""
    model = tiny_model(family, dtype=torch.float64, seed=2)
    prompt = prompts([5], seed=9)[0]
    g = torch.Generator().manual_seed(4)
    parents = stree.random_parents(12, g, max_children=3)
    tokens = torch.randint(0, 64, (12,), generator=g).tolist()
    tm = TreeModel(model)
    tm.prefill(prompt)
    got = [tm.tree_forward([tokens[:2]], [parents[:2]])[0], tm.extend([tokens[2:5]], [parents[2:5]])[0],
           tm.extend([tokens[5:]], [parents[5:]])[0]]
    got = torch.cat(got)
    deepest = max(range(12), key=lambda i: len(path_to(parents, i)))
    tm.commit([deepest])
    tol = 1e-10 if all(g.recurrent is None or g.recurrent.dtype == torch.float64 for g in tm.cache.groups) else 1e-6
    ref = TreeModel(model)
    for i in range(12):
        want = one_node_logits(ref, prompt, [tokens[k] for k in path_to(parents, i)])[-1]
        torch.testing.assert_close(got[i], want, rtol=tol, atol=tol)
        if i == deepest:
            for group, kept in zip(tm.cache.groups, ref.cache.groups):
                torch.testing.assert_close(group.conv, kept.conv, rtol=tol, atol=tol)
                if group.recurrent is not None:
                    torch.testing.assert_close(group.recurrent, kept.recurrent, rtol=tol, atol=tol)


# ---- generation --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, seed", [("jamba", 1), ("qwen3_5", 2), ("lfm2", 2)])
def test_long_greedy_with_eos_inside_an_accepted_path(family, seed):
    """300 tokens with a noisy draft (accepted deep and rejected) equal HF's greedy search token for token; an EOS
    that first appears inside an accepted path ends the output as HF's does (the target drafting for itself: every
    drafted token is accepted)."""
    target = without_eos(tiny_model(family, dtype=torch.float64, seed=seed))
    draft = noisy_copy(target, scale=0.01, seed=5)
    prompt = prompts([3], seed=2)[0]
    got, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=300, return_stats=True,
                                tree=stree.DynamicTree())  # fixed size: the adaptive default may stay shallow
    assert torch.equal(got, hf_greedy(target, prompt, 300))
    assert max(stats.tokens_per_pass) >= 4 and min(stats.tokens_per_pass) == 1, stats.tokens_per_pass
    prompt = prompts([4], seed=8)[0]
    reference = hf_greedy(target, prompt, 60)[0, 4:].tolist()
    k = next(k for k in range(1, 60) if k % 5 != 0 and reference[k] not in reference[:k])  # not a bonus token
    want = hf_greedy(target, prompt, 60, eos_token_id=reference[k])
    got = stree.generate(target, prompt, draft_model=target, max_new_tokens=60, eos_token_id=reference[k],
                         tree=(1, 1, 1, 1))
    assert torch.equal(got, want) and got.shape[1] == 4 + k + 1


@pytest.mark.parametrize("target_family, draft_family, draft_overrides", [
    ("qwen3_5", "qwen3_5", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                linear_num_value_heads=2)),   # a smaller Qwen3.5 drafting for a larger one
    ("jamba", "mamba", {}),
    ("qwen3_next", "lfm2", {}),
])
def test_any_supported_family_drafts(target_family, draft_family, draft_overrides):
    """Drafts of each kind (a smaller Qwen3.5 for a Qwen3.5, a Mamba for a Jamba, an LFM2 for a Qwen3-Next) give HF's
    greedy output."""
    target = without_eos(tiny_model(target_family, dtype=torch.float64, seed=3))
    draft = tiny_model(draft_family, dtype=torch.float64, seed=4, **draft_overrides)
    for prompt in prompts([2, 9], seed=6):
        assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=40),
                           hf_greedy(target, prompt, 40))


@pytest.mark.parametrize("family, tree, temperature, top_p", [
    ("jamba", stree.DynamicTree(budget=6, depth=3, top_k=2, frontier=2), 1.0, None),
    ("qwen3_5", (2, 1, 1), 0.7, 0.9),
])
def test_sampling_follows_the_target_conditionals(family, tree, temperature, top_p):
    """Lossless sampling (test_sampling.py's randomised-PIT test): every token of 30-token sampled generations from
    a noisy-copy draft is uniform under the target's exact conditional; judged against another temperature the same
    samples fail, so the test has power."""
    vocab = 8
    target = tiny_model(family, dtype=torch.float64, vocab_size=vocab, seed=1)
    with torch.no_grad():  # sharper next-token distributions than the tiny init gives
        target.get_output_embeddings().weight.mul_(12.0)
    draft = noisy_copy(target, 0.02, seed=3)
    target.generation_config.eos_token_id = None
    prompt = torch.tensor([[1, 3, 0, 5]])
    g = torch.Generator().manual_seed(3)
    outputs = [stree.generate(target, prompt, draft_model=draft, max_new_tokens=30, temperature=temperature,
                              top_p=top_p, tree=tree, generator=g) for _ in range(36)]
    counts, probs = pit_counts(target, prompt, outputs, Sampler(temperature, None, top_p))
    assert_matches(counts, probs)
    wrong, probs = pit_counts(target, prompt, outputs, Sampler(temperature * 3, None, top_p))
    assert chi_square(wrong, probs)[0] > chi_square_critical(9)


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_drop_in_generate(family):
    target = without_eos(tiny_model(family, dtype=torch.float64, seed=5))
    draft = noisy_copy(target, 0.02, seed=6)
    prompt = prompts([6], seed=7)[0]
    want = hf_greedy(target, prompt, 30)
    stree.enable(target)
    try:
        assert torch.equal(target.generate(prompt, draft_model=draft, max_new_tokens=30), want)
        # Sampled: what stree.generate draws from the same global seed with HF's merged settings (top_k=50)
        torch.manual_seed(0)
        sampled = target.generate(prompt, draft_model=draft, do_sample=True, max_new_tokens=10, tree=(2, 2))
        torch.manual_seed(0)
        assert torch.equal(sampled, stree.generate(target, prompt, draft_model=draft, max_new_tokens=10,
                                                   temperature=1.0, top_k=50, tree=(2, 2)))
    finally:
        stree.disable(target)


def test_qwen3_5_vision_language_wrapper():
    """model_type qwen3_5 is HF's image-text-to-text wrapper (what AutoModelForCausalLM gives is qwen3_5_text): text
    decoding through it runs the same mixers; its tree passes equal HF's sequential decoding, and stree's own
    decoding and tree decoding with a draft (a noisy copy) equal HF's greedy search."""
    from test_tree_model import decode_sequentially
    text = transformers.Qwen3_5TextConfig(**stree.models.TINY_CONFIGS["qwen3_5"][2]).to_dict()
    config = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32))
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).double().eval()
    assert model.config.model_type == "qwen3_5"
    without_eos(model)
    prompt = prompts([6], seed=1)[0]
    tm = TreeModel(model)
    tm.prefill(prompt)
    parents = [-1, 0, 0, 1, 3]
    tokens = [5, 9, 2, 7, 1]
    logits = tm.tree_forward([tokens], [parents])[0]
    for i in range(5):
        want, _ = decode_sequentially(model, prompt, [tokens[k] for k in path_to(parents, i)])
        torch.testing.assert_close(logits[i], want, rtol=FP32_TOL, atol=FP32_TOL)
    want = hf_greedy(model, prompt, 30)
    assert torch.equal(stree.generate(model, prompt, draft_model=None, max_new_tokens=30), want)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert torch.equal(stree.generate(model, prompt, draft_model=draft, max_new_tokens=30), want)


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_bfloat16_tree_pass_tracks_sequential_decode(family):
    from test_tree_model import assert_tree_logits_match_sequential
    assert_tree_logits_match_sequential(tiny_model(family, dtype=torch.bfloat16), prompt_len=6, T=8, seed=0,
                                        tol=0.05)


@pytest.mark.parametrize("family, overrides", [("mamba", {}), ("qwen3_5", {}), ("lfm2", {}),
                                               ("kimi_linear", dict(mlp_layer_types=["dense"] * 3))])
def test_fixed_shape_passes_trace_as_one_graph(family, overrides):
    """With a pass width, every pass of these mixers traces as one graph (fullgraph: no host synchronisation, no
    data-dependent Python) and gives the eager passes' logits; a second tree of other shapes reuses it. (HF's eager
    MoE experts loop over the experts hit, so the MoE tiny configs are left out here.)"""
    import torch._dynamo
    model = tiny_model(family, dtype=torch.float32, **overrides)
    eager, compiled = TreeModel(model, nodes=16, pass_width=4), TreeModel(model, nodes=16, pass_width=4)
    torch._dynamo.reset()
    compiled.compile(backend="eager", fullgraph=True)
    outs = []
    for tm in (eager, compiled):
        tm.prefill(prompts([7])[0])
        logits = [tm.tree_forward([[1, 2]], [[-1, 0]]), tm.extend([[3, 4, 5]], [[1, 1, 0]])]
        tm.commit([3])
        logits += [tm.tree_forward([[6, 7, 8, 9]], [[-1, 0, 1, 2]]), tm.extend([[1]], [[0]])]
        tm.commit([4])
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        logits.append(tm.tree_forward([[2, 3]], [[-1, -1]]))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
        outs.append(torch.cat([t[0] for t in logits]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["jamba", "granitemoehybrid"])  # Mamba1 / Mamba2 mixers, attention and MoE layers
def test_compiled_passes_through_graph_breaks_equal_hf(family):
    """HF's MoE blocks break dynamo's graph (`nonzero` over the experts hit), so the layers' own methods are traced as
    frames of their own, one code object shared by every layer. Compiled passes (dynamo alone: what is at stake is
    which graph is replayed, not a backend; fixed shapes, so that each frame is traced once per layer) still give
    HF's sequential logits over trees of several shapes and depths, with commits between them."""
    import torch._dynamo
    from test_tree_model import assert_node_logits_match_sequential, random_tree
    torch._dynamo.reset()
    model = tiny_model(family, dtype=torch.float64)
    tm = TreeModel(model, nodes=16, pass_width=8).compile(backend="eager")
    prompt = prompts([6])[0]
    tm.prefill(prompt)
    sequence = []
    for T, seed in ((3, 0), (8, 1), (6, 2)):
        tokens, parents = random_tree(T, seed)
        assert_node_logits_match_sequential(tm.tree_forward([tokens], [parents])[0], model, prompt, tokens, parents,
                                            FP32_TOL, committed=sequence)
        tm.commit([T - 1])
        sequence += [tokens[k] for k in path_to(parents, T - 1)]


# ---- errors ------------------------------------------------------------------------------------------------------

def test_unsupported_type_lists_the_new_families():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="jamba.*qwen3_next.*olmo_hybrid.*lfm2"):
        TreeModel(model)


@pytest.mark.parametrize("family, overrides, message", [
    ("mamba", dict(hidden_act="gelu"), "silu"),
    ("qwen3_5", dict(hidden_act="gelu"), "silu"),
])
def test_unimplemented_config_raises_at_construction(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        TreeModel(tiny_model(family, **overrides))
