"""The entry points of tree search: tree_search (one problem) and tree_search_batch (several decoded together).

    result = tree_search(model, prompt_ids, verifier, SearchConfig(strategy="rebase", width=16))

The verifier is any callable (prompt_tokens, steps) -> float scoring the latest step of a trajectory (steps: its
list of step token lists); a PRM wrapped in stree.search.PRMVerifier is one. config.strategy picks the search
from STRATEGIES (stree.search.strategies): a level-synchronous one (stree.search.levels) or spec_beam.
"""
import torch

from ..checks import check_token_ids, vocab_size
from ..decoding import check_inputs
from .policy import Policy
from .strategies import STRATEGIES
from .verifiers import PRMVerifier


def _policy(model, config):
    return Policy(model, temperature=config.temperature, top_p=config.top_p,
                  step_delimiter_ids=config.step_delimiter_ids, step_max_tokens=config.step_max_tokens,
                  eos_token_ids=config.eos_token_ids)


def check_prompt(model, prompt, index=0):
    """Prompt `index` as a list of ids, after the checks stree.generate makes of its input_ids
    (stree.decoding.check_inputs): a list of ints or a (P,) / (1, P) integer tensor, at least one token, every id in
    the model's vocabulary. Raises ValueError naming the prompt and the bad value."""
    ids = torch.as_tensor(prompt)
    if ids.numel() == 0:
        raise ValueError(f"prompt {index} is empty: a prompt needs at least one token")
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(f"prompt {index} must be a list of ids or a (P,) / (1, P) tensor, got shape "
                         f"{tuple(ids.shape)} (several prompts: tree_search_batch)")
    if not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        ids = ids.long()
    try:
        return check_inputs(model, None, ids, 0, 0).flatten().tolist()
    except ValueError as error:
        raise ValueError(f"prompt {index}: {error}") from None


def check_vocabularies(model, config, verifiers):
    """Raise ValueError if a token id of the config (a step delimiter or EOS) is outside the model's vocabulary, or a
    PRMVerifier, which reads the policy's tokens, has a smaller vocabulary than the policy's."""
    vocab = vocab_size(model)
    for name in ("step_delimiter_ids", "eos_token_ids"):
        check_token_ids(name, list(getattr(config, name)), vocab)
    for verifier in verifiers:
        if isinstance(verifier, PRMVerifier) and verifier.vocab < vocab:
            raise ValueError(f"the PRM verifier reads the policy's tokens, but its vocabulary ({verifier.vocab} ids) "
                             f"is smaller than the policy's ({vocab}); they must share a tokenizer")


def tree_search_batch(model, prompts, verifiers, config, answer_fn=None, embedder=None, seeds=None):
    """Search several problems at once: their trajectories share one batch, one forward pass per token for every
    live branch of every problem (what serving many problems on one accelerator does; a strategy that keeps less
    state fits more problems in the same memory). Every strategy; each problem moves on by itself (a
    level-synchronous one to its next level once its own level has ended; spec_beam verifying and expanding its
    own candidates).

    prompts: a list of prompt token ids; verifiers: one verifier per prompt, or one for all; config: the
    SearchConfig of every problem; seeds: one seed per problem (default config.seed for each, so problem i gets
    the result tree_search(model, prompts[i], verifiers[i], config) gets, up to float rounding). Returns a list of
    SearchResults; stats as tree_search's, counted per problem, except peak_held_bytes (the whole batch's) and
    wall_time (the whole call's)."""
    prompts = [check_prompt(model, p, i) for i, p in enumerate(prompts)]
    if not prompts:
        raise ValueError("tree_search_batch needs at least one prompt")
    verifiers = list(verifiers) if isinstance(verifiers, (list, tuple)) else [verifiers] * len(prompts)
    seeds = [config.seed] * len(prompts) if seeds is None else list(seeds)
    if len(verifiers) != len(prompts) or len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts need as many verifiers and seeds, got {len(verifiers)} and "
                         f"{len(seeds)}")
    check_vocabularies(model, config, verifiers)
    answer_fn = answer_fn or (lambda tokens: tuple(tokens[-8:]))
    return STRATEGIES[config.strategy](_policy(model, config), prompts, verifiers, config, seeds, answer_fn,
                                       embedder)


def tree_search(model, prompt_ids, verifier, config, answer_fn=None, embedder=None):
    """Search with `model` as policy. answer_fn(tokens) -> answer or None extracts a trajectory's final answer
    (default: its last 8 tokens as a tuple). embedder(tokens) -> vector gives ETS's diversity embeddings (default:
    the policy's hidden state at the step's last token, no extra model; e.g. a local sentence-transformers model's
    encode on the decoded text). Returns a SearchResult. stats:
      verifier_calls   one per distinct step of a parent node;
      steps, wall_time;
      forwards         model forward passes: one per decode step (batched), plus the replay passes;
      step_tokens      row-tokens drawn and fed (siblings share a row while their tokens agree);
      replayed, replay_tokens   leaves rebuilt and the tokens fed for them;
      replay_forwards  the passes that rebuilt them (a level's replays of one step length share one pass);
      peak_tree_bytes  the most bytes the tree held right after a step was generated (every live and finished
                       trajectory with its shared prefixes) under TreeMemory's model;
      peak_held_bytes  the most bytes of cache state this engine really kept: the padded batch plus every snapshot
                       alive (RowBatch.held_bytes).
    spec_beam documents its own stats (stree.search.strategies.spec_beam.spec_beam_searches)."""
    return tree_search_batch(model, [prompt_ids], [verifier], config, answer_fn, embedder)[0]
