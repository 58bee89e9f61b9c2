"""The bundled pair: it loads offline, has the promised shape, decodes exactly, and its draft is good."""
import torch

import stree
from stree.demo import demo_pair, held_out_prompts


def compute_params(model):
    """Parameters a token's forward pass multiplies by: all but the input embedding table."""
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def test_demo_pair_is_a_hybrid_target_with_a_cheap_mamba2_draft():
    assert stree.demo_pair is demo_pair  # the package attribute the README uses
    target, draft, tokenizer = demo_pair()
    assert target.config.model_type == "bamba" and target.config.attn_layer_indices
    assert draft.config.model_type == "mamba2"
    assert len(tokenizer) == target.config.vocab_size == draft.config.vocab_size
    assert compute_params(target) >= 8 * compute_params(draft)
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


def test_demo_pair_decodes_exactly_with_a_high_tau_on_held_out_code():
    target, draft, tokenizer = demo_pair()
    target.generation_config.eos_token_id = None
    passes = []
    for prompt in held_out_prompts(tokenizer, 3, 32):
        with torch.no_grad():
            want = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=64)
        got, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=64, return_stats=True)
        assert torch.equal(got, want)
        passes += stats.tokens_per_pass
    assert sum(passes) / len(passes) >= 3.0  # the target; measured 4.2 with the default tree


def test_draft_share_floor_is_the_drafts_own_step(monkeypatch):
    """benchmarks/decoding/draft_share.py's floor (a hand-written single-token step through the draft's modules)
    computes what HF's forward computes, one row or several rows at once: otherwise its timing would bound nothing."""
    import importlib
    import os
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # as python -m does
    module = importlib.import_module("benchmarks.decoding.draft_share")
    _, draft, tokenizer = demo_pair()
    prompts = held_out_prompts(tokenizer, 2, 12)
    assert module.check_hand_step(draft, prompts[0], 7) < 1e-4
    with torch.no_grad():  # two rows, each from its own prompt's state
        states = []
        for prompt in prompts:
            model = stree.TreeModel(draft)
            model.prefill(prompt)
            states.append(module.committed_states(model))
        conv, ssm = (torch.cat(rows) for rows in zip(*states))
        got = module.hand_step(draft, torch.tensor([3, 9]), conv, ssm)
        for row, (prompt, token) in enumerate(zip(prompts, (3, 9))):
            want = draft(torch.cat([prompt, torch.tensor([[token]])], dim=1)).logits[0, -1]
            torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)
