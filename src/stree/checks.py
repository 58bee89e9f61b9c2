"""Checks of token ids shared by every entry point (generate, the drop-in, TreeModel, search, distill): ids outside
the vocabulary would otherwise reach an embedding and fail there with an IndexError that names neither."""
import numpy as np
import torch


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
