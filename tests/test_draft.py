"""The drafter's trees against independent references: EAGLE-2 style growth and beam search written out naively,
one HF forward per prefix."""
import pytest
import torch

from stree import BeamTree, DynamicTree, StaticTree
from stree.adaptive import Acceptance, Pacing, PassTimes, RoundCosts, levels_that_pay
from stree.drafting import draft_tree, grows_on_device
from stree.shapes import tree_shapes
from stree.models import TreeModel, tiny_model
from stree.sampling import Sampler


def log_probs(model, prefix):
    """log p(next | prefix) from HF's own forward over the whole prefix (vocab,)."""
    with torch.no_grad():
        return model(torch.tensor([prefix])).logits[0, -1].double().log_softmax(-1)


def top(log_p, k):
    values, ids = log_p.topk(k)
    return list(zip(ids.tolist(), values.tolist()))


def reference_dynamic(model, context, spec):
    """Expand the `frontier` most probable paths by their `top_k` children per level, keep the `budget` most
    probable nodes (and their ancestors). Returns the kept paths below the root as token tuples."""
    joint, frontier = {(): 0.0}, [()]
    for _ in range(spec.depth):
        expand = sorted(frontier, key=lambda path: -joint[path])[:spec.frontier]
        frontier = []
        for path in expand:
            for token, lp in top(log_probs(model, context + list(path)), spec.top_k):
                joint[path + (token,)] = joint[path] + lp
                frontier.append(path + (token,))
    best = sorted((p for p in joint if p), key=lambda p: -joint[p])[:spec.budget]
    return {p[:i] for p in best for i in range(1, len(p) + 1)}


def reference_beam(model, context, spec):
    beams = [((), 0.0)]
    for _ in range(spec.steps):
        candidates = [(path + (token,), score + lp) for path, score in beams
                      for token, lp in top(log_probs(model, context + list(path)), spec.beams)]
        beams = sorted(candidates, key=lambda c: -c[1])[:spec.beams]
    return {path[:i] for path, _ in beams for i in range(1, len(path) + 1)}


def reference_static(model, context, spec):
    paths, frontier = set(), [()]
    for width in spec.branching:
        frontier = [path + (token,) for path in frontier
                    for token, _ in top(log_probs(model, context + list(path)), width)]
        paths.update(frontier)
    return paths


def drafted_paths(drafted, trunk_length):
    """Token paths below the root (the trunk's last node) of a DraftedTree."""
    root = trunk_length - 1
    paths = {}
    for node in range(trunk_length, len(drafted.tokens)):
        parent = drafted.parents[node]
        paths[node] = (paths[parent] if parent != root else ()) + (drafted.tokens[node],)
    return set(paths.values())


@pytest.mark.parametrize("spec, reference", [
    (DynamicTree(budget=6, depth=3, top_k=2, frontier=2), reference_dynamic),
    (DynamicTree(budget=9, depth=4, top_k=3, frontier=2), reference_dynamic),
    (BeamTree(beams=3, steps=3), reference_beam),
    (StaticTree((2, 2, 1)), reference_static),
])
@pytest.mark.parametrize("family, seed, trunk", [("mamba2", 0, [5]), ("bamba", 1, [7, 2]), ("mamba2", 2, [3, 9])])
@pytest.mark.parametrize("on_device", [False, True])
def test_greedy_drafts_equal_the_naive_reference(spec, reference, family, seed, trunk, on_device):
    """Greedy drafting keeps exactly the paths the reference procedure chooses, grown on the host or on the device;
    a two-token trunk (an accepted node the draft had not seen, then the root) is fed first."""
    model = tiny_model(family, dtype=torch.float64, vocab_size=16, seed=seed)
    with torch.no_grad():  # spread the next-token distributions so that choices are not near-ties
        model.get_output_embeddings().weight.mul_(20.0)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(seed))
    draft = TreeModel(model)
    draft.prefill(prompt)
    drafted = draft_tree(draft, trunk, spec, Sampler(), generated=0, on_device=on_device)
    assert drafted.tokens[:len(trunk)] == trunk
    want = reference(model, prompt[0].tolist() + trunk, spec)
    assert drafted_paths(drafted, len(trunk)) == want


@pytest.mark.parametrize("spec", [DynamicTree(budget=9, depth=4, top_k=3, frontier=2), BeamTree(beams=3, steps=3),
                                  StaticTree((2, 2, 1))])
