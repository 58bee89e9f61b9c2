"""Test helpers. The naive per-node references the kernels are tested against live beside each op in the package
(stree.triton_kernels.<op>_naive) and are re-exported here."""
import torch

from stree import random_parents
from stree.triton_kernels.tree_conv_naive import conv_loop, conv_windows_loop, path_to  # noqa: F401
from stree.triton_kernels.tree_gated_delta_naive import gated_delta_loop  # noqa: F401
from stree.triton_kernels.tree_kda_naive import kda_loop  # noqa: F401
from stree.triton_kernels.tree_scan_naive import scan_loop  # noqa: F401
from stree.triton_kernels.tree_selective_scan_naive import selective_scan_loop  # noqa: F401

BACKENDS = ["torch", "triton"]
KINDS = ["chain", "star", "random", "deep"]


def random_rows(kind, T, batch, seed):
    """`batch` random parent lists of one kind (see stree.random_parents), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [random_parents(T, g, kind=kind) for _ in range(batch)]


def plain_vote(answers, weights):
    """Weighted majority by hand: the answer with the largest summed weight (None abstains; a tie goes to the answer
    seen first)."""
    best, totals = None, {}
    for answer, weight in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + weight
    for answer in totals:
        if best is None or totals[answer] > totals[best]:
            best = answer
    return best
