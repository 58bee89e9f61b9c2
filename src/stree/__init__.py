"""stree: speculative tree decoding and tree search for Mamba2 and hybrid (SSM + attention) models.

Kernels alone: ``stree.triton_kernels`` (imports neither transformers nor the model code).
"""
from typing import TYPE_CHECKING

from .tree import TokenTree, TokenTreeBatch, random_parents, static_parents

if TYPE_CHECKING:  # the names _LAZY loads on first use, spelled out for type checkers and the API docs
    from .decoding import GenerationStats, generate
    from .demo import demo_head, demo_pair
    from .heads import DraftHead
    from .draft import BeamTree, DynamicTree, StaticTree
    from .dropin import disable, enable
    from .models import TreeModel
    from .warm_up import warmup

__version__ = "0.1.0"
__all__ = ["TokenTree", "TokenTreeBatch", "random_parents", "static_parents", "generate", "GenerationStats",
           "TreeModel", "StaticTree", "DynamicTree", "BeamTree", "enable", "disable", "demo_pair", "demo_head",
           "DraftHead", "warmup"]

_LAZY = {"generate": ".decoding", "GenerationStats": ".stats", "TreeModel": ".models", "StaticTree": ".shapes",
         "DynamicTree": ".shapes", "BeamTree": ".shapes", "enable": ".dropin", "disable": ".dropin",
         "demo_pair": ".demo", "demo_head": ".demo", "DraftHead": ".heads", "warmup": ".warm_up"}


def __getattr__(name):
    # The decoding side imports transformers; load it on first use so kernel users do not pay for it.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'stree' has no attribute {name!r}")
