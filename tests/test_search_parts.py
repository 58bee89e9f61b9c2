import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from loops import path_to
from stree import random_parents
from stree.search import ets_select, rebase_allocation


@pytest.mark.parametrize("scores, width, temperature, want", [
    ([0.0, 0.0], 4, 1.0, [2, 2]),
    ([math.log(3), 0.0], 4, 1.0, [3, 1]),             # e = (3, 1): ceil(4*3/4) = 3, then ceil(1*1/1) = 1
    ([math.log(2), 0.0, 0.0], 5, 1.0, [3, 1, 1]),     # ceil(5*2/4) = 3; ceil(2*1/2) = 1; ceil(1*1/1) = 1
    ([0.0, 0.0, 0.0], 2, 1.0, [1, 1, 0]),             # ceil(2/3) = 1; ceil(1/2) = 1; nothing left
    ([0.0, 1.0], 4, 0.5, [0, 4]),                     # e ratio e^2: ceil(4*7.39/8.39) = 4 for the better leaf
    ([5.0], 7, 0.2, [7]),
    ([0.3, 0.1], 0, 1.0, [0, 0]),
])
def test_rebase_allocation_hand_worked(scores, width, temperature, want):
    assert rebase_allocation(scores, width, temperature) == want


def test_rebase_allocation_sums_to_width_and_prefers_high_scores():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.randn(int(torch.randint(1, 9, (1,), generator=g)), generator=g).tolist()
        width = int(torch.randint(0, 20, (1,), generator=g))
        counts = rebase_allocation(scores, width, 0.3)
        assert sum(counts) == width
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        assert all(counts[a] >= counts[b] for a, b in zip(order, order[1:]))
    with pytest.raises(ValueError):
        rebase_allocation([0.1], 3, 0.0)


def brute_force_ets(paths, scores, clusters, width, lambda_b, lambda_d, temperature, steps=None, copies=None,
                    weights="rebase", node_costs=None, leaf_costs=None):
    """ETS's objective evaluated on every non-empty leaf subset, written out from its formula in exact rationals:
    O_i = (REBASE counts of leaf i's copies) / width (or softmax), y = the nodes on kept paths, z = the clusters kept,
    coverage dropped for one trajectory or one distinct step. Subsets are enumerated from "keep everything" down,
    leaves in REBASE order (score descending, then index), so the first optimum met is the tie rule's winner: the one
    keeping the earliest leaf where optimal subsets differ. Returns (counts, number of optimal subsets)."""
    n = len(scores)
    copies = copies or [1] * n
    owner = [i for i in range(n) for _ in range(copies[i])]
    if weights == "rebase":
        flat = rebase_allocation([scores[i] for i in owner], width, temperature)
        outcome = [Fraction(sum(c for c, o in zip(flat, owner) if o == i), width) for i in range(n)]
    else:
        mass = [copies[i] * float(np.exp((scores[i] - max(scores)) / temperature)) for i in range(n)]
        outcome = [Fraction(m) / Fraction(sum(mass)) for m in mass]
    nodes = {v for path in paths for v in path}
    node_cost = {v: Fraction(1 if node_costs is None else node_costs[v]) for v in nodes}
    leaf_cost = [Fraction(1 if leaf_costs is None else leaf_costs[i]) for i in range(n)]
    all_cost = sum(node_cost.values()) + sum(leaf_cost)
    coverage = lambda_d > 0 and sum(copies) > 1 and (steps is None or len(set(steps)) > 1)
    per_cluster = Fraction(lambda_d) / len(set(clusters)) if coverage else 0
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    best, best_value, optimal = None, None, 0
    for bits in itertools.product([1, 0], repeat=n):
        kept = [order[r] for r in range(n) if bits[r]]
        if not kept:
            continue
        y = {v for i in kept for v in paths[i]}
        z = {clusters[i] for i in kept}
        value = (sum(outcome[i] for i in kept)
                 - Fraction(lambda_b) * (sum(node_cost[v] for v in y) + sum(leaf_cost[i] for i in kept)) / all_cost
                 + per_cluster * len(z))
        if best is None or value > best_value:
            best, best_value, optimal = kept, value, 0
        optimal += value == best_value
    kept_copies = [i for i in owner if i in best]
    flat = rebase_allocation([scores[i] for i in kept_copies], width, temperature)
    counts = [0] * n
    for i, c in zip(kept_copies, flat):
        counts[i] += c
    return counts, optimal