@pytest.mark.parametrize("on_device", [False, True])
def test_draft_passes_carry_only_the_nodes_they_expand(spec, on_device):
    """The first pass carries the trunk; each later one only the nodes whose children it drafts (not every child
    of the last level). Every node with a child in the tree was in a pass (so an accepted path misses at most its
    last node), within tree_shapes' slots and pass width."""
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=3)
    draft = TreeModel(model)
    draft.prefill(torch.tensor([[1, 2, 3]]))
    sizes = []
    for name in ("tree_forward", "extend"):
        run = getattr(draft, name)
        setattr(draft, name, lambda tokens, parents, run=run, **kw: (sizes.append(len(tokens[0])),
                                                                      run(tokens, parents, **kw))[1])
    level = draft.extend_on_device  # greedy trees grown on the device feed their levels here, beams on the host
    draft.extend_on_device = lambda R, *args, more=None: (sizes.extend([R] + [m[0] for m in more or ()]),
                                                          level(R, *args, more=more))[1]
    trunk = [4, 5]
    drafted = draft_tree(draft, trunk, spec, Sampler(), generated=0, on_device=on_device)
    _, slots, width = tree_shapes(spec)
    expanding = {"DynamicTree": getattr(spec, "frontier", 0), "BeamTree": getattr(spec, "beams", 0),
                 "StaticTree": 4}[type(spec).__name__]
    assert sizes[0] == len(trunk) and all(size <= min(expanding, width) for size in sizes[1:])
    assert len(sizes) == drafted.passes
    assert drafted.transfers == (1 if on_device and not isinstance(spec, BeamTree) else drafted.passes)
    fed = [i for i in drafted.pass_index if i >= 0]
    assert len(set(fed)) == len(fed) and set(fed) <= set(range(sum(sizes))) and sum(sizes) <= slots  # pruning may drop some
    has_child = {p for p in drafted.parents if p >= 0}
    assert all(drafted.pass_index[n] >= 0 for n in has_child | set(range(len(trunk))))


def test_trees_grow_on_the_device_by_default_only_for_compiled_passes_on_cuda(monkeypatch):
    """draft_on_device=None: eager passes draft on the host (measured faster on a CPU and, eager, on an H200); compiled
    ones on CUDA (CUDA graphs) draft on the device; on a CPU compiled measurements disagree, so it drafts on the host.
    draft_tree asks with the draft's device and compiled flag."""
    import stree.drafting
    assert [grows_on_device(d, c) for d in ("cpu", "cuda", "cuda:1", "mps") for c in (False, True)] == [
        False, False, False, True, False, True, False, False]
    draft = TreeModel(tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=3))
    draft.prefill(torch.tensor([[1, 2, 3]]))
    asked = []
    monkeypatch.setattr(stree.drafting, "grows_on_device", lambda device, compiled: asked.append((device, compiled)))
    for compiled in (False, True):
        draft._compiled = compiled
        drafted = draft_tree(draft, [4], DynamicTree(budget=4, depth=2), Sampler(), generated=0)
        draft.discard()
        assert drafted.transfers == drafted.passes == 2  # the host path: one copy a pass
    assert asked == [(draft.device, False), (draft.device, True)]


def test_device_grown_trees_on_padded_compiled_passes():
    """With fixed pass widths (as on CUDA: every pass padded to pass_width nodes) a device-grown tree fits the
    slots it asked for, equals the naive reference, and compiled levels are shared by every trunk length (no graph
    per round shape: a level's parents come from the ids on the device, not from an int)."""
    import torch._dynamo
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(0))
    spec = DynamicTree(budget=9, depth=4, top_k=3, frontier=2)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    small = TreeModel(model, nodes=4, pass_width=4)  # 4 slots: the tree asks for more (padding included)
    _, slots, width = tree_shapes(spec)  # what generate sizes a draft with
    compiled = TreeModel(model, nodes=slots, pass_width=width).compile(backend="eager")
    context, counts = prompt[0].tolist(), []
    for draft in (small, compiled):
        draft.prefill(prompt)
    for trunk in ([5], [6], [7, 8], [9], [10, 11]):
        for draft in (small, compiled):
            drafted = draft_tree(draft, trunk, spec, Sampler(), generated=0, on_device=True)
            assert drafted_paths(drafted, len(trunk)) == reference_dynamic(model, context + trunk, spec)
            draft.commit([len(trunk) - 1])  # keep the trunk
        context += trunk
        counts.append(graphs["unique_graphs"])
    assert counts[1] == counts[-1]  # after the first commit nothing compiles again


