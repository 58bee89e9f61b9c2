"""BatchSizes: how large a batched round's trees are, chosen by the throughput measured at the batch's size.

At batch B a target pass over trees of n nodes runs B * n rows, so the size that pays shrinks as B grows (on a CPU a
16-node tree at B = 16 is a 256-row pass) and at some B no tree pays: a plain decoding step is then the fastest round.
The batch-1 cost model (RoundCosts) prices single passes; here the round as a whole is measured instead. The arms are
a plain step, chains of one and two drafts, and dynamic trees from small to the spec's own; an arm's rate is its tau
(tokens a row, over all its rounds) over its seconds a round at the batch's size (rounded up to a power of two):
the median of its last three measured rounds there. A new size starts from the arm whose target pass has as many
rows (batch x nodes) as the fastest arm's at the nearest size measured (with nothing measured: the spec's tree for
one row, a plain step for more); its neighbours and the plain step are tried next, and again from time to time (more
rarely while the fastest stays the same), so the choice climbs to the fastest arm and follows it when it changes
(rows leaving, longer contexts, a busier machine). What those tries cost beyond the fastest arm's rate is kept under
a share of all the time observed (`budget`): a try can cost several rounds (the first tree after plain steps
prefills the draft with every row), and where plain steps are fastest such tries would cost more than they find.
A tree that displaced the plain step by a narrow margin is checked against it again within `explore` rounds, since
a few plain rounds the machine slowed are enough for that (RECHECK).
"""
import dataclasses
import statistics

from ..shapes import StaticTree, tree_shapes

# The arms below the spec's own tree: chains of 1 and 2 drafts, then dynamic trees of these budgets (with the spec's
# depth). On the 0.9B target at B = 4 (bf16, AVX-512 CPU: 4 rows 96 ms a pass, 12 rows 138, 20 about 150, 28 about
# 190) a 4-draft DynamicTree (tau 2.55) beat chain-2 (1.94), chain-3 (2.16) and 6-draft trees (2.6-2.7).
CHAINS = ((1,), (1, 1))
# A tree that displaced the plain step by less than this factor of its rate is checked against it again soon: on 2
# shared cores three plain steps in a row took 1.3-1.6x their usual time (bundled pair, B = 16: 13-18 ms against
# 11), and a tree chosen on them cost 15% of the call until the next exploration.
RECHECK = 1.5
SMALLER = (4, 6, 10)


