"""What a search tree is made of: trajectories (search-tree nodes), the memory they keep alive, and the result."""
import time
from dataclasses import dataclass, field

from .rows import nbytes
from .answers import aggregate_step_scores, weighted_majority_vote


@dataclass(eq=False)
class Trajectory:
    node: int                         # id in the search tree (the prompt is node 0); siblings that drew the same
                                      # step are one node (same tokens, one shared state) and share its id
    parent: "Trajectory"
    steps: list                       # token lists, one per step
    step_scores: list
    state: object                     # RowState after the last step (released once nothing forks from it)
    finished: bool = False
    group: int = 0                    # DVTS subtree
    key: tuple = ()                   # sibling indices from the root (seeds the candidate's draws)

    @property
    def tokens(self):
        return [t for step in self.steps for t in step]

    def lineage(self):
        """This trajectory, then its parent, and so on up to the prompt."""
        at = self
        while at is not None:
            yield at
            at = at.parent

    def ancestors(self):
        """Search-tree node ids above this trajectory's node, nearest last."""
        return [t.node for t in self.lineage()][1:][::-1]


@dataclass
class SearchResult:
    answer: object
    trajectories: list                # the finished ones, or the live ones when none finished
    scores: list                      # their aggregated scores
    stats: dict = field(default_factory=dict)


class TreeMemory:
    """What a search tree keeps alive, in bytes, if nodes share their prefixes (the ETS cost model).

    A node keeps the attention K/V of its step's tokens (the prompt for the root); a node that holds a state also
    keeps one SSM snapshot (conv + recurrent states of every Mamba2 layer), from which its children fork: every
    unfinished leaf, or, with SearchConfig(leaf_states="replay"), only the nodes being expanded. Siblings that drew
    the same step are one node. Sizes measured on the prompt's snapshot. This is what a tree that shares prefixes
    keeps; the row engine itself copies each row's prefix (SearchResult.stats["peak_held_bytes"] counts that).
    """

    def __init__(self, root_state):
        """root_state: the prompt's RowState (stree.search.rows)."""
        self.kv_per_token = nbytes(root_state.kv) / root_state.length
        self.ssm_bytes = nbytes(root_state.states)
        self.prompt_length = root_state.length

    def node_bytes(self, trajectory):
        tokens = len(trajectory.steps[-1]) if trajectory.steps else self.prompt_length
        return self.kv_per_token * tokens

    def leaf_bytes(self, trajectory):
        return self.node_bytes(trajectory) + self.ssm_bytes

    def tree_bytes(self, leaves, holders=None):
        """Bytes kept by the leaves and every node on their paths, each node once, plus one SSM snapshot per
        distinct node in `holders` (the trajectories holding a state; default: the unfinished leaves)."""
        nodes = {at.node: at for leaf in leaves for at in leaf.lineage()}
        holders = [leaf for leaf in leaves if not leaf.finished] if holders is None else holders
        return len({t.node for t in holders}) * self.ssm_bytes + sum(self.node_bytes(at) for at in nodes.values())


def trajectory_scores(trajectories, aggregation):
    """Each trajectory's score from its step scores (answers.aggregate_step_scores)."""
    return [aggregate_step_scores(t.step_scores, aggregation) for t in trajectories]


def search_result(final, aggregation, answer_fn, stats, start):
    """The SearchResult of the trajectories `final`: their scores, the weighted majority answer, and stats with
    wall_time measured from `start` (time.perf_counter())."""
    scores = trajectory_scores(final, aggregation)
    answer = weighted_majority_vote([answer_fn(t.tokens) for t in final], scores)
    stats["wall_time"] = time.perf_counter() - start
    return SearchResult(answer, final, scores, stats)
