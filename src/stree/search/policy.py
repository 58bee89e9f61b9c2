"""The policy: a causal LM and the rules that cut its output into reasoning steps.

Steps are generated on batched rows (stree.search.batched.StepDecoder over a stree.search.rows.RowBatch): a state
is a RowState snapshot; children of a state start from copies of it (forking an SSM state is copying a fixed-size
tensor; attention layers copy their K/V), so a shared prefix is never re-prefilled.
"""
import torch

from .rows import RowBatch
from ..sampling import Sampler


class Policy:
    """Step generation settings for any supported causal LM (SSM, hybrid or Transformer)."""

    def __init__(self, model, *, temperature=1.0, top_k=None, top_p=None, step_delimiter_ids=(),
                 step_max_tokens=64, eos_token_ids=()):
        if temperature <= 0:
            raise ValueError(f"a policy samples its steps: temperature must be > 0, got {temperature}")
        self.model = model
        self.sampler = Sampler(temperature, top_k, top_p)
        self.delimiters = frozenset(step_delimiter_ids)
        self.eos = frozenset(eos_token_ids)
        self.step_max_tokens = step_max_tokens

    def prefill(self, prompt_ids):
        """(an empty RowBatch, the prompt's RowState) for a prompt (list of ids or a (1, P) / (P,) tensor)."""
        return RowBatch.prefill(self.model, torch.as_tensor(prompt_ids).flatten().tolist())

    def ends_step(self, token, length):
        """Whether a step ends with `token` as its `length`-th token: a delimiter, EOS or the token budget."""
        return token in self.delimiters or token in self.eos or length >= self.step_max_tokens
