"""Argument checks shared by every entry point (generate, the drop-in, TreeModel, search, distill, the CLI), each
raising ValueError naming the bad value. Token ids outside the vocabulary would otherwise reach an embedding and fail
there with an IndexError that names neither."""
import math
import numbers

import numpy as np
import torch


def is_number(value):
    """Whether value is a real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name, value, low):
    """value must be an int (numpy's included; not a bool) >= low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_float(name, value, low, *, strict):
    """value must be a finite real number > low (strict) or >= low."""
    if not (is_number(value) and math.isfinite(value)) or value < low or (strict and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}")


def check_ids(name, ids, vocab):
    """ids (an integer tensor) must hold token ids in [0, vocab)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    check_token_ids(name, ids, vocab)


def check_prompts(prompts, caller, vocab=None):
    """prompts (a sequence of 1-D integer tensors of token ids, lengths may differ) as a list, each non-empty and,
    given `vocab`, in [0, vocab); ValueError naming `caller` for an empty sequence."""
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"{caller} needs at least one prompt")
    for prompt in prompts:
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() == 0 or (
                prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool):
            raise ValueError("each prompt must be a non-empty 1-D integer tensor of token ids")
        if vocab is not None:
            check_token_ids("prompt", prompt, vocab)
    return prompts


def check_token_ids(name, ids, vocab, owner="the model's"):
    """Raise ValueError naming `name`, the first id outside 0..vocab-1 and the vocabulary's size, if any of `ids` (a
    tensor, a numpy array or a sequence of ints) is one."""
    if not isinstance(ids, torch.Tensor):
        ids = np.asarray(ids)
    if ids.size == 0 if isinstance(ids, np.ndarray) else ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside {owner} vocabulary of {vocab} ids (0..{vocab - 1})")


def vocab_size(model):
    """The vocabulary size of a causal LM or of its config (multimodal wrappers keep it in their text config)."""
    return getattr(model, "config", model).get_text_config().vocab_size
