"""One search loop for every strategy: expand the chosen trajectories by one step, score the new steps, choose.

    result = tree_search(model, prompt_ids, verifier, SearchConfig(strategy="rebase", width=16))

The verifier is any callable (prompt_tokens, steps) -> float scoring the latest step of a trajectory (steps: its
list of step token lists); a PRM is wrapped into one. Strategies, dispatched from STRATEGIES, decide how many
continuations each live trajectory gets next; the width shrinks as trajectories finish.
"""
import math
import time
from dataclasses import dataclass

import torch

from .allocation import ETS_WEIGHTS, ets_select, rebase_allocation
from .beam import batched_beam_search
from .clusters import cluster_embeddings
from .policy import Policy
from .tree import Trajectory, TreeMemory, search_result, trajectory_scores


@dataclass
class SearchConfig:
    strategy: str = "rebase"          # best_of_n | beam | dvts | rebase | ets
    width: int = 16                   # N: continuations per step
    beam_width: int = 0               # beam / DVTS: trajectories (subtrees) kept; 0 = round(sqrt(N))
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
    seed: int = 0
    leaf_states: str = "keep"         # keep: every leaf holds its SSM snapshot until the strategy chooses;
                                      # replay: leaves keep tokens only, chosen ones are rebuilt from their parent's
                                      # snapshot (one forward over the step): fewer snapshots, more compute
    # Beam search on the batched step decoder (stree.search.beam), each switch on its own:
    batched: bool = False             # decode candidates as rows of one batch; needs strategy="beam"
    speculative: bool = False         # expand a verified candidate without waiting for its level (SpecScale)
    early_pruning: bool = False       # speculative: drop candidates that can no longer reach their level's top-k
    dedup: bool = True                # siblings from one state share forward passes while their tokens agree
    lazy_verification: bool = False   # speculative: queue verifier requests and score them in batches
    verify_token_budget: int = 2048   # lazy verification: score once this many tokens wait...
    verify_max_deferrals: int = 6     # ...or once a request has waited this many decode steps
    verify_sibling_completion: bool = False  # lazy verification: ...or once all siblings of a request finished

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {self.strategy!r}")
        if self.width < 1 or self.max_steps < 1:
            raise ValueError("width and max_steps must be >= 1")
        if self.ets_weights not in ETS_WEIGHTS or self.ets_costs not in ("nodes", "bytes"):
            raise ValueError(f"ets_weights must be one of {ETS_WEIGHTS} and ets_costs 'nodes' or 'bytes', got "
                             f"{self.ets_weights!r} and {self.ets_costs!r}")
        if self.leaf_states not in ("keep", "replay"):
            raise ValueError(f"leaf_states must be 'keep' or 'replay', got {self.leaf_states!r}")
        if self.batched and self.leaf_states != "keep":
            raise ValueError("batched beam search keeps every candidate's state in its batch: use leaf_states='keep'")
        if self.batched:
            if self.strategy != "beam":
                raise ValueError(f"batched=True runs beam search only: set strategy='beam' (got {self.strategy!r})")
            if self.width % self.kept:
                raise ValueError(f"batched beam search expands each of the k={self.kept} kept trajectories into "
                                 f"width/k children: width ({self.width}) must be a multiple of k (set beam_width)")
        else:
            for name in ("speculative", "early_pruning", "lazy_verification"):
                if getattr(self, name):
                    raise ValueError(f"{name}=True needs the batched beam search (batched=True, strategy='beam')")
            if not self.dedup:
                raise ValueError("dedup=False needs batched=True: the sequential policy always merges siblings")
        if not self.speculative:
            for name in ("early_pruning", "lazy_verification"):
                if getattr(self, name):
                    raise ValueError(f"{name}=True needs speculative=True: synchronous beam search already decides "
                                     "and verifies whole levels at once")
        if self.verify_sibling_completion and not self.lazy_verification:
            raise ValueError("verify_sibling_completion=True is a lazy verification rule: it needs "
                             "lazy_verification=True")
        if self.verify_token_budget < 1 or self.verify_max_deferrals < 0:
            raise ValueError(f"verify_token_budget must be >= 1 and verify_max_deferrals >= 0, got "
                             f"{self.verify_token_budget} and {self.verify_max_deferrals}")

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


def dvts(live, width, config, context):
    """Diverse verifier tree search: the first step's children are dealt into `kept` subtrees; each subtree
    continues only its best trajectory, with an equal share of the width."""
    groups = sorted({t.group for t in live})
    shares = _shares(width, len(groups))
    return [(_best([t for t in live if t.group == g], config, 1)[0], n) for g, n in zip(groups, shares)]


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


STRATEGIES = {"best_of_n": best_of_n, "beam": beam, "dvts": dvts, "rebase": rebase, "ets": ets}


