"""A policy that generates reasoning steps from forked model states.

A PolicyState is a batch-1 HF cache positioned after some tokens, plus the logits there. Children of a state start
from copies of it (forking an SSM state is copying a fixed-size tensor; attention layers copy their K/V), so a
shared prefix is never re-prefilled. Siblings drawn from one state share its logits, and siblings whose tokens
agree so far share every forward pass until they differ.
"""
import copy
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..sampling import Sampler


@dataclass
class PolicyState:
    cache: object            # the HF cache after `length` tokens (batch 1)
    length: int              # tokens in the cache
    logits: torch.Tensor     # (vocab,) next-token logits at this state
    hidden: torch.Tensor     # (hidden,) last layer's hidden state of the latest token (a free step embedding)


@dataclass
class Step:
    tokens: list             # the step's token ids
    state: PolicyState       # the state after the step
    count: int               # how many of the requested siblings drew exactly this step
    finished: bool           # the step ended with an end-of-sequence token


class Policy:
    """Step generation for any supported causal LM (SSM, hybrid or Transformer)."""

    def __init__(self, model, *, temperature=1.0, top_k=None, top_p=None, step_delimiter_ids=(),
                 step_max_tokens=64, eos_token_ids=()):
        if temperature <= 0:
            raise ValueError(f"a policy samples its steps: temperature must be > 0, got {temperature}")
        self.model = model
        self.sampler = Sampler(temperature, top_k, top_p)
        self.delimiters = frozenset(step_delimiter_ids)
        self.eos = frozenset(eos_token_ids)
        self.step_max_tokens = step_max_tokens

    @torch.no_grad()
    def _run(self, cache, start, tokens):
        ids = torch.tensor([tokens], device=self.model.device)
        positions = torch.arange(start, start + len(tokens), device=self.model.device)[None]
        out = self.model(input_ids=ids, cache=cache, use_cache=True, position_ids=positions,
                         output_hidden_states=True, logits_to_keep=1)
        return PolicyState(cache, start + len(tokens), out.logits[0, -1], out.hidden_states[-1][0, -1])

    def prefill(self, prompt_ids):
        """The state after a prompt (list of ids or a (1, P) / (P,) tensor)."""
        tokens = torch.as_tensor(prompt_ids).flatten().tolist()
        if not tokens:
            raise ValueError("the prompt needs at least one token")
        return self._run(DynamicCache(config=self.model.config), 0, tokens)

    def extend(self, state, tokens, fork=True):
        """The state after feeding `tokens` on top of `state` (a forked copy unless fork=False)."""
        cache = copy.deepcopy(state.cache) if fork else state.cache
        return self._run(cache, state.length, list(tokens))

    def ends_step(self, token, length):
        """Whether a step ends with `token` as its `length`-th token: a delimiter, EOS or the token budget."""
        return token in self.delimiters or token in self.eos or length >= self.step_max_tokens

    def sample_steps(self, state, n, generator=None):
        """n sibling steps drawn independently from `state`, merged while their tokens agree.

        Yields the distinct steps with their multiplicities (counts sum to n), each as soon as it is complete
        (depth first), so the caller may score it and release its state before the next one is generated. A branch's
        state is made when the branch is taken up: besides the steps yielded, one state per split point of the
        current branch is alive at a time. A step ends after a delimiter or EOS token, or after step_max_tokens
        tokens.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self._steps(state, n, generator)

    def _steps(self, state, n, generator):
        pending = self._branches(state, n, [], None, generator)
        while pending:
            at, token, count, tokens, siblings_left = pending.pop()
            # The last branch taken from a state made here takes it over: nobody else reads it any more.
            last = siblings_left is not None and siblings_left.pop() == 0
            child = self.extend(at, [token], fork=not last)
            grown = tokens + [token]
            if self.ends_step(token, len(grown)):
                yield Step(grown, child, count, token in self.eos)
            else:
                pending += self._branches(child, count, grown, [], generator)

    def _branches(self, at, count, tokens, siblings_left, generator):
        """`count` next tokens drawn at state `at`, one pending branch per distinct token; siblings_left (a list
        shared by the branches, None for a state the caller owns) counts down as they are taken up."""
        probs = self.sampler.probs(at.logits, 0).cpu()
        draws = sorted(Counter(torch.multinomial(probs, count, replacement=True, generator=generator).tolist()).items())
        if siblings_left is not None:
            siblings_left.extend(range(len(draws)))  # pop() gives len - 1, ..., 0: zero for the last branch
        return [(at, token, k, tokens, siblings_left) for token, k in draws]
