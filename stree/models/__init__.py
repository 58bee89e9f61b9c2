"""Model adapters: run a token tree through an HF model in one pass, and commit the accepted branch."""
from .cache import StateCache
from .inflate import inflate_bamba
from .packed import drop_packed_linears
from .tiny import TINY_CONFIGS, tiny_model
from .tree_model import SUPPORTED_MODEL_TYPES, TreeModel

__all__ = ["TreeModel", "StateCache", "SUPPORTED_MODEL_TYPES", "tiny_model", "TINY_CONFIGS", "inflate_bamba",
           "drop_packed_linears"]
