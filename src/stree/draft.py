"""Drafting: grow a token tree from a draft model, one draft tree pass per level.

Three shapes, chosen by the `tree=` argument of generate():
  StaticTree((3, 2, 2, 1))  fixed children per depth (a plain tuple of ints means this);
  DynamicTree(budget, ...)  EAGLE-2 style: expand the most probable paths (joint draft probability), keep the
                            `budget` best nodes;
  BeamTree(beams, steps)    the draft's beam search, the surviving beams' paths merged into one tree (greedy only).
With sampling, a node's children are drawn from the draft's distribution one after another without replacement and
the number of children of a node never depends on the children drawn, which keeps verification lossless.
"""
import bisect
import functools
import itertools
import math
import operator
import time
from dataclasses import dataclass, field

import torch

from .models.host_tree import to_device
from .sampling import draw_without_replacement
from .tree import static_parents


@dataclass(frozen=True)
class StaticTree:
    branching: tuple

    def __post_init__(self):
        static_parents(self.branching)  # raises ValueError on a bad spec
        object.__setattr__(self, "branching", tuple(self.branching))


@dataclass(frozen=True)
class DynamicTree:
    """budget: draft nodes per tree (root excluded); depth: levels (at most); top_k: children per expanded node;
    frontier: nodes expanded per level, the most probable paths first.

    adaptive: decide each round's depth from measured costs (RoundCosts) instead of always drafting `depth`
    levels: another level is drafted only while its expected extra tokens per extra second beat the round's
    current expected tokens per second (expected tokens: the nodes' estimates, RoundCosts: greedy, how often the
    target has chosen children of the draft probabilities along the node's path; sampled, the measured level
    acceptance; calibrated by how many tokens the target actually accepted in earlier rounds).

    coverage (sampling only): an expanded node gets as many children, at most top_k, as its draft distribution's
    most probable tokens need to reach this share of its mass (a confident node one child, so the budget goes to
    depth); decided from the node's distribution before its children are drawn, which keeps verification
    lossless. 1.0: always top_k. The default 0.8 measured 1.32x the tokens/s of 1.0 on the bundled pair's target
    inflated to 0.9B (bf16, T=1, adaptive; README)."""
    budget: int = 16
    depth: int = 6
    top_k: int = 3
    frontier: int = 3
    adaptive: bool = False
    coverage: float = 0.8

    def __post_init__(self):
        _check_positive(self, ("budget", "depth", "top_k", "frontier"))
        if not 0.0 < self.coverage <= 1.0:
            raise ValueError(f"DynamicTree.coverage must be in (0, 1], got {self.coverage}")
        if self.budget < self.top_k:
            raise ValueError(f"DynamicTree.budget ({self.budget}) must be at least top_k ({self.top_k}): the root's "
                             "children alone take top_k nodes")


@dataclass(frozen=True)
class BeamTree:
    """The draft's beam search with `beams` beams over `steps` tokens; at most beams * steps nodes."""
    beams: int = 4
    steps: int = 4

    def __post_init__(self):
        _check_positive(self, ("beams", "steps"))


def _check_positive(spec, names):
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(spec).__name__}.{name} must be a positive int, got {value!r}")


def tree_spec(tree):
    """A StaticTree / DynamicTree / BeamTree from generate()'s `tree` argument (a branching tuple allowed)."""
    if isinstance(tree, (StaticTree, DynamicTree, BeamTree)):
        return tree
    if isinstance(tree, (str, bytes)) or not hasattr(tree, "__iter__"):
        raise ValueError(f"tree must be a sequence of positive ints (a static branching spec), a DynamicTree or a "
                         f"BeamTree, got {tree!r}")
    return StaticTree(tuple(tree))


def tree_shapes(spec, paced=False):
    """Upper bounds of what one round builds with `spec`, for fixed-shape passes:
    (target tree nodes, draft node slots, new draft nodes per pass). The draft is fed only the nodes it expands
    (_Growth.expand): its first pass the trunk, ending at the root, then each pass one level's expanded nodes.
    Every node of an accepted path but the last has a child on it, so it was expanded: at most one accepted node
    is not in the draft's cache, and the next trunk holds at most 2 tokens (that node and the bonus token).
    paced (adaptive rounds that may be plain steps, at most new-nodes-per-pass - 2 in a row): the trunk may hold
    as many as a pass's new nodes, which is then frontier * top_k."""
    if isinstance(spec, StaticTree):
        levels, width = [], 1
        for b in spec.branching:
            width *= b
            levels.append(width)
        grown, expanded = sum(levels), levels[:-1]
    elif isinstance(spec, DynamicTree):
        grown, expanded = spec.depth * spec.frontier * spec.top_k, [spec.frontier] * (spec.depth - 1)
    else:
        grown, expanded = spec.beams * spec.steps, [spec.beams] * (spec.steps - 1)
    target_nodes = 1 + (min(grown, spec.budget) if isinstance(spec, DynamicTree) else grown)
    per_pass = max([2] + expanded)
    if paced and isinstance(spec, DynamicTree):
        per_pass = max(per_pass, spec.frontier * spec.top_k)
    return target_nodes, (per_pass if paced else 2) + sum(expanded) + per_pass, per_pass


