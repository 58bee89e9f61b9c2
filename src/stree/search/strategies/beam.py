"""Beam search, level-synchronous: the best trajectories of a level share the width (k = config.kept of them).

Strategy "spec_beam" (stree.search.strategies.spec_beam) is beam search on its own schedule, synchronous or
speculative, with k kept and width/k children each.
"""
from .common import best, shares


def beam(live, width, config, context):
    """Keep the config.kept best live trajectories (by aggregated score; ties: the smaller key) and split the width
    left among them in near-equal shares, larger shares to the better ones. Returns [(trajectory, count)]."""
    kept = best(live, config, config.kept)
    return list(zip(kept, shares(width, len(kept))))
