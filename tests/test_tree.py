import pytest
import torch

from loops import path_to
from stree import TokenTree, TokenTreeBatch, random_parents, static_parents
from stree.triton_kernels import ancestor_mask


@pytest.mark.parametrize("kind", ["chain", "star", "random", "deep"])
@pytest.mark.parametrize("T", [1, 2, 17, 64, 130])
def test_ancestor_mask_matches_parent_walk(kind, T):
    g = torch.Generator().manual_seed(T)
    rows = [random_parents(T, g, kind=kind) for _ in range(3)]
    mask = ancestor_mask(torch.tensor(rows))
    for b, parents in enumerate(rows):
        want = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            want[i, path_to(parents, i)] = True
        assert torch.equal(mask[b], want)


def test_tree_structure():
    #      prefix
    #     /      \
    #    0        1
    #   / \       |
    #  2   3      4
    #  |
    #  5
    tree = TokenTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])
    assert len(tree) == 6
    assert tree.depth.tolist() == [0, 0, 1, 1, 1, 2]
    assert tree.path(5) == [0, 2, 5] and tree.path(4) == [1, 4] and tree.path(0) == [0]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3] and tree.children(5) == []
    assert tree.leaves == [3, 4, 5]
    assert tree.ancestor_mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    with pytest.raises(IndexError):
        tree.path(6)


def test_chain_and_single_node():
    chain = TokenTree.chain([5, 6, 7])
    assert chain.parents.tolist() == [-1, 0, 1] and chain.leaves == [2] and chain.depth.tolist() == [0, 1, 2]
    one = TokenTree.chain([9])
    assert one.parents.tolist() == [-1] and one.leaves == [0] and one.path(0) == [0]


def test_from_branching():
    tree = TokenTree.from_branching((3, 2, 2, 1))
    assert len(tree) == 3 + 6 + 12 + 12
    counts = torch.bincount(tree.depth).tolist()
    assert counts == [3, 6, 12, 12]
    assert all(len(tree.children(i)) == 2 for i in range(3))
    assert all(len(tree.children(i)) == 1 for i in range(9, 21))
    assert len(tree.leaves) == 12
    assert static_parents([1, 1, 1]) == [-1, 0, 1]
    tree = TokenTree.from_branching([2], tokens=[4, 5])
    assert tree.tokens.tolist() == [4, 5] and tree.parents.tolist() == [-1, -1]


@pytest.mark.parametrize("tokens, parents, message", [
    ([1, 2], [-1, 1], "earlier node"),
    ([1, 2], [-1, -2], "earlier node"),
    ([1, 2], [-1], "parents has 1"),
    ([], [], "at least one node"),
    ([1, -3], [-1, 0], "non-negative"),
    ([1.5], [-1], "integers"),
    ([[1]], [[-1]], "one-dimensional"),
])
def test_token_tree_rejects_bad_input(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents)


@pytest.mark.parametrize("branching", [(), (2, 0), (2, -1), "32", (1.5,), 3, (True,)])
def test_bad_branching(branching):
    with pytest.raises(ValueError, match="branching"):
        TokenTree.from_branching(branching)


def test_random_parents_kinds():
    g = torch.Generator().manual_seed(0)
    assert random_parents(4, g, kind="chain") == [-1, 0, 1, 2]
    assert random_parents(4, g, kind="star") == [-1] * 4
    for kind in ("random", "deep"):
        parents = random_parents(50, g, kind=kind)
        assert all(-1 <= p < i for i, p in enumerate(parents))
    limited = random_parents(60, g, max_children=2)
    assert max(limited.count(p) for p in set(limited) if p >= 0) <= 2
    with pytest.raises(ValueError):
        random_parents(3, g, kind="bushy")


def test_batch_padding():
    trees = [TokenTree([1, 2, 3], [-1, 0, 0]), TokenTree.chain([7])]
    batch = TokenTreeBatch.stack(trees, pad_token_id=0)
    assert batch.tokens.tolist() == [[1, 2, 3], [7, 0, 0]]
    assert batch.parents.tolist() == [[-1, 0, 0], [-1, -1, -1]]
    assert batch.valid.tolist() == [[True, True, True], [True, False, False]]
    assert batch.num_nodes == [3, 1] and len(batch) == 2
    with pytest.raises(ValueError):
        TokenTreeBatch.stack([])
