"""Former home of drafting, kept so that old imports work: the tree shapes are in stree.shapes, tree growth in
stree.drafting, the adaptive tree's cost model in stree.adaptive."""
from .adaptive import RoundCosts
from .adaptive import levels_that_pay as _levels_that_pay  # noqa: F401 (an old private name tests used)
from .drafting import DraftedTree, draft_tree, grows_on_device
from .shapes import BeamTree, DynamicTree, StaticTree, tree_shapes, tree_spec

__all__ = ["StaticTree", "DynamicTree", "BeamTree", "tree_spec", "tree_shapes", "RoundCosts", "DraftedTree",
           "draft_tree", "grows_on_device"]