@pytest.mark.parametrize("coverage", [1.0, 0.8, 0.5])
def test_sampled_dynamic_trees_give_each_node_the_children_its_coverage_needs(coverage):
    """Sampling: every expanded node has as many children as the most probable tokens of its distribution (HF's
    own forward over its path) need to reach `coverage` of the mass, at most top_k; its children are distinct."""
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(0))
    spec = DynamicTree(budget=12, depth=4, top_k=3, frontier=3, coverage=coverage)
    fewer = 0
    for seed in range(3):
        draft = TreeModel(model)
        draft.prefill(prompt)
        drafted = draft_tree(draft, [5], spec, Sampler(1.0), generated=0, generator=torch.Generator().manual_seed(seed))
        path = {0: ()}
        children = {}
        for node in range(1, len(drafted.tokens)):
            parent = drafted.parents[node]
            path[node] = path[parent] + (drafted.tokens[node],)
            children.setdefault(parent, []).append(drafted.tokens[node])
        for node, tokens in children.items():
            mass = log_probs(model, prompt[0].tolist() + [5] + list(path[node])).exp().sort(descending=True).values
            needed = spec.top_k if coverage == 1.0 else min(spec.top_k,
                                                             1 + int((mass[:spec.top_k].cumsum(0) < coverage).sum()))
            assert len(tokens) == needed and len(set(tokens)) == len(tokens), (seed, node)
            fewer += needed < spec.top_k
    assert (fewer > 0) == (coverage < 1.0)  # the sharpened distributions leave some nodes a single child


@pytest.mark.parametrize("sampled, on_device", [(True, False), (False, False), (False, True)])
def test_adaptive_trees_estimate_nodes_by_measured_acceptance(sampled, on_device):
    """The node estimates an adaptive tree sizes itself by (DraftedTree.expected is their sum), recomputed from the
    drafted tree: sampled, a child is its parent's estimate times level_accept, split among its siblings by their
    draft probabilities; greedy, its parent's estimate times the measured agreement at the child's draft
    probability (DraftedTree.draft_q, checked against HF's forward)."""
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=4)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(4))
    costs = RoundCosts(PassTimes(draft=1e-9, verify=1.0))  # every level pays
    acceptance = costs.acceptance
    acceptance.note_levels(3, True)
    acceptance.note_levels(0, True)
    assert acceptance.level_accept == pytest.approx((0.95 ** 2 + 0.95 * 3) / (2 * 0.95 ** 2 + 0.95 * 4 + 1))
    acceptance.note_agreement([(q / 20, q % 3 > 0) for q in range(20)] * 3)  # agreement now differs from q
    assert acceptance.agreement(0.12) != pytest.approx(0.12)
    spec = DynamicTree(budget=9, depth=3, top_k=2, frontier=2, adaptive=True, coverage=1.0)
    for seed in range(3):
        draft = TreeModel(model)
        draft.prefill(prompt)
        sampler = Sampler(1.0) if sampled else Sampler()
        drafted = draft_tree(draft, [5], spec, sampler, generated=0, costs=costs,
                             generator=torch.Generator().manual_seed(seed), on_device=on_device)
        children, path = {}, {0: ()}
        for node in range(1, len(drafted.tokens)):
            children.setdefault(drafted.parents[node], []).append(node)
            path[node] = path[drafted.parents[node]] + (drafted.tokens[node],)
        estimate = {0: 1.0}
        for node in range(1, len(drafted.tokens)):
            parent = drafted.parents[node]
            q = log_probs(model, prompt[0].tolist() + [5] + list(path[parent])).exp()
            if sampled:
                siblings = sum(float(q[drafted.tokens[s]]) for s in children[parent])
                estimate[node] = estimate[parent] * acceptance.level_accept * float(q[drafted.tokens[node]]) / siblings
            else:
                draft_q = float(q[drafted.tokens[node]])
                assert drafted.draft_q[node] == pytest.approx(draft_q, rel=1e-6)
                estimate[node] = estimate[parent] * acceptance.agreement(draft_q)
        assert drafted.expected == pytest.approx(sum(estimate.values()) - 1.0, rel=1e-6)


