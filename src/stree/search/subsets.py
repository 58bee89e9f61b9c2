"""The best subset of a tree's leaves to keep, found exactly (the optimisation inside ETS, stree.search.ets_select).

Over the non-empty subsets S of the leaves, maximise

    value(S) = sum_{i in S} gains[i] - sum_{v in V(S)} costs[v] + bonus * |{clusters[i] : i in S}|

where V(S) is the set of nodes on the paths of the kept leaves (a node shared by several paths counts once). All
numbers are integers, so equal values are exactly equal. Ties go to the subset that keeps the leaves earliest in
`order`: compare two optimal subsets leaf by leaf in that order; the first leaf kept by one and not the other decides
for the one that keeps it (the lexicographically greatest 0/1 vector in `order`). At equal value this keeps more
rather than fewer leaves, and better-ranked rather than worse-ranked ones.

The search is a depth-first branch and bound over the leaves in `order`, keep before prune, so subsets are visited
in exactly the tie order and the first one reaching the optimum is the answer. A branch is cut when an upper bound on
what its completions can reach is no more than the best value found so far (a later subset must do strictly better).
The bound is exact for the tree part (a dynamic program over the nodes: a subtree is worth opening when its leaves
pay for its unpaid nodes) and relaxes the coverage part per cluster (a Lagrangian bonus per leaf of a still-uncovered
cluster). Two rules skip the keep branch without changing the answer: a leaf whose best possible gain is negative once
something is kept, and a leaf whose equal-or-better sibling (same parent, same cluster, earlier in order) was pruned.
The problem is NP-hard (the coverage term makes it a set cover), so the worst case is exponential, as for any exact
integer program; the tests check it against enumeration of every subset. A search that runs past MAX_SEARCH_STEPS
hands over to SciPy's HiGHS MILP solver, which returns an optimal subset but breaks ties its own way.
"""


MAX_SEARCH_STEPS = 5000


class LeafForest:
    """The nodes above a set of leaves, from their root-first paths: per node its parent and cost, per leaf its
    nearest node. `nodes` lists node indices children first (deepest first), for bottom-up passes."""

    def __init__(self, paths, costs):
        index, parent = {}, []
        self.leaf_nodes = []                                   # per leaf: indices of the nodes on its path
        for path in paths:
            above = -1
            for v in path:
                if v not in index:
                    index[v] = len(parent)
                    parent.append(above)
                elif parent[index[v]] != above:
                    raise ValueError(f"node {v!r} has two parents: paths must be root-first paths in one tree")
                above = index[v]
            self.leaf_nodes.append([index[v] for v in path])
        self.parent = parent
        self.cost = [0] * len(parent)
        for v, k in index.items():
            self.cost[k] = costs[v]
        depth = [0] * len(parent)
        for k, p in enumerate(parent):                         # a parent is indexed before its children
            depth[k] = depth[p] + 1 if p >= 0 else 0
        self.nodes = sorted(range(len(parent)), key=lambda k: -depth[k])
        self.leaf_parent = [nodes[-1] if nodes else -1 for nodes in self.leaf_nodes]

    def best_gain(self, leaf_gain, paid):
        """The most that adding leaves can gain: max over sets T of the leaves with a gain (None = not available)
        of sum_{i in T} leaf_gain[i] minus the costs of the nodes they open (paid[k] > 0: already open, free)."""
        value, total = [0] * len(self.parent), 0
        for i, gain in enumerate(leaf_gain):
            if gain is not None and gain > 0:
                p = self.leaf_parent[i]
                if p < 0:
                    total += gain
                else:
                    value[p] += gain
        for k in self.nodes:
            worth = value[k] - (0 if paid[k] else self.cost[k])
            if worth > 0:
                p = self.parent[k]
                if p < 0:
                    total += worth
                else:
                    value[p] += worth
        return total


