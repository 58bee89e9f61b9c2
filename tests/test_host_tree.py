"""HostTree against a naive walk of the parents and triton_kernels' window_index: trees added whole, node by node
and two nodes at a time; every tree kind of loops.KINDS, batch 1 and 3, growing past the starting capacity."""
import numpy as np
import pytest
import torch

from loops import KINDS, path_to, random_rows
from stree.models.host_tree import HostTree, PassLayout
from stree.triton_kernels.utils import window_index

KEYS = ((4, 3), (2, 5))  # (conv width, state columns)


def _naive(parents):
    """mask, depth of each row's tree from every node's path (loops.path_to)."""
    batch, T = parents.shape
    mask, depth = np.zeros((batch, T, T), dtype=np.int64), np.zeros((batch, T), dtype=np.int64)
    for b in range(batch):
        for i in range(T):
            path = path_to(parents[b], i)
            mask[b, i, path] = 1
            depth[b, i] = len(path) - 1
    return mask, depth


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_host_tree_matches_naive_walk_whole_and_node_by_node(seed, kind, batch):
    T = 1 + seed * 3  # 1, 4, 7, 10 nodes
    parents = np.array(random_rows(kind, T, batch, seed))
    mask, depth = _naive(parents)
    for split in ("whole", "nodes", "pairs"):
        tree = HostTree(batch, KEYS, capacity=2)  # small: add() grows it
        step = {"whole": T, "nodes": 1, "pairs": 2}[split]
        for i in range(0, T, step):
            tree.add(parents[:, i:i + step])
        np.testing.assert_array_equal(tree.parents, parents)
        np.testing.assert_array_equal(tree.mask, mask)
        np.testing.assert_array_equal(tree.depth, depth)
        for width, state_len in KEYS:
            expected = window_index(torch.from_numpy(parents), torch.arange(T).expand(batch, T), width, state_len)
            np.testing.assert_array_equal(tree._windows[(width, state_len)][:, :T], expected.numpy())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batch", [1, 3])
def test_pass_inputs_unpack_to_what_a_pass_needs(seed, batch):
    """pass_inputs' one tensor, unpacked: every field against the tree and arguments it was built from, for a pass
    over the last nodes added, padded past them (padding rows: position = committed length, token 0)."""
    rng = np.random.default_rng(seed)
    T, length = 3 + 2 * seed, 7 + seed
    parents = np.array(random_rows("random", T, batch, seed))
    mask, depth = _naive(parents)
    tree = HostTree(batch, KEYS, capacity=T + 3)
    tree.add(parents[:, :2])
    tree.add(parents[:, 2:])
    start, width, R = 2, T - 2 + 2, T - 2  # the second add's nodes, padded by two slots
    tokens = rng.integers(0, 100, (batch, R))
    head_rows, extra = [1, 0, 0], rng.integers(-5, 50, 4).tolist()
    flat, layout = tree.pass_inputs(start, width, length, "cpu", tokens, head_rows, extra)
    got = HostTree.unpack(flat, layout)
    np.testing.assert_array_equal(got["rows"], np.arange(start, start + width))
    positions = np.full((batch, width), length)
    positions[:, :R] += depth[:, start:]
    np.testing.assert_array_equal(got["positions"], positions)
    np.testing.assert_array_equal(got["tokens"], np.concatenate([tokens, np.zeros((batch, 2), int)], 1))
    np.testing.assert_array_equal(got["head_rows"], head_rows)
    np.testing.assert_array_equal(got["extra"], extra)
    assert got["length"].item() == length and got["mask"].dtype == torch.bool
    np.testing.assert_array_equal(got["parents"][:, :T], parents)
    np.testing.assert_array_equal(got["mask"][:, :T, :T], mask.astype(bool))
    assert not got["mask"][:, :T, T:].any()  # free slots are nobody's ancestors
    for key in KEYS:
        np.testing.assert_array_equal(got["windows"][key][:, :T], tree._windows[key][:, :T])
    with pytest.raises(ValueError, match="node slots needed"):
        tree.pass_inputs(start, tree.capacity, length, "cpu")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batch", [1, 3])
def test_levels_extended_on_the_device_match_the_naive_walk(seed, batch):
    """HostTree.extended (a level of new nodes whose tokens and parents are tensors, added to the last pass's
    structure): the pass tensor it builds against the naive walk and window_index, level after level, padded
    passes included; the header's positions are the level's depth, its tokens the given ones."""
    rng = np.random.default_rng(seed)
    trunk, length, capacity = 1 + seed, 5, 24
    parents = np.array(random_rows("random", trunk, batch, seed))
    tree = HostTree(batch, KEYS, capacity=capacity)
    tree.add(parents)
    flat, _ = tree.pass_inputs(0, trunk, length, "cpu")
    structure = flat[flat.numel() - tree.structure_size:]
    last = np.arange(trunk)[None].repeat(batch, 0)
    for R, pad in ((2, 0), (3, 2), (1, 1), (4, 0)):
        start = parents.shape[1]
        level = np.stack([rng.choice(row, R) for row in last])  # each new node a child of an earlier node
        tokens = torch.from_numpy(rng.integers(0, 100, (batch, R)))
        depth = rng.integers(1, 9, (batch, R))  # extended() takes the header's positions as given
        layout = PassLayout(batch, R + pad, R, 0, capacity, KEYS)
        header = torch.from_numpy(HostTree.header(layout, start, length, depth, head_rows=list(range(R))))
        flat = HostTree.extended(header, tokens, torch.from_numpy(level), structure, layout)
        structure = flat[flat.numel() - tree.structure_size:]
        parents = np.concatenate([parents, level], 1)
        got, T = HostTree.unpack(flat, layout), parents.shape[1]
        mask, _ = _naive(parents)
        np.testing.assert_array_equal(got["rows"], np.arange(start, start + R + pad))
        np.testing.assert_array_equal(got["positions"][:, :R], length + depth)
        np.testing.assert_array_equal(got["positions"][:, R:], length)
        np.testing.assert_array_equal(got["tokens"][:, :R], tokens)
        assert not got["tokens"][:, R:].any()
        np.testing.assert_array_equal(got["parents"][:, :T], parents)
        np.testing.assert_array_equal(got["mask"][:, :T, :T], mask.astype(bool))
        assert not got["mask"][:, T:].any() and not got["mask"][:, :, T:].any()
        for width, state_len in KEYS:
            expected = window_index(torch.from_numpy(parents), torch.arange(T).expand(batch, T), width, state_len)
            np.testing.assert_array_equal(got["windows"][(width, state_len)][:, :T], expected.numpy())
        last = np.arange(start, T)[None].repeat(batch, 0)
