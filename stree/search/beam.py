"""Beam search on the batched step decoder, synchronous or speculative (SpecScale).

Beam semantics (both modes): level d holds the candidates at depth d (d steps). A level's top-k (by aggregated
score, ties broken by the candidate's key) survive; surviving trajectories that ended (EOS) or reached max_steps
are completed, the others are expanded into width/k children each; level 1 is `width` children of the prompt. The
search ends when a level has no live survivor. The answer is the weighted majority over the completed ones.

Every candidate has a key, its sibling indices from the root, and its own random generator seeded from that key:
what a candidate draws depends on who it is, not on when it is decoded. So the switches below change the schedule
and the work, never the candidates (up to float rounding of batched logits), and runs can be compared exactly.

- synchronous (speculative=False): a level's candidates are decoded together; when all have finished their step
  they are verified in one batch and the level's top-k are expanded. Decode batches shrink as rows finish.
- speculative: a candidate is verified as soon as its step ends and, if not pruned, expanded at once, so rows of
  several levels share decode batches. A level is still closed (its top-k chosen, the rest pruned with their
  subtrees) once its whole membership is known and decided.
- early_pruning: a verified candidate is dropped as soon as k verified candidates of its level outrank it that are
  sure to be in the level whenever it is (their ancestors off its own path are survivors of closed levels), so it
  never drops one of the final top-k. And once k such candidates have the maximum score (1.0), the level's
  unverified candidates are dropped (ties at the maximum go to those verified first).
- dedup: siblings from one state share one row (one forward per token) until their draws differ; off, every
  sibling gets its own row.
- lazy_verification: requests wait in a VerificationQueue for verify_token_budget tokens or verify_max_deferrals
  decode steps (or until decoding idles); off, each decode step's finished candidates are verified at once.
- verify_sibling_completion (with lazy_verification): the queue also flushes once every sibling of a waiting request
  (the children of its parent) has finished its step, so a complete family is never left waiting (SpecScale).
"""
import time
from dataclasses import dataclass, field

import torch

from .answers import aggregate_step_scores
from .batched import RowBatch
from .lazy import VerificationQueue
from .tree import Trajectory, TreeMemory, search_result

MAX_SCORE = 1.0


def candidate_generator(seed, key):
    """The random generator of the candidate with sibling indices `key` (a tuple, root first) in a search seeded
    `seed`: every token of its step is drawn from it."""
    return torch.Generator().manual_seed(hash((seed,) + tuple(key)) & (2 ** 63 - 1))


@dataclass(eq=False)
class Row:
    """Candidates of one parent being decoded in one batch row: they drew the same tokens so far."""
    parent: Trajectory
    tokens: list                                     # the step so far
    siblings: list                                   # [(key, generator)], one per candidate


@dataclass
class Level:
    verified: list = field(default_factory=list)     # candidates scored so far (pruned ones are removed)
    closed: bool = False


