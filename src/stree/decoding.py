"""stree.generate: speculative tree decoding whose output is distributed exactly as the target's own decoding.

The flow, as gpt-fast writes it: prefill both models once; then every round drafts a tree, verifies it with one
target pass, emits the accepted tokens plus the target's bonus token, and commits both caches to the accepted
branch. `Generation` holds one call's state and `Generation.round()` returns what a round did (a `Round`), so that
tests and benchmarks can drive the loop themselves:

    generation = Generation(model, input_ids, draft_model=draft, max_new_tokens=64)
    while not generation.done:
        result = generation.round()       # a Round: the verified tree, the accepted path, the tokens emitted
    output = generation.output()
"""
import time
import weakref
from dataclasses import dataclass

import torch

from .adaptive import RoundCosts, calibrate, kept_costs
from .checks import check_token_ids, vocab_size  # noqa: F401 (vocab_size: imported from here too)
from .drafting import DraftedTree, draft_tree, grows_on_device
from .heads.head import DraftHead
from .models import TreeModel
from .models.head_model import HeadTreeModel, head_inputs
from .models.claim import Claim
from .models.compile import compiled_tree_model
from .sampling import Sampler, sample
from .shapes import DynamicTree, tree_shapes, tree_spec
from .stats import Clock, GenerationStats
from .verify import verify_greedy, verify_sampling

# Sizing each round from measured costs beat every fixed tree on a CPU, where each node of a target pass costs; on a
# GPU the same rule keeps large trees (docs: performance).
DEFAULT_TREE = DynamicTree(adaptive=True)


@dataclass
class Round:
    """What one round did. tokens / parents: the verified tree, its root (the last token emitted before the round)
    as node 0; a plain decoding step verifies the root alone. accepted: node ids from the root down; bonus: the
    target's token after the last of them; emitted: the tokens the round emitted (the accepted nodes' below the
    root, then the bonus), cut at a stop condition. drafted: the DraftedTree (None for a plain step); greedy: the
    target's argmax after each node (greedy decoding of a drafted tree, else None)."""
    tokens: list
    parents: list
    accepted: list
    bonus: int
    emitted: list
    drafted: DraftedTree = None
    greedy: list = None


class Output:
    """The tokens emitted so far and the stop conditions: EOS, max_new_tokens, HF stopping criteria; a streamer gets
    the prompt, then each emission, then end()."""

    def __init__(self, input_ids, eos, max_new_tokens, stopping_criteria, streamer):
        self.input_ids, self.eos, self.max_new_tokens = input_ids, eos, max_new_tokens
        self.stopping_criteria, self.streamer = stopping_criteria, streamer
        self.generated, self.done = [], max_new_tokens == 0
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def emit(self, tokens):
        """Append tokens until a stop condition. Returns the tokens appended."""
        count = 0
        for count, token in enumerate(tokens, 1):
            self.generated.append(token)
            self.done = self._stops(token)
            if self.done:
                break
        if self.streamer is not None:
            self.streamer.put(torch.tensor(tokens[:count]))
        return tokens[:count]

    def _stops(self, token):
        if token in self.eos or len(self.generated) == self.max_new_tokens:
            return True
        if self.stopping_criteria is None:
            return False
        sequence = torch.cat([self.input_ids, torch.tensor([self.generated], device=self.input_ids.device)], dim=1)
        return bool(self.stopping_criteria(sequence, None).all())

    def sequence(self):
        """(1, P + n) token ids: the prompt, then the new tokens."""
        new = torch.tensor([self.generated], dtype=torch.long, device=self.input_ids.device)
        return torch.cat([self.input_ids, new], dim=1)