def best_leaf_subset(paths, gains, costs, clusters, bonus, order, max_steps=MAX_SEARCH_STEPS):
    """The optimal subset (sorted list of leaf indices) and its value; see the module docstring.

    paths[i]: the node ids above leaf i, root first (an empty path: a leaf with no node above it); costs: {node id:
    int >= 0}; gains[i]: int; clusters[i]: any hashable label; bonus: int >= 0 per covered cluster; order: a
    permutation of the leaf indices (the tie order). If the search takes more than max_steps steps it stops and the
    better of its best subset so far and HiGHS's MILP optimum is returned: the optimum still, but among optimal
    subsets whichever HiGHS finds (never reached in the tests or the benchmark; hundreds of steps at 32 leaves).
    """
    n = len(gains)
    if n == 0 or not (len(paths) == len(clusters) == n) or sorted(order) != list(range(n)):
        raise ValueError("paths, gains and clusters need one entry per leaf (at least one) and order a permutation")
    if bonus < 0 or any(c < 0 for c in costs.values()):
        raise ValueError("costs and bonus must be non-negative")
    forest = LeafForest(paths, costs)
    labels = {c: k for k, c in enumerate(dict.fromkeys(clusters))}
    cluster = [labels[c] for c in clusters]
    state = _SearchState(forest, gains, cluster, len(labels), bonus, order, max_steps)
    try:
        state.search(0, 0)
    except _OutOfSteps:
        fallback = _milp_subset(forest, gains, cluster, len(labels), bonus)
        value = subset_value(forest, gains, cluster, bonus, fallback)
        if state.best is None or value > state.best_value:
            return fallback, value
    return state.best, state.best_value


def subset_value(forest, gains, cluster, bonus, subset):
    """value(subset) under the module docstring's objective (forest: a LeafForest)."""
    nodes = {v for i in subset for v in forest.leaf_nodes[i]}
    return (sum(gains[i] for i in subset) - sum(forest.cost[v] for v in nodes)
            + bonus * len({cluster[i] for i in subset}))


