"""Test-time tree search: every strategy's steps generated on batched rows (stree.search.rows.RowBatch, one forward
per token for all branches), allocation rules, answer aggregation, diversity clusters, and synchronous or
speculative (SpecScale) beam search (strategy "spec_beam").

Layout: run (tree_search, tree_search_batch) -> config (SearchConfig) -> strategies (one module per strategy;
STRATEGIES and ALLOCATIONS) -> levels (the level-synchronous driver) -> batched (StepDecoder) -> rows (RowBatch).
"""
from .allocation import ets_select, rebase_allocation
from .answers import aggregate_step_scores, weighted_majority_vote
from .batched import StepDecoder, candidate_generator
from .clusters import cluster_embeddings
from .config import SearchConfig
from .lazy import VerificationQueue
from .policy import Policy
from .rows import RowBatch, RowState
from .run import tree_search, tree_search_batch
from .strategies import ALLOCATIONS, STRATEGIES
from .strategies.spec_beam import BeamOptions
from .tree import SearchResult, Trajectory, TreeMemory
from .verifiers import PRMVerifier, score_batch

__all__ = ["rebase_allocation", "ets_select", "aggregate_step_scores", "weighted_majority_vote", "cluster_embeddings",
           "Policy", "STRATEGIES", "ALLOCATIONS", "SearchConfig", "BeamOptions", "SearchResult", "Trajectory",
           "TreeMemory", "tree_search", "tree_search_batch", "PRMVerifier", "score_batch", "RowBatch", "RowState",
           "StepDecoder", "candidate_generator", "VerificationQueue"]