def test_greedy_agreement_is_the_measured_share_shrunk_towards_q():
    """Acceptance.agreement(q): before anything is verified, q itself; then, per bin of q, the decayed share of
    verified children the target chose, shrunk towards q by AGREE_PRIOR tries' worth; bins never seen stay q."""
    import random

    costs = Acceptance()
    for q in (0.0, 0.05, 0.33, 0.999, 1.0):
        assert costs.agreement(q) == pytest.approx(q)
    coin, rounds = random.Random(0), []
    for _ in range(300):
        rounds.append([(coin.uniform(0.6, 0.7), coin.random() < 0.9) for _ in range(5)] +
                      [(coin.uniform(0.2, 0.3), coin.random() < 0.4) for _ in range(3)])
        costs.note_agreement(rounds[-1])

    def shrunk_share(low, high, q):
        hits = tries = 0.0
        for verified in rounds:
            hits, tries = costs.AGREE_MEMORY * hits, costs.AGREE_MEMORY * tries
            for p, agreed in verified:
                if low <= p < high:
                    hits, tries = hits + agreed, tries + 1
        return (costs.AGREE_PRIOR * q + hits) / (costs.AGREE_PRIOR + tries)

    assert costs.agreement(0.65) == pytest.approx(shrunk_share(0.6, 0.7, 0.65), rel=1e-9)
    assert costs.agreement(0.25) == pytest.approx(shrunk_share(0.2, 0.3, 0.25), rel=1e-9)
    assert abs(costs.agreement(0.65) - 0.9) < 0.05 and abs(costs.agreement(0.25) - 0.4) < 0.07
    assert costs.agreement(0.95) == pytest.approx(0.95)
    low = Acceptance()  # the lowest tenth is split at 0.02 and 0.05: each part learns its own share
    for _ in range(100):
        low.note_agreement([(0.01, False), (0.03, True), (0.04, False), (0.07, True)])
    assert low.agreement(0.015) < 0.02 and abs(low.agreement(0.035) - 0.5) < 0.02 and low.agreement(0.09) > 0.95


def test_level_acceptance_follows_verification():
    """level_accept: accepted draft tokens over verification steps (a step that stopped at a leaf is not one), the
    older rounds' counts decayed by 0.95 a round."""
    costs = Acceptance()
    for _ in range(400):
        costs.note_levels(3, True)   # three children accepted, then one node whose children were all rejected
        costs.note_levels(2, False)  # two accepted, the second a leaf
    assert costs.level_accept == pytest.approx((2 + 0.95 * 3) / (2 + 0.95 * 4), rel=1e-6)  # the last round weighs most


def brute_force_rate(costs, probs, passes):
    """max over k of (1 + c * sum(top k)) / round_time(passes, 1 + k), by trying every k."""
    return max(((1 + costs.acceptance.calibration * sum(probs[:k])) / costs.times.round_time(passes, 1 + k), k)
               for k in range(len(probs) + 1))


def test_round_costs_keep_the_best_number_of_nodes():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        steps = torch.rand(4, generator=g).tolist()  # half the time a measured, concave pass curve
        curve = tuple(zip((1, 2, 4, 8, 17), [0.0] + [sum(steps[:i + 1]) / (i + 1) for i in range(4)]))
        times = PassTimes(draft=float(torch.rand(1, generator=g)), verify=float(torch.rand(1, generator=g)) + 0.1,
                          verify_node=float(torch.rand(1, generator=g)) * 0.3, other=0.05)
        calibration = float(torch.rand(1, generator=g)) + 0.3
        times.verify_curve = curve if _ % 2 else ()
        costs = RoundCosts(times, Acceptance(calibration=calibration))
        probs = sorted(torch.rand(12, generator=g).pow(3).tolist(), reverse=True)
        rate, k = costs.best_rate(probs, 3)
        want_rate, want_k = brute_force_rate(costs, probs, 3)
        assert abs(rate - want_rate) < 1e-12 and (k == want_k or abs(
            (1 + calibration * sum(probs[:k])) / times.round_time(3, 1 + k) - want_rate) < 1e-12)


