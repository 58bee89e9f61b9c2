"""The level-synchronous search loop: the driver of the strategies in ALLOCATIONS (best_of_n, beam, dvts, rebase,
ets; stree.search.strategies).

Each level expands the chosen trajectories by one step on batched rows (stree.search.batched.StepDecoder: for
one problem, one forward pass per token for every live trajectory's sibling branches together), scores the new
steps with the verifier, and asks the strategy's level rule how many continuations each trajectory gets next;
the rule also says which trajectories are final answers and when the search ends. Several problems may be decoded
together (level_searches), each moving on to its next level by itself.
"""
import time
from dataclasses import dataclass, replace

import torch

from .batched import Candidate, Request, StepDecoder, candidate_generator, shared_batch
from .tree import Trajectory, TreeMemory, search_result
from .verifiers import check_score


@dataclass
class SearchContext:
    """What strategies may consult besides the live trajectories."""
    memory: "TreeMemory"
    embedder: object = None           # callable(tokens) -> 1-D vector; None = the policy's own hidden state

    def embed(self, trajectory):
        if self.embedder is None:
            return trajectory.state.hidden.float().cpu()
        return torch.as_tensor(self.embedder(trajectory.tokens), dtype=torch.float32).flatten().cpu()


def level_searches(policy, prompts, verifiers, config, seeds, answer_fn, embedder=None, *, level_rule):
    """Level-synchronous searches of several problems decoded together: one RowBatch, one forward pass per token
    for the live branches of every problem. Each problem moves on by itself: once all branches of its level have
    ended it scores them, chooses, and starts its next level while the others keep decoding. Problem i runs
    `config` with seed seeds[i]; its draws depend only on that seed and its candidates' keys, so each result is the
    one the problem gets searched alone (up to the float rounding of batched rows). level_rule: the strategy's
    rule(children, answers, config, context, last) -> (expansions, answers) (stree.search.strategies.ALLOCATIONS).
    Returns one SearchResult per problem; stats["peak_held_bytes"] is the whole batch's."""
    start = time.perf_counter()
    batch, roots = shared_batch(policy, prompts)
    configs = [replace(config, seed=seed) for seed in seeds]
    decoder = StepDecoder(policy, batch, dedup=config.dedup, keep_states=config.leaf_states != "replay")
    searches = {owner: _level_search(prompt, verifier, c, state, policy.eos, embedder, owner, level_rule)
                for owner, (prompt, verifier, c, state) in enumerate(zip(prompts, verifiers, configs, roots))}
    finals, ended = {}, {}

    def resume(owner, sent):
        """Run search `owner` on from `sent` (its level's ended branches) until it starts a level that has branches
        to decode, or finishes."""
        while True:
            try:
                requests, copied = searches[owner].send(sent)
            except StopIteration as stop:
                finals[owner] = stop.value
                return
            decoder.start(requests)
            for trajectory in copied:  # the batch holds copies of their states now
                trajectory.state.release()
            if owner in decoder.owners():
                ended[owner] = []
                return
            sent = []

    for owner in searches:
        resume(owner, None)
    while decoder.branches:
        for branch, state in decoder.step():
            ended[branch.owner].append((branch, state))
        decoding = decoder.owners()
        for owner in [o for o in ended if o not in decoding]:
            resume(owner, ended.pop(owner))
    results = []
    for owner in range(len(prompts)):
        final, stats = finals[owner]
        stats.update(decoder.owner_stats(owner))
        results.append(search_result(final, config.aggregation, answer_fn, stats, start))
    return results


def _level_search(prompt, verifier, config, root_state, eos, embedder, owner, level_rule):
    """One problem's level-synchronous search as a generator: for each level it yields (decoder requests, the
    trajectories whose states the batch copies with them) and is sent back the (branch, state) pairs of those
    requests' ended branches; it returns (the final trajectories, stats)."""
    root = Trajectory(0, None, [], [], root_state)
    memory = TreeMemory(root_state)
    context = SearchContext(memory, embedder)
    replay = config.leaf_states == "replay"
    expansions = [(root, config.width)]
    answers, next_node = [], 1
    stats = dict(verifier_calls=0, steps=0, peak_tree_bytes=memory.tree_bytes([root]))
    previous_parents = []  # replay: the nodes expanded last step: their snapshots rebuild this step's parents
    for step in range(config.max_steps):
        parents = [parent for parent, count in expansions if count > 0]
        ended = yield _requests(expansions, config.seed, replay, owner), (previous_parents if replay else parents)
        previous_parents = parents
        children = []
        for (parent_node, tokens), group in _nodes(ended):
            head = group[0][0].parent
            steps = head.steps + [list(tokens)]
            score = check_score(verifier(prompt, steps))  # copies of a node (one step of a parent node) share it
            stats["verifier_calls"] += 1
            done = tokens[-1] in eos
            state = group[0][1]
            for candidate in sorted((c for branch, _ in group for c in branch.candidates), key=lambda c: c.key):
                p = candidate.parent
                children.append(Trajectory(next_node, p, steps, p.step_scores + [score], state, done,
                                           candidate.key[0] % config.kept if step == 0 else p.group, candidate.key))
            next_node += 1
        children.sort(key=lambda t: t.key)
        stats["steps"] = step + 1
        stats["peak_tree_bytes"] = max(stats["peak_tree_bytes"],
                                       memory.tree_bytes(children + answers, parents if replay else
                                                         [c for c in children if not c.finished]))
        expansions, answers = level_rule(children, answers, config, context, step == config.max_steps - 1)
        chosen = {t.node for t, count in expansions if count > 0}
        for t in children:
            if t.node not in chosen:  # nothing will fork from it
                t.state.release()
        if not chosen:
            break
    return [t for t in answers if t.finished] or answers, stats


def _requests(expansions, seed, replay, owner=0):
    """One decoder request per search-tree node to expand: its copies' candidates (trajectory t's j-th continuation
    has key t.key + (j,)) share the node's state. replay: a non-root node's state is rebuilt from its parent's
    snapshot by feeding its step first. owner: the search the requests belong to."""
    by_node = {}
    for t, count in expansions:
        keys = [t.key + (j,) for j in range(count)]
        by_node.setdefault(t.node, (t, []))[1].extend(Candidate(k, candidate_generator(seed, k), t) for k in keys)
    requests = []
    for t, candidates in by_node.values():
        if not candidates:
            continue
        if replay and t.parent is not None:
            requests.append(Request(t.parent.state, candidates, tuple(t.steps[-1]), t.state, owner))
        else:
            requests.append(Request(t.state, candidates, owner=owner))
    return requests


def _nodes(ended):
    """The ended branches grouped into search-tree nodes, one per (parent node, step tokens) (without dedup,
    candidates that drew the same step end in several rows: the node keeps the first row's state), ordered by their
    candidates' smallest key."""
    groups = {}
    for branch, state in ended:
        groups.setdefault((branch.parent.node, tuple(branch.tokens)), []).append((branch, state))
    for group in groups.values():
        for _, duplicate in group[1:]:
            duplicate.release()
    return sorted(groups.items(), key=lambda item: min(c.key for branch, _ in item[1] for c in branch.candidates))
