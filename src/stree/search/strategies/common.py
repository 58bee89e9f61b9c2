"""What the level rules share: ranking trajectories by score, splitting a width, and the shared-width level rule.

A level rule (stree.search.levels runs them) is rule(children, answers, config, context, last) -> (expansions
[(trajectory, count)], answers): children are the step's new trajectories (ordered by key), answers the final
trajectories so far, last whether this was the last step. Most strategies spend one shared width and only differ
in how they allocate it among the live trajectories: `shared_width` makes their level rule from that allocation.
"""
from ..tree import trajectory_scores


def shares(total, parts):
    """total split into `parts` near-equal ints, larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def scores(trajectories, config):
    """Each trajectory's aggregated score (config.aggregation)."""
    return trajectory_scores(trajectories, config.aggregation)


def best(trajectories, config, k):
    """The k best trajectories by aggregated score, best first (ties: the earlier in `trajectories`)."""
    ranked = scores(trajectories, config)
    return [trajectories[i] for i in sorted(range(len(trajectories)), key=lambda i: -ranked[i])[:k]]


def shared_width(allocate):
    """The level rule of a strategy that spends one shared width: finished children become answers, the width left
    (config.width minus the answers) goes to the live children by allocate(live, width, config, context) -> [(t,
    count)]; the search ends when nothing is live, the width is spent, or at the last step (the live children
    become answers too)."""
    def level(children, answers, config, context, last):
        answers = answers + [c for c in children if c.finished]
        live = [c for c in children if not c.finished]
        width = config.width - len(answers)
        if not live or width <= 0 or last:
            return [], answers + live
        return allocate(live, width, config, context), answers
    level.__doc__ = allocate.__doc__
    return level
