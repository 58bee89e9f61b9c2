"""stree.generate (this module): speculative tree decoding for HF Mamba2 / hybrid models (and Transformer drafts).

One readable loop: prefill both models; then repeat draft a tree -> verify it with one target pass -> emit the
accepted tokens plus the target's bonus token -> commit both caches to the accepted branch.
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .draft import check_branching, draft_static_tree
from .models import TreeModel
from .verify import verify_greedy

DEFAULT_TREE = (3, 2, 2, 1)


@dataclass
class GenerationStats:
    """Counters of one generate() call. Times in seconds."""
    new_tokens: int = 0
    target_passes: int = 0          # tree verification passes (the prefill is not counted)
    draft_passes: int = 0           # draft tree passes (the prefill is not counted)
    tokens_per_pass: list = field(default_factory=list)  # per verification: accepted drafts + bonus, as emitted
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    total_time: float = 0.0

    @property
    def tau(self):
        """Mean tokens emitted per target verification pass (STree's and Medusa's tau)."""
        return sum(self.tokens_per_pass) / max(len(self.tokens_per_pass), 1)

    def as_dict(self):
        return dict(new_tokens=self.new_tokens, target_passes=self.target_passes, draft_passes=self.draft_passes,
                    tau=self.tau, draft_time=self.draft_time, verify_time=self.verify_time,
                    commit_time=self.commit_time, total_time=self.total_time)


@contextmanager
def _timed(stats, name, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setattr(stats, name, getattr(stats, name) + time.perf_counter() - start)


def _check_inputs(model, draft_model, input_ids, max_new_tokens, temperature, top_k, top_p):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("input_ids must be an integer tensor of shape (1, prompt_length)")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (1, prompt_length >= 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"stree.generate decodes one sequence at a time (batch 1), got batch {input_ids.shape[0]}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0:
        raise NotImplementedError("sampling (temperature > 0) is not implemented yet; use temperature=0 (greedy)")
    if top_k is not None or top_p is not None:
        raise ValueError("top_k and top_p only apply to sampling (temperature > 0)")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft_model.config.vocab_size}) differs from the target's "
                         f"({model.config.vocab_size}); they must share a tokenizer")
    return input_ids.long().to(model.device)


def _eos_ids(eos_token_id):
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        return set(eos_token_id.flatten().tolist())
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


@torch.no_grad()
def generate(model, input_ids, *, draft_model, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
             eos_token_id=None, tree=DEFAULT_TREE, return_stats=False):
    """Speculative tree decoding; with temperature 0 the output equals model.generate(do_sample=False).

    Args:
        model: target, an HF causal LM of a supported family (stree.models.SUPPORTED_MODEL_TYPES).
        input_ids: (1, P) or (P,) prompt token ids, P >= 1.
        draft_model: any supported causal LM with the target's vocabulary.
        max_new_tokens: at most this many new tokens.
        temperature: 0 = greedy (sampling is not implemented yet).
        eos_token_id: int or list of ints that end generation (the EOS is kept in the output); None = the
            target's generation_config.eos_token_id, as HF's generate does.
        tree: static branching spec, tree[d] draft children per node at depth d; (1, 1, 1, 1) is a chain
            (vanilla speculative decoding).
        return_stats: also return a GenerationStats.
    Returns:
        (1, P + n) token ids (prompt + new tokens), and the stats when return_stats.

    Exactness: the tree pass equals token-by-token decoding up to float rounding, so the output equals HF's greedy
    search except where two top logits lie within that rounding (~1e-6 relative in float32, ~1e-14 in float64).
    """
    input_ids = _check_inputs(model, draft_model, input_ids, max_new_tokens, temperature, top_k, top_p)
    branching = check_branching(tree)
    eos = _eos_ids(model.generation_config.eos_token_id if eos_token_id is None else eos_token_id)
    stats = GenerationStats()
    device = input_ids.device
    start = time.perf_counter()
    generated = []

    def emit(tokens):
        """Append tokens until EOS or the length limit; True when generation is over."""
        for token in tokens:
            generated.append(token)
            if token in eos or len(generated) == max_new_tokens:
                return True
        return False

    done = max_new_tokens == 0
    if not done:
        target, draft = TreeModel(model), TreeModel(draft_model)
        root = int(target.prefill(input_ids)[0, -1].argmax())
        draft.prefill(input_ids)
        done = emit([root])
        trunk = [root]  # tokens the draft's cache still lacks; the last is the root of the next tree
    while not done:
        with _timed(stats, "draft_time", device):
            draft_tokens, draft_parents, covered = draft_static_tree(draft, trunk, branching)
        stats.draft_passes += len(branching)
        offset = len(trunk) - 1  # the root's index in the draft's tree; the target's tree starts at the root
        tokens = draft_tokens[offset:]
        parents = [p - offset for p in draft_parents[offset:]]
        with _timed(stats, "verify_time", device):
            logits = target.tree_forward(torch.tensor([tokens], device=device),
                                         torch.tensor([parents], device=device))[0]
            accepted, bonus = verify_greedy(tokens, parents, logits)
        stats.target_passes += 1
        emitted_before = len(generated)
        done = emit([tokens[n] for n in accepted[1:]] + [bonus])
        stats.tokens_per_pass.append(len(generated) - emitted_before)
        if done:
            break
        with _timed(stats, "commit_time", device):
            target.commit([accepted[-1]])
            in_draft = [n + offset for n in accepted]
            draft.commit([max(n for n in in_draft if n < covered)])
            trunk = [draft_tokens[n] for n in in_draft if n >= covered] + [bonus]
    stats.new_tokens = len(generated)
    stats.total_time = time.perf_counter() - start
    output = torch.cat([input_ids, torch.tensor([generated], dtype=torch.long, device=device)], dim=1)
    return (output, stats) if return_stats else output
