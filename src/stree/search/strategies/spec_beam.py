"""Beam search on its own schedule (strategy "spec_beam"), synchronous or speculative (SpecScale).

Beam semantics (both modes): level d holds the candidates at depth d (d steps). A level's top-k (by aggregated
score, ties broken by the candidate's key) survive; surviving trajectories that ended (EOS) or reached max_steps
are completed, the others are expanded into width/k children each; level 1 is `width` children of the prompt. The
search ends when a level has no live survivor. The answer is the weighted majority over the completed ones.

Steps are decoded by stree.search.batched.StepDecoder, where every candidate has a key, its sibling indices from
the root, and its own random generator seeded from that key: what a candidate draws depends on who it is, not on
when it is decoded. So the switches below (BeamOptions, and SearchConfig.dedup) change the schedule and the work,
never the candidates (up to float rounding of batched logits; perfect_ties="first_verified" is the one exception),
and runs can be compared exactly.

- synchronous (speculative=False): a level's candidates are decoded together; when all have finished their step
  they are verified in one batch and the level's top-k are expanded. Decode batches shrink as rows finish.
- speculative: a candidate is verified as soon as its step ends and, if not pruned, expanded at once, so rows of
  several levels share decode batches. A level is still closed (its top-k chosen, the rest pruned with their
  subtrees) once its whole membership is known and decided.
- early_pruning: a verified candidate is dropped as soon as k verified candidates of its level outrank it that are
  sure to be in the level whenever it is (their ancestors off its own path are survivors of closed levels), so it
  never drops one of the final top-k. An unverified candidate scores at most the maximum (1.0), so it is dropped
  once k such candidates with the maximum score have smaller keys (perfect_ties="key": exact, the same top-k as
  synchronous beam). perfect_ties="first_verified" is SpecScale's literal rule: once k such candidates have the
  maximum score, every unverified candidate of the level is dropped, so ties at the maximum go to those verified
  first, i.e. to short steps; more work is saved, but the survivors differ from synchronous beam's when many
  candidates score the maximum (with a checking program as verifier that cost accuracy: README).
- dedup (SearchConfig.dedup): siblings from one state share one row (one forward per token) until their draws
  differ; off, every sibling gets its own row.
- lazy_verification: requests wait in a VerificationQueue for verify_token_budget tokens or verify_max_deferrals
  decode steps (or until decoding idles); off, each decode step's finished candidates are verified at once.
- verify_sibling_completion (with lazy_verification): the queue also flushes once every sibling of a waiting request
  (the children of its parent) has finished its step, so a complete family is never left waiting (SpecScale).
"""
import time
from dataclasses import dataclass, field, replace

from ..answers import aggregate_step_scores
from ..batched import Candidate, Request, StepDecoder, candidate_generator, shared_batch
from ..lazy import VerificationQueue
from ..tree import Trajectory, TreeMemory, search_result

MAX_SCORE = 1.0
PERFECT_TIES = ("key", "first_verified")


@dataclass(frozen=True)
class BeamOptions:
    """The switches of strategy "spec_beam" (SearchConfig(strategy="spec_beam", spec_beam=BeamOptions(...)));
    see the module docstring. The default is synchronous beam search."""
    speculative: bool = False         # expand a verified candidate without waiting for its level (SpecScale)
    early_pruning: bool = False       # speculative: drop candidates that can no longer reach their level's top-k
    lazy_verification: bool = False   # speculative: queue verifier requests and score them in batches
    verify_token_budget: int = 2048   # lazy verification: score once this many tokens wait...
    verify_max_deferrals: int = 6     # ...or once a request has waited this many decode steps
    verify_sibling_completion: bool = False  # lazy verification: ...or once all siblings of a request finished
    perfect_ties: str = "key"         # early pruning at the maximum score: "key" (exact) or "first_verified"

    def __post_init__(self):
        if not self.speculative:
            for name in ("early_pruning", "lazy_verification"):
                if getattr(self, name):
                    raise ValueError(f"{name}=True needs speculative=True: synchronous beam search already decides "
                                     "and verifies whole levels at once")
        if self.perfect_ties not in PERFECT_TIES:
            raise ValueError(f"perfect_ties must be one of {PERFECT_TIES}, got {self.perfect_ties!r}")
        if self.perfect_ties != "key" and not self.early_pruning:
            raise ValueError("perfect_ties is an early pruning rule: it needs early_pruning=True")
        if self.verify_sibling_completion and not self.lazy_verification:
            raise ValueError("verify_sibling_completion=True is a lazy verification rule: it needs "
                             "lazy_verification=True")
        if self.verify_token_budget < 1 or self.verify_max_deferrals < 0:
            raise ValueError(f"verify_token_budget must be >= 1 and verify_max_deferrals >= 0, got "
                             f"{self.verify_token_budget} and {self.verify_max_deferrals}")


