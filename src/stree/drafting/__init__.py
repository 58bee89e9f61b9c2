"""Drafting: grow a token tree from a draft model below the speculation's root, on the host (every shape, greedy or
sampled: drafting/host.py) or, for greedy static and dynamic trees with compiled CUDA passes, on the device
(drafting/device.py). The tree shapes live in stree.shapes, the adaptive tree's cost model in stree.adaptive."""
import torch

from ..shapes import BeamTree
from .device import grow_on_device
from .growth import DraftedTree, Growth
from .host import GROW
from .rows import drive

__all__ = ["draft_tree", "grows_on_device", "DraftedTree", "Growth"]


def grows_on_device(device, compiled):
    """Whether greedy static and dynamic trees are grown on `device` (no host sync between draft passes, a round's
    levels in one call) rather than level by level on the host: only on CUDA with `compiled` draft passes (CUDA
    graphs), where every compiled call costs its guards and wrappers whatever it computes (about what a small
    draft's level computes) and a copy to the host would wait for the graphs queued before it. Eager, the device
    path's extra launches cost more than the syncs they save, on a GPU as on a CPU; a compiled CPU pass measured no
    steady gain either way (docs: performance). Other accelerators draft on the host."""
    return torch.device(device).type == "cuda" and compiled


def draft_tree(draft, trunk, spec, sampler, generated, generator=None, costs=None, on_device=None, features=None):
    """Draft a tree below trunk[-1] (the speculation's root) with a prefilled stree.models.TreeModel.

    trunk: tokens not yet in the draft's cache, fed as a chain, the root last. generated: new tokens emitted
    before the token that follows the root (for min_new_tokens). The draft's last pass is left uncommitted, so
    draft.commit() may take any node whose pass_index is not -1. costs: a RoundCosts for adaptive trees.
    on_device: grow a greedy StaticTree / DynamicTree on the device (the same tree); None = grows_on_device.
    features: a draft head's (models.head_model.HeadTreeModel): the target's features of the trunk's tokens
    (1, len(trunk), hidden). Returns a DraftedTree.
    """
    growth = Growth(draft, trunk, sampler, generated, generator, costs, features)
    if on_device is None:
        on_device = grows_on_device(draft.device, draft.compiled)
    if on_device and sampler.greedy and not isinstance(spec, BeamTree):
        return grow_on_device(growth, spec)
    return drive(draft, [GROW[type(spec)](growth, spec)])[0]
