"""The drafter's trees against independent references: EAGLE-2 style growth and beam search written out naively,
one HF forward per prefix."""
import pytest
import torch

from stree import BeamTree, DynamicTree, StaticTree
from stree.draft import draft_tree
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
def test_greedy_drafts_equal_the_naive_reference(spec, reference, family, seed, trunk):
    """Greedy drafting keeps exactly the paths the reference procedure chooses; a two-token trunk (an accepted node
    the draft had not seen, then the root) is fed first."""
    model = tiny_model(family, dtype=torch.float64, vocab_size=16, seed=seed)
    with torch.no_grad():  # spread the next-token distributions so that choices are not near-ties
        model.get_output_embeddings().weight.mul_(20.0)
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(seed))
    draft = TreeModel(model)
    draft.prefill(prompt)
    drafted = draft_tree(draft, trunk, spec, Sampler(), generated=0)
    assert drafted.tokens[:len(trunk)] == trunk
    want = reference(model, prompt[0].tolist() + trunk, spec)
    assert drafted_paths(drafted, len(trunk)) == want
