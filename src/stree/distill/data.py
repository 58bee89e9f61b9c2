"""Training data for drafts: text files, token files, and the target's own continuations of prompts.

Every dataset yields dicts with input_ids (L,), labels (L,) (the next token at each position) and mask (L,)
(positions that count in the loss).
"""
import glob
import os
import sysconfig

import torch
from torch.utils.data import Dataset

from ..checks import check_float, check_ids, check_int, vocab_size


def python_stdlib_files():
    """The Python standard library's own .py sources (tests and site-packages excluded), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    skip = (os.sep + "site-packages" + os.sep, os.sep + "test" + os.sep, os.sep + "tests" + os.sep,
            os.sep + "idle_test" + os.sep)
    return sorted(f for f in files if not any(s in f for s in skip))


def stdlib_split(every=20):
    """(training files, held-out files) of python_stdlib_files(): every `every`-th file is held out."""
    files = python_stdlib_files()
    return [f for i, f in enumerate(files) if i % every], [f for i, f in enumerate(files) if i % every == 0]


def random_windows(tokens, count, length, generator=None):
    """(count, length) int64: windows of a 1-D token stream at random offsets."""
    check_int("count", count, 1)
    check_int("length", length, 1)
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    if tokens.numel() < length:
        raise ValueError(f"a stream of {tokens.numel()} tokens has no window of {length}")
    starts = torch.randint(0, tokens.numel() - length + 1, (count,), generator=generator)
    return torch.stack([tokens[s:s + length] for s in starts.tolist()])


def text_files(paths, suffixes=(".txt", ".py", ".md")):
    """Files named in paths, and files with one of `suffixes` under the folders named there, sorted."""
    found = []
    for path in paths:
        if os.path.isdir(path):
            found += [f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                      if f.endswith(tuple(suffixes)) and os.path.isfile(f)]
        elif os.path.isfile(path):
            found.append(path)
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    return sorted(found)


def tokenize_files(files, tokenizer, separator_id=None):
    """One long 1-D int64 tensor: each file's tokens, files separated by separator_id (default: the EOS id)."""
    separator_id = tokenizer.eos_token_id if separator_id is None else separator_id
    pieces = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        pieces.append(torch.tensor(ids + ([separator_id] if separator_id is not None else []), dtype=torch.long))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def load_tokens(path):
    """A 1-D token tensor saved with torch.save (.pt) or numpy (.npy)."""
    if path.endswith(".npy"):
        import numpy as np
        return torch.from_numpy(np.load(path)).long().flatten()
    return torch.load(path).long().flatten()


class TokenChunks(Dataset):
    """Non-overlapping windows of a token stream: input_ids = stream[s:s+L], labels = stream[s+1:s+L+1]."""

    def __init__(self, tokens, length):
        check_int("length", length, 1)
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        if tokens.dim() != 1 or tokens.numel() < length + 1:
            raise ValueError(f"need a 1-D stream of at least {length + 1} tokens, got shape {tuple(tokens.shape)}")
        self.tokens, self.length = tokens, length

    def __len__(self):
        return (self.tokens.numel() - 1) // self.length

    def __getitem__(self, i):
        window = self.tokens[i * self.length: (i + 1) * self.length + 1]
        return dict(input_ids=window[:-1], labels=window[1:], mask=torch.ones(self.length, dtype=torch.bool))


class Continuations(Dataset):
    """Prompts followed by the target's own continuation; only the continuation's predictions count.

    sequences: list of 1-D tensors (prompt + continuation), all of the same length; prompt_length: tokens of
    prompt at the start of each (at least 1, fewer than the sequences' length).
    """

    def __init__(self, sequences, prompt_length):
        lengths = sorted({seq.numel() for seq in sequences})
        if len(lengths) > 1:
            raise ValueError(f"sequences must all have the same length, got lengths {lengths}")
        check_int("prompt_length", prompt_length, 1)
        if lengths and prompt_length >= lengths[0]:
            raise ValueError(f"prompt_length {prompt_length} leaves no continuation in sequences of {lengths[0]} "
                             f"tokens")
        self.sequences, self.prompt_length = sequences, prompt_length

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        seq = self.sequences[i]
        mask = torch.arange(seq.numel() - 1) >= self.prompt_length - 1
        return dict(input_ids=seq[:-1], labels=seq[1:], mask=mask)


@torch.no_grad()
def target_continuations(target, prompts, max_new_tokens, temperature=1.0, top_p=None, batch_size=16):
    """What the draft will have to predict: the target continues each prompt (sampled at `temperature`, greedy
    at 0). prompts: (n, P) int64. Returns a Continuations dataset of n sequences of P + max_new_tokens tokens."""
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or 0 in prompts.shape:
        raise ValueError(f"prompts must be a non-empty (n, P) tensor of token ids, got "
                         f"{tuple(prompts.shape) if isinstance(prompts, torch.Tensor) else type(prompts).__name__}")
    check_ids("prompts", prompts, vocab_size(target))
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("batch_size", batch_size, 1)
    check_float("temperature", temperature, 0.0, strict=False)
    if top_p is not None:
        check_float("top_p", top_p, 0.0, strict=True)
        if top_p > 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    target.eval()
    sequences = []
    for start in range(0, prompts.shape[0], batch_size):
        batch = prompts[start:start + batch_size].to(target.device)
        kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=None) if temperature > 0 else dict(
            do_sample=False)
        out = target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, **kwargs)
        sequences += list(out.cpu())
    return Continuations(sequences, prompts.shape[1])
