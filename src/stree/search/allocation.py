"""How many continuations each partial trajectory gets: REBASE's allocation and ETS's pruning ILP (solved exactly by
stree.search.subsets).

Scores are process-reward scores of the current leaves (higher is better).
"""
import math
from fractions import Fraction

import numpy as np

from .subsets import best_leaf_subset


def _exp_weights(scores, temperature):
    """exp(score / temperature), shifted by the top score (unnormalised; only ratios are used)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scores = np.asarray(scores, dtype=np.float64)
    e = np.exp((scores - scores.max()) / temperature)  # the shift cancels in every ratio below
    return e


def rebase_allocation(scores, width, temperature):
    """REBASE's sequential-ceil rule: visit leaves by score, best first; each gets
    n_i = ceil(W_rem * e_i / S_rem), then W_rem -= n_i and S_rem -= e_i, with e = exp(score / temperature).

    Returns per-leaf counts (list of ints, in the order of `scores`) summing to `width`.
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be a non-negative int, got {width!r}")
    if len(scores) == 0:
        if width:
            raise ValueError("no leaves to allocate a positive width to")
        return []
    e = _exp_weights(scores, temperature)
    counts = [0] * len(e)
    remaining_width, remaining_mass = width, float(e.sum())
    for i in sorted(range(len(e)), key=lambda i: (-scores[i], i)):
        share = remaining_width * e[i] / remaining_mass if remaining_mass > 0 else remaining_width
        n = min(remaining_width, math.ceil(share - 1e-9))  # the tolerance absorbs rounding of exact integers
        counts[i] = n
        remaining_width -= n
        remaining_mass -= e[i]
    return counts


ETS_WEIGHTS = ("rebase", "softmax")


