"""One search loop for the level-synchronous strategies, and the dispatch to every strategy.

    result = tree_search(model, prompt_ids, verifier, SearchConfig(strategy="rebase", width=16))

The verifier is any callable (prompt_tokens, steps) -> float scoring the latest step of a trajectory (steps: its
list of step token lists); a PRM is wrapped into one. Every strategy generates its steps on batched rows
(stree.search.batched.StepDecoder): for one problem, one forward pass per token for every live trajectory's
sibling branches together. The level-synchronous ones (ALLOCATIONS: best_of_n, beam, dvts, rebase, ets) expand the
chosen trajectories by one step, score the new steps, and decide how many continuations each live trajectory gets
next (ALLOCATIONS holds each one's level rule); the width shrinks as trajectories finish, except in DVTS, where each
subtree keeps its share until it stops. spec_beam is beam search on its own schedule, synchronous or
speculative (stree.search.beam, options in BeamOptions).
"""
import math
import time
from dataclasses import dataclass, field, replace

import torch

from .allocation import ETS_WEIGHTS, ets_select, rebase_allocation
from .batched import Candidate, Request, StepDecoder, candidate_generator, check_seed, shared_batch
from .beam import BeamOptions, spec_beam_searches
from .clusters import cluster_embeddings
from .policy import Policy
from .tree import Trajectory, TreeMemory, search_result, trajectory_scores


@dataclass
class SearchConfig:
    strategy: str = "rebase"          # best_of_n | beam | dvts | rebase | ets | spec_beam
    width: int = 16                   # N: continuations per step
    beam_width: int = 0               # beam / DVTS / spec_beam: trajectories (subtrees) kept; 0 = round(sqrt(N))
    max_steps: int = 8
    temperature: float = 1.0
    top_p: float = None
    step_delimiter_ids: tuple = ()
    step_max_tokens: int = 64
    eos_token_ids: tuple = ()
    rebase_temperature: float = 0.2
    lambda_b: float = 1.0             # ETS: weight of the retained-node term
    lambda_d: float = 1.0             # ETS: weight of the cluster-coverage term
    cluster_threshold: float = 0.3    # ETS: cosine distance cut of the step-embedding clusters
    ets_weights: str = "rebase"       # ETS outcome weights: "rebase" (REBASE's counts / width, as ETS) or "softmax"
    ets_costs: str = "nodes"          # ETS node term: "nodes" (one per node, as ETS) or "bytes" (TreeMemory's bytes)
    aggregation: str = "last"         # trajectory score from step scores: last | min | prod
    seed: int = 0                     # candidate with sibling indices `key` draws from candidate_generator(seed, key)
    leaf_states: str = "keep"         # keep: every leaf holds its SSM snapshot until the strategy chooses;
                                      # replay: leaves keep tokens only, chosen ones are rebuilt from their parent's
                                      # snapshot (one forward pass over their step): fewer snapshots, more compute
    dedup: bool = True                # candidates from one state share a row (one forward) while their tokens agree
    spec_beam: BeamOptions = field(default_factory=BeamOptions)  # strategy="spec_beam" only

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {self.strategy!r}")
        if self.width < 1 or self.max_steps < 1 or self.beam_width < 0:
            raise ValueError(f"width and max_steps must be >= 1 and beam_width >= 0 (0: round(sqrt(width))), got "
                             f"{self.width}, {self.max_steps} and {self.beam_width}")
        check_seed(self.seed)
        if self.ets_weights not in ETS_WEIGHTS or self.ets_costs not in ("nodes", "bytes"):
            raise ValueError(f"ets_weights must be one of {ETS_WEIGHTS} and ets_costs 'nodes' or 'bytes', got "
                             f"{self.ets_weights!r} and {self.ets_costs!r}")
        if self.leaf_states not in ("keep", "replay"):
            raise ValueError(f"leaf_states must be 'keep' or 'replay', got {self.leaf_states!r}")
        if not isinstance(self.spec_beam, BeamOptions):
            raise ValueError(f"spec_beam must be a BeamOptions, got {type(self.spec_beam).__name__}")
        if self.strategy == "spec_beam":
            if self.leaf_states != "keep":
                raise ValueError("spec_beam keeps every candidate's state in its batch: use leaf_states='keep'")
            if self.width % self.kept:
                raise ValueError(f"spec_beam expands each of the k={self.kept} kept trajectories into width/k "
                                 f"children: width ({self.width}) must be a multiple of k (set beam_width)")
        elif self.spec_beam != BeamOptions():
            raise ValueError(f"spec_beam options apply to strategy='spec_beam' only (got {self.strategy!r})")

    @property
    def kept(self):
        return self.beam_width or max(1, round(math.sqrt(self.width)))


