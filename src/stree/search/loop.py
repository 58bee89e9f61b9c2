"""Moved: the level-synchronous driver is stree.search.levels, the strategies stree.search.strategies, SearchConfig
stree.search.config and tree_search stree.search.run. Re-exported here so that old imports keep working."""
from .config import SearchConfig  # noqa: F401
from .levels import SearchContext, level_searches  # noqa: F401
from .run import tree_search, tree_search_batch  # noqa: F401
from .strategies import ALLOCATIONS, STRATEGIES  # noqa: F401
from .strategies.beam import beam  # noqa: F401
from .strategies.best_of_n import best_of_n  # noqa: F401
from .strategies.dvts import dvts  # noqa: F401
from .strategies.ets import ets  # noqa: F401
from .strategies.rebase import rebase  # noqa: F401
from .tree import Trajectory, TreeMemory  # noqa: F401
