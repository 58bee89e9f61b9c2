"""How many continuations each partial trajectory gets: REBASE's allocation and ETS's pruning ILP.

Scores are process-reward scores of the current leaves (higher is better).
"""
import math

import numpy as np


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


def ets_select(leaf_ancestors, scores, clusters, width, *, lambda_b, lambda_d, temperature, node_costs=None,
               leaf_costs=None):
    """ETS: choose the leaves to keep by an exact ILP, then share `width` among them with REBASE.

    Maximise  sum_{i in S} w_i  -  lambda_b * |V_S| / |V_A|  +  lambda_d * |C_S| / |C_A|   subject to |S| >= 1, where
    w = softmax(scores / temperature) (REBASE's weights, normalised to sum 1 so the three terms share a scale),
    V_S = the kept leaves and every node on their paths, V_A = all leaves and nodes, C_S = clusters with a kept leaf.
    With node_costs / leaf_costs, |V| becomes the sum of those costs (e.g. bytes a node keeps alive).

    leaf_ancestors[i]: ids of the non-leaf nodes on leaf i's path; clusters[i]: leaf i's cluster label;
    node_costs: {node id: cost} for the non-leaf nodes; leaf_costs[i]: leaf i's cost (both default to 1).
    Returns per-leaf continuation counts (0 = pruned) summing to width. Solved with SciPy's HiGHS MILP solver.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(scores)
    if not (len(leaf_ancestors) == len(clusters) == n) or n == 0:
        raise ValueError("leaf_ancestors, scores and clusters must be non-empty and of the same length")
    nodes = sorted({v for anc in leaf_ancestors for v in anc})
    labels = sorted(set(clusters))
    node_col = {v: n + k for k, v in enumerate(nodes)}
    cluster_col = {c: n + len(nodes) + k for k, c in enumerate(labels)}
    size = n + len(nodes) + len(labels)
    costs = np.array([1.0] * n if leaf_costs is None else list(leaf_costs), dtype=np.float64)
    costs = np.concatenate([costs, [1.0 if node_costs is None else float(node_costs[v]) for v in nodes]])
    if costs.shape[0] != n + len(nodes) or (costs < 0).any() or costs.sum() <= 0:
        raise ValueError("leaf_costs must give one non-negative cost per leaf, node_costs one per ancestor id, "
                         "not all zero")

    w = _exp_weights(scores, temperature)
    gain = np.zeros(size)
    gain[:n + len(nodes)] = -lambda_b * costs / costs.sum()
    gain[:n] += w / w.sum()
    gain[n + len(nodes):] = lambda_d / len(labels)

    rows, lower, upper = [], [], []
    for i, ancestors in enumerate(leaf_ancestors):  # a kept leaf keeps its path: y_v >= x_i
        for v in ancestors:
            row = np.zeros(size)
            row[node_col[v]], row[i] = 1.0, -1.0
            rows.append(row), lower.append(0.0), upper.append(np.inf)
    for c in labels:  # a cluster counts only when one of its leaves is kept: z_c <= sum x_i
        row = np.zeros(size)
        row[cluster_col[c]] = 1.0
        for i in range(n):
            if clusters[i] == c:
                row[i] = -1.0
        rows.append(row), lower.append(-np.inf), upper.append(0.0)
    row = np.zeros(size)
    row[:n] = 1.0
    rows.append(row), lower.append(1.0), upper.append(np.inf)  # |S| >= 1
    result = milp(-gain, integrality=np.ones(size), bounds=Bounds(0, 1),
                  constraints=LinearConstraint(np.array(rows), lower, upper))
    if not result.success:
        raise RuntimeError(f"the ETS ILP was not solved: {result.message}")
    kept = [i for i in range(n) if result.x[i] > 0.5]
    counts = [0] * n
    for i, count in zip(kept, rebase_allocation([scores[i] for i in kept], width, temperature)):
        counts[i] = count
    return counts