def random_ets_instance(g):
    """A random ETS selection: leaves hung under a random tree (root first paths), scores on a coarse grid (ties),
    a few clusters, copies, repeated step texts, and one of several lambda / width / weights / costs settings."""
    internal = random_parents(int(torch.randint(1, 8, (1,), generator=g)), g)
    n = int(torch.randint(1, 9, (1,), generator=g))
    attach = torch.randint(0, len(internal), (n,), generator=g).tolist()
    paths = [[-1] + path_to(internal, a) for a in attach]               # -1: the root above every tree node
    scores = (torch.randint(0, 5, (n,), generator=g) / 4).tolist()
    clusters = torch.randint(0, int(torch.randint(1, 4, (1,), generator=g)), (n,), generator=g).tolist()
    steps = torch.randint(0, int(torch.randint(1, 4, (1,), generator=g)), (n,), generator=g).tolist()
    copies = (1 + torch.randint(0, 3, (n,), generator=g) * (torch.rand(n, generator=g) < 0.3)).tolist()
    pick = lambda options: options[int(torch.randint(0, len(options), (1,), generator=g))]  # noqa: E731
    kwargs = dict(lambda_b=pick([0.0, 0.5, 1.0, 1.5, 2.0, 4.0]), lambda_d=pick([0.0, 0.5, 1.0, 2.0]),
                  temperature=pick([0.2, 0.5, 1.0]), steps=steps, copies=copies, weights=pick(["rebase", "rebase",
                                                                                               "softmax"]))
    if torch.rand((), generator=g) < 0.25:                              # byte-like costs
        kwargs["node_costs"] = {v: int(torch.randint(0, 4, (1,), generator=g)) * 256 for v in [-1] + list(range(len(internal)))}
        kwargs["leaf_costs"] = [float(c) for c in (torch.randint(1, 4, (n,), generator=g) * 100.5).tolist()]
    width = int(torch.randint(1, 17, (1,), generator=g))
    return (paths, scores, clusters, width), kwargs


def test_ets_select_equals_the_brute_force_optimum():
    """On 600 random instances: ets_select's counts are the brute-force optimum's, ties resolved the same way; a
    tenth of the instances have several optimal subsets, so the tie rule is exercised."""
    g = torch.Generator().manual_seed(0)
    ties = 0
    for _ in range(600):
        args, kwargs = random_ets_instance(g)
        want, optimal = brute_force_ets(*args, **kwargs)
        assert ets_select(*args, **kwargs) == want, (args, kwargs)
        assert sum(want) == args[3]
        ties += optimal > 1
    assert ties > 50


def test_ets_select_follows_the_reference_weights_and_coverage_rule():
    """Hand-worked: width 4 at temperature 1 over scores (log 3, 0): REBASE counts (3, 1), so O = (3/4, 1/4); two
    leaves under their own nodes below a root: M + N = 5. lambda_b = 1: keeping the second leaf costs 2/5 > 1/4, so
    it is pruned; with a second cluster (lambda_d = 1, K = 2) it is worth 1/4 + 1/2 - 2/5 > 0 and kept, unless both
    last steps have the same text, which drops the coverage term."""
    paths, scores = [[0, 1], [0, 2]], [math.log(3), 0.0]
    common = dict(lambda_b=1.0, temperature=1.0)
    assert ets_select(paths, scores, [0, 0], 4, lambda_d=0.0, **common) == [4, 0]
    assert ets_select(paths, scores, [0, 1], 4, lambda_d=1.0, steps=["a", "b"], **common) == [3, 1]
    assert ets_select(paths, scores, [0, 1], 4, lambda_d=1.0, steps=["a", "a"], **common) == [4, 0]
    # the softmax variant weighs the second leaf 1/4 too (e = (3, 1)); REBASE counts each copy: two copies of the
    # second leaf, width 5: counts (3, 1, 1), O = (3/5, 2/5), and the copies' 2/5 exactly pays for their node and
    # leaf (2/5): a tie, which keeps them
    assert ets_select(paths, scores, [0, 0], 4, lambda_d=0.0, weights="softmax", **common) == [4, 0]
    assert ets_select(paths, scores, [0, 0], 5, lambda_d=0.0, copies=[1, 2], **common) == [3, 2]
    with pytest.raises(ValueError, match="weights"):
        ets_select(paths, scores, [0, 0], 4, lambda_d=0.0, weights="uniform", **common)