class Generation:
    """One generate() call: both models prefilled, then round() until done. Arguments as generate()'s."""

    def __init__(self, model, input_ids, *, draft_model, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                 eos_token_id=None, tree=DEFAULT_TREE, min_new_tokens=0, generator=None, streamer=None,
                 stopping_criteria=None, compile=False, draft_on_device=None, costs=None, sync=False):
        self.start = time.perf_counter()
        input_ids = check_inputs(model, draft_model, input_ids, max_new_tokens, min_new_tokens)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if costs is not None and not isinstance(costs, RoundCosts):
            raise TypeError(f"costs must be a stree.adaptive.RoundCosts, got {type(costs).__name__}")
        self.spec = tree_spec(tree) if draft_model is not None else None
        eos = eos_ids(model.generation_config.eos_token_id if eos_token_id is None else eos_token_id)
        self.sampler = Sampler(temperature, top_k, top_p, min_new_tokens, eos)
        self.generator, self.stats = generator, GenerationStats()
        self.clock = Clock(self.stats, input_ids.device, sync)
        self.out = Output(input_ids, eos, max_new_tokens, stopping_criteria, streamer)
        self.costs = self.draft = self._claim = None
        self.head = isinstance(draft_model, DraftHead)
        self.features = None  # a head's: the target's features of the trunk's tokens (1, len(trunk), feature_size)
        self._verified = None  # a head's: the target's features over the last verified tree (1, T, feature_size)
        if not self.out.done:
            try:
                self._prefill(model, draft_model, input_ids, compile, draft_on_device, costs)
            except BaseException:
                self.close()
                raise

    @property
    def done(self):
        return self.out.done

    def close(self):
        """Release the models' TreeModels for other calls (claim.py). Done when the generation ends or raises, on
        output(), on leaving a `with Generation(...)` block, and when the Generation is garbage-collected."""
        if self._claim is not None:
            self._claim.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _prefill(self, model, draft_model, input_ids, compile, draft_on_device, costs):
        """Both TreeModels prefilled with the prompt, the first token emitted, the cost model of adaptive trees."""
        spec = self.spec
        # Timing-driven sizes would make seeded samples irreproducible: with a generator, sampled trees stay fixed.
        adaptive = getattr(spec, "adaptive", False) and (self.sampler.greedy or self.generator is None)
        target_nodes, draft_nodes, draft_width = tree_shapes(spec, paced=adaptive) if spec else (1, 1, 1)
        max_length = input_ids.shape[1] + self.out.max_new_tokens + draft_nodes
        features = (draft_model.feature_layers or True) if self.head else False  # what the head reads
        self.target = tree_model(model, compile, target_nodes, target_nodes, pad_single=not adaptive,
                                 returns_hidden=features)
        if draft_model is not None:
            self.draft = tree_model(draft_model, compile, draft_nodes, draft_width)
        self._claim = Claim([self.target, self.draft])  # compiled TreeModels are shared by all calls on a model
        weakref.finalize(self, self._claim.release)
        with self.clock("prefill_time"):
            logits, hidden = self._split(self.target.prefill(input_ids, max_length=max_length))
            root = self._pick(logits[0])
            if self.head:
                held, fed, self.features = head_inputs(input_ids, hidden)
                self.draft.prefill(held, max_length=max_length, features=fed)
            elif draft_model is not None:
                self.draft.prefill(input_ids, max_length=max_length)
            if draft_model is not None and draft_on_device is None:
                draft_on_device = grows_on_device(self.draft.device, self.draft.compiled)
        self.on_device = draft_on_device
        self.out.emit([root])
        self.trunk = [root]  # tokens the draft's cache still lacks; the last is the root of the next tree
        if adaptive and not self.done:
            self.costs = self._costs(model, draft_model, compile, costs, target_nodes)
        # Paced rounds (adaptive trees): a round whose context has not paid lately is one plain step instead, at most
        # `max_steps` in a row (the draft then takes the skipped tokens in its next pass, within one pass's width).
        self.max_steps = 0 if self.costs is None else draft_width - 2
        self.hit, self.steps = True, 0  # the pacing context: did the last speculative round accept a draft; steps

    def _costs(self, model, draft_model, compile, costs, target_nodes):
        """The RoundCosts adaptive trees decide with: `costs` if given, else the one kept for this setting
        (acceptance differs by dtype and sampling; a level drafted on the device costs what a call spread over
        several levels costs, not what a host level costs); timed now if it has no timings yet."""
        if costs is None:
            kept = kept_costs(model)
            greedy = self.sampler.greedy
            key = (id(draft_model), self.spec, bool(compile), str(model.dtype), greedy, greedy and self.on_device)
            costs = kept.setdefault(key, RoundCosts())
        if not costs.known:
            with self.clock("prefill_time"):  # setup, not decoding
                calibrate(costs, self.target, self.draft, target_nodes, self.spec.frontier, self.trunk[-1])
        return costs

    def _split(self, out):
        """(logits, hidden states or None) of a target pass (its hidden states: a head's features)."""
        return out if self.head else (out, None)

    def _pick(self, logits):
        """The next token from the target's logits (vocab,) after the tokens emitted so far."""
        self.stats.transfers += 1
        scores = self.sampler.scores(logits, len(self.out.generated))
        return int(scores.argmax()) if self.sampler.greedy else sample(scores.softmax(-1), self.generator)

    def round(self):
        """Draft, verify, emit and commit one round (or one plain decoding step: stree's autoregressive loop, and an
        adaptive tree's paced rounds). Returns the Round."""
        try:
            result = self._round()
        except BaseException:
            self.close()
            raise
        if self.done:
            self.close()
        return result

    def _round(self):
        start, spent = time.perf_counter(), (self.stats.draft_time, self.stats.verify_time)
        context = (self.hit, self.steps)
        if self.draft is None or (self.steps < self.max_steps and not self.costs.pacing.speculates(context)):
            return self._plain_step(context, start)
        with self.clock("draft_time"):
            drafted = draft_tree(self.draft, self.trunk, self.spec, self.sampler, len(self.out.generated),
                                 self.generator, self.costs, self.on_device, self.features)
        self.stats.draft_passes += drafted.passes
        self.stats.transfers += drafted.transfers
        result = self._verify(drafted)
        if self.done:
            return result
        with self.clock("commit_time"):
            self.target.commit([result.accepted[-1]])
            if self.head:  # the head catches up on the accepted tokens with the target's features
                node, self.trunk = drafted.head_commit(result.accepted, result.bonus)
                self.features = self._verified.index_select(1, torch.tensor(result.accepted, device=self.target.device))
            else:
                node, self.trunk = drafted.draft_commit(result.accepted, result.bonus)
            self.draft.commit([node])
        if self.costs is not None:
            seconds = (self.stats.draft_time - spent[0], self.stats.verify_time - spent[1], time.perf_counter() - start)
            agreed = None if result.greedy is None else [result.greedy[p] == t for t, p in
                                                         zip(result.tokens[1:], result.parents[1:])]
            self.costs.observe(context, drafted, result.accepted, agreed, seconds)
            self.hit, self.steps = len(result.accepted) > 1, 0
        return result

    def _verify(self, drafted):
        """One target pass over the drafted tree below the root; emit what it accepts. Returns the Round."""
        tokens, parents = drafted.target_tokens, drafted.target_parents
        generated, greedy = len(self.out.generated), None
        with self.clock("verify_time"):
            logits, self._verified = self._split(self.target.tree_forward([tokens], [parents]))
            logits = logits[0]
            scores = self.sampler.scores(logits, [generated + d for d in drafted.target_depth])  # a tensor if needed
            if self.sampler.greedy:
                greedy = scores.argmax(-1).tolist()
                accepted, bonus = verify_greedy(tokens, parents, greedy)
                self.stats.transfers += 1
            else:
                accepted, bonus = verify_sampling(tokens, parents, scores.softmax(-1), drafted.target_probs(),
                                                  self.generator)
                self.stats.transfers += len(accepted)
        self.stats.target_passes += 1
        self.stats.tree_sizes.append(len(tokens))
        emitted = self.out.emit([tokens[n] for n in accepted[1:]] + [bonus])
        self.stats.tokens_per_pass.append(len(emitted))
        return Round(tokens, parents, accepted, bonus, emitted, drafted, greedy)

    def _plain_step(self, context, start):
        """One plain decoding step of the target: the token after the last one emitted, which the target's cache does
        not hold yet; that one is committed."""
        root = self.out.generated[-1]
        with self.clock("verify_time"):
            logits, hidden = self._split(self.target.tree_forward([[root]], [[-1]]))
            token = self._pick(logits[0, 0])
        with self.clock("commit_time"):
            self.target.commit([0])
        self.stats.target_passes += 1
        self.stats.tree_sizes.append(1)
        self.stats.tokens_per_pass.append(1)
        if self.draft is not None:
            self.trunk.append(token)
            if self.head:
                self.features = torch.cat([self.features, hidden], 1)
            self.steps += 1
            self.costs.pacing.note_step(context, time.perf_counter() - start)
        return Round([root], [-1], [0], token, self.out.emit([token]))

    def output(self, return_stats=False):
        """(1, P + n) token ids (prompt + new tokens), and the GenerationStats when return_stats."""
        self.close()
        if self.out.streamer is not None:
            self.out.streamer.end()
        self.stats.new_tokens = len(self.out.generated)
        self.stats.total_time = time.perf_counter() - self.start
        output = self.out.sequence()
        return (output, self.stats) if return_stats else output


