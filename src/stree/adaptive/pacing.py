"""Pacing: whether a round drafts at all, or is one plain decoding step of the target.

Acceptance runs in streaks (after a round that accepted no draft token the next one often accepts none either), so a
speculative round's yield is tracked per context: (whether the last speculative round accepted a draft token, plain
steps taken since). A round speculates unless its context's expected tokens per second fall below a plain step's.
A context's expectation is its own rounds' figures shrunk towards those of all rounds (PRIOR rounds' worth), so a
context seen a few times is judged mostly by the pooled figures; each plain step taken instead fades its own
evidence (FADE), so a context once found wanting is tried again after a while.
"""
from dataclasses import dataclass, field

from .timing import bounded


@dataclass
class Pacing:
    """step: seconds of a plain decoding step (0 = not measured yet); paced: round context (None: every round) ->
    [weight, weighted tokens, weighted seconds] of its speculative rounds."""
    step: float = 0.0
    paced: dict = field(default_factory=dict)
    decay: float = 0.8  # weight of the step estimate so far when a step is timed

    MEMORY = 0.95  # weight of a context's past rounds when a new one comes in
    PRIOR = 2.0
    FADE = 0.9

    def speculates(self, context):
        """Whether a round in `context` should draft (else: one plain decoding step of the target)."""
        pooled = self.paced.get(None)
        if pooled is None or self.step <= 0.0:
            return True
        _, tokens, seconds = self.paced.get(context, (0.0, 0.0, 0.0))
        prior = self.PRIOR / pooled[0]
        tokens, seconds = tokens + prior * pooled[1], seconds + prior * pooled[2]
        return tokens * self.step >= seconds

    def note_round(self, context, tokens, seconds, estimate=0.0):
        """Fold in a speculative round started in `context` that emitted `tokens` in `seconds`; estimate: the cost
        model's seconds for it (before this round updates the model). The sample is capped at twice the larger of
        the estimate and the pooled mean of earlier rounds (either where the other is missing): a compiled
        generate's first rounds compile (seconds each: 1.3 s and 5.4 s on the bundled pair) and come before any
        pooled figure; uncapped, they made every context look dear for the rest of the call. The pooled mean keeps
        a model that underestimates rounds (its fixed parts start at 0) from capping real seconds."""
        pooled = self.paced.get(None)
        reference = max(estimate, pooled[2] / pooled[0] if pooled is not None else 0.0)
        if reference > 0.0:
            seconds = bounded(seconds, reference)
        for key in (context, None):
            seen = self.paced.setdefault(key, [0.0, 0.0, 0.0])
            for i, value in enumerate((1.0, tokens, seconds)):
                seen[i] = self.MEMORY * seen[i] + value

    def note_step(self, context, seconds):
        """Fold in a plain decoding step of `seconds` taken in `context`."""
        self.step = seconds if self.step <= 0.0 else self.step + (1.0 - self.decay) * (
            bounded(seconds, self.step) - self.step)
        if context in self.paced:
            self.paced[context] = [self.FADE * v for v in self.paced[context]]