def ets_select(leaf_ancestors, scores, clusters, width, *, lambda_b, lambda_d, temperature, steps=None, copies=None,
               weights="rebase", node_costs=None, leaf_costs=None):
    """ETS (Hooper et al., its reference code's select_softmax_costmodel): choose the leaves to keep by an exact
    integer program, then share `width` among them with REBASE.

    With x_i = 1 for a kept leaf, y_v = 1 for a kept node (one with a kept leaf below it) and z_k = 1 for a covered
    cluster (one with a kept leaf), maximise

        sum_i O_i x_i  -  lambda_b * (sum_v y_v + sum_i x_i) / (M + N)  +  (lambda_d / K) * sum_k z_k

    subject to y_v >= x_i for every node v on leaf i's path, y_v <= sum of the x_i below v, z_k <= sum of the x_i in
    cluster k, and sum_i x_i >= 1. Here O_i = n_i / sum(n) with n = rebase_allocation(scores, width, temperature)
    (REBASE's sequential-ceil counts at the REBASE temperature); N is the number of leaves and M the number of
    distinct nodes above them, the root included, so leaves count in the node term and |V_A| = M + N; K is the
    number of distinct cluster labels. As in ETS's code, the coverage term is dropped when lambda_d is 0, when there
    is one trajectory (copies counted), or when every leaf's last step has the same text (`steps`, when given, holds
    one distinct value). Then the width is shared among the kept leaves by REBASE again (rebase_allocation over the
    kept leaves only).

    Ties: values are computed exactly (rationals), and among optimal subsets the one that keeps the leaves earliest in
    REBASE's order (score descending, then index) wins: the first leaf in that order kept by one optimal subset and
    not by another decides for the first (stree.search.subsets). At equal value this keeps rather than prunes; with
    lambda_b = 0 it keeps every leaf, which is what the reference code gets from the small reward (1e-4 per node)
    it substitutes for lambda_b = 0. Two details differ from that code on purpose: the counts are computed in float64
    (theirs in float32), and in the final REBASE pass leaves of equal score are visited in index order as in the first
    (theirs visits them in reverse there), which decides only which of equal-score leaves gets the larger share.

    leaf_ancestors[i]: the ids of the nodes above leaf i, root first (its path from the root; the root is an
    ancestor of every leaf, as in ETS's branch mapping). clusters[i]: leaf i's cluster label. steps[i] (optional):
    a hashable of leaf i's last step (e.g. its token tuple), for the one-distinct-text rule. copies[i] (default 1):
    how many trajectories leaf i stands for (siblings that drew the same step: one node, one state in stree); they
    are kept or pruned together and count once in M + N, and REBASE's counts are computed per copy, as ETS's code
    sees them, and summed; the returned count of a leaf is its copies' total.

    Extensions (off by default): weights="softmax" uses O_i = copies_i e_i / sum(copies e) with e = exp(score /
    temperature) (REBASE's weights before rounding; stree's earlier variant). node_costs ({node id: cost}) and
    leaf_costs (per leaf) replace the unit costs, the node term becoming lambda_b * (sum of kept costs) / (sum of all
    costs), e.g. the bytes each node keeps alive (stree.search.TreeMemory).

    Returns per-leaf continuation counts (0 = pruned) summing to width.
    """
    n = len(scores)
    copies = [1] * n if copies is None else [int(c) for c in copies]
    if n == 0 or not (len(leaf_ancestors) == len(clusters) == len(copies) == n) or (steps is not None and len(steps) != n):
        raise ValueError("leaf_ancestors, scores, clusters (and steps, copies if given) must be non-empty and of the "
                         "same length")
    if weights not in ETS_WEIGHTS:
        raise ValueError(f"weights must be one of {ETS_WEIGHTS}, got {weights!r}")
    if lambda_b < 0 or lambda_d < 0 or min(copies) < 1:
        raise ValueError("lambda_b and lambda_d must be >= 0 and copies >= 1")
    if width == 0:
        return [0] * n
    outcome = _outcome_weights(scores, copies, width, temperature, weights)
    nodes = list(dict.fromkeys(v for path in leaf_ancestors for v in path))
    leaf_cost = [Fraction(1)] * n if leaf_costs is None else [Fraction(c) for c in leaf_costs]
    node_cost = {v: Fraction(1) if node_costs is None else Fraction(node_costs[v]) for v in nodes}
    total = sum(leaf_cost) + sum(node_cost.values())
    if len(leaf_cost) != n or min(leaf_cost + list(node_cost.values())) < 0 or total <= 0:
        raise ValueError("leaf_costs must give one non-negative cost per leaf, node_costs one per ancestor id, "
                         "not all zero")
    budget = Fraction(lambda_b) / total
    gains = [o - budget * c for o, c in zip(outcome, leaf_cost)]
    costs = {v: budget * c for v, c in node_cost.items()}
    coverage = lambda_d > 0 and sum(copies) > 1 and (steps is None or len(set(steps)) > 1)
    bonus = Fraction(lambda_d) / len(set(clusters)) if coverage else Fraction(0)
    scale = math.lcm(*(q.denominator for q in gains + list(costs.values()) + [bonus]))  # exact integers
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    kept, _ = best_leaf_subset(leaf_ancestors, [int(g * scale) for g in gains],
                               {v: int(c * scale) for v, c in costs.items()}, clusters, int(bonus * scale), order)
    counts = [0] * n
    for i, count in zip(kept, _per_copy_rebase([scores[i] for i in kept], [copies[i] for i in kept], width,
                                               temperature)):
        counts[i] = count
    return counts


def _per_copy_rebase(scores, copies, width, temperature):
    """rebase_allocation over every copy of every leaf, summed per leaf."""
    counts = rebase_allocation([s for s, c in zip(scores, copies) for _ in range(c)], width, temperature)
    totals, at = [], 0
    for c in copies:
        totals.append(sum(counts[at:at + c]))
        at += c
    return totals


def _outcome_weights(scores, copies, width, temperature, weights):
    """ETS's outcome weights O_i (exact Fractions summing to 1): REBASE's counts over the width, or softmax."""
    if weights == "rebase":
        return [Fraction(count, width) for count in _per_copy_rebase(scores, copies, width, temperature)]
    mass = _exp_weights(scores, temperature) * np.asarray(copies, dtype=np.float64)
    return [Fraction(float(m)) / Fraction(float(mass.sum())) for m in mass]
