"""Drafting: grow a static token tree from a draft model's top-k, one draft forward pass per level."""
import torch

from .tree import static_parents


def check_branching(branching):
    """Validate a static branching spec (a non-empty sequence of positive ints) and return it as a tuple."""
    static_parents(branching)  # raises ValueError with a clear message
    return tuple(branching)


def draft_static_tree(draft, trunk, branching):
    """Grow a tree below trunk[-1] with branching[d] draft top-k children per node at depth d.

    draft: a prefilled stree.models.TreeModel. trunk: token ids not yet in the draft's cache, fed as a chain;
    its last token is the root of the speculation. Level by level, the whole tree so far goes through the draft
    in one tree pass and each frontier node gets its top-k tokens as children.
    Returns (tokens, parents, covered): python lists in topological order (trunk first) and the number of leading
    nodes that the draft's last pass saw; that pass is left uncommitted, so draft.commit() may take any of them.
    """
    device = draft.model.device
    tokens = list(trunk)
    parents = list(range(-1, len(trunk) - 1))
    frontier = [len(trunk) - 1]
    for level, width in enumerate(branching):
        if level:
            draft.discard()
        covered = len(tokens)
        logits = draft.tree_forward(torch.tensor([tokens], device=device), torch.tensor([parents], device=device))[0]
        children = logits[frontier].topk(width, dim=-1).indices.tolist()
        next_frontier = []
        for node, kids in zip(frontier, children):
            for token in kids:
                parents.append(node)
                tokens.append(token)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return tokens, parents, covered