def _milp_subset(forest, gains, cluster, clusters, bonus):
    """The same optimum from SciPy's HiGHS MILP solver (x: leaves, y: nodes, z: clusters), for searches that ran
    out of steps. Coefficients are scaled to at most 1."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n, m = len(gains), len(forest.parent)
    scale = max([abs(g) for g in gains] + forest.cost + [bonus, 1])
    objective = np.concatenate([[-g / scale for g in gains], [c / scale for c in forest.cost],
                                [-bonus / scale] * clusters])
    entries, lower = [], []                                     # (row, column, value); row lower bounds

    def constraint(terms, low):                                 # sum of value * variable >= low
        entries.extend((len(lower), col, value) for col, value in terms)
        lower.append(low)

    for i in range(n):
        for v in forest.leaf_nodes[i]:
            constraint([(n + v, 1.0), (i, -1.0)], 0.0)          # y_v >= x_i
    for k in range(clusters):
        constraint([(i, 1.0) for i in range(n) if cluster[i] == k] + [(n + m + k, -1.0)], 0.0)  # z_k <= sum x
    constraint([(i, 1.0) for i in range(n)], 1.0)               # sum x >= 1
    rows, cols, values = zip(*entries)
    matrix = coo_matrix((values, (rows, cols)), shape=(len(lower), n + m + clusters))
    result = milp(objective, integrality=np.ones(n + m + clusters), bounds=Bounds(0, 1),
                  constraints=LinearConstraint(matrix, lower, np.inf), options=dict(mip_rel_gap=0.0))
    if not result.success:
        raise RuntimeError(f"HiGHS did not solve the leaf subset problem: {result.message}")
    return [i for i in range(n) if result.x[i] > 0.5]


class _OutOfSteps(Exception):
    pass


class _SearchState:
    """The branch and bound's mutable state: what is decided, kept, open and covered."""

    def __init__(self, forest, gains, cluster, clusters, bonus, order, max_steps):
        self.forest, self.gains, self.cluster, self.bonus, self.order = forest, gains, cluster, bonus, order
        self.steps_left = max_steps
        n = len(gains)
        self.paid = [0] * len(forest.parent)                   # kept leaves below each node
        self.covered = [0] * clusters                          # kept leaves per cluster
        self.left = [0] * clusters                             # undecided leaves per cluster
        for k in cluster:
            self.left[k] += 1
        self.undecided, self.pruned, self.kept = [True] * n, [False] * n, []
        self.best, self.best_value = None, None
        # siblings of a leaf (same path, same cluster) earlier in order with at least its gain
        group, self.dominators = {}, [[] for _ in range(n)]
        for i in order:
            key = (tuple(forest.leaf_nodes[i]), cluster[i])
            self.dominators[i] = [j for j in group.get(key, []) if gains[j] >= gains[i]]
            group.setdefault(key, []).append(i)

    def search(self, r, value):
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _OutOfSteps
        if r == len(self.order):
            if self.kept and (self.best is None or value > self.best_value):
                self.best, self.best_value = sorted(self.kept), value
            return
        if self.best is not None and value + self.bound() <= self.best_value:
            return
        i = self.order[r]
        k = self.cluster[i]
        self.undecided[i] = False
        self.left[k] -= 1
        most = self.gains[i] + (0 if self.covered[k] else self.bonus)
        if not (self.kept and most < 0) and not any(self.pruned[j] for j in self.dominators[i]):
            self.search(r + 1, value + self.keep(i))
            self.unkeep(i)
        self.pruned[i] = True
        self.search(r + 1, value)
        self.pruned[i] = False
        self.left[k] += 1
        self.undecided[i] = True

    def keep(self, i):
        """Keep leaf i; returns what that adds to the value."""
        k = self.cluster[i]
        delta = self.gains[i] + (0 if self.covered[k] else self.bonus)
        for node in self.forest.leaf_nodes[i]:
            if not self.paid[node]:
                delta -= self.forest.cost[node]
            self.paid[node] += 1
        self.covered[k] += 1
        self.kept.append(i)
        return delta

    def unkeep(self, i):
        self.kept.pop()
        self.covered[self.cluster[i]] -= 1
        for node in self.forest.leaf_nodes[i]:
            self.paid[node] -= 1

    def bound(self):
        """An upper bound on what the undecided leaves can still add. A cluster's bonus is relaxed into a bonus lam
        for each of its leaves plus (bonus - lam) once (any 0 <= lam <= bonus gives a bound); tried with lam = bonus
        everywhere, and with lam = the cheapest standalone cost of covering the cluster for clusters of several
        undecided leaves."""
        forest, n = self.forest, len(self.gains)
        open_clusters = [not c and l > 0 for c, l in zip(self.covered, self.left)]
        full = [self.gains[i] + (self.bonus if open_clusters[self.cluster[i]] else 0) if self.undecided[i] else None
                for i in range(n)]
        bound = forest.best_gain(full, self.paid)
        if not self.bonus or not any(c and self.left[k] > 1 for k, c in enumerate(open_clusters)):
            return bound
        cheapest = [None] * len(open_clusters)
        for i in range(n):
            k = self.cluster[i]
            if self.undecided[i] and open_clusters[k] and self.left[k] > 1:
                cost = sum(forest.cost[v] for v in forest.leaf_nodes[i] if not self.paid[v]) - self.gains[i]
                cheapest[k] = cost if cheapest[k] is None else min(cheapest[k], cost)
        lam = [self.bonus if c is None else min(self.bonus, max(0, c)) for c in cheapest]
        relaxed = [self.gains[i] + (lam[self.cluster[i]] if open_clusters[self.cluster[i]] else 0)
                   if self.undecided[i] else None for i in range(n)]
        once = sum(self.bonus - lam[k] for k, c in enumerate(open_clusters) if c)
        return min(bound, forest.best_gain(relaxed, self.paid) + once)
