"""The tree being drafted (Growth) and what drafting hands to verification (DraftedTree).

A round's tree starts with the trunk: tokens the draft's cache still lacks, fed as a chain whose last token is the
root of the speculation (the last token emitted). Nodes are then appended level by level below the root. Every draft
pass feeds only the nodes it expands (and those of their ancestors no pass has seen yet): the draft's uncommitted
tree is extended, never recomputed, and nodes never expanded are never fed.
"""
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..sampling import draw_without_replacement


@dataclass
class DraftedTree:
    """A drafted tree, trunk first. Node lists are in topological order; `root` is the speculation's root.

    The target verifies target_tokens / target_parents: the tree from the root down, the root as node 0."""
    tokens: list
    parents: list
    depth: list          # depth below the root (trunk nodes before the root: negative)
    pass_index: list     # each node's id in the draft's last, uncommitted tree pass; -1 if it was not in it
    passes: int          # draft tree passes spent
    probs: dict = field(default_factory=dict)  # node -> draft distribution (vocab,) its children were drawn from
    transfers: int = 0   # device-to-host copies made while drafting
    expected: float = 0.0  # the draft's expected accepted tokens: sum of the kept nodes' estimates (RoundCosts)
    draft_q: list = None   # greedy dynamic trees: each node's draft probability given its parent (None: trunk, root)
    level_seconds: float = 0.0  # from the first level's arrival on the host to the last's (PassTimes.update)

    @property
    def root(self):
        return self.depth.index(0)

    @property
    def target_tokens(self):
        return self.tokens[self.root:]

    @property
    def target_parents(self):
        root = self.root
        return [p - root for p in self.parents[root:]]

    @property
    def target_depth(self):
        return self.depth[self.root:]

    def target_probs(self):
        """{target node: draft distribution its children were drawn from} (sampled trees)."""
        return {node - self.root: q for node, q in self.probs.items() if node >= self.root}

    def head_commit(self, accepted, bonus):
        """draft_commit for a draft head: the node to commit is the root (the last node fed the target's own
        feature; the head's entries for the accepted nodes below it were fed its own), and the next trunk holds every
        accepted token below the root, then the bonus (the head catches up on them with the target's features)."""
        root = self.root
        return self.pass_index[root], [self.tokens[n + root] for n in accepted[1:]] + [bonus]

    def draft_commit(self, accepted, bonus):
        """(the draft node to commit, the next round's trunk) after the target accepted `accepted` (target node ids,
        root first) and drew `bonus`: the deepest accepted node the draft's last pass holds, and the accepted tokens
        its cache lacks (at most one: every accepted node but the last was expanded) followed by the bonus token."""
        root = self.root
        index = [self.pass_index[n + root] for n in accepted]
        trunk = [self.tokens[n + root] for n, i in zip(accepted, index) if i < 0]
        return max(index), trunk + [bonus]


class Feed(NamedTuple):
    """A draft pass Growth.expand asks for: feed `new` (node ids, topological) and return the logits of `nodes`."""
    growth: object
    new: list
    nodes: list


class Growth:
    """The tree being drafted: the trunk as a chain, then nodes appended level by level. costs: the RoundCosts an
    adaptive tree decides with (None: a fixed tree)."""

    def __init__(self, draft, trunk, sampler, generated, generator, costs=None, features=None):
        self.draft, self.sampler, self.generator, self.costs = draft, sampler, generator, costs
        self.features = features  # a head's trunk features (the first pass's), else None
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
        """One draft pass over `nodes` and those of their ancestors no pass has seen yet, then k children for each
        of `nodes`: the top-k tokens when greedy, else k draws without replacement (coverage < 1: only as many as
        the node's k most probable tokens need to reach that share of its mass; see DynamicTree). The LM head runs
        on `nodes` only, and the choice is one batched operation over (len(nodes), vocab) with one copy to the host.

        A generator (the grow functions call it with `yield from`), so that a driver (drafting.rows.drive) can run
        the passes of many rows' trees as one batched pass: it first yields a Feed (answered with the logits
        (len(nodes), vocab) of `nodes`), then the tensor to copy to the host (answered with that copy as nested
        lists). Returns {node: [(token, log q(token))]} in drawing order.
        """
        new = set()
        for node in nodes:
            while node >= 0 and node not in self.fed and node not in new:
                new.add(node)
                node = self.parents[node]
        logits = yield Feed(self, sorted(new), nodes)  # topological: a parent's id is below its children's
        self.passes += 1
        generated = [self.generated + self.depth[n] for n in nodes]  # a tensor only if min_new_tokens needs one
        picked, values, valid = self._choose(self.sampler.scores(logits, generated), nodes, k, coverage)
        host = yield torch.stack([picked.double(), values, valid])
        self.transfers += 1
        self.arrivals.append(time.perf_counter())
        return {node: [(int(t), v) for t, v, ok in zip(*(h[r] for h in host)) if ok]
                for r, node in enumerate(nodes)}

    def feed(self, new, first_id):
        """Give the nodes `new` (a Feed's) the draft ids first_id, first_id + 1, ... Returns their tokens and their
        parents' draft ids (-1: the committed sequence)."""
        for j, node in enumerate(new):
            self.fed[node] = first_id + j
        return [self.tokens[n] for n in new], [self.fed.get(self.parents[n], -1) for n in new]

    def _choose(self, scores, nodes, k, coverage):
        """(token ids, log q, valid 0/1), each (K, k), of the children of `nodes` from their scores (K, vocab)."""
        if self.sampler.greedy:
            values, picked = scores.log_softmax(-1).topk(k, dim=-1)
            return picked, values, torch.ones_like(values)
        probs = scores.softmax(-1)
        self.probs.update(zip(nodes, probs))
        picked, valid = draw_without_replacement(probs, k, self.generator)
        if coverage < 1.0:  # from probs alone, never from the draws
            needed = (probs.topk(valid.shape[-1], dim=-1).values.cumsum(-1) < coverage).sum(-1, keepdim=True)
            valid = valid * (torch.arange(valid.shape[-1], device=probs.device) <= needed)
        return picked, probs.gather(-1, picked).log(), valid

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


def ancestors(parents, nodes):
    """Every proper ancestor of `nodes` (a set of ids), given the parents list."""
    found = set()
    for node in nodes:
        node = parents[node]
        while node >= 0 and node not in found:
            found.add(node)
            node = parents[node]
    return found