class BeamRun:
    """One batched beam search; see the module docstring."""

    def __init__(self, policy, prompt, verifier, config):
        self.policy, self.config = policy, config
        self.children_per_survivor = config.width // config.kept
        state = policy.prefill(prompt)
        self.memory = TreeMemory(state)
        self.batch = RowBatch(policy.model, state)
        self.root = Trajectory(0, None, [], [], RowBatch.snapshot(state))
        self.rows = []                               # Row per batch row
        if not config.speculative:
            self.queue = VerificationQueue(verifier, prompt, flush_tokens=None, max_deferrals=None)
        elif config.lazy_verification:
            self.queue = VerificationQueue(verifier, prompt, flush_tokens=config.verify_token_budget,
                                           max_deferrals=config.verify_max_deferrals,
                                           sibling_completion=config.verify_sibling_completion)
        else:
            self.queue = VerificationQueue(verifier, prompt, max_deferrals=0)
        self.levels = {0: Level([self.root], closed=True)}
        self.key = {self.root: ()}
        self.score = {}
        self.survivors, self.pruned, self.expanded, self.completed = {self.root}, set(), set(), []
        self.next_node = 1
        self.stats = dict(step_tokens=0, forwards=0, verifier_calls=0, verifier_batches=0, steps=0, pruned=0,
                          peak_tree_bytes=self.memory.tree_bytes([self.root]), peak_batch_bytes=0)

    def run(self):
        self._expand([self.root])
        while self.rows or len(self.queue):
            if self.rows:
                self._decode()
            if self.queue.due(idle=not self.rows, decoding={row.parent for row in self.rows}):
                for (row, state), score in self.queue.flush():
                    self._accept(row, state, score)
                self._settle()
        self.stats.update(verifier_calls=self.queue.calls, verifier_batches=self.queue.batches)
        return self.completed

    # decoding

    def _expand(self, trajectories):
        """Rows for the children of `trajectories`; with dedup, the children of one trajectory share a row."""
        states, rows = [], []
        for t in trajectories:
            self.expanded.add(t)
            count = self.config.width if t is self.root else self.children_per_survivor
            siblings = [self._sibling(self.key[t] + (i,)) for i in range(count)]
            groups = [siblings] if self.config.dedup else [[s] for s in siblings]
            states += [t.state] * len(groups)
            rows += [Row(t, [], g) for g in groups]
        self.batch.add(states)
        self.rows += rows
        for t in trajectories:  # the batch holds copies now
            t.state = None

    def _sibling(self, key):
        return key, candidate_generator(self.config.seed, key)

    def _decode(self):
        """Each candidate draws its next token; rows split where their candidates' draws differ; one forward pass;
        rows whose step ended leave the batch for the verification queue."""
        self.queue.defer()
        probs = self.policy.sampler.probs(self.batch.logits, 0).cpu()
        index, feed, rows = [], [], []
        for i, row in enumerate(self.rows):
            draws = {}
            for sibling in row.siblings:
                draws.setdefault(int(torch.multinomial(probs[i], 1, generator=sibling[1])), []).append(sibling)
            for token, siblings in draws.items():
                index.append(i)
                feed.append(token)
                rows.append(Row(row.parent, row.tokens + [token], siblings))
        self.batch.select(torch.tensor(index))
        self.batch.advance(feed)
        self.stats["forwards"] += 1
        self.stats["step_tokens"] += len(feed)
        self.stats["peak_batch_bytes"] = max(self.stats["peak_batch_bytes"], self.batch.nbytes())
        keep = []
        for i, row in enumerate(rows):
            if self.policy.ends_step(row.tokens[-1], len(row.tokens)):
                self.queue.submit((row, self.batch.row(i)), row.parent.steps + [row.tokens], family=row.parent)
            else:
                keep.append(i)
        self.batch.select(torch.tensor(keep, dtype=torch.long))
        self.rows = [rows[i] for i in keep]
        self._measure(rows)

    def _measure(self, rows):
        """peak_tree_bytes: the prompt, every unexpanded verified candidate, every queued and decoding step (with
        its ancestors once) under TreeMemory's model. rows: this decode step's rows (those that ended are queued)."""
        waiting = {id(row): row for row in rows + [row for row, _ in self.queue.items()]}.values()
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
        for key, _ in row.siblings:
            t = Trajectory(self.next_node, row.parent, row.parent.steps + [row.tokens], step_scores, state,
                           row.tokens[-1] in self.policy.eos)
            self.key[t] = key
            self.score[t] = aggregated
            level.verified.append(t)
        self.next_node += 1
        self.stats["steps"] = max(self.stats["steps"], depth)

    def _settle(self):
        """After new scores: prune, close every level that can be closed, and (speculative) expand every verified
        candidate still standing."""
        if self.config.early_pruning:
            self._prune_early()
        depth = next((d for d in sorted(self.levels) if not self.levels[d].closed), None)
        while depth in self.levels and self.levels[depth].verified and self._closable(depth):
            self._close(depth)
            depth += 1
        if self.config.speculative:
            self._expand([t for d, level in sorted(self.levels.items()) for t in level.verified
                          if d < self.config.max_steps and not t.finished and t not in self.expanded])

    def _rank(self, t):
        return -self.score[t], self.key[t]

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
        keep = [i for i, row in enumerate(self.rows) if not doomed_parent(row.parent)]
        if len(keep) < len(self.rows):
            self.batch.select(torch.tensor(keep, dtype=torch.long))
            self.rows = [self.rows[i] for i in keep]
        self.queue.drop(lambda item: doomed_parent(item[0].parent))

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
            if len(perfect) >= k:  # nothing still unverified in this level can beat k sure perfect candidates
                self._drop(lambda parent, depth=depth, perfect=perfect: len(parent.steps) + 1 == depth and
                           self._sure_count(perfect, parent) >= k)

    def _outranked(self, t, verified, k):
        """At least k sure candidates of t's level rank above t."""
        return self._sure_count([o for o in verified if self._rank(o) < self._rank(t)], t) >= k

    def _sure_count(self, others, t):
        """How many of `others` are in a level whenever a candidate with t's path (t included) is."""
        path = set(t.lineage())
        return sum(self._sure(o, path) for o in others)


def batched_beam_search(policy, prompt, verifier, config, answer_fn):
    """Beam search with `policy` (a Policy) on the batched decoder; config: SearchConfig with batched=True.
    Returns a SearchResult; stats: step_tokens (row-tokens decoded), forwards (batched forward passes), verifier_calls
    (requests scored) and verifier_batches (verifier invocations), steps (deepest level), pruned (candidates pruned
    after verification), peak_tree_bytes (TreeMemory's model) and peak_batch_bytes (the padded batch's cache)."""
    start = time.perf_counter()
    run = BeamRun(policy, prompt, verifier, config)
    completed = run.run()
    return search_result(completed, config.aggregation, answer_fn, run.stats, start)
