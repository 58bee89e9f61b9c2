"""Realistic-size draft/target pairs without a download: the bundled trained pair inflated function-preservingly.

The bundled target (Bamba, 6 layers, 256 wide) and draft (Mamba2, 1 layer, 128 wide) grow to the shapes below with
stree.models.inflate_bamba / inflate_mamba2: every old weight sits in the corner of its new matrix, the rest is zero,
so the big pair computes the same logits, drafts the same trees and keeps the trained pair's acceptance, while each
pass costs what a model of that shape costs (dense products do not skip zeros). The draft keeps a realistic share of
the target's cost, the regime real sibling drafts and MTP / EAGLE heads live in: 5-10% of a target pass a token.
On a CPU a small model's pass is half per-operation overhead, so a draft's share of the cost is about twice its
share of the parameters: the 0.9b pair's 4-layer draft (3.8% of the parameters) costs 7% of a target pass a token
eager in bf16 on an AVX-512 EPYC, its 8-layer one (61M, `draft_layers=8`) 13%.

    name    target (parameters, shape)                          draft (parameters, shape)
    0.9b    918M: 12 layers, hidden 2048, 64 heads, state 128    35M: 4 layers, hidden 1024
    2.7b    2.8B: 64 layers, hidden 2560, 80 heads (Mamba2-2.7B) 128M: 32 layers, hidden 768 (Mamba2-130M)
    8b      8.9B: 32 layers, hidden 4096, 128 heads, MLP 14336   364M: 24 layers, hidden 1536
            (Bamba-9B / Nemotron-H-8B cost)
"""
from stree.models import inflate_bamba, inflate_mamba2

# name: (inflate_bamba's sizes for the target, inflate_mamba2's for the draft)
PAIRS = {
    "0.9b": (dict(hidden_size=2048, mamba_heads=64, d_state=128, intermediate_size=8192, num_layers=12),
             dict(hidden_size=1024, d_state=128, num_layers=4)),
    "2.7b": (dict(hidden_size=2560, mamba_heads=80, d_state=128, intermediate_size=512, num_layers=64),
             dict(hidden_size=768, d_state=128, num_layers=32)),
    "8b": (dict(hidden_size=4096, mamba_heads=128, d_state=128, intermediate_size=14336, num_layers=32),
           dict(hidden_size=1536, d_state=128, num_layers=24)),
}


def inflate_pair(target, draft, name, device=None, inflate_draft=True, draft_layers=None):
    """(target, draft) of the pair `name`, built on `device` in the bundled models' dtype; with
    inflate_draft=False the draft stays the bundled 1.2M one (nearly free beside any of these targets);
    draft_layers: the inflated draft's layer count instead of the pair's."""
    big_target = inflate_bamba(target, **PAIRS[name][0], device=device)
    if not inflate_draft:
        return big_target, draft.to(device)
    return big_target, inflate_mamba2(draft, **draft_sizes(name, draft_layers), device=device)


def draft_sizes(name, draft_layers=None):
    """inflate_mamba2's sizes for the pair's draft, with `draft_layers` layers if given."""
    sizes = PAIRS[name][1]
    return sizes if draft_layers is None else {**sizes, "num_layers": draft_layers}


def head_sizes(name):
    """inflate_head's sizes for a head of the pair's target (the target's widths; its layer count is not a
    head's)."""
    return {k: v for k, v in PAIRS[name][0].items() if k != "num_layers"}


def pair_tag(name, inflate_draft, draft_layers=None):
    """The pair's part of a result file name: large (0.9b) or large8b, then the inflated draft's layers (draft4l)."""
    tags = ["large" if name == "0.9b" else f"large{name}"]
    return tags + ([f"draft{draft_sizes(name, draft_layers)['num_layers']}l"] if inflate_draft else [])