@dataclass
class Level:
    verified: list = field(default_factory=list)     # candidates scored so far (pruned ones are removed)
    closed: bool = False


class BeamRun:
    """One spec_beam search of `prompt` from its prefilled `root_state`, decoding on `decoder` (a StepDecoder that
    several runs may share, each run's rows tagged `owner`); run_together runs them. See the module docstring."""

    def __init__(self, policy, prompt, verifier, config, decoder, root_state, owner=0):
        self.policy, self.config, self.options = policy, config, config.spec_beam
        self.children_per_survivor = config.width // config.kept
        self.decoder, self.owner = decoder, owner
        self.memory = TreeMemory(root_state)
        self.root = Trajectory(0, None, [], [], root_state)
        options = self.options
        if not options.speculative:
            self.queue = VerificationQueue(verifier, prompt, flush_tokens=None, max_deferrals=None)
        elif options.lazy_verification:
            self.queue = VerificationQueue(verifier, prompt, flush_tokens=options.verify_token_budget,
                                           max_deferrals=options.verify_max_deferrals,
                                           sibling_completion=options.verify_sibling_completion)
        else:
            self.queue = VerificationQueue(verifier, prompt, max_deferrals=0)
        self.levels = {0: Level([self.root], closed=True)}
        self.score = {}
        self.survivors, self.pruned, self.expanded, self.completed = {self.root}, set(), set(), []
        self.next_node = 1
        self.stats = dict(verifier_calls=0, verifier_batches=0, steps=0, pruned=0,
                          peak_tree_bytes=self.memory.tree_bytes([self.root]))

    @property
    def rows(self):
        """This run's branches being decoded (one per batch row)."""
        return [row for row in self.decoder.branches if row.owner == self.owner]

    def _verify_due(self):
        """Score the queue if it is due, then settle."""
        if self.queue.due(idle=not self.rows, decoding={row.parent for row in self.rows}):
            for (row, state), score in self.queue.flush():
                self._accept(row, state, score)
            self._settle()

    def _finish(self):
        # one token per row per forward pass, so no schedule that selects these survivors takes fewer passes than
        # the tokens on their longest chain (a level's step starts only once its parent's has ended)
        self.stats.update(self.decoder.owner_stats(self.owner), verifier_calls=self.queue.calls,
                          verifier_batches=self.queue.batches,
                          critical_path=max(len(t.tokens) for t in self.survivors))

    # decoding

    def _expand(self, trajectories):
        """Rows for the children of `trajectories` (the j-th child of t has key t.key + (j,)); a trajectory's
        children start in one row (split as their draws differ, every one at once without dedup)."""
        requests = []
        for t in trajectories:
            self.expanded.add(t)
            count = self.config.width if t is self.root else self.children_per_survivor
            keys = [t.key + (i,) for i in range(count)]
            requests.append(Request(t.state, [Candidate(k, candidate_generator(self.config.seed, k), t)
                                              for k in keys], owner=self.owner))
        self.decoder.start(requests)
        for t in trajectories:  # the batch holds copies now
            t.state = None

    def _take(self, ended):
        """After a forward pass this run had rows in: its rows whose step ended go to the verification queue."""
        self.queue.defer()
        for row, state in ended:
            self.queue.submit((row, state), row.parent.steps + [row.tokens], family=row.parent)
        self._measure()

    def _measure(self):
        """peak_tree_bytes: the prompt, every unexpanded verified candidate, every queued and decoding step (with
        its ancestors once) under TreeMemory's model."""
        waiting = {id(row): row for row in self.rows + [row for row, _ in self.queue.items()]}.values()
        open_steps = [Trajectory(-1 - i, row.parent, row.parent.steps + [row.tokens], [], None)
                      for i, row in enumerate(waiting)]
        leaves = [t for level in self.levels.values() for t in level.verified if t not in self.expanded]
        self.stats["peak_tree_bytes"] = max(self.stats["peak_tree_bytes"], self.memory.tree_bytes(leaves + open_steps))

    # verification and selection

    def _accept(self, row, state, score):
        """A verified step: one trajectory per candidate of the row, all on one search-tree node (they share the
        step's tokens and state)."""
        depth = len(row.parent.steps) + 1
        level = self.levels.setdefault(depth, Level())
        step_scores = row.parent.step_scores + [score]
        aggregated = aggregate_step_scores(step_scores, self.config.aggregation)  # the same for every copy
        if self.options.early_pruning and aggregated > MAX_SCORE:
            raise ValueError(f"early pruning needs trajectory scores of at most {MAX_SCORE} (it drops candidates "
                             f"that candidates with the maximum score outrank), got {aggregated}")
        for candidate in row.candidates:
            t = Trajectory(self.next_node, row.parent, row.parent.steps + [row.tokens], step_scores, state,
                           row.tokens[-1] in self.policy.eos, key=candidate.key)
            self.score[t] = aggregated
            level.verified.append(t)
        self.next_node += 1
        self.stats["steps"] = max(self.stats["steps"], depth)

    def _settle(self):
        """After new scores: prune, close every level that can be closed, and (speculative) expand every verified
        candidate still standing."""
        if self.options.early_pruning:
            self._prune_early()
        depth = next((d for d in sorted(self.levels) if not self.levels[d].closed), None)
        while depth in self.levels and self.levels[depth].verified and self._closable(depth):
            self._close(depth)
            depth += 1
        if self.options.speculative:
            self._expand([t for d, level in sorted(self.levels.items()) for t in level.verified
                          if d < self.config.max_steps and not t.finished and t not in self.expanded])

    def _rank(self, t):
        return -self.score[t], t.key

    def _doomed(self, t):
        return any(a in self.pruned for a in t.lineage())

    def _prune(self, trajectories):
        for t in trajectories:
            self.pruned.add(t)
            self.stats["pruned"] += 1
        for level in self.levels.values():
            for t in level.verified:
                if self._doomed(t):
                    t.state = None  # nothing will fork from it
            level.verified = [t for t in level.verified if not self._doomed(t)]
        self._drop(self._doomed)

    def _drop(self, doomed_parent):
        """Drop decoding rows and queued requests whose parent satisfies doomed_parent(parent)."""
        self.decoder.drop(lambda row: row.owner == self.owner and doomed_parent(row.parent))
        self.queue.drop(lambda item: doomed_parent(item[0].parent))

    def _drop_candidates(self, doomed):
        """Drop the unverified candidates (decoding or queued) for which doomed(candidate) holds, and the rows they
        leave empty."""
        for row in self.rows + [row for row, _ in self.queue.items()]:
            row.candidates = [c for c in row.candidates if not doomed(c)]
        self.decoder.drop(lambda row: row.owner == self.owner and not row.candidates)
        self.queue.drop(lambda item: not item[0].candidates)

    def _closable(self, depth):
        """Level `depth` is decided: its parent level is closed and none of its candidates is still decoding or
        waiting for a score (children of pruned parents were dropped)."""
        if not self.levels[depth - 1].closed:
            return False
        waiting = self.rows + [row for row, _ in self.queue.items()]
        return not any(len(row.parent.steps) + 1 == depth for row in waiting)

    def _close(self, depth):
        level = self.levels[depth]
        ranked = sorted(level.verified, key=self._rank)
        top, rest = ranked[:self.config.kept], ranked[self.config.kept:]
        self._prune(rest)
        self.survivors.update(top)
        done = [t for t in top if t.finished or depth == self.config.max_steps]
        for t in done:
            t.state = None
        self.completed += done
        self._expand([t for t in top if not t.finished and depth < self.config.max_steps and t not in self.expanded])
        level.closed = True
        self.levels.setdefault(depth + 1, Level())

    def _sure(self, other, path):
        """Whether `other` is in a level whenever a candidate with ancestors `path` (a set, nearest included) is:
        each ancestor of `other` off that path survived a closed level."""
        for a in list(other.lineage())[1:]:
            if a in path:
                return True
            if a not in self.survivors:
                return False
        return True

    def _prune_early(self):
        k = self.config.kept
        for depth, level in self.levels.items():
            if level.closed:
                continue
            if len(level.verified) > k:
                self._prune([t for t in level.verified if self._outranked(t, level.verified, k)])
            perfect = [o for o in level.verified if self.score[o] >= MAX_SCORE]
            if len(perfect) < k:
                continue
            if self.options.perfect_ties == "first_verified":
                self._drop(lambda parent, depth=depth, perfect=perfect: len(parent.steps) + 1 == depth and
                           self._sure_count(perfect, parent) >= k)
            else:  # an unverified candidate scores at most the maximum, so perfect ones with smaller keys outrank it
                self._drop_candidates(lambda c, depth=depth, perfect=perfect: len(c.parent.steps) + 1 == depth and
                                      self._sure_count([o for o in perfect if o.key < c.key], c.parent) >= k)

    def _outranked(self, t, verified, k):
        """At least k sure candidates of t's level rank above t."""
        return self._sure_count([o for o in verified if self._rank(o) < self._rank(t)], t) >= k

    def _sure_count(self, others, t):
        """How many of `others` are in a level whenever a candidate with t's path (t included) is."""
        path = set(t.lineage())
        return sum(self._sure(o, path) for o in others)


