import pytest
import torch

import stree
from stree.demo import demo_pair
from stree.models.inflate import inflate_bamba, inflate_mamba2


def hf_greedy(model, ids, new_tokens):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)


def assert_same_function(big, small, ids, new_tokens):
    """big's logits equal small's over ids and HF's greedy continuation of ids is the same; returns that continuation.
    (HF's chunked prefill accumulates in float32 whatever the model dtype: equal up to that rounding.)"""
    torch.testing.assert_close(big(ids).logits, small(ids).logits, rtol=0, atol=1e-5)
    want = hf_greedy(small, ids, new_tokens)
    assert torch.equal(hf_greedy(big, ids, new_tokens), want)
    return want


def test_inflated_target_computes_the_same_function():
    """The bundled target inflated x1.5 (hidden, mixer heads, state, MLP, layers) gives the same logits and the same
    greedy continuation as the original, under HF's own generate and under stree's tree decoding."""
    target, draft, _ = demo_pair(dtype=torch.float64)
    big = inflate_bamba(target, hidden_size=384, mamba_heads=12, d_state=48, intermediate_size=640, num_layers=8)
    assert sum(p.numel() for p in big.parameters()) > 1.5 * sum(p.numel() for p in target.parameters())
    ids = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(0))
    want = assert_same_function(big, target, ids, 48)
    assert torch.equal(stree.generate(big, ids, draft_model=draft, max_new_tokens=48), want)


def test_inflated_draft_computes_the_same_function():
    """The bundled draft (Mamba2) inflated x4 in width, x2 in state and to 3 layers gives the same logits, HF's
    same greedy continuation, and as stree's draft the same trees: the same output and the same tokens per pass."""
    target, draft, _ = demo_pair(dtype=torch.float64)
    big = inflate_mamba2(draft, hidden_size=512, d_state=64, num_layers=3)
    assert big.config.num_heads == 4 * draft.config.num_heads
    assert sum(p.numel() for p in big.parameters()) > 4 * sum(p.numel() for p in draft.parameters())
    ids = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(1))
    assert_same_function(big, draft, ids, 32)
    runs = [stree.generate(target, ids, draft_model=d, max_new_tokens=32, tree=(3, 2, 1), return_stats=True)
            for d in (draft, big)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1].tokens_per_pass == runs[1][1].tokens_per_pass


def test_inflate_refuses_shapes_it_cannot_preserve():
    target, draft, _ = demo_pair()
    with pytest.raises(ValueError, match="whole heads"):
        inflate_mamba2(draft, hidden_size=144, d_state=32, num_layers=1)  # 4.5 heads of 64
    with pytest.raises(ValueError, match="only grows"):
        inflate_mamba2(draft, hidden_size=256, d_state=16, num_layers=1)
    with pytest.raises(ValueError, match="mamba2"):
        inflate_mamba2(target, hidden_size=512, d_state=64, num_layers=6)
    with pytest.raises(ValueError, match="same factor"):
        inflate_bamba(target, hidden_size=512, mamba_heads=12, d_state=32, intermediate_size=512, num_layers=6)
    with pytest.raises(ValueError, match="only grows"):
        inflate_bamba(target, hidden_size=512, mamba_heads=16, d_state=16, intermediate_size=512, num_layers=6)


def test_inflated_models_are_built_in_the_models_dtype_and_leave_the_default_dtype_alone():
    """The big model's parameters are created in the small model's dtype on the device asked for (no float32 copy
    first: an 8.9B target is built on the GPU in bf16), and torch's default dtype is restored, also when building
    fails."""
    from stree.models.inflate import _new_model
    target, draft, _ = demo_pair(dtype=torch.bfloat16)
    big = inflate_mamba2(draft, hidden_size=256, d_state=32, num_layers=2, device="cpu")
    assert {p.dtype for p in big.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    assert not big.training and big.config.hidden_size == 256

    def broken(config):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        _new_model(broken, None, target, None)
    assert torch.get_default_dtype() == torch.float32


def test_the_benchmark_pairs_have_the_shapes_they_claim(monkeypatch):
    """benchmarks/decoding/pairs.py: every pair inflates the bundled models to the parameter counts its docstring
    gives (built on the meta device: shapes only), and its sizes are ones the inflation accepts."""
    import copy
    import os
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.decoding.pairs import PAIRS
    target, draft = (copy.deepcopy(m).to("meta") for m in demo_pair()[:2])
    claimed = {"0.9b": (918e6, 35e6), "2.7b": (2.83e9, 128e6), "8b": (8.89e9, 364e6)}
    for name, (target_sizes, draft_sizes) in PAIRS.items():
        counts = []
        for model, inflate, sizes in ((target, inflate_bamba, target_sizes), (draft, inflate_mamba2, draft_sizes)):
            big = inflate(model, **sizes)
            counts.append(sum(p.numel() for p in big.parameters()))
        assert counts == pytest.approx(claimed[name], rel=0.01), name