@dataclass
class RoundCosts:
    """The cost model DynamicTree(adaptive=True) decides with, in seconds: a draft pass (a level's, timed from the
    first level's arrival on the host to the last's) and what a round's drafting costs beyond its passes
    (draft_round: the first pass also feeds the trunk and applies the last commit's device part); a target pass of
    n nodes (target_time: verify + verify_node·n, or verify + the measured verify_curve at n); the rest of a round
    (commit, bookkeeping); calibration = tokens the target accepted / tokens the tree's node estimates expected;
    greedy agreement and, for sampled trees, level_accept. Measured once at the start (generate's calibration
    passes) and updated every round.

    Node estimates: greedy, the product along the node's path of agreement(q) (a greedy child is accepted when
    the target's argmax after its parent is its token; agreement maps the draft's probability q of that token to
    how often that has happened, measured on every verified node). Sampled, the draft's probability of a drawn
    token says how likely it was drawn, not how likely it is accepted (with a draft equal to the target every first
    child is), so a sampled child is estimated at its parent's estimate times level_accept (the measured share of
    verification steps at which a child of the last accepted node was accepted), split among its siblings in
    proportion to their draft probabilities."""
    draft: float = 0.0
    draft_round: float = 0.0
    verify: float = 0.0
    verify_node: float = 0.0
    other: float = 0.0
    # ((nodes, seconds over `verify`), ...) at ascending sizes, measured: a pass's cost is far from linear in its
    # nodes where a 2-row matrix product already costs ~2x a 1-row one (CPUs without bf16 / AMX units). () = linear
    verify_curve: tuple = ()
    calibration: float = 1.0
    decay: float = 0.8
    step: float = 0.0     # seconds of a plain decoding step (one target node, no drafting); 0 = not measured yet
    paced: dict = field(default_factory=dict)  # round context (None: all) -> [weight, tokens, seconds]
    level_hits: float = 1.0   # decayed counts behind level_accept (prior: one hit in two tries)
    level_tries: float = 2.0
    # decayed counts behind agreement(q), per bin of q: greedy children the target chose, children verified
    agree_hits: list = field(default_factory=lambda: [0.0] * len(RoundCosts.AGREE_EDGES))
    agree_tries: list = field(default_factory=lambda: [0.0] * len(RoundCosts.AGREE_EDGES))
    rank_agreement: list = None  # (k,) decayed mean agreement of greedy levels' j-th children (note_ranks)

    @property
    def level_accept(self):
        return self.level_hits / self.level_tries

    def note_levels(self, accepted, stopped):
        """Fold in one verification: `accepted` draft tokens, and whether it then stopped at a node that had
        children (all rejected) rather than at a leaf."""
        self.level_hits = self.PACE_MEMORY * self.level_hits + accepted
        self.level_tries = self.PACE_MEMORY * self.level_tries + accepted + bool(stopped)

    # Greedy agreement: how often the target's argmax is a child the draft gave probability q, in bins of q. The
    # draft's probability itself underestimates it wherever the draft is not sure (the bundled pair, held-out
    # prompts, benchmarks/tree_policy.py: q 0.05-0.1 chosen 20% of the time, 0.3-0.4 69%), and a path compounds the
    # gap: depth-5 nodes were accepted 3.9x as often as their path probability said, depth-1 nodes 1.8x, which no
    # single calibration factor fixes. Bins are tenths, the lowest split in three: 40% of verified nodes have
    # q < 0.1, chosen 7% of the time below 0.05 and 20% at 0.05-0.1.
    AGREE_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # bins' lower edges
    AGREE_PRIOR = 2.0     # tries' worth of the draft's own probability in every bin
    AGREE_MEMORY = 0.99   # weight of the counts so far when a round's nodes come in

    def _agree_bin(self, q):
        return max(bisect.bisect_right(self.AGREE_EDGES, q) - 1, 0)

    def agreement(self, q):
        """The estimated chance that the target's greedy choice after a node is its child of draft probability q:
        the child's bin's measured share, shrunk towards q itself (AGREE_PRIOR tries' worth; q with no counts)."""
        b = self._agree_bin(q)
        return (self.AGREE_PRIOR * q + self.agree_hits[b]) / (self.AGREE_PRIOR + self.agree_tries[b])

    def note_agreement(self, verified):
        """Fold in one greedy verification: (q, agreed) per verified draft node, q its draft probability given its
        parent, agreed whether the target's argmax after its parent is its token (whether or not the parent was
        accepted). A round that verified no draft node still fades the counts towards q, so that the table does not
        freeze once trees stop keeping nodes (benchmarks/tree_policy.py with its recorded fp32 costs, tenths as bins:
        the default 100.2 modelled tokens/s with the fading, 98.9 without; grown on the device 94.6 against 85.0)."""
        self.agree_hits = [self.AGREE_MEMORY * h for h in self.agree_hits]
        self.agree_tries = [self.AGREE_MEMORY * t for t in self.agree_tries]
        for q, agreed in verified:
            b = self._agree_bin(q)
            self.agree_hits[b] += bool(agreed)
            self.agree_tries[b] += 1.0

    # Greedy levels' mean agreement per child rank, as _levels_that_pay extrapolates the levels after the next:
    # what the last level's children say of the next level's holds less the further ahead (an adaptive tree grown
    # on the device decides every level from the root's children; extrapolated from those alone it drafted 2.59
    # levels a round for the host's 1.87 at the same tau, benchmarks/tree_policy.py, fp32). Fed by device-grown
    # trees, the only ones that look further than one level (host decisions keep a cost model of their own). The
    # root level counts as any other: in rounds that draft one level only, it is all the mean hears.
    RANK_MEMORY = 0.9     # weight of the mean so far when a level comes in

    def note_ranks(self, ratios):
        """Fold in one greedy level's mean agreement per child rank (ratios: (k,) floats)."""
        if self.rank_agreement is None or len(self.rank_agreement) != len(ratios):
            self.rank_agreement = list(ratios)
        else:
            self.rank_agreement = [self.RANK_MEMORY * a + (1.0 - self.RANK_MEMORY) * r
                                   for a, r in zip(self.rank_agreement, ratios)]

    @property
    def known(self):
        return self.draft > 0.0

    def target_times(self, most):
        """Seconds of a target pass of 1, 2, ..., `most` nodes: piecewise linear between the verify_curve's sizes
        (the first segment's slope below them, the last's beyond), or verify + verify_node·nodes with fewer than
        two measured sizes. (One walk over the curve: best_rate needs every size, several times a round.)"""
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
        return self._round(passes, self.target_time(nodes))

    def _round(self, passes, target):
        """Seconds of a round of `passes` draft passes whose target pass takes `target` seconds."""
        return self.draft_round + passes * self.draft + target + self.other

    def best_rate(self, probs, passes):
        """(expected tokens per second, nodes kept) of the best tree made of the most probable of `probs` (path
        probabilities below the root, sorted descending): keep k nodes for the k that maximises
        (1 + calibration·sum of the first k) / round_time(passes, 1 + k)."""
        times = self.target_times(1 + len(probs))
        best, expected = (1.0 / self._round(passes, times[0]), 0), 1.0
        for k, p in enumerate(probs, 1):
            expected += self.calibration * p
            rate = expected / self._round(passes, times[k])
            if rate > best[0]:
                best = (rate, k)
        return best

    def update(self, draft_seconds, passes, level_seconds, verify_seconds, nodes, other_seconds, accepted,
               expected):
        """Fold in one round: its draft time over `passes` passes (level_seconds of it from the first level on the
        host to the last), its target pass over `nodes` nodes, the rest, and the draft tokens accepted against the
        draft's expectation for the tree it sent."""
        mix = 1.0 - self.decay
        if passes > 1:
            level = level_seconds / (passes - 1)
        else:  # one pass alone cannot be split: still follow it, so that a dear first estimate comes down
            level = max(0.0, draft_seconds - self.draft_round)
        if passes:
            self.draft += mix * (_bounded(level, self.draft) - self.draft)
            fixed = max(0.0, draft_seconds - passes * self.draft)
            # bounded by a pass's cost until it has an estimate of its own: a first round that compiles must not count
            self.draft_round += mix * (_bounded(fixed, self.draft_round or self.draft) - self.draft_round)
        base = self.target_time(nodes)
        self.verify += mix * (_bounded(verify_seconds, base) - base)  # drift goes to the base
        self.other += mix * (_bounded(other_seconds, self.other) - self.other)
        ratio = (accepted + 0.5) / (expected + 0.5)
        self.calibration = min(2.0, max(0.1, self.calibration + mix * (ratio - self.calibration)))

    # Pacing: whether a round drafts at all. Acceptance runs in streaks (after a round that accepted no draft token
    # the next one often accepts none either), so a speculative round's yield is tracked per context: (whether the
    # last speculative round accepted a draft token, plain steps taken since). A round speculates unless its
    # context's expected tokens per second fall below a plain step's. A context's expectation is its own rounds'
    # figures shrunk towards those of all rounds (PACE_PRIOR rounds' worth), so a context seen a few times is judged
    # mostly by the pooled figures; each plain step taken instead fades its own evidence (PACE_FADE), so a context
    # once found wanting is tried again after a while.
    PACE_MEMORY = 0.95  # weight of a context's past rounds when a new one comes in
    PACE_PRIOR = 2.0
    PACE_FADE = 0.9

    def speculates(self, context):
        """Whether a round in `context` should draft (else: one plain decoding step of the target)."""
        pooled = self.paced.get(None)
        if pooled is None or self.step <= 0.0:
            return True
        _, tokens, seconds = self.paced.get(context, (0.0, 0.0, 0.0))
        prior = self.PACE_PRIOR / pooled[0]
        tokens, seconds = tokens + prior * pooled[1], seconds + prior * pooled[2]
        return tokens * self.step >= seconds

    def note_round(self, context, tokens, seconds, estimate=0.0):
        """Fold in a speculative round started in `context` that emitted `tokens` in `seconds`; estimate: the cost
        model's seconds for it (round_time of its passes and nodes, before this round updates it). The sample is
        capped at twice the larger of the estimate and the pooled mean of earlier rounds (either where the other is
        missing): a compiled generate's first rounds compile (seconds each, measured: 1.3 s and 5.4 s on the
        bundled pair) and come before any pooled figure; uncapped, they made every context look dear for the rest
        of the call, and the adaptive tree took plain steps at 0.9x a fixed tree's speed. The pooled mean keeps a
        model that underestimates rounds (its fixed parts start at 0) from capping real seconds."""
        pooled = self.paced.get(None)
        reference = max(estimate, pooled[2] / pooled[0] if pooled is not None else 0.0)
        if reference > 0.0:
            seconds = _bounded(seconds, reference)
        for key in (context, None):
            seen = self.paced.setdefault(key, [0.0, 0.0, 0.0])  # weight, weighted tokens, weighted seconds
            for i, value in enumerate((1.0, tokens, seconds)):
                seen[i] = self.PACE_MEMORY * seen[i] + value

    def note_step(self, context, seconds):
        """Fold in a plain decoding step of `seconds` taken in `context`."""
        self.step = seconds if self.step <= 0.0 else self.step + (1.0 - self.decay) * (
            _bounded(seconds, self.step) - self.step)
        if context in self.paced:
            self.paced[context] = [self.PACE_FADE * v for v in self.paced[context]]


