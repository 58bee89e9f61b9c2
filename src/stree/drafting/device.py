"""Greedy static and dynamic trees grown on the device: the trunk pass, then every level in one call
(TreeModel.extend_on_device: compiled, one graph; on CUDA one replay), each level choosing the nodes to expand among
the last level's children (a DynamicTree's `frontier` most probable paths, a StaticTree's all), feeding them and
taking their top-k children, with no host sync; the tree comes to the host in one copy at the end.

An adaptive tree first brings the root's children to the host and decides from them how many levels pay
(levels_that_pay: the next level extrapolated from them, the later ones from earlier rounds' levels), since a call a
level would cost what a small draft's level computes. Its levels teach Acceptance.note_ranks.
"""
import functools
import itertools
import math
import operator
import time

import torch

from ..adaptive import levels_that_pay
from ..models.host_tree import to_device
from ..shapes import StaticTree
from .host import adaptive_costs, greedy_estimates, most_probable


def greedy_plan(spec):
    """[(nodes expanded, children each)] per level of a greedy StaticTree / DynamicTree, root level first: a greedy
    node always gets all its children, so the tree's shape is known before any of its tokens."""
    if isinstance(spec, StaticTree):
        return list(zip([1] + list(itertools.accumulate(spec.branching, operator.mul))[:-1], spec.branching))
    plan, frontier = [], 1
    for _ in range(spec.depth):
        plan.append((min(spec.frontier, frontier), spec.top_k))
        frontier = plan[-1][0] * spec.top_k
    return plan


def grow_on_device(growth, spec):
    """A greedy StaticTree / DynamicTree grown on the device (see the module docstring); the same tree as the host's
    but for exact ties and node order (an adaptive tree may differ in depth)."""
    draft, plan, sampler, costs = growth.draft, greedy_plan(spec), growth.sampler, adaptive_costs(growth, spec)
    trunk, root = len(growth.tokens), growth.root
    # first[level]: the draft's id of the first node expanded at that level (level 0: the root)
    first = [root] + list(itertools.accumulate([e for e, _ in plan[1:]], initial=trunk))
    growth.fed = {n: n for n in range(trunk)}
    logits = draft.tree_forward([growth.tokens], [growth.parents], logits_for=[root], slots=first[-1],
                                features=growth.features)
    growth.passes = 1
    # new tokens before the root's children where the scores read them (min_new_tokens), as a tensor that each
    # level adds one to (an int would be a constant of a compiled level); else a constant 0
    generated = to_device(growth.generated, logits.device) if sampler.min_new_tokens and sampler.eos_ids else 0
    replay = Replay(growth, first)
    joint = logits.new_zeros(1, dtype=torch.float64)
    replay.levels.append(top_children(sampler, plan[0][1], logits, (joint, None, generated)))
    levels = [(expand, root + level, pick_children, functools.partial(top_children, sampler, k),
               functools.partial(level_args, expand)) for level, (expand, k) in enumerate(plan[1:], 1)]
    if costs is not None and levels:  # adaptive: as many levels as the first one's estimates say pay
        replay.pull()
        levels = levels[:levels_that_pay(costs, spec, *replay.decision(spec, costs), most=len(levels))]
    if levels:  # every level in one call
        (R, depth, choose, then, args_of), *more = levels
        replay.levels += draft.extend_on_device(R, depth, choose, args_of(replay.levels[-1]), then, more=more)
        growth.passes += len(levels)
    replay.pull()
    draft.settle([replay.settled])
    if costs is not None:
        for log_q in replay.level_log_q:
            costs.acceptance.note_ranks(rank_means(costs, log_q))
    if isinstance(spec, StaticTree):
        return growth.result()
    return most_probable(growth, spec, replay.joint, costs)


def pick_children(ids, joint, log_q, tokens, expand, generated):
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


def level_args(expand, level):
    """pick_children's arguments for the level after `level` (top_children's output), which expands `expand`."""
    joint, _, log_q, tokens, generated = level
    return joint, log_q, tokens, expand, generated


def top_children(sampler, k, logits, carry):
    """A greedy level's then(): the top-k children of each new node, logits (1, E, vocab). Returns (log path
    probabilities (E,), positions among the last level's children (E,) or None, log q (E, k), tokens (E, k),
    generated for the next level)."""
    joint, picked, generated = carry
    log_q, tokens = sampler.scores(logits[0], generated).log_softmax(-1).topk(k, dim=-1)
    return joint, picked, log_q, tokens, generated + 1 if torch.is_tensor(generated) else generated


def rank_means(costs, log_q):
    """The mean agreement of each child rank over a level's rows of log q (E, k)."""
    agreement = costs.acceptance.agreement
    return [sum(agreement(math.exp(row[r])) for row in log_q) / len(log_q) for r in range(len(log_q[0]))]


class Replay:
    """The host's copy of a tree grown on the device: its levels (top_children's tuples) come over in one transfer
    per pull() and are added to the growth: each level's children in the order of their parents' ids, then by
    rank."""

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
        for level, (_, picked, _, tokens, _) in enumerate(new, self.done):
            expanded = self.children
            if picked is not None:
                expanded = [self.children[int(i)] for i in values[at:at + picked.numel()]]
                at += picked.numel()
                self._fed(level, expanded)
            at = self._add_children(expanded, tokens.shape, values, at)
        self.done = len(self.levels)

    def _fed(self, level, expanded):
        """Record the draft ids the device gave the nodes `expanded` at `level`, and their parents' for settle()."""
        growth = self.growth
        for j, node in enumerate(expanded):
            growth.fed[node] = self.first[level] + j
            self.settled.append(growth.fed[growth.parents[node]])

    def _add_children(self, expanded, shape, values, at):
        """Add the top-k children (tokens, then log q, from values[at:]) of each expanded node. Returns the next
        read position."""
        E, k = shape
        ids, lq = values[at:at + E * k], values[at + E * k:at + 2 * E * k]
        self.children, self.log_q = [], [lq[e * k:(e + 1) * k] for e in range(E)]
        self.level_log_q.append(self.log_q)
        for e, node in enumerate(expanded):
            for r in range(k):
                child = self.growth.add(node, int(ids[e * k + r]))
                self.joint[child] = self.joint[node] + lq[e * k + r]
                self.children.append(child)
        return at + 2 * E * k

    def decision(self, spec, costs):
        """levels_that_pay's arguments after the host has every level: (node estimates, root, the nodes the next
        level would expand, the mean agreement of each child rank at the last level, passes so far)."""
        expand = sorted(self.children, key=lambda n: -self.joint[n])[:spec.frontier]
        ratios = rank_means(costs, self.log_q)
        estimates, _ = greedy_estimates(costs, self.growth.parents, self.joint)
        return estimates, self.growth.root, expand, ratios, self.growth.passes
