"""RoundCosts: the model DynamicTree(adaptive=True) sizes each round with, and the decisions made from it.

It holds three parts, each updated from every round: PassTimes (what passes cost), Acceptance (how likely drafted
nodes are accepted) and Pacing (whether a round drafts at all). A caller may hold one and pass it to
stree.generate(costs=...) (a benchmark can freeze its timings by passing a PassTimes subclass whose update does
nothing); otherwise stree keeps one per target model and setting (kept_costs), weakly, so that it dies with the
model.
"""
import itertools
import time
import weakref
from dataclasses import dataclass, field

from .acceptance import Acceptance
from .pacing import Pacing
from .timing import PassTimes

_KEPT = weakref.WeakKeyDictionary()  # target model -> {setting: RoundCosts}


def kept_costs(model):
    """The RoundCosts stree keeps for `model` across generate() calls, {setting: RoundCosts} (setting: the draft,
    tree, compile, dtype, greedy or sampled, and where greedy trees are grown). Clear it to measure afresh."""
    return _KEPT.setdefault(model, {})


@dataclass
class RoundCosts:
    """times: PassTimes; acceptance: Acceptance; pacing: Pacing (see their modules)."""
    times: PassTimes = field(default_factory=PassTimes)
    acceptance: Acceptance = field(default_factory=Acceptance)
    pacing: Pacing = field(default_factory=Pacing)

    @property
    def known(self):
        return self.times.known

    def best_rate(self, probs, passes):
        """(expected tokens per second, nodes kept) of the best tree made of the most probable of `probs` (node
        estimates below the root, sorted descending): keep k nodes for the k that maximises
        (1 + calibration·sum of the first k) / round_time(passes, 1 + k)."""
        times, calibration = self.times.target_times(1 + len(probs)), self.acceptance.calibration
        best, expected = (1.0 / self.times.round_with(passes, times[0]), 0), 1.0
        for k, p in enumerate(probs, 1):
            expected += calibration * p
            rate = expected / self.times.round_with(passes, times[k])
            if rate > best[0]:
                best = (rate, k)
        return best

    def observe(self, context, drafted, accepted, agreed, seconds):
        """Fold in one speculative round started in pacing `context`: the DraftedTree it verified, the accepted node
        ids below the root (root first), agreed (greedy: whether the target's argmax after each draft node's parent
        is its token, per node below the root; None when sampling), and seconds = (drafting, target pass, whole
        round)."""
        draft_s, verify_s, round_s = seconds
        nodes = len(drafted.target_tokens)
        modelled = self.times.round_time(drafted.passes, nodes)  # before this round's timings move it
        self.times.update(draft_s, drafted.passes, drafted.level_seconds, verify_s, nodes, round_s - draft_s - verify_s)
        self.acceptance.calibrate(len(accepted) - 1, drafted.expected)
        self.acceptance.note_levels(len(accepted) - 1, accepted[-1] in drafted.target_parents)
        if agreed is not None:
            draft_q = drafted.draft_q[drafted.root + 1:]
            self.acceptance.note_agreement(list(zip(draft_q, agreed)))
        self.pacing.note_round(context, len(accepted), round_s, modelled)


def levels_that_pay(costs, spec, estimates, root, expand, ratios, passes, most=1):
    """How many more levels (at most `most`) raise the round's expected tokens per second, each in turn
    (DynamicTree.adaptive).

    estimates: {node: estimated chance of acceptance} below the root. The next level's nodes would be the children
    of `expand`: child j of a node of estimate p is estimated at p times the mean estimate of the j-th child at the
    last level given its parent (`ratios`); a level after that, the children of the `frontier` likeliest of those,
    at p times the mean over earlier rounds' levels (Acceptance.rank_agreement, where known and of the same top_k).
    A level pays when the best tree of the nodes so far and its estimated children (best_rate: the likeliest
    nodes, as many as pay for their share of the target pass), one draft pass dearer, promises more than the best
    tree without them."""
    probs = sorted((p for n, p in estimates.items() if n != root), reverse=True)[:spec.budget]
    frontier = [estimates.get(n, 1.0) for n in expand]
    ranks = costs.acceptance.rank_agreement
    for levels in range(most):
        if levels and ranks is not None and len(ranks) == len(ratios):
            ratios = ranks
        estimated = sorted((p * r for p in frontier for r in ratios), reverse=True)
        grown = sorted(probs + estimated, reverse=True)[:spec.budget]
        if costs.best_rate(grown, passes + levels + 1)[0] <= costs.best_rate(probs, passes + levels)[0]:
            return levels
        probs, frontier = grown, estimated[:spec.frontier]
    return most


def calibrate(costs, target, draft, target_nodes, draft_rows, token):
    """Start the cost model's timings: target passes of 1, 2, 4, 8 and `target_nodes` nodes (those up to
    target_nodes: PassTimes.verify_curve), a draft pass of `draft_rows` nodes (a level's expanded nodes) and a plain
    step (a one-node target pass carrying the last commit, here an empty one), each the faster of two runs; both
    TreeModels' states are left unchanged. Compiled, this also compiles the one-node passes that paced rounds take.
    Returns costs."""
    def seconds(model, n, carrying=False, **kwargs):
        best = float("inf")
        for _ in range(2):
            if carrying:
                model.tree_forward([[token]], [[-1]])
                model.commit([-1])
            start = time.perf_counter()
            out = model.tree_forward([[token] * n], [[-1] * n], **kwargs)
            (out[0] if isinstance(out, tuple) else out)[0, 0].tolist()  # (logits, hidden) from a head's target
            model.discard()
            best = min(best, time.perf_counter() - start)
        return best

    sizes = sorted({n for n in (1, 2, 4, 8, target_nodes) if n <= target_nodes})
    # a larger pass never costs less: a running maximum irons out timing noise
    times = list(itertools.accumulate((seconds(target, n) for n in sizes), max))
    costs.times.verify = times[0]
    costs.times.verify_curve = tuple((n, t - times[0]) for n, t in zip(sizes, times))  # one size: flat
    costs.times.draft = seconds(draft, draft_rows)
    costs.pacing.step = seconds(target, 1, carrying=True)
    return costs
