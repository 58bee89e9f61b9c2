"""Step generation on batched rows: every strategy's steps, one forward pass per token for all branches.

A candidate is one requested continuation of a trajectory, with its own key (its sibling indices from the root)
and its own random generator seeded from that key (`candidate_generator`): what a candidate draws depends on who it
is, not on which row or batch it is decoded in. Candidates from one state that drew the same tokens so far share a
branch, one row of the RowBatch (dedup; off, every candidate gets its own row at its first draw). Each forward pass
feeds one token per branch: every candidate of a drawing branch draws its next token from the row's distribution,
branches split where their draws differ, and branches whose step ended (a delimiter, EOS or the token budget) leave
the batch with their state: a snapshot (RowState), or, with keep_states=False or after EOS, only the hidden state.

Replayed leaves (SearchConfig(leaf_states="replay")): a request may name `forced` tokens (the step of the leaf it
continues) to feed on top of its state (the leaf's parent's snapshot) before the first draw; they go in with one
forward pass over all of them (RowBatch.extend), shared by every replay of the same length started together, and
the leaf's released state gets the result back (the leaf's children are rebuilt from it next time).

Branches of several searches (problems) may share one decoder: each request names its `owner`, and the decoder
counts every owner's work apart (owner_stats).

    decoder = StepDecoder(policy, batch)
    decoder.start([Request(root_state, [Candidate(key, candidate_generator(seed, key), root) for key in keys])])
    while decoder.branches:
        for branch, state in decoder.step():   # the branches whose step ended in this forward pass
            ...
"""
from collections import Counter
from dataclasses import dataclass, field

import torch

from .rows import RowState


SEED_LIMIT = 2 ** 61 - 1  # below it, distinct seeds have distinct hashes (CPython: hash(-1) == hash(-2))


