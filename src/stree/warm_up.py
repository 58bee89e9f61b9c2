"""warmup: pay a decoding setting's one-off costs before serving. With compile=True the first call per model and
tree shape compiles its passes (tens of seconds on a CPU), and an adaptive tree times its passes once per target and
setting; later calls with the same setting reuse both. A server calls warmup() with its settings at start-up, so
that no request pays them.

Compiled passes see their varying sizes (node and LM-head row counts, the pass's input tensor) as dynamic from
their first compilation (models.compile.PASS_SIZES), so a call after the first recompiles nothing for a new prompt
length, new tokens or a new tree of the same shape.
"""
import time

import torch

from .checks import vocab_size
from .decoding import generate


def warmup(model, draft_model=None, *, prompt_lengths=(32, 20), max_new_tokens=64, seed=0, **options):
    """Run stree.generate(model, prompt, draft_model=draft_model, max_new_tokens=max_new_tokens, **options) on
    random prompts of each of `prompt_lengths` (token ids drawn with `seed`; the outputs are dropped). options: any
    of generate's (compile, tree, temperature, top_k, top_p, generator, draft_on_device, ...): those the real calls
    will use (with a seeded generator sampled trees keep a fixed shape, without one they are adaptive: other
    passes, other compilations).
    Returns the seconds each call took (the first pays the compilation and the calibration, the later ones show
    the steady cost)."""
    if not prompt_lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in prompt_lengths):
        raise ValueError(f"prompt_lengths must be positive ints, got {prompt_lengths!r}")
    options.setdefault("eos_token_id", [])  # the whole length, whatever the random prompt makes likely
    g = torch.Generator().manual_seed(seed)
    seconds = []
    for length in prompt_lengths:
        prompt = torch.randint(0, vocab_size(model), (1, length), generator=g).to(model.device)
        started = time.perf_counter()
        generate(model, prompt, draft_model=draft_model, max_new_tokens=max_new_tokens, **options)
        seconds.append(time.perf_counter() - started)
    return seconds
