"""Diverse verifier tree search (DVTS): k independent subtrees, each a greedy beam of one on its own share."""
from .common import best, shares


def dvts(children, answers, config, context, last):
    """Diverse verifier tree search (as search-and-learn's DVTS): the first step's children are dealt into k
    subtrees (child j into subtree j % k); each step, every subtree expands only its best child (ties: smallest key)
    into its fixed share of the width (config.width split into k near-equal shares), its other children are
    dropped. A subtree stops when its best child has finished or at the last step: that step's children, finished
    or not, are its answers (all answers ordered by key). The search ends when every subtree has stopped."""
    width_shares = shares(config.width, config.kept)
    expansions, answers = [], list(answers)
    for g in sorted({t.group for t in children}):
        members = [t for t in children if t.group == g]
        leader = best(members, config, 1)[0]
        if leader.finished or last:
            answers += members
        else:
            expansions.append((leader, width_shares[g]))
    return expansions, sorted(answers, key=lambda t: t.key)
