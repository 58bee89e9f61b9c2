"""Verification of a drafted tree against the target's logits: greedy (exact match) and lossless sampling."""
import torch

from .sampling import sample


def children_lists(parents):
    """children[i] = node ids whose parent is i, in index order."""
    children = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def verify_greedy(tokens, parents, greedy, root=0):
    """Longest path from `root` whose every token is the target's argmax after its parent.

    tokens, parents: the tree (python lists); greedy (T,): the target's argmax after each node, a list of ints
    (`logits.argmax(-1).tolist()`: ties resolve to the lowest token id, as in HF's greedy search).
    Returns (accepted, bonus): accepted node ids from root down (root included) and the target's argmax after
    the last accepted node.
    """
    children = children_lists(parents)
    accepted = [root]
    while True:
        node = accepted[-1]
        match = next((c for c in children[node] if tokens[c] == greedy[node]), None)
        if match is None:
            return accepted, greedy[node]
        accepted.append(match)


def verify_sampling(tokens, parents, target_probs, draft_probs, generator=None, root=0):
    """Lossless multi-draft speculative sampling over a tree (recursive rejection sampling).

    At the current node, its children (drafted from draft_probs[node] one after another without replacement, and
    listed in that order) are tried in turn: child token x is accepted with probability min(1, p(x) / q(x));
    on rejection p <- normalise(max(p - q, 0)) and x is removed from q (q renormalised). The first accepted child
    becomes the current node; when every child is rejected the bonus token is drawn from the residual p.
    The emitted tokens are then distributed exactly as sampling from the target.

    target_probs (T, vocab): the target's sampling distribution at each node; draft_probs: indexable by node,
    the draft's distribution at each node that has children. Returns (accepted, bonus) like verify_greedy.
    """
    children = children_lists(parents)
    accepted = [root]
    while True:
        node = accepted[-1]
        residual = target_probs[node].double().cpu()
        proposal = None
        for child in children[node]:
            if proposal is None:
                proposal = draft_probs[node].double().cpu().clone()
            x = tokens[child]
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * proposal[x] < residual[x]:
                accepted.append(child)
                break
            leftover = (residual - proposal).clamp_(min=0.0)
            if leftover.sum() > 0:  # zero only through rounding, when p and q already agree
                residual = leftover / leftover.sum()
            proposal[x] = 0.0
            proposal /= proposal.sum().clamp(min=1e-300)
        else:
            return accepted, sample(residual, generator)
