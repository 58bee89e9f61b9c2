"""Batched speculative tree decoding: many prompts decoded together, each row with its own tree, its own acceptance
and its own state, every row's output distributed exactly as the target's own decoding of that row alone.

A `Batch` holds the rows being decoded (continuous batching): `add()` prefills new prompts (each unpadded, so its
state is exactly its prompt's) and emits their first token; `step()` runs one round for every row: the draft grows
every row's tree in the same draft passes (drafting.rows.drive), one target pass verifies all trees (rows padded to
the widest tree with nodes that no node descends from), each row accepts its own path and both models commit each
row's own path (rows advance by different numbers of tokens); rows that end leave the batch at once, so they cost
nothing afterwards; `finished()` hands their outputs over.

    batch = Batch(model, draft_model=draft, max_new_tokens=64)
    ids = batch.add([prompt_a, prompt_b])        # 1-D token tensors of any lengths
    while batch.active:
        batch.step()
        outputs = batch.finished()               # {id: (P + n,) prompt and new tokens} of rows that ended
"""
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .adaptive import kept_costs
from .adaptive.batch_sizes import BatchSizes
from .checks import check_prompts, vocab_size
from .decoding import DEFAULT_TREE, Output, check_count, check_models, eos_ids, tree_model
from .drafting import Growth, drive
from .drafting.host import GROW
from .heads.head import DraftHead
from .models.claim import Claim
from .models.head_model import head_inputs
from .sampling import Sampler, sample
from .shapes import tree_shapes, tree_spec
from .stats import GenerationStats
from .verify import verify_greedy, verify_sampling


@dataclass(eq=False)
class Row:
    """One prompt being decoded: its id, its Output (tokens and stop conditions), its random generator (None: the
    global RNG), its trunk (tokens the draft's cache still lacks, the last emitted one last: until the draft holds
    the row, its prompt's too, a head's from the second on) and, drafting with a head, the target's features of the
    trunk's tokens, in pieces (1, k, feature_size) joined only when the head reads them (plain steps add one each):
    each token's is the target's hidden state at the token before it."""
    id: int
    out: Output
    generator: object
    trunk: list
    features: list = None

    def trunk_features(self):
        """The trunk's features (1, len(trunk), feature_size), or None without a head."""
        return None if self.features is None else torch.cat(self.features, 1)