@torch.no_grad()
def generate(model, input_ids, *, draft_model, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
             eos_token_id=None, tree=DEFAULT_TREE, return_stats=False, min_new_tokens=0, generator=None,
             streamer=None, stopping_criteria=None, compile=False, draft_on_device=None, costs=None,
             attention_mask=None, pad_token_id=None):
    """Speculative tree decoding whose output is distributed exactly as the target's own decoding.

    Args:
        model: target, an HF causal LM of a supported family (stree.models.SUPPORTED_MODEL_TYPES).
        input_ids: (1, P) or (P,) prompt token ids, P >= 1; or a batch: (B, P) with an attention_mask (B, P) of
            left padding (HF's decoder-only convention), or a list of 1-D prompts of any lengths. Every row of a
            batch is decoded with its own tree and acceptance (stree.batch.Batch: an adaptive tree sized for the
            batch, rows that end leave the batch), as if alone, drafted by a draft model or a draft head, eager or
            compiled; not with a streamer, costs or draft_on_device. `generator` may then be a list with one
            torch.Generator per row (a row's draws then do not depend on its batch mates).
        draft_model: any supported causal LM with the target's vocabulary, or a stree.DraftHead made for this target
            (it drafts from the target's hidden states: docs/heads.md); None = stree's own autoregressive
            decoding of the target (one single-node pass per token on the same engine: the baseline that shows
            what speculation adds).
        max_new_tokens / min_new_tokens: bounds on the number of new tokens (EOS is banned before the minimum).
        temperature: 0 = greedy, equal to model.generate(do_sample=False); > 0 = sampling from the target's
            distribution after temperature, top_k and top_p (HF's order), verified losslessly. top_k=None cuts
            nothing, whereas HF's generate(do_sample=True) applies its generation config's top_k (50 by default):
            pass top_k=50 to sample what HF samples (the drop-in model.generate merges HF's config itself).
        eos_token_id: int or list of ints that end generation (kept in the output); None = the target's
            generation_config.eos_token_id, as HF's generate does.
        tree: stree.DynamicTree(adaptive=True) by default (at most 16 draft nodes over 6 levels, each round as
            many as measured costs say pay, and no drafting at all, a plain decoding step, in rounds whose context
            has not paid lately; a seeded `generator` keeps sampled trees at their fixed shape); a static
            branching tuple (tree[d] children per node at depth d; (1, 1, 1, 1) is vanilla speculative decoding),
            or stree.DynamicTree(...) / stree.BeamTree(...) (beam trees: greedy only); stree.shapes.parse_tree
            makes one from a name ("adaptive", "dynamic-16", "chain-4", ...).
        return_stats: also return a GenerationStats.
        generator: torch.Generator (CPU) for the random draws when sampling; None = the global RNG.
        streamer: an HF streamer (e.g. TextStreamer): gets the prompt, then each round's new tokens, then end().
        stopping_criteria: an HF StoppingCriteriaList, checked after every new token as HF does (with scores=None:
            a round has no single step's logits to give).
        compile: run every draft and target pass with fixed shapes through torch.compile (inductor on CPU, CUDA
            graphs on CUDA); a dict gives torch.compile's options (e.g. {"backend": "aot_eager"}). The first call
            per model and tree shape pays the compilation (tens of seconds on a CPU); later calls reuse it. Off by
            default (docs: performance says when it pays).
        draft_on_device: grow greedy static and dynamic trees on the device, with one copy to the host per round
            (adaptive trees: two when more levels follow the root's children, which decide how many) instead of
            one per draft pass; fixed trees are the same as on the host but for exact ties and node order,
            adaptive trees may differ in depth (on the host each level decides on the next). None = on CUDA with
            compiled passes, else not (stree.drafting.grows_on_device says why).
        costs: the stree.adaptive.RoundCosts an adaptive tree decides with (updated in place; timed first if it
            holds no timings). None = the one stree keeps for this target and setting (stree.adaptive.kept_costs).
        attention_mask / pad_token_id: batches only. pad_token_id pads rows that end early (default: the
            generation config's, else the smallest EOS id).
    Returns:
        (1, P + n) token ids (prompt + new tokens), and the stats when return_stats; a batch: (B, P + n), each row
        its input row then its new tokens, right-padded with pad_token_id, as HF's generate returns a batch.

    Greedy exactness: the tree pass equals token-by-token decoding up to float rounding, so the output equals HF's
    greedy search except where two top logits lie within that rounding (~1e-6 relative in float32; in bf16 /
    fp16 rounding differs between a tree pass and a decode step, so outputs agree with HF's for a while, not
    token for token).
    """
    if is_batch(input_ids, attention_mask):
        from .batch import generate_batch  # batch.py builds on this module
        unsupported = dict(streamer=streamer, costs=costs, draft_on_device=draft_on_device)
        if any(unsupported.values()):
            raise ValueError(f"a batch of prompts drafts on the host and takes none of {sorted(unsupported)}; got "
                             f"{sorted(k for k, v in unsupported.items() if v)}")
        return generate_batch(model, input_ids, draft_model=draft_model, max_new_tokens=max_new_tokens,
                              attention_mask=attention_mask, pad_token_id=pad_token_id, generator=generator,
                              return_stats=return_stats, temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_token_id=eos_token_id, tree=tree, min_new_tokens=min_new_tokens,
                              stopping_criteria=stopping_criteria, compile=compile)
    generation = Generation(model, input_ids, draft_model=draft_model, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, tree=tree,
                            min_new_tokens=min_new_tokens, generator=generator, streamer=streamer,
                            stopping_criteria=stopping_criteria, compile=compile, draft_on_device=draft_on_device,
                            costs=costs, sync=return_stats)
    while not generation.done:
        generation.round()
    return generation.output(return_stats)


