"""Test-time tree search (in progress): allocation rules shared by the strategies."""
from .allocation import ets_select, rebase_allocation

__all__ = ["rebase_allocation", "ets_select"]
