"""Test-time tree search: step generation on forked states (one at a time, or batched rows), allocation rules,
answer aggregation, diversity clusters, and synchronous or speculative (SpecScale) batched beam search."""
from .allocation import ets_select, rebase_allocation
from .answers import aggregate_step_scores, weighted_majority_vote
from .batched import RowBatch, RowState
from .clusters import cluster_embeddings
from .lazy import VerificationQueue
from .loop import STRATEGIES, SearchConfig, tree_search
from .policy import Policy, PolicyState, Step
from .tree import SearchResult, Trajectory, TreeMemory
from .verifiers import PRMVerifier, score_batch

__all__ = ["rebase_allocation", "ets_select", "aggregate_step_scores", "weighted_majority_vote", "cluster_embeddings",
           "Policy", "PolicyState", "Step", "STRATEGIES", "SearchConfig", "SearchResult", "Trajectory", "TreeMemory",
           "tree_search",
           "PRMVerifier", "score_batch", "RowBatch", "RowState", "VerificationQueue"]