@dataclass
class SearchContext:
    """What strategies may consult besides the live trajectories."""
    memory: "TreeMemory"
    embedder: object = None           # callable(tokens) -> 1-D vector; None = the policy's own hidden state

    def embed(self, trajectory):
        if self.embedder is None:
            return trajectory.state.hidden.float().cpu()
        return torch.as_tensor(self.embedder(trajectory.tokens), dtype=torch.float32).flatten().cpu()


def tree_search(model, prompt_ids, verifier, config, answer_fn=None, embedder=None):
    """Search with `model` as policy. answer_fn(tokens) -> answer or None extracts a trajectory's final answer
    (default: its last 8 tokens as a tuple). embedder(tokens) -> vector gives ETS's diversity embeddings (default:
    the policy's hidden state at the step's last token, no extra model; e.g. a local sentence-transformers model's
    encode on the decoded text). Returns a SearchResult; stats count the tokens of the distinct steps
    drawn (siblings that drew the same step count once), verifier calls, steps, wall time, and peak_tree_bytes:
    the most bytes the tree held right after a step was generated (every live and finished trajectory with its
    shared prefixes) under TreeMemory's model. With config.batched, beam search runs on the batched step decoder,
    synchronous or speculative (stree.search.beam.batched_beam_search, which documents its stats)."""
    policy = Policy(model, temperature=config.temperature, top_p=config.top_p,
                    step_delimiter_ids=config.step_delimiter_ids, step_max_tokens=config.step_max_tokens,
                    eos_token_ids=config.eos_token_ids)
    answer_fn = answer_fn or (lambda tokens: tuple(tokens[-8:]))
    prompt = torch.as_tensor(prompt_ids).flatten().tolist()
    if config.batched:
        return batched_beam_search(policy, prompt, verifier, config, answer_fn)
    generator = torch.Generator().manual_seed(config.seed)
    start = time.perf_counter()
    root = Trajectory(node=0, parent=None, steps=[], step_scores=[], state=policy.prefill(prompt))
    memory = TreeMemory(root.state)
    context = SearchContext(memory, embedder)
    expansions = [(root, config.width)]
    finished, live, next_node = [], [], 1
    stats = dict(step_tokens=0, verifier_calls=0, steps=0, peak_tree_bytes=memory.tree_bytes([root]))
    replay = config.leaf_states == "replay"
    previous_parents = []  # replay: the trajectories expanded last: the chosen leaves are rebuilt from them
    for step in range(config.max_steps):
        parents = [parent for parent, count in expansions if count > 0]
        if replay and step:
            _rebuild_states(policy, parents)
            for parent in previous_parents:
                _release(parent.state)
        previous_parents = parents
        children = []
        for parent, count in expansions:
            if count <= 0:
                continue
            for drawn in policy.sample_steps(parent.state, count, generator):
                if replay or drawn.finished:  # nothing forks from here (yet): drop the snapshot, keep the embedding
                    _release(drawn.state)
                steps = parent.steps + [drawn.tokens]
                score = verifier(prompt, steps)  # siblings that drew the same step share its score
                stats["verifier_calls"] += 1
                for _ in range(drawn.count):  # one search-tree node: the copies share its tokens and state
                    group = len(children) % config.kept if step == 0 else parent.group
                    children.append(Trajectory(next_node, parent, steps, parent.step_scores + [score], drawn.state,
                                               drawn.finished, group))
                next_node += 1
                stats["step_tokens"] += len(drawn.tokens)
        stats["steps"] = step + 1
        finished += [c for c in children if c.finished]
        live = [c for c in children if not c.finished]
        stats["peak_tree_bytes"] = max(stats["peak_tree_bytes"],
                                       memory.tree_bytes(live + finished, parents if replay else None))
        if not replay:  # the children hold their own states now
            for parent in parents:
                _release(parent.state)
        width = config.width - len(finished)
        if not live or width <= 0 or step == config.max_steps - 1:
            break
        expansions = STRATEGIES[config.strategy](live, width, config, context)
    return search_result(finished or live, config.aggregation, answer_fn, stats, start)


def _release(state):
    """Free a PolicyState's cache (its snapshot); its hidden state stays as the step's embedding."""
    state.cache = state.logits = None


def _rebuild_states(policy, chosen):
    """leaf_states="replay": give each chosen trajectory its state back, replaying its last step on top of its
    parent's snapshot, once per search-tree node (copies share one state). A parent's last rebuilt child takes its
    snapshot over instead of copying it; the caller releases the parents that had no chosen child."""
    nodes = list({t.node: t for t in chosen}.values())
    last_child = {id(t.parent.state): t for t in nodes}  # copies of a parent share one state: key by the state
    for t in nodes:
        rebuilt = policy.extend(t.parent.state, t.steps[-1], fork=last_child[id(t.parent.state)] is not t)
        t.state.cache, t.state.logits = rebuilt.cache, rebuilt.logits
