"""REBASE: every live trajectory gets a share of the width that grows with its score (stree.search.allocation)."""
from ..allocation import rebase_allocation
from .common import scores


def rebase(live, width, config, context):
    """Share the width left among the live trajectories by REBASE's sequential-ceil rule on their aggregated
    scores at config.rebase_temperature (rebase_allocation); those that get 0 are pruned. Returns [(trajectory,
    count)] for every live one."""
    return list(zip(live, rebase_allocation(scores(live, config), width, config.rebase_temperature)))