def _shares(total, parts):
    """total split into `parts` near-equal ints, larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _scores(trajectories, config):
    return trajectory_scores(trajectories, config.aggregation)


def _best(trajectories, config, k):
    scores = _scores(trajectories, config)
    return [trajectories[i] for i in sorted(range(len(trajectories)), key=lambda i: -scores[i])[:k]]


def best_of_n(live, width, config, context):
    return [(t, 1) for t in live]


def beam(live, width, config, context):
    kept = _best(live, config, config.kept)
    return list(zip(kept, _shares(width, len(kept))))


def rebase(live, width, config, context):
    return list(zip(live, rebase_allocation(_scores(live, config), width, config.rebase_temperature)))


def ets(live, width, config, context):
    """ETS (ets_select) over distinct search-tree nodes: copies of a node (siblings that drew the same step) share one
    state, so they are one leaf of the ILP, kept or pruned together, with REBASE counted per copy; a kept node's count
    is then shared evenly among its copies. Costs: one per node (ETS) or, with ets_costs="bytes", the bytes each node
    keeps alive (TreeMemory)."""
    nodes = {}
    for t in live:
        nodes.setdefault(t.node, []).append(t)
    copies = list(nodes.values())
    heads = [group[0] for group in copies]
    clusters = cluster_embeddings(torch.stack([context.embed(t) for t in heads]).numpy(), config.cluster_threshold)
    costs = {}
    if config.ets_costs == "bytes":
        memory = context.memory
        costs = dict(node_costs={at.node: memory.node_bytes(at) for t in heads for at in list(t.lineage())[1:]},
                     leaf_costs=[memory.leaf_bytes(t) for t in heads])
    counts = ets_select([t.ancestors() for t in heads], _scores(heads, config), clusters, width,
                        lambda_b=config.lambda_b, lambda_d=config.lambda_d, temperature=config.rebase_temperature,
                        steps=[tuple(t.steps[-1]) for t in heads], copies=[len(group) for group in copies],
                        weights=config.ets_weights, **costs)
    return [(t, n) for group, count in zip(copies, counts) for t, n in zip(group, _shares(count, len(group)))]


def _shared_width(allocate):
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


def dvts(children, answers, config, context, last):
    """Diverse verifier tree search (as search-and-learn's DVTS): the first step's children are dealt into k
    subtrees (child j into subtree j % k); each step, every subtree expands only its best child (ties: smallest key)
    into its fixed share of the width (config.width split into k near-equal shares), its other children are
    dropped. A subtree stops when its best child has finished or at the last step: that step's children, finished
    or not, are its answers (all answers ordered by key). The search ends when every subtree has stopped."""
    shares = _shares(config.width, config.kept)
    expansions, answers = [], list(answers)
    for g in sorted({t.group for t in children}):
        members = [t for t in children if t.group == g]
        best = _best(members, config, 1)[0]
        if best.finished or last:
            answers += members
        else:
            expansions.append((best, shares[g]))
    return expansions, sorted(answers, key=lambda t: t.key)


# name -> level rule(children, answers, config, context, last) -> (expansions [(trajectory, count)], answers):
# children are the step's new trajectories (ordered by key), answers the final trajectories so far
ALLOCATIONS = {"best_of_n": _shared_width(best_of_n), "beam": _shared_width(beam), "dvts": dvts,
               "rebase": _shared_width(rebase), "ets": _shared_width(ets)}


@dataclass
class SearchContext:
    """What strategies may consult besides the live trajectories."""
    memory: "TreeMemory"
    embedder: object = None           # callable(tokens) -> 1-D vector; None = the policy's own hidden state

    def embed(self, trajectory):
        if self.embedder is None:
            return trajectory.state.hidden.float().cpu()
        return torch.as_tensor(self.embedder(trajectory.tokens), dtype=torch.float32).flatten().cpu()


def level_searches(policy, prompts, verifiers, config, seeds, answer_fn, embedder=None):
    """Level-synchronous searches of several problems decoded together: one RowBatch, one forward pass per token
    for the live branches of every problem. Each problem moves on by itself: once all branches of its level have
    ended it scores them, chooses, and starts its next level while the others keep decoding. Problem i runs
    `config` with seed seeds[i]; its draws depend only on that seed and its candidates' keys, so each result is the
    one the problem gets searched alone (up to the float rounding of batched rows).
    Returns one SearchResult per problem; stats["peak_held_bytes"] is the whole batch's."""
    start = time.perf_counter()
    batch, roots = shared_batch(policy, prompts)
    configs = [replace(config, seed=seed) for seed in seeds]
    decoder = StepDecoder(policy, batch, dedup=config.dedup, keep_states=config.leaf_states != "replay")
    searches = {owner: _level_search(prompt, verifier, c, state, policy.eos, embedder, owner)
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


def _level_search(prompt, verifier, config, root_state, eos, embedder, owner):
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
            score = verifier(prompt, steps)  # copies of a node (one step of one parent node) share its score
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
        expansions, answers = ALLOCATIONS[config.strategy](children, answers, config, context,
                                                           step == config.max_steps - 1)
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


# name -> search(policy, prompts, verifiers, config, seeds, answer_fn, embedder): one SearchResult per problem
STRATEGIES = {**{name: level_searches for name in ALLOCATIONS}, "spec_beam": spec_beam_searches}


def _policy(model, config):
    return Policy(model, temperature=config.temperature, top_p=config.top_p,
                  step_delimiter_ids=config.step_delimiter_ids, step_max_tokens=config.step_max_tokens,
                  eos_token_ids=config.eos_token_ids)


def tree_search_batch(model, prompts, verifiers, config, answer_fn=None, embedder=None, seeds=None):
    """Search several problems at once: their trajectories share one batch, one forward pass per token for every
    live branch of every problem (what serving many problems on one accelerator does; a strategy that keeps less
    state fits more problems in the same memory). Every strategy; each problem moves on by itself (a
    level-synchronous one to its next level once its own level has ended; spec_beam verifying and expanding its
    own candidates).

    prompts: a list of prompt token ids; verifiers: one verifier per prompt, or one for all; config: the
    SearchConfig of every problem; seeds: one seed per problem (default config.seed for each, so problem i gets
    the result tree_search(model, prompts[i], verifiers[i], config) gets, up to float rounding). Returns a list of
    SearchResults; stats as tree_search's, counted per problem, except peak_held_bytes (the whole batch's) and
    wall_time (the whole call's)."""
    prompts = [torch.as_tensor(p).flatten().tolist() for p in prompts]
    if not prompts:
        raise ValueError("tree_search_batch needs at least one prompt")
    verifiers = list(verifiers) if isinstance(verifiers, (list, tuple)) else [verifiers] * len(prompts)
    seeds = [config.seed] * len(prompts) if seeds is None else list(seeds)
    if len(verifiers) != len(prompts) or len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts need as many verifiers and seeds, got {len(verifiers)} and "
                         f"{len(seeds)}")
    answer_fn = answer_fn or (lambda tokens: tuple(tokens[-8:]))
    return STRATEGIES[config.strategy](_policy(model, config), prompts, verifiers, config, seeds, answer_fn,
                                       embedder)


def tree_search(model, prompt_ids, verifier, config, answer_fn=None, embedder=None):
    """Search with `model` as policy. answer_fn(tokens) -> answer or None extracts a trajectory's final answer
    (default: its last 8 tokens as a tuple). embedder(tokens) -> vector gives ETS's diversity embeddings (default:
    the policy's hidden state at the step's last token, no extra model; e.g. a local sentence-transformers model's
    encode on the decoded text). Returns a SearchResult. stats:
      verifier_calls   one per distinct step of a parent node;
      steps, wall_time;
      forwards         model forward passes: one per decode step (batched), plus the replay passes;
      step_tokens      row-tokens drawn and fed (siblings share a row while their tokens agree);
      replayed, replay_tokens   leaves rebuilt and the tokens fed for them;
      replay_forwards  the passes that rebuilt them (a level's replays of one step length share one pass);
      peak_tree_bytes  the most bytes the tree held right after a step was generated (every live and finished
                       trajectory with its shared prefixes) under TreeMemory's model;
      peak_held_bytes  the most bytes of cache state this engine really kept: the padded batch plus every snapshot
                       alive (RowBatch.held_bytes).
    spec_beam documents its own stats (stree.search.beam.spec_beam_searches)."""
    return tree_search_batch(model, [prompt_ids], [verifier], config, answer_fn, embedder)[0]
