"""Acceptance: how likely the target is to accept a drafted node, as measured on the verified trees.

Greedy, a child is accepted when the target's argmax after its parent is its token; `agreement(q)` maps the draft's
probability q of that token to how often that has happened, by bins of q. The draft's own probability
underestimates it wherever the draft is not sure (on the bundled pair, held-out prompts: q 0.05-0.1 chosen 20% of
the time, 0.3-0.4 69%), and a path compounds the gap (depth-5 nodes were accepted 3.9x as often as their path
probability said, depth-1 nodes 1.8x), which no single factor fixes. A greedy node's estimate is the product of
agreement(q) along its path.

Sampled, a drawn token's probability says how likely it was drawn, not how likely it is accepted (with a draft equal
to the target every first child is), so a sampled child is estimated at its parent's estimate times level_accept
(the measured share of verification steps at which a child of the last accepted node was accepted), split among
its siblings in proportion to their draft probabilities.

`calibration` (tokens the target accepted / tokens the estimates expected, per round) scales every estimate.
"""
import bisect
from dataclasses import dataclass, field

# Bins' lower edges: tenths, the lowest split in three (40% of verified nodes have q < 0.1 on the bundled pair,
# chosen 7% of the time below 0.05 and 20% at 0.05-0.1).
AGREE_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class Acceptance:
    """The measured acceptance the adaptive tree estimates nodes with (see the module docstring)."""
    calibration: float = 1.0
    level_hits: float = 1.0   # decayed counts behind level_accept (prior: one hit in two tries)
    level_tries: float = 2.0
    # decayed counts behind agreement(q), per bin of q: greedy children the target chose, children verified
    agree_hits: list = field(default_factory=lambda: [0.0] * len(AGREE_EDGES))
    agree_tries: list = field(default_factory=lambda: [0.0] * len(AGREE_EDGES))
    rank_agreement: list = None  # (k,) decayed mean agreement of greedy levels' j-th children (note_ranks)

    AGREE_EDGES = AGREE_EDGES
    AGREE_PRIOR = 2.0         # tries' worth of the draft's own probability in every bin
    AGREE_MEMORY = 0.99       # weight of the counts so far when a round's nodes come in
    LEVEL_MEMORY = 0.95       # weight of the level counts so far when a verification comes in
    CALIBRATION_MIX = 0.2     # weight of a round's accepted / expected ratio in the calibration
    # Weight of the mean so far when a greedy level's per-rank agreement comes in. What the last level's children say
    # of the next level's holds less the further ahead: a tree grown on the device decides every level from the
    # root's children, and extrapolated from those alone it drafted 2.59 levels a round for the host's 1.87 at the
    # same tau (the bundled pair, fp32). The root level counts as any other.
    RANK_MEMORY = 0.9

    @property
    def level_accept(self):
        return self.level_hits / self.level_tries

    def note_levels(self, accepted, stopped):
        """Fold in one verification: `accepted` draft tokens, and whether it then stopped at a node that had
        children (all rejected) rather than at a leaf."""
        self.level_hits = self.LEVEL_MEMORY * self.level_hits + accepted
        self.level_tries = self.LEVEL_MEMORY * self.level_tries + accepted + bool(stopped)

    def _bin(self, q):
        return max(bisect.bisect_right(self.AGREE_EDGES, q) - 1, 0)

    def agreement(self, q):
        """The estimated chance that the target's greedy choice after a node is its child of draft probability q:
        the child's bin's measured share, shrunk towards q itself (AGREE_PRIOR tries' worth; q with no counts)."""
        b = self._bin(q)
        return (self.AGREE_PRIOR * q + self.agree_hits[b]) / (self.AGREE_PRIOR + self.agree_tries[b])

    def note_agreement(self, verified):
        """Fold in one greedy verification: (q, agreed) per verified draft node, q its draft probability given its
        parent, agreed whether the target's argmax after its parent is its token (whether or not the parent was
        accepted). A round that verified no draft node still fades the counts towards q, so that the table does not
        freeze once trees stop keeping nodes."""
        self.agree_hits = [self.AGREE_MEMORY * h for h in self.agree_hits]
        self.agree_tries = [self.AGREE_MEMORY * t for t in self.agree_tries]
        for q, agreed in verified:
            b = self._bin(q)
            self.agree_hits[b] += bool(agreed)
            self.agree_tries[b] += 1.0

    def note_ranks(self, ratios):
        """Fold in one greedy level's mean agreement per child rank (ratios: (k,) floats)."""
        if self.rank_agreement is None or len(self.rank_agreement) != len(ratios):
            self.rank_agreement = list(ratios)
        else:
            self.rank_agreement = [self.RANK_MEMORY * a + (1.0 - self.RANK_MEMORY) * r
                                   for a, r in zip(self.rank_agreement, ratios)]

    def calibrate(self, accepted, expected):
        """Fold in one round's draft tokens accepted against the estimates' expectation for the tree it sent."""
        ratio = (accepted + 0.5) / (expected + 0.5)
        self.calibration = min(2.0, max(0.1, self.calibration + self.CALIBRATION_MIX * (ratio - self.calibration)))