def run_together(runs):
    """Run BeamRuns that share one StepDecoder to the end: one forward pass at a time for the rows of every run, each
    run verifying, pruning and expanding by itself, as it would alone."""
    decoder = runs[0].decoder
    for run in runs:
        run._expand([run.root])
    while any(run.rows or len(run.queue) for run in runs):
        if decoder.branches:
            decoding = [run for run in runs if run.rows]
            ended = decoder.step()
            for run in decoding:
                run._take([(row, state) for row, state in ended if row.owner == run.owner])
        for run in runs:
            run._verify_due()
    for run in runs:
        run._finish()


def spec_beam_searches(policy, prompts, verifiers, config, seeds, answer_fn, embedder=None):
    """Beam searches with `policy` (a Policy), one per prompt, decoded together on one batch; config:
    SearchConfig(strategy="spec_beam"), switches in config.spec_beam (BeamOptions); problem i runs with seed
    seeds[i] and gets the result it gets alone (up to float rounding of batched rows). Returns one SearchResult per
    problem; stats: step_tokens (row-tokens decoded), forwards (batched forward passes it had rows in),
    critical_path (the tokens on the longest chain of surviving steps: the fewest forward passes any schedule that
    selects these survivors needs, speculative or not),
    verifier_calls (requests scored) and verifier_batches (verifier invocations), steps (deepest level), pruned
    (candidates pruned after verification), peak_tree_bytes (TreeMemory's model) and peak_held_bytes (the whole
    padded batch plus every snapshot alive, RowBatch.held_bytes). embedder is unused."""
    start = time.perf_counter()
    batch, roots = shared_batch(policy, prompts)
    decoder = StepDecoder(policy, batch, dedup=config.dedup)
    runs = [BeamRun(policy, prompt, verifier, replace(config, seed=seed), decoder, root, owner)
            for owner, (prompt, verifier, seed, root) in enumerate(zip(prompts, verifiers, seeds, roots))]
    run_together(runs)
    return [search_result(run.completed, config.aggregation, answer_fn, run.stats, start) for run in runs]