class Batch:
    """Rows decoded together (see the module's docstring). Arguments as stree.generate's; rows may join between
    steps. An adaptive tree (the default) sizes each round for the batch: a plain step, a short chain or a tree up
    to the spec's own, whichever gave the most tokens per second at this batch size (adaptive.BatchSizes, kept for
    the model across calls; sampled rows with their own generators keep the spec's shape, as at batch 1). The
    draft is a draft model or a draft head (stree.heads.DraftHead), which drafts from the target's hidden states:
    the target's passes then return them, and the head holds every row from its first token on.

    compile: False (eager passes), True or torch.compile's options (as stree.generate's): every pass compiled, the
    node slots fixed at the spec's, the node count dynamic. The batch dimension is specialised at the first size a
    pass meets and at 1, dynamic for the others (torch.compile's automatic dynamic shapes), but CUDA graphs record
    one graph per batch size: there (`pad_batch`, default: compiled on CUDA) the models' batches are padded with
    spare rows (empty, never kept) to the next power of two of the rows decoding, so that passes meet 1, 2, 4, ...
    rows only, and rows leaving or joining within a size move within the buffers (TreeModel.keep_rows: the graphs
    replay over the same addresses). Compilation is paid by the first calls that meet a size and reused by every
    later Batch on these models (stree.warmup(batch_sizes=...) pays it at start-up). Compiled TreeModels are kept
    per model and shared, so a compiled Batch holds them until close() (or until it is garbage-collected): a second
    one in the same thread raises meanwhile, another thread's waits."""

    def __init__(self, model, *, draft_model, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                 eos_token_id=None, tree=DEFAULT_TREE, min_new_tokens=0, stopping_criteria=None, compile=False):
        check_models(model, draft_model)
        check_count("max_new_tokens", max_new_tokens)
        check_count("min_new_tokens", min_new_tokens)
        self.spec = tree_spec(tree) if draft_model is not None else None
        self.eos = eos_ids(model.generation_config.eos_token_id if eos_token_id is None else eos_token_id)
        self.sampler = Sampler(temperature, top_k, top_p, min_new_tokens, self.eos)
        self.max_new_tokens, self.stopping_criteria = max_new_tokens, stopping_criteria
        target_nodes, self.draft_nodes, _ = tree_shapes(self.spec, paced=False) if self.spec else (1, 1, 1)
        self.sizes = None  # adaptive.BatchSizes of an adaptive tree
        self.compiled = bool(compile)
        if getattr(self.spec, "adaptive", False):
            key = ("batch", id(draft_model), self.spec, str(model.dtype), self.sampler.greedy, self.compiled)
            self.sizes = kept_costs(model).setdefault(key, BatchSizes(self.spec))
        self.head = isinstance(draft_model, DraftHead)
        features = (draft_model.feature_layers or True) if self.head else False  # what the head reads
        # node slots: a pass's buffers and a commit's work (eager: sized per round; compiled: fixed, one graph
        # less per size). Compiled targets run plain steps' one-node passes unpadded, in a graph of their own.
        self.target = tree_model(model, compile, target_nodes, None, pad_single=False, returns_hidden=features)
        self.draft = None if draft_model is None else tree_model(draft_model, compile, self.draft_nodes, None)
        self.pad_batch = self.compiled and self.target.device.type == "cuda"  # to powers of two (see above)
        self._claim = Claim([self.target, self.draft])  # compiled TreeModels are shared by every call on a model
        weakref.finalize(self, self._claim.release)
        for engine in (self.target, self.draft):  # a shared one may hold an earlier call's rows
            if engine is not None:
                engine.clear()
        # whether the draft holds the rows' states: it is prefilled at the first speculative round (a head with
        # the target's features of the rows' tokens, kept until then), so plain steps alone never pay for it
        self.drafting = False
        self._verified = None  # a head's: the target's features over the last pass's nodes (batch, width, size)
        self.vocab, self.device = vocab_size(model), model.device
        self.rows, self._done, self._next_id, self.closed = [], {}, 0, False
        self.stats = GenerationStats()

    def close(self):
        """Release the (compiled) TreeModels for other Batches and calls; the Batch takes no prompts after it (rows
        still decoding are dropped)."""
        self._claim.release()
        self.rows, self.closed = [], True

    @property
    def active(self):
        """How many rows are still decoding."""
        return len(self.rows)

    @torch.no_grad()
    def add(self, prompts, *, generators=None, max_new_tokens=None):
        """Start decoding `prompts`: one 1-D token tensor, or a list of them (lengths may differ). generators: one
        torch.Generator per prompt (a row's draws then depend on its generator alone, not on its batch mates), a
        single one shared by the rows (in row order), or None (the global RNG). max_new_tokens: these rows' own
        bound (default the Batch's). Returns the new rows' ids (an int for a single tensor)."""
        if self.closed:
            raise RuntimeError("this Batch is closed: make a new one")
        single = isinstance(prompts, torch.Tensor) and prompts.dim() == 1
        prompts = check_prompts([prompts] if single else prompts, "add()", self.vocab)
        generators = _per_row(generators, len(prompts))
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_count("max_new_tokens", limit)
        prompts = [p.long().to(self.device) for p in prompts]
        new = [Row(self._next_id + i, Output(p[None], self.eos, limit, self.stopping_criteria, None), g, [])
               for i, (p, g) in enumerate(zip(prompts, generators))]
        self._next_id += len(new)
        if limit == 0:  # nothing to decode
            self._done.update((row.id, row.out.sequence()[0]) for row in new)
            return new[0].id if single else [row.id for row in new]
        self._resize(range(len(self.rows)), pad=False)  # new rows go right after the rows decoding
        logits = self._add_rows(new, prompts, self._max_length(new))
        scores = self.sampler.scores(logits, 0)
        for row, row_scores in zip(new, scores):
            root = int(row_scores.argmax()) if self.sampler.greedy else sample(row_scores.softmax(-1), row.generator)
            row.out.emit([root])
            row.trunk.append(root)
        if self.drafting:
            self._hand_to_draft(new)
        self.rows += new
        if self.sizes is not None:
            self.sizes.rows_changed()
        if not self._drop_finished():
            self._resize(range(len(self.rows)))
        return new[0].id if single else [row.id for row in new]

    def _add_rows(self, rows, prompts, max_length):
        """Prefill the target with `prompts`; returns their last logits. Each row's trunk starts with what the draft
        is to hold of its prompt: its tokens (a head: what head_inputs says, with the target's features)."""
        if not self.head:
            for row, prompt in zip(rows, prompts):
                row.trunk = prompt.tolist() if self.draft is not None else []
            return self.target.add_rows(prompts, max_length=max_length)
        logits, features = self.target.add_rows(prompts, max_length=max_length)
        for row, prompt, f in zip(rows, prompts, features):
            held, fed, first = head_inputs(prompt, f)  # the trunk: held (fed's), then the root (first's)
            row.trunk, row.features = held.tolist(), [fed[None], first[None]]
        return logits

    def finished(self):
        """{id: (P + n,) token ids: the prompt, then the new tokens} of the rows that ended since the last call."""
        done, self._done = self._done, {}
        return done

    @torch.no_grad()
    def step(self):
        """One round for every active row: draft, verify, emit, commit; rows that end leave the batch."""
        if not self.rows:
            raise RuntimeError("no active rows: add() prompts first")
        start, rows = time.perf_counter(), len(self.rows)
        arm, spec = self._round_tree()
        target_nodes, draft_nodes, _ = tree_shapes(spec, paced=False) if spec else (1, 1, 1)
        if not self.compiled:  # compiled passes keep their slots
            self.target.set_slots(target_nodes)
            if spec is not None:
                self.draft.set_slots(draft_nodes)
        if spec is not None and not self.drafting:
            self._start_draft()
        drafted = self._draft_trees(spec)
        trees = [(d.target_tokens, d.target_parents, d.target_depth) if d is not None else
                 ([row.out.generated[-1]], [-1], [0]) for row, d in zip(self.rows, drafted)]
        verdicts = self._verify(self._target_scores(trees), trees, drafted)
        self.stats.target_passes += 1
        for row, (tokens, _, _), (accepted, bonus) in zip(self.rows, trees, verdicts):
            count = len(row.out.emit([tokens[n] for n in accepted[1:]] + [bonus]))
            self.stats.tokens_per_pass.append(count)
            self.stats.tree_sizes.append(len(tokens))
        self.target.commit([accepted[-1] for accepted, _ in verdicts] + [-1] * self.spare)
        self._commit_draft(drafted, verdicts)
        if arm is not None:  # the arm's worth is the tokens it produced, also where a row's budget cut them short
            produced = sum(len(accepted) for accepted, _ in verdicts)
            self.sizes.observe(rows, arm, produced, time.perf_counter() - start)
        self._drop_finished()

    def _round_tree(self):
        """(the BatchSizes arm or None, the tree spec of this round: None = a plain step)."""
        seeded = not self.sampler.greedy and any(row.generator is not None for row in self.rows)
        if self.sizes is None or seeded:
            return None, self.spec
        arm = self.sizes.choose(len(self.rows))
        return arm, self.sizes.arms[arm]

    def _target_scores(self, trees):
        """The target's processed scores (batch, width, vocab) over every row's tree (tokens, parents, depth below
        the root), rows padded to the widest with nodes that no node descends from (spare rows: with such nodes
        alone)."""
        width = max(len(tokens) for tokens, _, _ in trees)
        tokens = np.zeros((len(trees) + self.spare, width), dtype=np.int64)
        parents = np.full(tokens.shape, -1, dtype=np.int64)
        generated = np.zeros((len(trees), width), dtype=np.int64)
        for b, ((row_tokens, row_parents, depth), row) in enumerate(zip(trees, self.rows)):
            tokens[b, :len(row_tokens)], parents[b, :len(row_parents)] = row_tokens, row_parents
            generated[b, :len(depth)] = len(row.out.generated) + np.asarray(depth)
        logits = self.target.tree_forward(tokens, parents)
        if self.head:
            logits, self._verified = logits
        return self.sampler.scores(logits[:len(trees)], generated.tolist())

    def _start_draft(self):
        """Prefill the draft with every row: until a round speculates the draft holds nothing, so a batch whose
        rounds are all plain steps never pays the draft's prefill."""
        self._hand_to_draft(self.rows)
        self.drafting = True
        self._resize(range(len(self.rows)))

    def _max_length(self, rows):
        """The most tokens any of `rows` will hold in a model's cache: its prompt, its budget and a tree's nodes."""
        return max(row.out.input_ids.shape[1] + row.out.max_new_tokens for row in rows) + self.draft_nodes

    def _hand_to_draft(self, rows):
        """Append `rows` to the draft's batch: each holds its trunk but the last token (a head: fed the features
        beside them), which stays the trunk."""
        held = [torch.tensor(row.trunk[:-1], dtype=torch.long, device=self.device) for row in rows]
        max_length = self._max_length(rows)
        features = [row.trunk_features() for row in rows] if self.head else None
        fed = None if features is None else [f[0, :-1] for f in features]
        self.draft.add_rows(held, max_length=max_length, features=fed)
        for b, row in enumerate(rows):
            row.trunk = row.trunk[-1:]
            if self.head:
                row.features = [features[b][:, -1:]]

    def _draft_trees(self, spec):
        """Every row's DraftedTree under `spec` (None per row for a plain step or without a draft model)."""
        if self.draft is None or spec is None:
            return [None] * len(self.rows)
        programs = [GROW[type(spec)](Growth(self.draft, row.trunk, self.sampler, len(row.out.generated),
                                            row.generator, features=row.trunk_features()), spec) for row in self.rows]
        drafted = drive(self.draft, programs + [_nothing() for _ in range(self.spare)])[:len(self.rows)]
        self.stats.draft_passes += max(d.passes for d in drafted)
        return drafted

    def _commit_draft(self, drafted, verdicts):
        """Commit each row's accepted path in the draft and set its trunk; after a plain step the draft is not
        touched and each row's new token joins its trunk. A head's next trunk comes with the target's features of
        the accepted nodes (after a plain step: the root's joins the row's)."""
        if self.draft is None:
            return
        if drafted[0] is None:
            for b, (row, (_, bonus)) in enumerate(zip(self.rows, verdicts)):
                row.trunk.append(bonus)
                if self.head:
                    row.features.append(self._verified[b:b + 1, :1])
            return
        commits = [d.head_commit(accepted, bonus) if self.head else d.draft_commit(accepted, bonus)
                   for d, (accepted, bonus) in zip(drafted, verdicts)]
        self.draft.commit([node for node, _ in commits] + [-1] * self.spare)
        for b, (row, (_, trunk), (accepted, _)) in enumerate(zip(self.rows, commits, verdicts)):
            row.trunk = trunk
            if self.head:
                row.features = [self._verified[b:b + 1, accepted]]

    def _verify(self, scores, trees, drafted):
        """[(accepted node ids, bonus token)] per row from the target's scores (batch, width, vocab)."""
        if self.sampler.greedy:
            greedy = scores.argmax(-1).tolist()  # one copy for the batch
            self.stats.transfers += 1
            return [verify_greedy(tokens, parents, greedy[b][:len(tokens)])
                    for b, (tokens, parents, _) in enumerate(trees)]
        probs = scores.softmax(-1)
        return [verify_sampling(tokens, parents, probs[b, :len(tokens)], {} if d is None else d.target_probs(),
                                row.generator)
                for b, ((tokens, parents, _), d, row) in enumerate(zip(trees, drafted, self.rows))]

    def _drop_finished(self):
        """Hand the rows that ended to finished() and take them out of both models' batches. Returns whether any
        did."""
        keep = [b for b, row in enumerate(self.rows) if not row.out.done]
        if len(keep) == len(self.rows):
            return False
        self.stats.new_tokens += sum(len(row.out.generated) for row in self.rows if row.out.done)
        self._done.update((row.id, row.out.sequence()[0]) for row in self.rows if row.out.done)
        self.rows = [self.rows[b] for b in keep]
        if self.sizes is not None:
            self.sizes.rows_changed()
        self._resize(keep)
        self.drafting = self.drafting and bool(keep)
        return True

    @property
    def spare(self):
        """How many spare rows follow the rows decoding in the models' batches (pad_batch: see _resize)."""
        cache = self.target._cache
        return 0 if cache is None else cache.batch - len(self.rows)

    def _resize(self, keep, pad=True):
        """Make rows `keep` (model row indices, increasing) the models' batch (the draft's while it holds the
        rows); with pad_batch (and `pad`), followed by spare rows up to the next power of two: passes then meet few
        batch sizes (CUDA graphs record one graph per size); spare rows run nodes that no commit keeps."""
        keep = list(keep)
        bucket = BatchSizes.size(len(keep)) if self.pad_batch and pad and keep else len(keep)
        for engine in (self.target, self.draft if self.drafting else None):
            if engine is None or engine._cache is None:
                continue
            if not keep:
                engine.clear()
                continue
            batch = engine._cache.batch
            if keep == list(range(len(keep))) and batch == bucket:  # the rows after `keep` are spare already
                continue
            if keep != list(range(batch)):
                engine.keep_rows(keep)
            engine.pad_rows(bucket - len(keep))


