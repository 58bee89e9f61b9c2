"""GenerationStats: what one stree.generate() call did and where its time went."""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """Counters of one generate() call. Times in seconds (on CUDA each timed phase ends with a synchronize, which
    only happens when stats are returned)."""
    new_tokens: int = 0
    target_passes: int = 0          # verification passes (autoregressive: decode steps); the prefill is not counted
    draft_passes: int = 0           # draft tree passes (the prefill is not counted)
    tokens_per_pass: list = field(default_factory=list)  # per verification: accepted drafts + bonus, as emitted
    tree_sizes: list = field(default_factory=list)       # nodes per verified tree, root included
    transfers: int = 0              # device-to-host copies in the decoding loop (drafting, verification)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    total_time: float = 0.0

    @property
    def tau(self):
        """Mean tokens emitted per target verification pass (STree's and Medusa's tau)."""
        return sum(self.tokens_per_pass) / max(len(self.tokens_per_pass), 1)

    @property
    def rounds(self):
        return len(self.tokens_per_pass)

    def breakdown(self):
        """Milliseconds per round: draft / verify / commit / other (emission, bookkeeping), and transfers."""
        rounds = max(self.rounds, 1)
        decode = self.total_time - self.prefill_time
        other = decode - self.draft_time - self.verify_time - self.commit_time
        return {"draft_ms": 1e3 * self.draft_time / rounds, "verify_ms": 1e3 * self.verify_time / rounds,
                "commit_ms": 1e3 * self.commit_time / rounds, "other_ms": 1e3 * other / rounds,
                "transfers": self.transfers / rounds}


class Clock:
    """Adds phase durations to a GenerationStats; synchronizes CUDA around a phase only when `sync`."""

    def __init__(self, stats, device, sync):
        self.stats, self.sync = stats, sync and device.type == "cuda"

    @contextmanager
    def __call__(self, name):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - start)
