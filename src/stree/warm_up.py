"""warmup: pay a decoding setting's one-off costs before serving. With compile=True the first call per model and
tree shape compiles its passes (tens of seconds on a CPU), and an adaptive tree times its passes once per target and
setting; later calls with the same setting reuse both. A server calls warmup() with its settings at start-up, so
that no request pays them.

Compiled passes see their varying sizes (node and LM-head row counts, the pass's input tensor) as dynamic from
their first compilation (models.compile.PASS_SIZES), so a call after the first recompiles nothing for a new prompt
length, new tokens or a new tree of the same shape. A compiled Batch on CUDA pads its rows to a power of two, and
CUDA graphs record once per such batch size: `batch_sizes` warms them.
"""
import time

import torch

from .adaptive.batch_sizes import BatchSizes
from .checks import vocab_size
from .decoding import generate


def warmup(model, draft_model=None, *, prompt_lengths=(32, 20), max_new_tokens=64, seed=0, batch_sizes=(),
           **options):
    """Run stree.generate(model, prompt, draft_model=draft_model, max_new_tokens=max_new_tokens, **options) on
    random prompts of each of `prompt_lengths` (token ids drawn with `seed`; the outputs are dropped). options: any
    of generate's (compile, tree, temperature, top_k, top_p, generator, draft_on_device, ...): those the real calls
    will use (with a seeded generator sampled trees keep a fixed shape, without one they are adaptive: other
    passes, other compilations).

    batch_sizes: for batched calls (stree.batch.Batch, generate on a batch), the widest batches they will decode,
    e.g. (16,): then the calls are batched instead, one on random prompts (lengths from prompt_lengths, in turn)
    for every power of two up to each, the sizes a compiled Batch pads its rows to, so that rows joining and
    leaving meet compiled passes only.
    Returns the seconds each call took (the first pays the compilation and the calibration, the later ones show
    the steady cost)."""
    if not prompt_lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in prompt_lengths):
        raise ValueError(f"prompt_lengths must be positive ints, got {prompt_lengths!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in batch_sizes):
        raise ValueError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
    options.setdefault("eos_token_id", [])  # the whole length, whatever the random prompt makes likely
    g = torch.Generator().manual_seed(seed)
    rows = sorted({1 << k for n in batch_sizes for k in range(BatchSizes.size(n).bit_length())})
    calls = [[prompt_lengths[i % len(prompt_lengths)] for i in range(n)] for n in rows] or [
        [length] for length in prompt_lengths]
    seconds = []
    for lengths in calls:
        prompts = [torch.randint(0, vocab_size(model), (length,), generator=g).to(model.device) for length in lengths]
        started = time.perf_counter()
        generate(model, prompts if batch_sizes else prompts[0][None], draft_model=draft_model,
                 max_new_tokens=max_new_tokens, **options)
        seconds.append(time.perf_counter() - started)
    return seconds
