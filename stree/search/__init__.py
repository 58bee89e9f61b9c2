"""Test-time tree search (in progress): step generation on forked states, allocation rules, answer aggregation
and diversity clusters."""
from .allocation import ets_select, rebase_allocation
from .answers import aggregate_step_scores, weighted_majority_vote
from .clusters import cluster_embeddings
from .loop import STRATEGIES, SearchConfig, SearchResult, Trajectory, tree_search
from .policy import Policy, PolicyState, Step
from .verifiers import PRMVerifier

__all__ = ["rebase_allocation", "ets_select", "aggregate_step_scores", "weighted_majority_vote", "cluster_embeddings",
           "Policy", "PolicyState", "Step", "STRATEGIES", "SearchConfig", "SearchResult", "Trajectory", "tree_search",
           "PRMVerifier"]
