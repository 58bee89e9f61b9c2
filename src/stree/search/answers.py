"""Final answers of a search: trajectory scores from step scores, and weighted majority voting."""
import math

AGGREGATIONS = ("last", "min", "prod")


def aggregate_step_scores(step_scores, how="last"):
    """One score per trajectory from its per-step verifier scores: the last, the minimum or the product."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {how!r}")
    if not step_scores:
        raise ValueError("a trajectory needs at least one scored step")
    if how == "last":
        return float(step_scores[-1])
    if how == "min":
        return float(min(step_scores))
    return float(math.prod(step_scores))


def weighted_majority_vote(answers, weights):
    """The answer whose trajectories carry the largest total weight; None answers (nothing extracted) abstain.

    Ties go to the answer reached first. Returns None when no trajectory has an answer.
    """
    if len(answers) != len(weights):
        raise ValueError(f"{len(answers)} answers but {len(weights)} weights")
    totals = {}
    for answer, weight in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + float(weight)
    return max(totals, key=totals.get) if totals else None
