"""Token trees: candidate continuations sharing prefixes, in topological order.

A tree of T nodes holds tokens (T,) and parents (T,) with parents[i] < i; parents[i] == -1 attaches node i
to the prefix (the tokens already in the cache). Several roots are allowed.
"""
from dataclasses import dataclass
from functools import cached_property

import torch

from .triton_kernels import ancestor_mask


def _as_index_tensor(name, values):
    t = torch.as_tensor(values)
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.dtype == torch.bool or t.is_complex()):
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    return t.long()


class TokenTree:
    """A token tree in topological order.

    Attributes:
        tokens: (T,) int64 token ids.
        parents: (T,) int64, parents[i] < i, -1 = child of the prefix.
    Derived (cached): depth (T,) with roots at depth 0, ancestor_mask (T, T) with [i, k] = k on path(i).
    """

    def __init__(self, tokens, parents):
        self.tokens = _as_index_tensor("tokens", tokens)
        self.parents = _as_index_tensor("parents", parents).to(self.tokens.device)
        T = self.tokens.numel()
        if self.parents.numel() != T:
            raise ValueError(f"tokens has {T} entries but parents has {self.parents.numel()}")
        if T == 0:
            raise ValueError("a token tree needs at least one node")
        if bool((self.tokens < 0).any()):
            raise ValueError(f"tokens must be non-negative ids, got {self.tokens.min().item()}")
        index = torch.arange(T, device=self.parents.device)
        bad = ((self.parents < -1) | (self.parents >= index)).nonzero()
        if bad.numel():
            i = bad[0].item()
            raise ValueError(f"parents[{i}] = {self.parents[i].item()}: each parent must be -1 or an earlier "
                             f"node (topological order)")

    def __len__(self):
        return self.tokens.numel()

    def __repr__(self):
        return f"TokenTree(tokens={self.tokens.tolist()}, parents={self.parents.tolist()})"

    @cached_property
    def ancestor_mask(self):
        """(T, T) bool, [i, k] = node k is on path(i) (i itself included)."""
        return ancestor_mask(self.parents[None])[0]

    @cached_property
    def depth(self):
        """(T,) int64, number of ancestors inside the tree (0 for a root)."""
        return self.ancestor_mask.sum(-1) - 1

    def path(self, i):
        """Node ids from the root down to node i (inclusive)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"node {i} out of range for a tree of {len(self)} nodes")
        return self.ancestor_mask[i % len(self)].nonzero().flatten().tolist()

    def children(self, i):
        """Node ids whose parent is i (i = -1: the roots)."""
        if not -1 <= i < len(self):
            raise IndexError(f"node {i} out of range [-1, {len(self)})")
        return (self.parents == i).nonzero().flatten().tolist()

    @property
    def leaves(self):
        """Node ids with no children."""
        has_child = torch.zeros(len(self), dtype=torch.bool, device=self.parents.device)
        has_child[self.parents[self.parents >= 0]] = True
        return (~has_child).nonzero().flatten().tolist()

    @classmethod
    def chain(cls, tokens):
        """A single path: node i's parent is i - 1 (plain speculative decoding)."""
        tokens = _as_index_tensor("tokens", tokens)
        return cls(tokens, torch.arange(tokens.numel(), device=tokens.device) - 1)

    @classmethod
    def from_branching(cls, branching, tokens=None):
        """A static tree: branching[d] children for every node at depth d-1 (the prefix for d = 0).

        Example: (3, 2, 2, 1) gives 3 roots, 6 nodes at depth 1, 12 at depth 2 and 12 at depth 3, in
        breadth-first order. tokens (T,) fills the nodes; when None they are 0, a placeholder for a drafter.
        """
        parents = static_parents(branching)
        if tokens is None:
            tokens = torch.zeros(len(parents), dtype=torch.long)
        return cls(tokens, parents)


def static_parents(branching):
    """Parent list of the breadth-first static tree described by `branching` (see TokenTree.from_branching)."""
    if isinstance(branching, (str, bytes)) or not hasattr(branching, "__iter__"):
        raise ValueError(f"branching must be a sequence of positive ints, got {branching!r}")
    branching = list(branching)
    if not branching or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in branching):
        raise ValueError(f"branching must be a non-empty sequence of positive ints, got {branching!r}")
    parents, level = [], [-1]
    for width in branching:
        next_level = []
        for parent in level:
            for _ in range(width):
                next_level.append(len(parents))
                parents.append(parent)
        level = next_level
    return parents


def random_parents(T, generator=None, kind="random", max_children=None):
    """Parents of a random topological tree with T nodes, for tests and benchmarks.

    kind: "random" (each node picks a uniformly random earlier node or the prefix), "chain", "star"
    (every node a child of the prefix), "deep" (mostly a chain with occasional short side branches).
    max_children bounds the children per node for "random" (None = unbounded).
    """
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    if kind == "chain":
        return list(range(-1, T - 1))
    if kind == "star":
        return [-1] * T
    if kind == "deep":
        draws = torch.rand(T, generator=generator).tolist()
        return [-1] + [i - 1 if r < 0.8 else max(i - 2, -1) for i, r in zip(range(1, T), draws[1:])]
    if kind != "random":
        raise ValueError(f"kind must be random, chain, star or deep, got {kind!r}")
    parents, counts = [], {}
    for i in range(T):
        while True:
            p = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
            if max_children is None or p == -1 or counts.get(p, 0) < max_children:
                break
        counts[p] = counts.get(p, 0) + 1
        parents.append(p)
    return parents


@dataclass
class TokenTreeBatch:
    """Trees of different sizes padded to one (batch, T_max) layout.

    Padding rule: padded slots hold token pad_token_id and parent -1, so they hang off the prefix and are
    nobody's ancestor: real nodes compute exactly as in their own tree; outputs at padded slots are
    meaningless and `valid` marks the real ones.
    """
    tokens: torch.Tensor      # (batch, T_max) int64
    parents: torch.Tensor     # (batch, T_max) int64
    valid: torch.Tensor       # (batch, T_max) bool
    num_nodes: list

    @classmethod
    def stack(cls, trees, pad_token_id=0):
        if not trees:
            raise ValueError("need at least one tree")
        T_max = max(len(t) for t in trees)
        batch = len(trees)
        tokens = torch.full((batch, T_max), pad_token_id, dtype=torch.long)
        parents = torch.full((batch, T_max), -1, dtype=torch.long)
        valid = torch.zeros(batch, T_max, dtype=torch.bool)
        for b, tree in enumerate(trees):
            n = len(tree)
            tokens[b, :n], parents[b, :n], valid[b, :n] = tree.tokens.cpu(), tree.parents.cpu(), True
        return cls(tokens, parents, valid, [len(t) for t in trees])

    def to(self, device):
        return TokenTreeBatch(self.tokens.to(device), self.parents.to(device), self.valid.to(device),
                              self.num_nodes)

    def __len__(self):
        return self.tokens.shape[0]