def test_levels_that_pay_extrapolate_the_first_level():
    """An adaptive tree grown on the device decides after the root's children how many levels follow: a chain whose
    every child is estimated at r times its parent gains r^(i+1) tokens at level i for one draft pass more, so
    the number of levels is the one that maximises (1 + r + ... + r^(L+1)) / (round + (1 + L)·draft + verify),
    written out here over every L."""
    spec = DynamicTree(budget=16, depth=8, top_k=1, frontier=1, adaptive=True)
    seen = set()
    for r in (0.3, 0.6, 0.8, 0.9, 0.97):
        for draft in (0.01, 0.05, 0.1, 0.3, 1.0):
            costs = RoundCosts(PassTimes(draft=draft, draft_round=0.2, verify=1.0))
            rate = [sum(r ** i for i in range(L + 2)) / (0.2 + (1 + L) * draft + 1.0) for L in range(8)]
            want = max(range(8), key=lambda L: rate[L])
            got = levels_that_pay(costs, spec, {1: r}, 0, [1], [r], passes=1, most=7)
            assert got == want, (r, draft)
            seen.add(want)
    assert {0, 7} < seen and len(seen) >= 4


def test_levels_beyond_the_next_are_extrapolated_from_earlier_rounds_levels():
    """With a mean agreement per rank from earlier levels (Acceptance.rank_agreement = [a]), a chain's next level is
    estimated from the last level (r times its parent) and every level after it at a times its parent: L levels
    gain r^2 + r^2·a + ... + r^2·a^(L-1), and the number of levels maximises (1 + r + those) / (round + (1 + L)·draft
    + verify), written out over every L."""
    spec = DynamicTree(budget=16, depth=8, top_k=1, frontier=1, adaptive=True)
    seen = set()
    for r, a in ((0.95, 0.3), (0.9, 0.6), (0.5, 0.9), (0.97, 0.97), (0.3, 0.99)):
        for draft in (0.01, 0.05, 0.1, 0.3):
            costs = RoundCosts(PassTimes(draft=draft, draft_round=0.2, verify=1.0), Acceptance(rank_agreement=[a]))
            gains = [1 + r] + [r * r * a ** i for i in range(7)]
            rate = [sum(gains[:L + 1]) / (0.2 + (1 + L) * draft + 1.0) for L in range(8)]
            want = max(range(8), key=lambda L: rate[L])
            assert levels_that_pay(costs, spec, {1: r}, 0, [1], [r], passes=1, most=7) == want, (r, a, draft)
            seen.add(want)
    assert {0, 1, 7} < seen


def test_greedy_adaptive_levels_teach_the_mean_agreement_per_rank():
    """Every level a greedy adaptive tree grown on the device drafts folds the mean over its expanded nodes of
    agreement(q) of their j-th children into Acceptance.rank_agreement (the first level sets it, each later one
    moves it by 1 - RANK_MEMORY), recomputed here from the drafted tree's draft_q (checked against HF's forward in
    test_adaptive_trees_estimate_nodes_by_measured_acceptance). Host decisions, which look one level ahead, neither
    read nor feed it."""
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=4)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(4))
    costs = RoundCosts(PassTimes(draft=1e-9, verify=1.0))  # every level pays
    costs.acceptance.note_agreement([(q / 20, q % 3 > 0) for q in range(20)] * 3)
    spec = DynamicTree(budget=10, depth=3, top_k=2, frontier=2, adaptive=True)  # every node kept
    draft = TreeModel(model)
    draft.prefill(prompt)
    draft_tree(draft, [5], spec, Sampler(), generated=0, costs=costs, on_device=False)
    assert costs.acceptance.rank_agreement is None
    want = None
    for _ in range(2):
        draft = TreeModel(model)
        draft.prefill(prompt)
        drafted = draft_tree(draft, [5], spec, Sampler(), generated=0, costs=costs, on_device=True)
        children, depth = {}, {0: 0}
        for node in range(1, len(drafted.tokens)):
            children.setdefault(drafted.parents[node], []).append(node)
            depth[node] = depth[drafted.parents[node]] + 1
        for level in range(spec.depth):
            expanded = [n for n in sorted(children) if depth[n] == level]
            means = [sum(costs.acceptance.agreement(drafted.draft_q[children[n][j]]) for n in expanded) / len(expanded)
                     for j in range(spec.top_k)]
            want = means if want is None else [0.9 * w + 0.1 * m for w, m in zip(want, means)]
        assert costs.acceptance.rank_agreement == pytest.approx(want, rel=1e-9)


