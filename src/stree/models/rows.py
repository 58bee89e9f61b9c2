"""Moved: the search rows live in stree.search.rows, the HF cache reader in stree.models.hf_cache. Re-exported here
so that `from stree.models.rows import RowBatch, RowState, layer_states` keeps working."""
from ..search.rows import RowBatch, RowState, nbytes  # noqa: F401
from .hf_cache import KV_NAMES, STATE_NAMES, layer_states  # noqa: F401
