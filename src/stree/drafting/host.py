"""Trees grown level by level on the host: one draft pass per level, its children copied to the host, the next
level chosen there (every shape, greedy or sampled). Each grow function is a generator run by drafting.rows.drive
(through Growth.expand's requests), so that the trees of many rows grow in the same batched draft passes. With
sampling, a node's children are drawn one after another without replacement and the number of children of a node
never depends on the children drawn, which keeps verification lossless."""
import math

from ..adaptive import levels_that_pay
from ..shapes import BeamTree, DynamicTree, StaticTree
from .growth import ancestors


def adaptive_costs(growth, spec):
    """The RoundCosts an adaptive DynamicTree decides with (None: a fixed tree, or no costs measured yet)."""
    adaptive = getattr(spec, "adaptive", False) and growth.costs is not None and growth.costs.known
    return growth.costs if adaptive else None


def grow_static(growth, spec):
    frontier = [growth.root]
    for width in spec.branching:
        children = yield from growth.expand(frontier, width)
        frontier = [growth.add(node, token) for node in frontier for token, _ in children[node]]
    return growth.result()


def grow_dynamic(growth, spec):
    """EAGLE-2's dynamic tree: each level expands the `frontier` nodes of highest estimate (the draft's path
    probability; adaptive, RoundCosts' estimates), and an adaptive tree stops at the first level that does not pay
    (levels_that_pay). Greedy keeps the best nodes at the end (most_probable); sampling spends the budget while
    growing, deciding a node's number of children before drawing them."""
    joint = {growth.root: 0.0}  # log estimate that a node is accepted (see RoundCosts)
    frontier, ratios = [growth.root], None
    costs = adaptive_costs(growth, spec)
    sampled_estimates = costs is not None and not growth.sampler.greedy
    for _ in range(spec.depth):
        expand = sorted(frontier, key=lambda n: -joint[n])[:spec.frontier]
        if not growth.sampler.greedy:  # the budget is spent during growth; ranks are known before drawing
            room = spec.budget - (len(growth.tokens) - growth.root - 1)
            expand = expand[:room // spec.top_k]
        if not expand or (costs is not None and ratios is not None and
                          not levels_that_pay(costs, spec, estimates_of(costs, growth, joint), growth.root, expand,
                                              ratios, growth.passes)):
            break
        children = yield from growth.expand(expand, spec.top_k, spec.coverage)
        frontier, ratios = _add_level(growth, costs, expand, children, joint, sampled_estimates, spec.top_k)
    if not growth.sampler.greedy:
        return growth.result(estimates=estimates_of(costs, growth, joint))
    return most_probable(growth, spec, joint, costs)


def _add_level(growth, costs, expand, children, joint, sampled_estimates, top_k):
    """Add the drafted children of `expand` and their log estimates (into `joint`). Returns (the new nodes, the
    mean estimate of each child rank given its parent, for levels_that_pay)."""
    frontier, ratios = [], [0.0] * top_k
    for node in expand:
        if sampled_estimates and children[node]:
            share = math.log(costs.acceptance.level_accept / sum(math.exp(log_q) for _, log_q in children[node]))
        for rank, (token, log_q) in enumerate(children[node]):
            child = growth.add(node, token)
            estimate = log_q + share if sampled_estimates else log_q
            joint[child] = joint[node] + estimate
            frontier.append(child)
            if costs is not None:
                ratios[rank] += (math.exp(estimate) if sampled_estimates else
                                 costs.acceptance.agreement(math.exp(log_q))) / len(expand)
    return frontier, ratios


def estimates_of(costs, growth, joint):
    """{node: estimated chance of acceptance} of grow_dynamic's nodes: greedy, greedy_estimates; sampled, `joint`
    holds the estimates' logs already (see RoundCosts)."""
    if growth.sampler.greedy:
        return greedy_estimates(costs, growth.parents, joint)[0]
    return {n: math.exp(lp) for n, lp in joint.items() if n != growth.root}


def greedy_estimates(costs, parents, joint):
    """({node: estimated chance the target accepts it}, {node: its draft probability given its parent}) of the
    nodes below the root of `joint` (log draft path probabilities, the root at 0): the product along the path of
    Acceptance.agreement(q), or of q itself without costs (a fixed tree)."""
    estimates, draft_q = {}, {}
    for node in sorted(joint):  # ids are topological
        parent = parents[node]
        if parent in joint:
            draft_q[node] = q = math.exp(joint[node] - joint[parent])
            estimates[node] = estimates.get(parent, 1.0) * (q if costs is None else costs.acceptance.agreement(q))
    return estimates, draft_q


def most_probable(growth, spec, joint, costs):
    """A greedy DynamicTree's kept nodes: the `budget` most probable (adaptive: the most likely of those by their
    estimates, as many as pay); neither a path's probability nor its estimate exceeds its prefix's, so ancestors
    rank first (ties broken towards earlier, i.e. shallower or earlier-drawn, nodes)."""
    ranked = sorted((n for n in joint if n != growth.root), key=lambda n: (-joint[n], n))[:spec.budget]
    estimates, draft_q = greedy_estimates(costs, growth.parents, joint)
    if costs is not None:
        ranked.sort(key=lambda n: (-estimates[n], n))
        ranked = ranked[:costs.best_rate([estimates[n] for n in ranked], growth.passes)[1]]
    keep = set(range(growth.root + 1)) | set(ranked) | ancestors(growth.parents, ranked)
    return growth.result(sorted(keep), estimates, draft_q)


def grow_beam(growth, spec):
    if not growth.sampler.greedy:
        raise ValueError("BeamTree is deterministic and cannot be verified losslessly when sampling; use a "
                         "StaticTree or DynamicTree with temperature > 0")
    beams = [(growth.root, 0.0)]
    for _ in range(spec.steps):
        children = yield from growth.expand([node for node, _ in beams], spec.beams)
        candidates = [(score + log_q, node, token) for node, score in beams for token, log_q in children[node]]
        candidates.sort(key=lambda c: -c[0])
        beams = [(growth.add(node, token), score) for score, node, token in candidates[:spec.beams]]
    leaves = [node for node, _ in beams]
    return growth.result(sorted(set(range(growth.root + 1)) | set(leaves) | ancestors(growth.parents, leaves)))


GROW = {StaticTree: grow_static, DynamicTree: grow_dynamic, BeamTree: grow_beam}  # level by level on the host
