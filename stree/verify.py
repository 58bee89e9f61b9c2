"""Verification of a drafted tree against the target's logits."""


def children_lists(parents):
    """children[i] = node ids whose parent is i, in index order."""
    children = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def verify_greedy(tokens, parents, logits, root=0):
    """Longest path from `root` whose every token is the target's argmax after its parent.

    tokens, parents: the tree (python lists); logits (T, vocab): the target's logits at each node.
    Returns (accepted, bonus): accepted node ids from root down (root included) and the target's argmax after
    the last accepted node. Ties resolve to the lowest token id, as torch.argmax does in HF's greedy search.
    """
    children = children_lists(parents)
    greedy = logits.argmax(dim=-1).tolist()
    accepted = [root]
    while True:
        node = accepted[-1]
        match = next((c for c in children[node] if tokens[c] == greedy[node]), None)
        if match is None:
            return accepted, greedy[node]
        accepted.append(match)