def test_round_costs_split_drafting_into_levels_and_a_fixed_part():
    """A round's drafting is a draft pass per level plus a fixed part (draft_round: the trunk, the last commit):
    rounds of 3 passes whose levels after the first took 2 s each and whose drafting took 9 s teach draft = 2 and
    draft_round = 3; a round of one pass (4 s) counts as a pass of 4 - draft_round; round_time counts both. The
    first fixed part is bounded by twice a pass (a first round that compiles must not steer the model)."""
    costs = PassTimes(draft=5.0, verify=1.0)
    for _ in range(200):
        costs.update(9.0, 3, 4.0, 1.0, 1, 0.0)
    assert costs.draft == pytest.approx(2.0) and costs.draft_round == pytest.approx(3.0)
    costs.update(4.0, 1, 0.0, 1.0, 1, 0.0)
    draft = 2.0 + 0.2 * ((4.0 - 3.0) - 2.0)
    assert costs.draft == pytest.approx(draft) and costs.draft_round == pytest.approx(3.0 + 0.2 * (4.0 - draft - 3.0))
    assert costs.round_time(4, 1) == pytest.approx(costs.draft_round + 4 * draft + 1.0)
    stalled = PassTimes(draft=1.0, verify=1.0)
    stalled.update(100.0, 1, 0.0, 1.0, 1, 0.0)
    assert stalled.draft == pytest.approx(1.2) and stalled.draft_round == pytest.approx(0.2 * 2 * 1.2)


def test_round_costs_interpolate_a_measured_pass_curve():
    """With a measured curve a target pass costs verify + the curve at n: linear between the measured sizes, along
    the last segment beyond them; without one, verify + verify_node * n. Where a second row costs almost a pass,
    an uncertain node does not pay."""
    curve = ((1, 0.0), (2, 0.9), (4, 1.2), (8, 1.5), (17, 2.4))
    costs = PassTimes(draft=0.01, verify=1.0, verify_node=5.0, verify_curve=curve)
    sizes, extra = zip(*curve)
    for n in range(1, 18):
        at = max(i for i, size in enumerate(sizes) if size <= n)
        nxt = min(at + 1, len(sizes) - 1)
        want = extra[at] if nxt == at else extra[at] + (extra[nxt] - extra[at]) * (n - sizes[at]) / (sizes[nxt] -
                                                                                                      sizes[at])
        assert abs(costs.target_time(n) - (1.0 + want)) < 1e-12, n
    assert abs(costs.target_time(20) - (1.0 + 2.4 + 3 * 0.9 / 9)) < 1e-12
    assert PassTimes(verify=1.0, verify_node=0.5).target_time(4) == 3.0
    # a curve measured from 2 nodes on: its first segment's slope below it, its last's beyond
    late = PassTimes(verify=1.0, verify_curve=((2, 0.5), (4, 0.9), (8, 1.3)))
    assert late.target_times(12) == pytest.approx([1.0 + x for x in (0.3, 0.5, 0.7, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4,
                                                                     1.5, 1.6, 1.7)], abs=1e-12)
    # a node of p = 0.5 brings 1.5x the tokens for 1.9x the seconds: none pays; with cheap rows all three do
    assert RoundCosts(costs).best_rate([0.5, 0.05, 0.05], 1)[1] == 0
    assert RoundCosts(PassTimes(draft=0.01, verify=1.0, verify_node=0.02)).best_rate([0.5, 0.05, 0.05], 1)[1] == 3


@pytest.mark.parametrize("draft_cost, verify_node, depth_at_most, nodes_at_least", [
    (10.0, 0.0, 1, 3),      # a draft pass costs ten target passes: stop after the root's children
    (1e-6, 0.0, 5, 9),      # draft passes are free and target rows too: draft the full depth, keep the budget
    (1e-6, 10.0, 5, 0),     # every target node costs ten passes: keep (almost) none
])
@pytest.mark.parametrize("on_device", [False, True])
def test_adaptive_trees_follow_their_costs(draft_cost, verify_node, depth_at_most, nodes_at_least, on_device):
    """The adaptive tree drafts fewer levels when draft passes are dear and keeps fewer nodes when target rows are
    dear; its kept nodes are always the most probable (a subset of the fixed-depth reference)."""
    model = tiny_model("mamba2", dtype=torch.float64, vocab_size=16, seed=0)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(0))
    spec = DynamicTree(budget=9, depth=5, top_k=3, frontier=2, adaptive=True)
    costs = RoundCosts(PassTimes(draft=draft_cost, verify=1.0, verify_node=verify_node, other=0.0))
    draft = TreeModel(model)
    draft.prefill(prompt)
    drafted = draft_tree(draft, [5], spec, Sampler(), generated=0, costs=costs, on_device=on_device)
    kept = drafted_paths(drafted, 1)
    assert drafted.passes <= depth_at_most and len(kept) >= min(nodes_at_least, 9)
    if depth_at_most == 1:  # the root's children only: one copy to the host, no level after the first to time
        assert drafted.passes == drafted.transfers == 1 and drafted.level_seconds == 0.0
    if verify_node >= 10:
        assert len(kept) <= 1
    fixed = reference_dynamic(model, prompt[0].tolist() + [5], DynamicTree(budget=9, depth=drafted.passes, top_k=3,
                                                                           frontier=2))
    assert kept <= fixed


