"""The l2 norms of the delta-rule families, in the two forms HF keeps apart on purpose.

Both divide x by sqrt(sum(x^2) + eps) over the last dim, with eps inside the root; they differ in how, which
changes the last bits of fp32 results (and so, over a long generation, can change a greedy token):

    l2norm_rsqrt   x * rsqrt(sum(x^2) + eps)    Gated DeltaNet: HF's Qwen3-Next / Qwen3.5 / OLMo-Hybrid l2norm,
                                                as fla's
    l2norm_divide  x / sqrt(sum(x^2) + eps)     KDA: HF's Kimi Linear l2norm (sqrt and a division, to match
                                                the original Triton kernel)
"""
import torch

L2NORM_EPS = 1e-6  # both families' default


def l2norm_rsqrt(x, eps=L2NORM_EPS):
    """x (..., D) normalised over D as Gated DeltaNet does: x * rsqrt(sum(x^2) + eps)."""
    return x * (x * x).sum(-1, keepdim=True).add(eps).rsqrt()


def l2norm_divide(x, eps=L2NORM_EPS):
    """x (..., D) normalised over D as KDA does: x / sqrt(sum(x^2) + eps)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
