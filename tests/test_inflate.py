import pytest
import torch

import stree
from stree.demo import demo_pair
from stree.models.inflate import inflate_bamba


def test_inflated_target_computes_the_same_function():
    """The bundled target inflated x1.5 (hidden, mixer heads, state, MLP, layers) gives the same logits and the same
    greedy continuation as the original, under HF's own generate and under stree's tree decoding."""
    target, draft, _ = demo_pair(dtype=torch.float64)
    big = inflate_bamba(target, hidden_size=384, mamba_heads=12, d_state=48, intermediate_size=640, num_layers=8)
    assert sum(p.numel() for p in big.parameters()) > 1.5 * sum(p.numel() for p in target.parameters())
    ids = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(0))
    # HF's chunked prefill accumulates in float32 whatever the model dtype: equal up to that rounding.
    torch.testing.assert_close(big(ids).logits, target(ids).logits, rtol=0, atol=1e-5)
    want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    assert torch.equal(big.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False),
                       want)
    assert torch.equal(stree.generate(big, ids, draft_model=draft, max_new_tokens=48), want)


def test_inflate_refuses_shapes_it_cannot_preserve():
    target, _, _ = demo_pair()
    with pytest.raises(ValueError, match="same factor"):
        inflate_bamba(target, hidden_size=512, mamba_heads=12, d_state=32, intermediate_size=512, num_layers=6)
    with pytest.raises(ValueError, match="only grows"):
        inflate_bamba(target, hidden_size=512, mamba_heads=16, d_state=16, intermediate_size=512, num_layers=6)