def _nothing():
    """The grow program of a spare row: it asks for no node (drafting.drive pads its row)."""
    return
    yield


def _per_row(generators, count):
    """A list of `count` generators (or Nones) from None, one torch.Generator or a list of them."""
    if generators is None or isinstance(generators, torch.Generator):
        return [generators] * count
    generators = list(generators)
    if len(generators) != count or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError(f"generators must be one torch.Generator or a list of {count} of them (one per prompt)")
    return generators


def batch_prompts(input_ids, attention_mask=None):
    """(prompts: a list of 1-D token tensors, the padded (B, P) input to return them in) from a (B, P) tensor,
    left-padded where `attention_mask` (B, P) holds zeros (HF's decoder-only convention), or a list of 1-D prompts
    (their padded input is built with pad id -1, filled in later by generate_batch)."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a padded (batch, P) tensor, not with a list of prompts")
        prompts = check_prompts([torch.as_tensor(p) for p in input_ids], "a list of prompts")
        width = max(p.numel() for p in prompts)
        padded = torch.full((len(prompts), width), -1, dtype=torch.long)
        for b, p in enumerate(prompts):
            padded[b, width - p.numel():] = p
        return prompts, padded
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("batched input_ids must be a (batch, prompt_length) tensor or a list of 1-D prompts")
    if attention_mask is None:
        return list(input_ids), input_ids
    mask = torch.as_tensor(attention_mask).to(input_ids.device)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    lengths = mask.sum(1)
    left_padded = torch.arange(mask.shape[1], device=mask.device) >= (mask.shape[1] - lengths)[:, None]
    if not torch.equal(mask.bool(), left_padded) or bool((lengths == 0).any()):
        raise ValueError("attention_mask must be left padding (zeros, then ones: HF's decoder-only convention) with "
                         "at least one token per row; right-padded or holed masks are not supported")
    return [row[row.numel() - int(n):] for row, n in zip(input_ids, lengths)], input_ids


def generate_batch(model, input_ids, *, draft_model, max_new_tokens, attention_mask=None, pad_token_id=None,
                   generator=None, return_stats=False, **options):
    """stree.generate on a batch (its docstring): every row decoded by a Batch. Returns (B, P + n) token ids, each
    row its input row then its new tokens, right-padded with pad_token_id (default: the generation config's, else
    the smallest EOS id), and the Batch's GenerationStats when return_stats."""
    prompts, padded = batch_prompts(input_ids, attention_mask)
    batch = Batch(model, draft_model=draft_model, max_new_tokens=max_new_tokens, **options)
    start = time.perf_counter()
    try:
        ids = batch.add(prompts, generators=generator)
        while batch.active:
            batch.step()
    finally:
        batch.close()
    done = batch.finished()
    new = [done[i][prompt.numel():] for i, prompt in zip(ids, prompts)]
    width = max(n.numel() for n in new)
    pad = _pad_id(model, pad_token_id, batch.eos)
    if pad is None and (any(n.numel() < width for n in new) or bool((padded < 0).any())):
        raise ValueError("rows of different lengths need pad_token_id (the model's generation config has none and no "
                         "EOS id)")
    output = torch.full((len(prompts), padded.shape[1] + width), -1 if pad is None else pad, dtype=torch.long,
                        device=model.device)
    output[:, :padded.shape[1]] = padded.to(model.device)
    output[output < 0] = -1 if pad is None else pad
    for b, tokens in enumerate(new):
        output[b, padded.shape[1]:padded.shape[1] + tokens.numel()] = tokens
    batch.stats.total_time = time.perf_counter() - start
    return (output, batch.stats) if return_stats else output


def _pad_id(model, pad_token_id, eos):
    """The id that pads outputs: pad_token_id, else the generation config's, else the smallest EOS id (None: none)."""
    for candidate in (pad_token_id, model.generation_config.pad_token_id):
        if candidate is not None:
            return int(candidate)
    return min(eos) if eos else None
