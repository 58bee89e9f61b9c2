"""The adaptive tree's cost model: pass timings, measured acceptance and pacing, and the decisions made from them
(DynamicTree(adaptive=True), the default tree)."""
from .acceptance import Acceptance
from .costs import RoundCosts, calibrate, kept_costs, levels_that_pay
from .pacing import Pacing
from .timing import PassTimes

__all__ = ["RoundCosts", "PassTimes", "Acceptance", "Pacing", "calibrate", "kept_costs", "levels_that_pay"]