def test_leaf_subset_search_hands_over_to_highs_with_the_same_optimum():
    """Cut off after one step, best_leaf_subset answers with HiGHS's MILP: the optimal value, from an independent
    solver (the tie rule may differ there); and on instances too large to enumerate, the search and HiGHS agree on
    the optimal value."""
    from stree.search.subsets import LeafForest, best_leaf_subset, subset_value
    g = torch.Generator().manual_seed(1)
    for n, max_steps in [(8, 1)] * 40 + [(20, 5000)] * 6:
        internal = random_parents(n, g)
        paths = [path_to(internal, int(a)) for a in torch.randint(0, n, (n,), generator=g)]
        gains = torch.randint(-6, 10, (n,), generator=g).tolist()
        costs = {v: int(c) for v, c in enumerate(torch.randint(0, 5, (n,), generator=g))}
        clusters = torch.randint(0, 4, (n,), generator=g).tolist()
        bonus = int(torch.randint(0, 8, (1,), generator=g))
        order = torch.randperm(n, generator=g).tolist()
        subset, value = best_leaf_subset(paths, gains, costs, clusters, bonus, order, max_steps=max_steps)
        exact = best_leaf_subset(paths, gains, costs, clusters, bonus, order, max_steps=1)[1] if n > 12 else max(
            subset_value(LeafForest(paths, costs), gains, clusters, bonus, [i for i in range(n) if bits >> i & 1])
            for bits in range(1, 2 ** n))
        assert value == exact
        assert value == subset_value(LeafForest(paths, costs), gains, clusters, bonus, subset)
    with pytest.raises(ValueError, match="two parents"):
        best_leaf_subset([[0, 1], [2, 1]], [1, 1], {0: 1, 1: 1, 2: 1}, [0, 0], 0, [0, 1])


def test_ets_select_extremes():
    leaf_ancestors = [[0, 1], [0, 1], [0, 2], [3]]
    scores = [0.5, 0.4, 0.45, 0.44]
    counts = ets_select(leaf_ancestors, scores, [0, 0, 0, 0], 8, lambda_b=0.0, lambda_d=0.0, temperature=1.0)
    assert all(c > 0 for c in counts)  # every weight is positive: nothing is worth pruning
    counts = ets_select(leaf_ancestors, scores, [0, 0, 0, 0], 8, lambda_b=5.0, lambda_d=0.0, temperature=1.0)
    assert counts == [0, 0, 0, 8]  # nodes dominate: one leaf, the one with the shortest path (2 nodes, not 3)
    counts = ets_select(leaf_ancestors, scores, [0, 1, 2, 3], 8, lambda_b=0.5, lambda_d=10.0, temperature=1.0)
    assert all(c > 0 for c in counts)  # coverage dominates: one leaf of every cluster
    with pytest.raises(ValueError):
        ets_select([], [], [], 4, lambda_b=1.0, lambda_d=1.0, temperature=1.0)


def test_step_score_aggregation_and_voting():
    from stree.search import aggregate_step_scores, weighted_majority_vote
    steps = [0.9, 0.5, 0.8]
    assert aggregate_step_scores(steps, "last") == 0.8
    assert aggregate_step_scores(steps, "min") == 0.5
    assert aggregate_step_scores(steps, "prod") == pytest.approx(0.36)
    with pytest.raises(ValueError):
        aggregate_step_scores(steps, "mean")
    # "7" has more trajectories but "12" more weight; None abstains
    assert weighted_majority_vote(["7", "7", "12", None], [0.2, 0.3, 0.9, 5.0]) == "12"
    assert weighted_majority_vote(["7", "7", "12"], [0.5, 0.5, 0.9]) == "7"
    assert weighted_majority_vote([None], [1.0]) is None


def test_cosine_clusters():
    from stree.search import cluster_embeddings
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    points = torch.stack([a, a * 2 + 0.01 * torch.randn(8, generator=g), b, b + 0.01 * torch.randn(8, generator=g),
                          -a])
    labels = cluster_embeddings(points.numpy(), distance_threshold=0.1)
    assert labels[0] == labels[1] and labels[2] == labels[3] and len(set(labels)) == 3 and labels[0] == 0
    assert cluster_embeddings(points.numpy(), distance_threshold=2.0) == [0] * 5  # one cluster at the top
    assert cluster_embeddings(points[:1].numpy()) == [0]