def is_batch(input_ids, attention_mask):
    """Whether generate() was given a batch: a list of prompts, several rows, or a mask with padding."""
    if isinstance(input_ids, (list, tuple)):
        return True
    rows = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 1
    return rows > 1 or (attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()))


def check_inputs(model, draft_model, input_ids, max_new_tokens, min_new_tokens):
    """input_ids as a (1, P) int64 tensor on the model's device, after checking every argument that shapes it."""
    check_models(model, draft_model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("input_ids must be an integer tensor of shape (1, prompt_length)")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (1, prompt_length >= 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"stree.generate decodes one sequence at a time (batch 1), got batch {input_ids.shape[0]}")
    check_token_ids("input_ids", input_ids, vocab_size(model))
    check_count("max_new_tokens", max_new_tokens)
    check_count("min_new_tokens", min_new_tokens)
    return input_ids.long().to(model.device)


def check_models(model, draft_model):
    """TypeError / ValueError unless `model` is an HF causal LM and `draft_model` (or None) one with its vocabulary,
    or a draft head made for it."""
    for name, value in (("model", model), ("draft_model", draft_model)):
        if value is not None and not (isinstance(value, torch.nn.Module) and hasattr(value, "config")):
            raise TypeError(f"{name} must be an HF causal LM (a PreTrainedModel), got {type(value).__name__}")
    shares = lambda head: (head.inner.get_input_embeddings() is model.get_input_embeddings()  # noqa: E731
                           and head.inner.get_output_embeddings() is model.get_output_embeddings())
    if isinstance(draft_model, DraftHead) and not shares(draft_model):
        raise ValueError("the draft head was made for another model: a head drafts with its target's embedding and LM "
                         "head (DraftHead.from_pretrained(path, target=model) loads it for this one)")
    if draft_model is not None and vocab_size(draft_model) != vocab_size(model):
        raise ValueError(f"the draft's vocabulary ({vocab_size(draft_model)}) differs from the target's "
                         f"({vocab_size(model)}); they must share a tokenizer")


def check_count(name, value):
    """ValueError unless `value` is a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def eos_ids(eos_token_id):
    """A set of ids from None, an int, a list of ints or a tensor."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        return frozenset(eos_token_id.flatten().tolist())
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


def tree_model(model, compile, nodes, pass_width, pad_single=True, returns_hidden=False):
    """A TreeModel of `model`: a new eager one, or with compile (True or torch.compile options) the compiled one
    kept for the model and these shapes and options (so compilation is paid once per model and tree shape). On
    CUDA every pass is padded to `pass_width` nodes (one CUDA graph per shape: extra rows cost a GPU almost
    nothing); on a CPU, where every row costs, the number of nodes stays a dynamic dimension (pad_single: see
    TreeModel.compile; adaptive trees' targets run one-node passes unpadded, warmed up by the calibration)."""
    if not compile and isinstance(model, DraftHead):
        return HeadTreeModel(model, nodes=nodes)
    if not compile:
        return TreeModel(model, nodes=nodes, returns_hidden=returns_hidden)
    options = {} if compile is True else dict(compile)
    width = pass_width if model.device.type == "cuda" else None
    return compiled_tree_model(model, nodes, width, pad_single, options, returns_hidden)