def _bounded(seconds, estimate):
    """A timing sample capped at twice the current estimate (if any): a one-off stall (a compilation, the OS)
    must not steer the cost model for dozens of rounds, while real drifts still come through, doubled at most
    per sample."""
    return min(seconds, 2.0 * estimate) if estimate > 0.0 else seconds


@dataclass
class DraftedTree:
    """A drafted tree, trunk first. Node lists are in topological order."""
    tokens: list
    parents: list
    depth: list          # depth below the root of the speculation (trunk nodes before the root: negative)
    pass_index: list     # each node's index in the draft's last, uncommitted tree pass; -1 if it was not in it
    passes: int          # draft tree passes spent
    probs: dict = field(default_factory=dict)  # node -> draft distribution (vocab,) its children were drawn from
    transfers: int = 0   # device-to-host copies made while drafting
    expected: float = 0.0  # the draft's expected accepted tokens: sum of the kept nodes' estimates (RoundCosts)
    draft_q: list = None   # greedy dynamic trees: each node's draft probability given its parent (None: trunk, root)
    level_seconds: float = 0.0  # from the first level's arrival on the host to the last's (RoundCosts.update)


class _Growth:
    """The tree being drafted: trunk as a chain, then nodes appended level by level."""

    def __init__(self, draft, trunk, sampler, generated, generator, costs=None):
        self.draft, self.sampler, self.generator, self.costs = draft, sampler, generator, costs
        self.generated = generated  # new tokens emitted before the root's successor is predicted
        self.tokens = list(trunk)
        self.parents = list(range(-1, len(trunk) - 1))
        self.depth = list(range(1 - len(trunk), 1))
        self.probs = {}
        self.fed = {}  # node -> its id in the draft's uncommitted tree (the nodes its passes have seen)
        self.passes = 0
        self.transfers = 0  # device-to-host copies
        self.arrivals = []  # perf_counter() when each level (or levels pulled together) came to the host

    @property
    def root(self):
        return self.depth.index(0)

    def expand(self, nodes, k, coverage=1.0):
        """One draft pass over `nodes` and those of their ancestors no pass has seen yet (the draft's uncommitted
        tree is extended, not recomputed; nodes never expanded are never fed, so a pass carries the expanded
        nodes only, not every child of the last level), then k children for each of `nodes`: the top-k tokens
        when greedy, else k draws without replacement (coverage < 1: only as many as the node's k most probable
        tokens need to reach that share of its mass; see DynamicTree). The LM head runs on `nodes` only, and the
        choice is one batched operation over (len(nodes), vocab) with one copy to the host.

        Returns {node: [(token, log q(token))]} in drawing order.
        """
        device = self.draft.device
        new = set()
        for node in nodes:
            while node >= 0 and node not in self.fed and node not in new:
                new.add(node)
                node = self.parents[node]
        new = sorted(new)  # topological: a parent's id is below its children's
        run = self.draft.extend if self.fed else self.draft.tree_forward
        for node in new:
            self.fed[node] = len(self.fed)
        tokens = [[self.tokens[n] for n in new]]
        parents = [[self.fed.get(self.parents[n], -1) for n in new]]
        position = {node: j for j, node in enumerate(new)}
        logits = run(tokens, parents, logits_for=[position[n] for n in nodes])[0]         # (K, vocab)
        self.passes += 1
        generated = [self.generated + self.depth[n] for n in nodes]  # a tensor only if min_new_tokens needs one
        scores = self.sampler.scores(logits, generated)                                   # (K, vocab) float64
        if self.sampler.greedy:
            values, picked = scores.log_softmax(-1).topk(k, dim=-1)
            valid = torch.ones_like(values)
        else:
            probs = scores.softmax(-1)
            self.probs.update(zip(nodes, probs))
            picked, valid = draw_without_replacement(probs, k, self.generator)
            if coverage < 1.0:  # from probs alone, never from the draws
                needed = (probs.topk(valid.shape[-1], dim=-1).values.cumsum(-1) < coverage).sum(-1, keepdim=True)
                valid = valid * (torch.arange(valid.shape[-1], device=device) <= needed)
            values = probs.gather(-1, picked).log()
        host = torch.stack([picked.double(), values, valid]).tolist()                      # one transfer
        self.transfers += 1
        self.arrivals.append(time.perf_counter())
        return {node: [(int(t), v) for t, v, ok in zip(*(h[r] for h in host)) if ok]
                for r, node in enumerate(nodes)}

    def add(self, parent, token):
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        return len(self.tokens) - 1

    def result(self, keep=None, estimates=None, draft_q=None):
        """The DraftedTree; keep (sorted node ids, trunk included) restricts it to a subtree, order preserved;
        estimates: {node: estimated chance of acceptance} of the nodes the expectation counts; draft_q: {node: its
        draft probability given its parent}."""
        keep = list(range(len(self.tokens))) if keep is None else keep
        kept = set(keep)
        expected = sum(p for n, p in (estimates or {}).items() if n in kept and n != self.root)
        new_id = {old: new for new, old in enumerate(keep)}
        return DraftedTree(tokens=[self.tokens[i] for i in keep],
                           parents=[new_id[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep],
                           depth=[self.depth[i] for i in keep],
                           pass_index=[self.fed.get(i, -1) for i in keep], passes=self.passes,
                           probs={new_id[i]: q for i, q in self.probs.items() if i in new_id},
                           transfers=self.transfers, expected=expected,
                           draft_q=None if draft_q is None else [draft_q.get(i) for i in keep],
                           level_seconds=self.arrivals[-1] - self.arrivals[0] if self.arrivals else 0.0)


def _greedy_plan(spec):
    """[(nodes expanded, children each)] per level of a greedy StaticTree / DynamicTree, root level first: a greedy
    node always gets all its children, so the tree's shape is known before any of its tokens."""
    if isinstance(spec, StaticTree):
        return list(zip([1] + list(itertools.accumulate(spec.branching, operator.mul))[:-1], spec.branching))
    plan, frontier = [], 1
    for _ in range(spec.depth):
        plan.append((min(spec.frontier, frontier), spec.top_k))
        frontier = plan[-1][0] * spec.top_k
    return plan


def _greedy(growth, spec):
    """A greedy StaticTree / DynamicTree grown on the device: the trunk pass, then the levels
    (TreeModel.extend_on_device), each choosing the nodes to expand among the last level's children (a DynamicTree's
    `frontier` most probable paths, a StaticTree's all), feeding them and taking their top-k children, with no host
    sync, all in one call (compiled: one graph), the tree coming to the host in one copy at the end. An adaptive
    tree first brings the root's children to the host and decides from them how many levels pay
    (_levels_that_pay: the next level extrapolated from them, the later ones from earlier rounds' levels), since a
    call a level would cost what a small draft's level computes. Its levels teach RoundCosts.note_ranks."""
    draft, plan, sampler, costs = growth.draft, _greedy_plan(spec), growth.sampler, _costs(growth, spec)
    trunk, root = len(growth.tokens), growth.root
    # first[level]: the draft's id of the first node expanded at that level (level 0: the root)
    first = [root] + list(itertools.accumulate([e for e, _ in plan[1:]], initial=trunk))
    growth.fed = {n: n for n in range(trunk)}
    logits = draft.tree_forward([growth.tokens], [growth.parents], logits_for=[root], slots=first[-1])
    growth.passes = 1
    # new tokens before the root's children where the scores read them (min_new_tokens), as a tensor that each
    # level adds one to (an int would be a constant of a compiled level); else a constant 0
    generated = to_device(growth.generated, logits.device) if sampler.min_new_tokens and sampler.eos_ids else 0
    replay = _Replay(growth, first)
    joint = logits.new_zeros(1, dtype=torch.float64)
    replay.levels.append(_top_children(sampler, plan[0][1], logits, (joint, None, generated)))
    levels = [(expand, root + level, _pick_children, functools.partial(_top_children, sampler, k),
               functools.partial(_level_args, expand)) for level, (expand, k) in enumerate(plan[1:], 1)]
    if costs is not None and levels:  # adaptive: as many levels as the first one's estimates say pay
        replay.pull()
        levels = levels[:_levels_that_pay(costs, spec, *replay.decision(spec, costs), most=len(levels))]
    if levels:  # every level in one call
        (R, depth, choose, then, args_of), *more = levels
        replay.levels += draft.extend_on_device(R, depth, choose, args_of(replay.levels[-1]), then, more=more)
        growth.passes += len(levels)
    replay.pull()
    draft.settle([replay.settled])
    if costs is not None:
        for log_q in replay.level_log_q:
            costs.note_ranks(_rank_means(costs, log_q))
    if isinstance(spec, StaticTree):
        return growth.result()
    return _most_probable(growth, spec, replay.joint, costs)


def _pick_children(ids, joint, log_q, tokens, expand, generated):
    """A greedy level's choose() (TreeModel.extend_on_device; ids (expand,): the draft ids the picked nodes get):
    of the last level's children, whose log path probabilities are joint[:, None] + log_q and tokens `tokens`
    (E, k), the `expand` most probable (ties to the earlier), in id order. Returns their tokens and draft parents
    (1, expand), and (their log path probabilities, their positions among the children, generated) to carry.
    The last level's E expanded nodes are the E ids just before these (the root, for the first level): their
    first id comes from the device, not as an int, which a compiled level would hold as a constant."""
    E, k = log_q.shape
    paths = (joint[:, None] + log_q).reshape(-1)
    picked = paths.sort(descending=True, stable=True).indices[:expand].sort().values
    parents = ids[0] - E + picked // k
    return tokens.reshape(-1)[picked][None], parents[None], (paths[picked], picked, generated)


def _level_args(expand, level):
    """_pick_children's arguments for the level after `level` (_top_children's output), which expands `expand`."""
    joint, _, log_q, tokens, generated = level
    return joint, log_q, tokens, expand, generated


def _top_children(sampler, k, logits, carry):
    """A greedy level's then(): the top-k children of each new node, logits (1, E, vocab). Returns (log path
    probabilities (E,), positions among the last level's children (E,) or None, log q (E, k), tokens (E, k),
    generated for the next level)."""
    joint, picked, generated = carry
    log_q, tokens = sampler.scores(logits[0], generated).log_softmax(-1).topk(k, dim=-1)
    return joint, picked, log_q, tokens, generated + 1 if torch.is_tensor(generated) else generated


class _Replay:
    """The host's copy of a tree _greedy grows on the device: its levels (_top_children's tuples) come over in one
    transfer per pull() and are added to the growth: each level's children in the order of their parents' ids,
    then by rank."""

    def __init__(self, growth, first):
        self.growth, self.first = growth, first
        self.levels, self.done = [], 0   # device levels; how many are on the host
        self.joint = {growth.root: 0.0}  # node -> log path probability below the root
        self.children, self.log_q = [growth.root], None  # the last level's children and their log q (expand, k)
        self.level_log_q = []            # every level's log q rows, root level first
        self.settled = []                # draft slots of the parents of the nodes fed on the device, in feeding order

    def pull(self):
        """Copy the levels not on the host yet (one transfer) and add them to the growth."""
        new = self.levels[self.done:]
        if not new:
            return
        parts = [t.double().reshape(-1) for _, picked, log_q, tokens, _ in new for t in (picked, tokens, log_q)
                 if t is not None]
        values, at = torch.cat(parts).tolist(), 0
        self.growth.transfers += 1
        self.growth.arrivals.append(time.perf_counter())
        growth = self.growth
        for level, (_, picked, _, tokens, _) in enumerate(new, self.done):
            expanded = self.children
            if picked is not None:
                expanded = [self.children[int(i)] for i in values[at:at + picked.numel()]]
                at += picked.numel()
                for j, node in enumerate(expanded):
                    growth.fed[node] = self.first[level] + j
                    self.settled.append(growth.fed[growth.parents[node]])
            E, k = tokens.shape
            ids, lq = values[at:at + E * k], values[at + E * k:at + 2 * E * k]
            at += 2 * E * k
            self.children, self.log_q = [], [lq[e * k:(e + 1) * k] for e in range(E)]
            self.level_log_q.append(self.log_q)
            for e, node in enumerate(expanded):
                for r in range(k):
                    child = growth.add(node, int(ids[e * k + r]))
                    self.joint[child] = self.joint[node] + lq[e * k + r]
                    self.children.append(child)
        self.done = len(self.levels)

    def decision(self, spec, costs):
        """_levels_that_pay's arguments after the host has every level: (node estimates, root, the nodes the next level
        would expand, the mean agreement of each child rank at the last level, passes so far)."""
        expand = sorted(self.children, key=lambda n: -self.joint[n])[:spec.frontier]
        ratios = _rank_means(costs, self.log_q)
        estimates, _ = _greedy_estimates(costs, self.growth.parents, self.joint)
        return estimates, self.growth.root, expand, ratios, self.growth.passes


def _rank_means(costs, log_q):
    """The mean agreement of each child rank over a level's rows of log q (E, k)."""
    return [sum(costs.agreement(math.exp(row[r])) for row in log_q) / len(log_q) for r in range(len(log_q[0]))]


def _most_probable(growth, spec, joint, costs):
    """A greedy DynamicTree's kept nodes: the `budget` most probable (adaptive: the most likely of those by their
    estimates, as many as pay); neither a path's probability nor its estimate exceeds its prefix's, so ancestors
    rank first (ties broken towards earlier, i.e. shallower or earlier-drawn, nodes)."""
    ranked = sorted((n for n in joint if n != growth.root), key=lambda n: (-joint[n], n))[:spec.budget]
    estimates, draft_q = _greedy_estimates(costs, growth.parents, joint)
    if costs is not None:
        ranked.sort(key=lambda n: (-estimates[n], n))
        ranked = ranked[:costs.best_rate([estimates[n] for n in ranked], growth.passes)[1]]
    keep = set(range(growth.root + 1)) | set(ranked) | _ancestors(growth.parents, ranked)
    return growth.result(sorted(keep), estimates, draft_q)


def _greedy_estimates(costs, parents, joint):
    """({node: estimated chance the target accepts it}, {node: its draft probability given its parent}) of the
    nodes below the root of `joint` (log draft path probabilities, the root at 0): the product along the path of
    costs.agreement(q) (RoundCosts), or of q itself without costs (a fixed tree)."""
    estimates, draft_q = {}, {}
    for node in sorted(joint):  # ids are topological
        parent = parents[node]
        if parent in joint:
            draft_q[node] = q = math.exp(joint[node] - joint[parent])
            estimates[node] = estimates.get(parent, 1.0) * (q if costs is None else costs.agreement(q))
    return estimates, draft_q


def _static(growth, spec):
    frontier = [growth.root]
    for width in spec.branching:
        children = growth.expand(frontier, width)
        frontier = [growth.add(node, token) for node in frontier for token, _ in children[node]]
    return growth.result()


def _dynamic(growth, spec):
    joint = {growth.root: 0.0}  # log estimate that a node is accepted: its draft path probability (see RoundCosts)
    frontier, ratios = [growth.root], None
    costs = _costs(growth, spec)
    sampled_estimates = costs is not None and not growth.sampler.greedy  # see RoundCosts
    for _ in range(spec.depth):
        expand = sorted(frontier, key=lambda n: -joint[n])[:spec.frontier]
        if not growth.sampler.greedy:  # the budget is spent during growth; ranks are known before drawing
            room = spec.budget - (len(growth.tokens) - growth.root - 1)
            expand = expand[:room // spec.top_k]
        if not expand or (costs is not None and ratios is not None and
                          not _levels_that_pay(costs, spec, _estimates(costs, growth, joint), growth.root, expand,
                                               ratios, growth.passes)):
            break
        children = growth.expand(expand, spec.top_k, spec.coverage)
        frontier, ratios = [], [0.0] * spec.top_k
        for node in expand:
            if sampled_estimates and children[node]:
                share = math.log(costs.level_accept / sum(math.exp(log_q) for _, log_q in children[node]))
            for rank, (token, log_q) in enumerate(children[node]):
                child = growth.add(node, token)
                estimate = log_q + share if sampled_estimates else log_q
                joint[child] = joint[node] + estimate
                frontier.append(child)
                if costs is not None:  # the mean estimate of the rank-th child
                    ratios[rank] += (math.exp(estimate) if sampled_estimates else
                                     costs.agreement(math.exp(log_q))) / len(expand)
    if not growth.sampler.greedy:
        return growth.result(estimates=_estimates(costs, growth, joint))
    return _most_probable(growth, spec, joint, costs)


def _estimates(costs, growth, joint):
    """{node: estimated chance of acceptance} of _dynamic's nodes: greedy, _greedy_estimates; sampled, `joint`
    holds the estimates' logs already (see RoundCosts)."""
    if growth.sampler.greedy:
        return _greedy_estimates(costs, growth.parents, joint)[0]
    return {n: math.exp(lp) for n, lp in joint.items() if n != growth.root}


def _costs(growth, spec):
    """The RoundCosts an adaptive DynamicTree decides with (None: a fixed tree, or no costs measured yet)."""
    adaptive = getattr(spec, "adaptive", False) and growth.costs is not None and growth.costs.known
    return growth.costs if adaptive else None


def _levels_that_pay(costs, spec, estimates, root, expand, ratios, passes, most=1):
    """How many more levels (at most `most`) raise the round's expected tokens per second, each in turn
    (DynamicTree.adaptive).

    estimates: {node: estimated chance of acceptance} (RoundCosts) below the root. The next level's nodes would be
    the children of `expand`: child j of a node of estimate p is estimated at p times the mean estimate of the
    j-th child at the last level given its parent (`ratios`); a level after that, the children of the `frontier`
    likeliest of those, at p times the mean over earlier rounds' levels (RoundCosts.rank_agreement, where known and
    of the same top_k).
    A level pays when the best tree of the nodes so far and its estimated children (costs.best_rate: the likeliest
    nodes, as many as pay for their share of the target pass), one draft pass dearer, promises more than the best
    tree without them."""
    probs = sorted((p for n, p in estimates.items() if n != root), reverse=True)[:spec.budget]
    frontier = [estimates.get(n, 1.0) for n in expand]
    for levels in range(most):
        if levels and costs.rank_agreement is not None and len(costs.rank_agreement) == len(ratios):
            ratios = costs.rank_agreement
        estimated = sorted((p * r for p in frontier for r in ratios), reverse=True)
        grown = sorted(probs + estimated, reverse=True)[:spec.budget]
        if costs.best_rate(grown, passes + levels + 1)[0] <= costs.best_rate(probs, passes + levels)[0]:
            return levels
        probs, frontier = grown, estimated[:spec.frontier]
    return most


def _beam(growth, spec):
    if not growth.sampler.greedy:
        raise ValueError("BeamTree is deterministic and cannot be verified losslessly when sampling; use a "
                         "StaticTree or DynamicTree with temperature > 0")
    beams = [(growth.root, 0.0)]
    for _ in range(spec.steps):
        children = growth.expand([node for node, _ in beams], spec.beams)
        candidates = [(score + log_q, node, token) for node, score in beams for token, log_q in children[node]]
        candidates.sort(key=lambda c: -c[0])
        beams = [(growth.add(node, token), score) for score, node, token in candidates[:spec.beams]]
    leaves = [node for node, _ in beams]
    return growth.result(sorted(set(range(growth.root + 1)) | set(leaves) | _ancestors(growth.parents, leaves)))


def _ancestors(parents, nodes):
    found = set()
    for node in nodes:
        node = parents[node]
        while node >= 0 and node not in found:
            found.add(node)
            node = parents[node]
    return found


_GROW = {StaticTree: _static, DynamicTree: _dynamic, BeamTree: _beam}  # level by level on the host


def grows_on_device(device, compiled):
    """Whether greedy static and dynamic trees are grown on `device` (_greedy: no host sync between draft passes, a
    round's levels in one call) rather than level by level on the host: only on CUDA with `compiled` draft passes
    (TreeModel.compile: CUDA graphs), where every compiled call costs its guards and wrappers whatever it computes
    (about what a small draft's level computes) and a copy to the host would wait for the graphs queued before it
    (not yet measured against the host path there: benchmarks/gpu.py's compiled step does). On a CPU, compiled, the
    measurements disagree (the bundled pair, fp32, benchmarks/generate.py --compile --both-drafting): the adaptive
    default gave 3.20x / 3.45x HF generate drafted on the device against 2.74x / 2.88x on the host in two runs where
    both ways shared one cost model, then 2.51x against 3.13x once each kept its own; DynamicTree(16) 3.47x against
    3.06x (one run). So a CPU drafts on the host. Eager, the device path's extra launches cost more than the syncs
    they save, on a GPU as on a CPU (the bundled pair in bf16 on an H200: DynamicTree(16) 1.52x HF generate
    drafted on the host against 1.28x on the device, drafting 12.1 against 15.5 ms a round; on a CPU, fp32,
    +13-18% drafting a round on the device). Other accelerators draft on the host (unmeasured)."""
    return torch.device(device).type == "cuda" and compiled


def draft_tree(draft, trunk, spec, sampler, generated, generator=None, costs=None, on_device=None):
    """Draft a tree below trunk[-1] (the speculation's root) with a prefilled stree.models.TreeModel.

    trunk: tokens not yet in the draft's cache, fed as a chain, the root last. generated: new tokens emitted
    before the token that follows the root (for min_new_tokens). The draft's last pass is left uncommitted, so
    draft.commit() may take any node whose pass_index is not -1. costs: a RoundCosts for adaptive trees.
    on_device: grow a greedy StaticTree / DynamicTree on the device (the same tree); None = grows_on_device.
    """
    growth = _Growth(draft, trunk, sampler, generated, generator, costs)
    if on_device is None:
        on_device = grows_on_device(draft.device, draft.compiled)
    if on_device and sampler.greedy and not isinstance(spec, BeamTree):
        return _greedy(growth, spec)
    return _GROW[type(spec)](growth, spec)
