"""HostTree against a naive walk of the parents and triton_kernels' window_index: trees added whole, node by node
and two nodes at a time; random trees, chains and stars, batch 1 and 3, growing past the starting capacity."""
import numpy as np
import pytest
import torch

from stree.models.host_tree import HostTree
from triton_kernels.utils import window_index

KEYS = ((4, 3), (2, 5))  # (conv width, state columns)


def _naive(parents):
    """mask, depth of each row's tree by walking up from every node."""
    batch, T = parents.shape
    mask, depth = np.zeros((batch, T, T), dtype=np.int64), np.zeros((batch, T), dtype=np.int64)
    for b in range(batch):
        for i in range(T):
            node = i
            while node >= 0:
                mask[b, i, node] = 1
                node = parents[b, node]
            depth[b, i] = mask[b, i].sum() - 1
    return mask, depth


def _random_parents(rng, batch, T, shape):
    if shape == "chain":
        return np.tile(np.arange(-1, T - 1), (batch, 1))
    if shape == "star":
        return np.full((batch, T), -1 if T == 1 else 0) - (np.arange(T) == 0)[None] * (T > 1)
    return np.array([[rng.integers(-1, i) if i else -1 for i in range(T)] for _ in range(batch)])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("batch", [1, 3])
def test_host_tree_matches_naive_walk_whole_and_node_by_node(seed, shape, batch):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(1, 12))
    parents = _random_parents(rng, batch, T, shape)
    mask, depth = _naive(parents)
    for split in ("whole", "nodes", "levels"):
        tree = HostTree(batch, KEYS, capacity=2)  # small: add() grows it
        if split == "whole":
            tree.add(parents)
        elif split == "nodes":
            for i in range(T):
                tree.add(parents[:, i:i + 1])
        else:
            for i in range(0, T, 2):
                tree.add(parents[:, i:i + 2])
        np.testing.assert_array_equal(tree.parents, parents)
        np.testing.assert_array_equal(tree.mask, mask)
        np.testing.assert_array_equal(tree.depth, depth)
        for width, state_len in KEYS:
            expected = window_index(torch.from_numpy(parents), torch.arange(T).expand(batch, T), width, state_len)
            np.testing.assert_array_equal(tree._windows[(width, state_len)][:, :T], expected.numpy())