class BatchSizes:
    """arms: None (a plain step), chains of 1 and 2 drafts, then DynamicTrees from small to `spec` itself (fixed:
    not adaptive), in growing node count."""

    def __init__(self, spec, explore=8, samples=3, tau_weight=0.1, budget=0.03):
        full = dataclasses.replace(spec, adaptive=False)
        self.arms = [None] + [StaticTree(chain) for chain in CHAINS] + [
            dataclasses.replace(full, budget=drafts) for drafts in SMALLER if spec.top_k <= drafts < spec.budget]
        self.arms.append(full)
        self.nodes = [1] + [tree_shapes(arm)[0] for arm in self.arms[1:]]  # a row's nodes in the target pass
        self.explore, self.samples, self.tau_weight, self.budget = explore, samples, tau_weight, budget
        self.tau = {}      # arm -> tokens a row produced in a round, a moving average over all the arm's rounds
        self.seconds = {}  # (size, arm) -> the seconds of its last `samples` measured rounds, oldest first
        self.rounds = {}  # size -> rounds decided at that size
        self.schedule = {}  # size -> (rounds between explorations, the round of the next, the fastest then)
        self.leader = {}    # size -> the fastest arm when last chosen
        self.recheck = {}   # size -> the round at which the plain step, narrowly displaced by a tree, is tried again
        self.explored = {}  # size -> explorations so far
        self.last = None    # (size, arm) of the last round observed; None: the rows changed since
        self.again = None   # (size, arm, rounds) that runs `rounds` more: its last round was a switch, not measured
        self.elapsed = 0.0  # seconds of every round observed
        self.regret = 0.0   # seconds of rounds of other arms than the fastest, beyond what it would have taken

    @staticmethod
    def size(rows):
        """The batch size `rows` rounded up to a power of two: seconds are kept per such size."""
        return 1 << max(rows - 1, 0).bit_length()

    def choose(self, rows):
        """The arm (an index into arms) for a round of `rows` rows: the fastest measured at this size (at first,
        _start's); now and then a neighbour of it or the plain step instead (those not measured at this size
        first), so that the choice climbs to the fastest arm and follows it when it changes: after `explore`
        rounds, then twice as many each time the fastest stayed the same (up to 4 x explore), back to `explore` when
        it changed, and only while the tries so far cost at most `budget` of the time observed (observe: where tries
        cost much, the choice follows a change more slowly). An arm switched to runs samples (3) rounds: the first
        is not measured (observe), the other two outvote one stray round in the median."""
        size = self.size(rows)
        if self.again is not None and self.again[0] == size:
            _, arm, left = self.again
            self.again = (size, arm, left - 1) if left > 1 else None
            return arm
        count = self.rounds[size] = self.rounds.get(size, 0) + 1
        best = self._fastest(size)
        if best is None:
            return self._start(size)
        if self.leader.get(size) == 0 and best != 0 and self.rate(size, best) < RECHECK * self.rate(size, 0):
            self.recheck[size] = count + self.explore  # by a margin a slowed machine can make
        self.leader[size] = best
        # the plain step too: it drafts nothing, so its rate need not continue the trees' slope
        others = sorted({arm for arm in (0, best - 1, best + 1) if 0 <= arm < len(self.arms)} - {best})
        untried = [arm for arm in others if (size, arm) not in self.seconds]
        if untried:
            return untried[0]
        if self.recheck.get(size, count + 1) <= count:  # not held to the budget: near the tree's rate it costs little
            del self.recheck[size]
            if best != 0:
                return 0
        interval, due, last_best = self.schedule.get(size, (self.explore, self.explore, best))
        if count >= due and self.regret <= self.budget * self.elapsed:
            # explore; less often while the fastest stays the same (at most every 4 x explore)
            interval = min(2 * interval, 4 * self.explore) if best == last_best else self.explore
            self.schedule[size] = (interval, count + interval, best)
            self.explored[size] = self.explored.get(size, 0) + 1
            return others[self.explored[size] % len(others)]
        return best

    def _start(self, size):
        """The arm a size starts from, before anything is measured at it: the one whose target pass has about as
        many rows as the fastest arm's at the nearest size measured (a pass costs by its rows, batch x nodes: four
        rows' chain-2 is one row's 10-draft tree), else the spec's own tree for one row and a plain step for more."""
        measured = {s for s, _ in self.seconds}
        if not measured:
            return len(self.arms) - 1 if size == 1 else 0
        known = min(measured, key=lambda s: (abs(s.bit_length() - size.bit_length()), s))
        rows = known * self.nodes[self._fastest(known)]
        return max(arm for arm in range(len(self.arms)) if arm == 0 or size * self.nodes[arm] <= rows)

    def rate(self, size, arm):
        """An arm's tokens per row and second at `size`: its tau over the median of its last measured rounds there."""
        return self.tau[arm] / statistics.median(self.seconds[size, arm])

    def _fastest(self, size):
        """The fastest arm measured at `size`; None if none is."""
        measured = [arm for arm in range(len(self.arms)) if (size, arm) in self.seconds]
        return max(measured, key=lambda arm: self.rate(size, arm)) if measured else None

    def observe(self, rows, arm, tokens, seconds):
        """A round of `rows` rows with arm `arm` produced `tokens` tokens in `seconds`.

        The tokens feed the arm's tau, averaged over all its rounds (a round's count swings with its rows' texts far
        more than its time does). The seconds of a round that switched arm or batch size, or came after rows joined
        or left (rows_changed), are not kept: it pays one-off costs (node buffers resized, the draft catching up
        with plain steps' tokens, states copied) that the arm does not pay round after round; that arm runs
        samples - 1 more rounds instead (choose). An arm's seconds are the median of its last `samples` measured
        rounds: recent ones (not from when the machine was busier or contexts shorter), and a single round slowed
        by the machine cannot make the fastest arm look slower than the next (on 2 shared cores plain steps of 9 ms
        took 11-15 ms now and then, and one such round set plain steps' seconds until the next exploration). A
        round of another arm than the fastest adds what it took beyond the fastest arm's rate to the tries' cost,
        which choose keeps within `budget` of all the seconds observed."""
        per_row, old = tokens / rows, self.tau.get(arm)
        size = self.size(rows)
        key, best = (size, arm), self._fastest(size)
        self.elapsed += seconds
        if best is not None and arm != best:
            self.regret += max(0.0, seconds - per_row / self.rate(size, best))
        self.tau[arm] = per_row if old is None else (1 - self.tau_weight) * old + self.tau_weight * per_row
        if key != self.last:
            self.last = key
            self.again = (*key, self.samples - 1)
            return
        self.seconds[key] = (self.seconds.get(key, []) + [seconds])[-self.samples:]

    def rows_changed(self):
        """Rows joined or left the batch: the next round is not measured (see observe)."""
        self.last = None
