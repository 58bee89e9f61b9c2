"""PassTimes: what a round costs, in seconds, as the adaptive tree prices candidate trees.

A round is: the draft's passes (a pass per level, plus a fixed part: the first pass also feeds the trunk and applies
the last commit's device part), one target pass over the tree, and the rest (commit, bookkeeping). The target pass
costs `verify` at one node plus a measured curve over the node count: far from linear where a 2-row matrix product
already costs ~2x a 1-row one (CPUs without bf16 / AMX units), nearly flat on a GPU.
"""
from dataclasses import dataclass


def bounded(seconds, estimate):
    """A timing sample capped at twice the current estimate (if any): a one-off stall (a compilation, the OS)
    must not steer the cost model for dozens of rounds, while real drifts still come through, doubled at most
    per sample."""
    return min(seconds, 2.0 * estimate) if estimate > 0.0 else seconds


@dataclass
class PassTimes:
    """Seconds of: a draft pass (`draft`, a level's: timed from the first level's arrival on the host to the
    last's), a round's drafting beyond its passes (`draft_round`), a target pass of n nodes (target_time: verify +
    verify_node·n, or verify + the measured verify_curve at n) and the rest of a round (`other`). Measured once at
    the start (stree.adaptive.calibrate) and updated every round, each sample weighing 1 - decay."""
    draft: float = 0.0
    draft_round: float = 0.0
    verify: float = 0.0
    verify_node: float = 0.0
    other: float = 0.0
    # ((nodes, seconds over `verify`), ...) at ascending sizes; () = linear in verify_node
    verify_curve: tuple = ()
    decay: float = 0.8

    @property
    def known(self):
        """Whether a draft pass has been timed (the adaptive tree decides nothing before)."""
        return self.draft > 0.0

    def target_times(self, most):
        """Seconds of a target pass of 1, 2, ..., `most` nodes: piecewise linear between the verify_curve's sizes
        (the first segment's slope below them, the last's beyond), or verify + verify_node·nodes with fewer than
        two measured sizes. (One walk over the curve: pricing trees needs every size, several times a round.)"""
        curve = self.verify_curve
        if len(curve) < 2:
            return [self.verify + self.verify_node * n for n in range(1, most + 1)]
        times, segment = [], 0
        for n in range(1, most + 1):
            while segment + 2 < len(curve) and n > curve[segment + 1][0]:
                segment += 1
            (n0, s0), (n1, s1) = curve[segment], curve[segment + 1]
            times.append(self.verify + s0 + (s1 - s0) * (n - n0) / (n1 - n0))
        return times

    def target_time(self, nodes):
        """Seconds of a target pass of `nodes` >= 1 nodes (target_times)."""
        return self.target_times(nodes)[-1]

    def round_time(self, passes, nodes):
        """Seconds of a round of `passes` draft passes verifying `nodes` nodes (root included)."""
        return self.round_with(passes, self.target_time(nodes))

    def round_with(self, passes, target):
        """Seconds of a round of `passes` draft passes whose target pass takes `target` seconds."""
        return self.draft_round + passes * self.draft + target + self.other

    def update(self, draft_seconds, passes, level_seconds, verify_seconds, nodes, other_seconds):
        """Fold in one round: its draft time over `passes` passes (level_seconds of it from the first level on the
        host to the last), its target pass over `nodes` nodes, and the rest."""
        mix = 1.0 - self.decay
        if passes > 1:
            level = level_seconds / (passes - 1)
        else:  # one pass alone cannot be split: still follow it, so that a dear first estimate comes down
            level = max(0.0, draft_seconds - self.draft_round)
        if passes:
            self.draft += mix * (bounded(level, self.draft) - self.draft)
            fixed = max(0.0, draft_seconds - passes * self.draft)
            # bounded by a pass's cost until it has an estimate of its own: a first round that compiles must not count
            self.draft_round += mix * (bounded(fixed, self.draft_round or self.draft) - self.draft_round)
        base = self.target_time(nodes)
        self.verify += mix * (bounded(verify_seconds, base) - base)  # drift goes to the base
        self.other += mix * (bounded(other_seconds, self.other) - self.other)
