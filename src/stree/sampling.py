"""Sampling distributions and draws shared by drafting and verification.

The target's sampling distribution is HF's: logits -> temperature -> top-k -> top-p -> softmax (the order of
HF's logits warpers; min_new_tokens, when set, first bans the EOS ids). The draft's distribution is processed the
same way; it only affects speed, never the output distribution.
"""
import math
from dataclasses import dataclass

import torch

from .checks import is_number


@dataclass(frozen=True)
class Sampler:
    """How logits become a distribution. temperature 0 = greedy (argmax)."""
    temperature: float = 0.0
    top_k: int = None
    top_p: float = None
    min_new_tokens: int = 0
    eos_ids: frozenset = frozenset()

    def __post_init__(self):
        if not is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be a positive int, got {self.top_k!r}")
        if self.top_p is not None and not (is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.greedy and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k and top_p only apply to sampling (temperature > 0)")

    @property
    def greedy(self):
        return self.temperature == 0

    def _may_ban_eos(self, generated):
        """Whether EOS may still be banned for these counts (of a tensor: unknown without a sync, so yes)."""
        if not (self.min_new_tokens and self.eos_ids):
            return False
        if torch.is_tensor(generated):
            return True
        counts = generated if isinstance(generated, (list, tuple)) else [generated]
        return min(counts, default=self.min_new_tokens) < self.min_new_tokens

    def scores(self, logits, generated):
        """Processed logits (..., vocab) in float64 for a row whose sequence already holds `generated` new tokens.

        generated: an int, or a list or tensor broadcastable to logits.shape[:-1] (one count per row; made a
            tensor only while min_new_tokens may still ban EOS for one of them).
        """
        scores = logits.double()
        if self._may_ban_eos(generated):
            banned = torch.as_tensor(generated, device=scores.device) < self.min_new_tokens
            eos = torch.tensor(sorted(self.eos_ids), device=scores.device)
            scores = scores.clone()
            scores[..., eos] = torch.where(banned[..., None], float("-inf"), scores[..., eos])
        if self.greedy:
            return scores
        scores = scores / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th are kept, as in HF
        if self.top_p is not None and self.top_p < 1.0:
            ascending, order = scores.sort(dim=-1)
            tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
            drop = tail_mass <= 1.0 - self.top_p
            drop[..., -1] = False  # always keep the most likely token
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return scores

    def probs(self, logits, generated):
        """The sampling distribution (..., vocab), float64."""
        return self.scores(logits, generated).softmax(dim=-1)


def sample(probs, generator=None):
    """One token id drawn from probs (vocab,). Draws happen on the CPU, where `generator` lives."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def draw_without_replacement(probs, k, generator=None):
    """k distinct token ids per row drawn one after another from probs (..., vocab), each from the tokens not yet
    drawn, renormalised: sequential sampling without replacement, by inverse CDF (k uniforms per row, drawn on the
    CPU, where `generator` lives; a Gumbel-top-k draw would need a uniform per token). Returns (ids (..., k) int64,
    valid (..., k) 0/1 in probs' dtype): a row with fewer than k non-zero entries marks the extra draws invalid."""
    k = min(k, probs.shape[-1])
    left = probs.reshape(-1, probs.shape[-1]).clone()                          # (rows, vocab): mass not yet drawn
    uniforms = torch.rand(left.shape[0], k, generator=generator, dtype=probs.dtype).to(probs.device)
    zero = left.new_zeros(())
    ids, valid = [], []
    for j in range(k):
        cdf = left.cumsum(-1)
        total = cdf[:, -1:]
        # below the total, so the first cdf entry above it belongs to a token with mass (if the row has any left)
        target = torch.minimum(uniforms[:, j:j + 1] * total, torch.nextafter(total, zero))
        pick = torch.searchsorted(cdf, target, right=True).clamp_(max=left.shape[-1] - 1)
        ids.append(pick)
        # the picked token's own mass, not only the row's: a cumsum that is not exactly monotone (parallel sums
        # on a GPU) could land on a token with no mass, which verification must never see as drafted
        valid.append(left.gather(-1, pick) > 0)
        left.scatter_(-1, pick, 0.0)
    shape = (*probs.shape[:-1], k)
    return torch.cat(ids, -1).view(shape), torch.cat(valid, -1).to(probs.dtype).view(shape)
