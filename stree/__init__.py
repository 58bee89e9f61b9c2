"""stree: speculative tree decoding and tree search for Mamba2 and hybrid (SSM + attention) models."""
from .tree import TokenTree, TokenTreeBatch, random_parents, static_parents

__version__ = "0.1.0"
__all__ = ["TokenTree", "TokenTreeBatch", "random_parents", "static_parents"]