def test_pacing_follows_measured_rates_and_retries_contexts():
    """Pacing: before any round everything speculates; a context whose rounds yield fewer tokens per
    second than a plain step stops speculating once its own evidence outweighs the pooled figures, and plain steps
    taken in it fade that evidence, so it speculates again while speculation pays overall; when no round pays,
    nothing speculates however long, until steps get dearer."""
    costs = Pacing(step=1.0)
    assert costs.speculates((True, 0))
    for _ in range(5):
        costs.note_round((True, 0), tokens=4, seconds=2.0)  # 2 tokens/s against a step's 1
    costs.note_round((False, 0), tokens=1, seconds=2.0)     # 0.5 tokens/s, once: the pooled figures still win
    assert costs.speculates((False, 0))
    for _ in range(10):
        costs.note_round((False, 0), tokens=1, seconds=2.0)
    for _ in range(20):
        costs.note_round((True, 0), tokens=4, seconds=2.0)
    assert not costs.speculates((False, 0)) and costs.speculates((True, 0)) and costs.speculates((False, 3))
    steps = 0
    while not costs.speculates((False, 0)):
        costs.note_step((False, 0), seconds=1.0)
        steps += 1
    assert 3 <= steps <= 40
    slow = Pacing(step=1.0)
    for context in ((True, 0), (False, 0)):
        for _ in range(3):
            slow.note_round(context, tokens=1, seconds=3.0)
    for _ in range(100):
        slow.note_step((False, 0), seconds=1.0)
        assert not slow.speculates((False, 0)) and not slow.speculates((True, 0))
    for _ in range(10):
        slow.note_step((False, 0), seconds=5.0)  # steps got dearer than rounds: rounds pay again
    assert slow.speculates((False, 0)) and slow.speculates((True, 0))


def test_pacing_caps_stalled_rounds_at_twice_the_modelled_time():
    """A round that stalls (a compiled generate's first rounds compile: seconds each) counts as at most twice the
    larger of the cost model's estimate for it and the pooled mean of earlier rounds, even as the first round of all,
    so that it does not make speculation look dear for the rest of the call; an estimate below what rounds really
    take does not cap them below the pooled mean."""
    costs = Pacing(step=1.0)
    costs.note_round((True, 0), tokens=3, seconds=1000.0, estimate=1.0)    # stalled: counts as 2 s
    assert costs.paced[None][2] == pytest.approx(2.0)
    assert costs.speculates((True, 0))                                    # 3 tokens in 2 s beat a 1 s step
    costs.note_round((True, 0), tokens=3, seconds=1.5, estimate=1.0)      # under the cap: counted as it is
    assert costs.paced[None][2] == pytest.approx(0.95 * 2.0 + 1.5)
    costs.note_round((True, 0), tokens=3, seconds=3.0, estimate=0.1)      # the model underestimates: the mean caps
    assert costs.paced[None][2] == pytest.approx(0.95 * (0.95 * 2.0 + 1.5) + 3.0)
    costs.note_round((True, 0), tokens=3, seconds=100.0, estimate=0.1)
    assert costs.paced[None][2] == pytest.approx(0.95 * (0.95 * (0.95 * 2.0 + 1.5) + 3.0) + 2 * (
        (0.95 * (0.95 * 2.0 + 1.5) + 3.0) / (0.95 * (0.95 + 1) + 1)))
    uncapped = Pacing(step=1.0)
    uncapped.note_round((True, 0), tokens=3, seconds=1000.0)              # no estimate, no pooled mean yet
    assert not uncapped.speculates((True, 0))
    uncapped.note_round((True, 0), tokens=3, seconds=5000.0)              # capped by the pooled mean, 1000 s
    assert uncapped.paced[None][2] == pytest.approx(0.95 * 1000.0 + 2000.0)
