import itertools
import math

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


def brute_force_ets(leaf_ancestors, scores, clusters, width, lambda_b, lambda_d, temperature, node_costs=None,
                    leaf_costs=None):
    n = len(scores)
    e = [math.exp(s / temperature) for s in scores]
    w = [x / sum(e) for x in e]
    all_nodes = {v for anc in leaf_ancestors for v in anc}
    node_cost = (lambda v: 1.0) if node_costs is None else node_costs.__getitem__
    leaf_cost = [1.0] * n if leaf_costs is None else leaf_costs
    total_nodes = sum(leaf_cost) + sum(node_cost(v) for v in all_nodes)
    total_clusters = len(set(clusters))
    best, best_value = None, -math.inf
    for size in range(1, n + 1):
        for kept in itertools.combinations(range(n), size):
            nodes = sum(leaf_cost[i] for i in kept) + sum(node_cost(v) for v in {v for i in kept for v in leaf_ancestors[i]})
            value = (sum(w[i] for i in kept) - lambda_b * nodes / total_nodes
                     + lambda_d * len({clusters[i] for i in kept}) / total_clusters)
            if value > best_value + 1e-12:
                best, best_value = kept, value
    counts = [0] * n
    for i, c in zip(best, rebase_allocation([scores[i] for i in best], width, temperature)):
        counts[i] = c
    return counts


@pytest.mark.parametrize("seed", range(12))
def test_ets_select_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    internal = random_parents(int(torch.randint(1, 7, (1,), generator=g)), g)
    n = int(torch.randint(1, 9, (1,), generator=g))
    attach = torch.randint(0, len(internal), (n,), generator=g).tolist()
    leaf_ancestors = [path_to(internal, a) for a in attach]
    scores = (torch.randn(n, generator=g) * 0.5).tolist()
    clusters = torch.randint(0, 3, (n,), generator=g).tolist()
    lambda_b, lambda_d = [(1.0, 1.0), (2.0, 0.5), (0.0, 0.0), (1.5, 2.0)][seed % 4]
    args = (leaf_ancestors, scores, clusters, 16)
    got = ets_select(*args, lambda_b=lambda_b, lambda_d=lambda_d, temperature=0.2)
    assert got == brute_force_ets(*args, lambda_b, lambda_d, 0.2)
    assert sum(got) == 16
    node_costs = {v: float(torch.rand((), generator=g)) * 3 for v in range(len(internal))}
    leaf_costs = (torch.rand(n, generator=g) * 3).tolist()
    got = ets_select(*args, lambda_b=lambda_b, lambda_d=lambda_d, temperature=0.2, node_costs=node_costs,
                     leaf_costs=leaf_costs)
    assert got == brute_force_ets(*args, lambda_b, lambda_d, 0.2, node_costs, leaf_costs)


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
