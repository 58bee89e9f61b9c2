"""Verification requests queued and scored in batches (SpecScale's lazy verification).

A request waits until the queue is due: its tokens reach `flush_tokens`, one request has waited `max_deferrals`
decode steps, with `sibling_completion` every sibling of a waiting request has finished its step (no candidate of
its family, e.g. the children of one parent, is still decoding: SpecScale's sibling-completion rule), or the decoder
is idle (nothing else can make progress). Then everything waiting is scored, in verifier batches of up to
`flush_tokens` tokens. max_deferrals=0 scores every request as soon as it arrives
(eager); flush_tokens=None and max_deferrals=None score only when the decoder is idle (synchronous search: a
level's requests in one batch).
"""
from .verifiers import score_batch


class VerificationQueue:
    def __init__(self, verifier, prompt, *, flush_tokens=None, max_deferrals=0, sibling_completion=False):
        if flush_tokens is not None and flush_tokens < 1:
            raise ValueError(f"flush_tokens must be >= 1 or None, got {flush_tokens}")
        if max_deferrals is not None and max_deferrals < 0:
            raise ValueError(f"max_deferrals must be >= 0 or None, got {max_deferrals}")
        self.verifier, self.prompt = verifier, list(prompt)
        self.flush_tokens, self.max_deferrals = flush_tokens, max_deferrals
        self.sibling_completion = sibling_completion
        self.waiting = []     # [item, steps, tokens, deferrals, family]
        self.calls = 0        # requests scored
        self.batches = 0      # verifier invocations (batch calls, or single calls for a plain callable)

    def __len__(self):
        return len(self.waiting)

    def items(self):
        """The items waiting, in submission order."""
        return [w[0] for w in self.waiting]

    def submit(self, item, steps, family=None):
        """Queue `item` (anything; returned with its score) whose trajectory's steps are `steps`; `family` (hashable,
        e.g. the parent) names its siblings for the sibling-completion rule."""
        self.waiting.append([item, steps, len(self.prompt) + sum(len(s) for s in steps), 0, family])

    def drop(self, doomed):
        """Forget the requests whose item satisfies doomed(item)."""
        self.waiting = [w for w in self.waiting if not doomed(w[0])]

    def defer(self):
        """One decode step passed while the requests waited."""
        for w in self.waiting:
            w[3] += 1

    def due(self, idle, decoding=()):
        """Whether to flush now. idle: nothing is decoding; decoding: the families with a candidate still decoding."""
        if not self.waiting:
            return False
        if idle:
            return True
        if self.flush_tokens is not None and sum(w[2] for w in self.waiting) >= self.flush_tokens:
            return True
        if self.sibling_completion and any(w[4] not in decoding for w in self.waiting):
            return True
        return self.max_deferrals is not None and max(w[3] for w in self.waiting) >= self.max_deferrals

    def flush(self):
        """Score everything waiting; returns [(item, score)] in submission order."""
        scored, chunk, tokens = [], [], 0
        for w in self.waiting + [None]:
            if chunk and (w is None or (self.flush_tokens is not None and tokens + w[2] > self.flush_tokens)):
                scores = score_batch(self.verifier, self.prompt, [c[1] for c in chunk])
                scored += [(c[0], s) for c, s in zip(chunk, scores)]
                self.calls += len(chunk)
                self.batches += 1 if hasattr(self.verifier, "batch") else len(chunk)
                chunk, tokens = [], 0
            if w is not None:
                chunk.append(w)
                tokens += w[2]
        self.waiting = []
        return scored
