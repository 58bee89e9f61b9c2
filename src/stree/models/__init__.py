"""Model adapters: run a token tree through an HF model in one pass, and commit the accepted branch."""
import transformers
from packaging.version import Version

# From 5.24 on every model's forward takes its cache as `cache=`; before, Mamba models took cache_params= and hybrids
# past_key_values=, and a cache passed as cache= was silently ignored.
MIN_TRANSFORMERS = "5.24"
if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:  # 5.24.0.dev0 passes
    raise ImportError(f"stree needs transformers>={MIN_TRANSFORMERS}, found {transformers.__version__}: "
                      f"pip install 'transformers>={MIN_TRANSFORMERS}'")

from .cache import StateCache
from .inflate import inflate_bamba, inflate_mamba2
from .packed import drop_packed_linears
from .tiny import TINY_CONFIGS, tiny_model
from .families import SUPPORTED_MODEL_TYPES
from .tree_model import TreeModel

__all__ = ["TreeModel", "StateCache", "SUPPORTED_MODEL_TYPES", "tiny_model", "TINY_CONFIGS", "inflate_bamba",
           "inflate_mamba2", "drop_packed_linears"]