def check_seed(seed):
    """Raise ValueError unless `seed` is an int in [0, SEED_LIMIT): candidate_generator hashes it, and outside
    that range two seeds can give the same search."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"a search seed must be an int in [0, 2**61 - 1), got {seed!r}")


def candidate_generator(seed, key):
    """The random generator of the candidate with sibling indices `key` (a tuple, root first) in a search seeded
    `seed`: every token of its step is drawn from it."""
    return torch.Generator().manual_seed(hash((seed,) + tuple(key)) & (2 ** 63 - 1))


@dataclass(eq=False)
class Candidate:
    key: tuple                   # sibling indices from the root
    generator: torch.Generator   # candidate_generator(seed, key)
    parent: object               # the trajectory it continues


@dataclass(eq=False)
class Branch:
    """Candidates decoded in one batch row: they start from one state and drew the same tokens so far."""
    candidates: list
    tokens: list = field(default_factory=list)   # the step so far
    owner: int = 0                               # the search it belongs to

    @property
    def parent(self):
        return self.candidates[0].parent


@dataclass
class Request:
    """Start a branch: `candidates` continue from `state` (a RowState, copied into the batch); replay: after
    `forced` tokens, whose resulting state fills the released RowState `rebuilds`."""
    state: RowState
    candidates: list
    forced: tuple = ()
    rebuilds: RowState = None
    owner: int = 0


class StepDecoder:
    """Branches of steps decoded together on one RowBatch. stats: forwards (model passes: batched decode passes and
    replay passes), step_tokens (row-tokens drawn and fed, after dedup), replayed (leaves rebuilt), replay_tokens
    (the tokens fed to rebuild them), replay_forwards (the passes that did: one per distinct number of forced
    tokens among the requests of one start()), peak_held_bytes (RowBatch.held_bytes after each decode pass,
    when the ended rows' snapshots and the batch both exist). owner_stats(owner): the same counts for one owner's
    branches (forwards: the passes it had a branch in, and its replays), peak_held_bytes being the whole batch's."""

    def __init__(self, policy, batch, *, dedup=True, keep_states=True):
        self.policy, self.batch = policy, batch
        self.dedup, self.keep_states = dedup, keep_states
        self.branches = []                       # Branch per batch row
        self.stats = dict(forwards=0, step_tokens=0, replayed=0, replay_tokens=0, replay_forwards=0,
                          peak_held_bytes=batch.held_bytes())
        self._owners = {}                        # owner -> Counter of its forwards, step_tokens, replays

    def start(self, requests):
        """Add one row per request (its state is copied: the caller may release it afterwards). Replays with the same
        number of forced tokens go in one forward pass."""
        by_length = {}
        for r in requests:
            if r.forced:
                by_length.setdefault(len(r.forced), []).append(r)
        for group in by_length.values():
            for r, state in zip(group, self.batch.extend([r.state for r in group], [r.forced for r in group])):
                _fill(r.rebuilds, state)
                self.batch.snapshots.add(r.rebuilds)
                self._count(r.owner, replayed=1, replay_tokens=len(r.forced))
            self.stats["forwards"] += 1
            self.stats["replay_forwards"] += 1
            for owner in {r.owner for r in group}:
                self._owners.setdefault(owner, Counter()).update(forwards=1, replay_forwards=1)
        states = [r.rebuilds if r.forced else r.state for r in requests]
        self.batch.add(states)
        self.branches += [Branch(list(r.candidates), owner=r.owner) for r in requests]

    def owners(self):
        """The owners that have branches in the batch."""
        return {b.owner for b in self.branches}

    def owner_stats(self, owner):
        """stats counted over `owner`'s branches alone (peak_held_bytes: the whole batch's)."""
        counts = self._owners.get(owner, Counter())
        return {key: counts[key] if key != "peak_held_bytes" else value for key, value in self.stats.items()}

    def _count(self, owner, **counts):
        """Add counts to the decoder's stats and to `owner`'s."""
        for key, n in counts.items():
            self.stats[key] += n
        self._owners.setdefault(owner, Counter()).update(counts)

    def drop(self, doomed):
        """Drop the branches for which doomed(branch) holds."""
        keep = [i for i, b in enumerate(self.branches) if not doomed(b)]
        if len(keep) < len(self.branches):
            self.batch.select(torch.tensor(keep, dtype=torch.long))
            self.branches = [self.branches[i] for i in keep]

    def step(self):
        """One forward pass; returns [(branch, state)] for the branches whose step ended, in row order."""
        probs = self.policy.sampler.probs(self.batch.logits, 0).cpu()
        index, feed, grown = [], [], []
        for i, branch in enumerate(self.branches):
            draws = {}
            for c in branch.candidates:
                token = int(torch.multinomial(probs[i], 1, generator=c.generator))
                draws.setdefault(token if self.dedup else (token, id(c)), []).append(c)
            for token, candidates in draws.items():
                token = token if self.dedup else token[0]
                index.append(i)
                feed.append(token)
                grown.append(Branch(candidates, branch.tokens + [token], branch.owner))
        self.batch.select(torch.tensor(index, dtype=torch.long))
        self.batch.advance(feed)
        self.stats["forwards"] += 1
        for owner, rows in Counter(b.owner for b in grown).items():
            self._owners.setdefault(owner, Counter()).update(forwards=1, step_tokens=rows)
        self.stats["step_tokens"] += len(feed)
        ended, keep = [], []
        for i, branch in enumerate(grown):
            if self.policy.ends_step(branch.tokens[-1], len(branch.tokens)):
                ended.append((branch, self._ended_state(i, branch.tokens[-1])))
            else:
                keep.append(i)
        self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], self.batch.held_bytes())
        self.batch.select(torch.tensor(keep, dtype=torch.long))
        self.branches = [grown[i] for i in keep]
        return ended

    def _ended_state(self, i, last_token):
        if self.keep_states and last_token not in self.policy.eos:
            return self.batch.row(i)
        b = self.batch
        return RowState(None, None, int(b.lengths[i]), None, b.hidden[i].clone())


def shared_batch(policy, prompts):
    """(one empty RowBatch for every problem's rows, each prompt's RowState): each prompt is prefilled alone; the
    other prompts' batches go, their states counted among the kept one's snapshots."""
    roots = [policy.prefill(prompt) for prompt in prompts]
    batch = roots[0][0]
    for _, state in roots[1:]:
        batch.snapshots.add(state)
    return batch, [state for _, state in roots]


def _fill(state, snapshot):
    """Give a released RowState the tensors of `snapshot` (the same row rebuilt)."""
    state.kv, state.states, state.logits = snapshot.kv, snapshot.states, snapshot.logits
    snapshot.kv = snapshot.states = None  # the snapshot object is dropped; `state` holds its tensors now
