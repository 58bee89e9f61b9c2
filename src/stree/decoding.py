"""stree.generate (this module): speculative tree decoding for HF Mamba2 / hybrid models (and Transformer drafts).

One readable loop: prefill both models; then repeat draft a tree -> verify it with one target pass -> emit the
accepted tokens plus the target's bonus token -> commit both caches to the accepted branch.
"""
import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .draft import DynamicTree, RoundCosts, draft_tree, grows_on_device, tree_shapes, tree_spec
from .models import TreeModel
from .sampling import Sampler, sample
from .verify import verify_greedy, verify_sampling

# Measured on the bundled pair (stree bench, benchmarks/generate.py, README): sizing each round from measured costs
# beat every fixed tree on a CPU, where each node of a target pass costs; on a GPU the same rule keeps large trees.
DEFAULT_TREE = DynamicTree(adaptive=True)


@dataclass
class GenerationStats:
    """Counters of one generate() call. Times in seconds (on CUDA each timed phase ends with a synchronize, which
    only happens when stats are returned)."""
    new_tokens: int = 0
    target_passes: int = 0          # verification passes (autoregressive: decode steps); the prefill is not counted
    draft_passes: int = 0           # draft tree passes (the prefill is not counted)
    tokens_per_pass: list = field(default_factory=list)  # per verification: accepted drafts + bonus, as emitted
    tree_sizes: list = field(default_factory=list)       # nodes per verified tree, root included
    transfers: int = 0              # device-to-host copies in the decoding loop (drafting, verification)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    total_time: float = 0.0

    @property
    def tau(self):
        """Mean tokens emitted per target verification pass (STree's and Medusa's tau)."""
        return sum(self.tokens_per_pass) / max(len(self.tokens_per_pass), 1)

    @property
    def rounds(self):
        return len(self.tokens_per_pass)

    def breakdown(self):
        """Milliseconds per round: draft / verify / commit / other (emission, bookkeeping), and transfers."""
        rounds = max(self.rounds, 1)
        decode = self.total_time - self.prefill_time
        other = decode - self.draft_time - self.verify_time - self.commit_time
        return {"draft_ms": 1e3 * self.draft_time / rounds, "verify_ms": 1e3 * self.verify_time / rounds,
                "commit_ms": 1e3 * self.commit_time / rounds, "other_ms": 1e3 * other / rounds,
                "transfers": self.transfers / rounds}


class _Clock:
    """Adds phase durations to a GenerationStats; synchronizes CUDA around a phase only when `sync`."""

    def __init__(self, stats, device, sync):
        self.stats, self.sync = stats, sync and device.type == "cuda"

    @contextmanager
    def __call__(self, name):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        setattr(self.stats, name, getattr(self.stats, name) + time.perf_counter() - start)


def _check_inputs(model, draft_model, input_ids, max_new_tokens, min_new_tokens):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("input_ids must be an integer tensor of shape (1, prompt_length)")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (1, prompt_length >= 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"stree.generate decodes one sequence at a time (batch 1), got batch {input_ids.shape[0]}")
    for name, value in (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if draft_model is not None and _vocab(draft_model) != _vocab(model):
        raise ValueError(f"the draft's vocabulary ({_vocab(draft_model)}) differs from the target's "
                         f"({_vocab(model)}); they must share a tokenizer")
    return input_ids.long().to(model.device)


def _vocab(model):
    """The vocabulary size of a causal LM (multimodal wrappers keep it in their text config)."""
    return model.config.get_text_config().vocab_size


def eos_ids(eos_token_id):
    """A set of ids from None, an int, a list of ints or a tensor."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        return frozenset(eos_token_id.flatten().tolist())
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


@torch.no_grad()
def generate(model, input_ids, *, draft_model, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
             eos_token_id=None, tree=DEFAULT_TREE, return_stats=False, min_new_tokens=0, generator=None,
             streamer=None, stopping_criteria=None, compile=False, draft_on_device=None):
    """Speculative tree decoding whose output is distributed exactly as the target's own decoding.

    Args:
        model: target, an HF causal LM of a supported family (stree.models.SUPPORTED_MODEL_TYPES).
        input_ids: (1, P) or (P,) prompt token ids, P >= 1.
        draft_model: any supported causal LM with the target's vocabulary; None = stree's own autoregressive
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
            branching tuple (tree[d] children per node at depth d; (1, 1, 1, 1) is vanilla speculative decoding), or
            stree.DynamicTree(...) / stree.BeamTree(...) (beam trees: greedy only).
        return_stats: also return a GenerationStats.
        generator: torch.Generator (CPU) for the random draws when sampling; None = the global RNG.
        streamer: an HF streamer (e.g. TextStreamer): gets the prompt, then each round's new tokens, then end().
        stopping_criteria: an HF StoppingCriteriaList, checked after every new token as HF does (with scores=None:
            a round has no single step's logits to give).
        compile: run every draft and target pass with fixed shapes through torch.compile (inductor on CPU, CUDA
            graphs on CUDA); a dict gives torch.compile's options (e.g. {"backend": "aot_eager"}). The first call
            per model and tree shape pays the compilation (tens of seconds on a CPU); later calls reuse it. Off by
            default: see the README for when it pays.
        draft_on_device: grow greedy static and dynamic trees on the device, with one copy to the host per round
            (adaptive trees: two when more levels follow the root's children, which decide how many) instead of
            one per draft pass; fixed trees are the same as on the host but for exact ties and node order,
            adaptive trees may differ in depth (on the host each level decides on the next). None = on CUDA with
            compiled passes, else not (stree.draft.grows_on_device says why).
    Returns:
        (1, P + n) token ids (prompt + new tokens), and the stats when return_stats.

    Greedy exactness: the tree pass equals token-by-token decoding up to float rounding, so the output equals HF's
    greedy search except where two top logits lie within that rounding (~1e-6 relative in float32; in bf16 /
    fp16 rounding differs between a tree pass and a decode step, so outputs agree with HF's for a while, not
    token for token).
    """
    input_ids = _check_inputs(model, draft_model, input_ids, max_new_tokens, min_new_tokens)
    spec = tree_spec(tree) if draft_model is not None else None
    eos = eos_ids(model.generation_config.eos_token_id if eos_token_id is None else eos_token_id)
    sampler = Sampler(temperature, top_k, top_p, min_new_tokens, eos)
    stats = GenerationStats()
    device = input_ids.device
    clock = _Clock(stats, device, sync=return_stats)
    start = time.perf_counter()
    generated = []
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def emit(tokens):
        """Append tokens until a stop condition; True when generation is over."""
        done = False
        for count, token in enumerate(tokens, 1):
            generated.append(token)
            done = token in eos or len(generated) == max_new_tokens or (
                stopping_criteria is not None and bool(stopping_criteria(
                    torch.cat([input_ids, torch.tensor([generated], device=device)], dim=1), None).all()))
            if done:
                break
        if streamer is not None:
            streamer.put(torch.tensor(tokens[:count]))
        return done

    def pick(logits):
        stats.transfers += 1
        scores = sampler.scores(logits, len(generated))
        return int(scores.argmax()) if sampler.greedy else sample(scores.softmax(-1), generator)

    def step():
        """One plain decoding step of the target (the autoregressive loop's, and a paced round's): the next token
        after generated[-1], which the target's cache does not hold yet, is picked and generated[-1] committed."""
        with clock("verify_time"):
            token = pick(target.tree_forward([[generated[-1]]], [[-1]])[0, 0])
        with clock("commit_time"):
            target.commit([0])
        stats.target_passes += 1
        stats.tree_sizes.append(1)
        stats.tokens_per_pass.append(1)
        return token

    done = max_new_tokens == 0
    # Timing-driven sizes would make seeded samples irreproducible: with a generator, sampled trees stay fixed.
    adaptive = getattr(spec, "adaptive", False) and (sampler.greedy or generator is None)
    if not done:
        target_nodes, draft_nodes, draft_width = tree_shapes(spec, paced=adaptive) if spec is not None else (1, 1, 1)
        max_length = input_ids.shape[1] + max_new_tokens + draft_nodes
        target = _tree_model(model, compile, target_nodes, target_nodes, pad_single=not adaptive)
        with clock("prefill_time"):
            root = pick(target.prefill(input_ids, max_length=max_length)[0])
            if draft_model is not None:
                draft = _tree_model(draft_model, compile, draft_nodes, draft_width)
                draft.prefill(input_ids, max_length=max_length)
                if draft_on_device is None:
                    draft_on_device = grows_on_device(draft.device, draft.compiled)
        done = emit([root])
        trunk = [root]  # tokens the draft's cache still lacks; the last is the root of the next tree
    while not done and draft_model is None:  # stree's own autoregressive decoding: one node per pass
        done = emit([step()])
    costs = None  # what adaptive trees decide their size with: kept on the target across calls
    if not done and adaptive:
        kept = model.__dict__.setdefault("_stree_costs", {})
        # acceptance differs by dtype and sampling; a level drafted on the device costs what a call spread over
        # several levels costs, not what a host level costs
        key = (id(draft_model), spec, bool(compile), str(model.dtype), sampler.greedy,
               sampler.greedy and draft_on_device)
        if key not in kept:
            with clock("prefill_time"):  # setup, not decoding
                kept[key] = _calibrate(RoundCosts(), target, draft, target_nodes, spec.frontier, root)
        costs = kept[key]
    # Paced rounds (adaptive trees): a round whose context has not paid lately is one plain step instead, at most
    # `max_steps` in a row (the draft then takes the skipped tokens in its next pass, within one pass's width).
    hit, steps = True, 0  # the round's context: whether the last speculative round accepted a draft, steps since
    max_steps = 0 if costs is None else draft_width - 2
    while not done:
        round_start, spent = time.perf_counter(), (stats.draft_time, stats.verify_time)
        context = (hit, steps)
        if steps < max_steps and not costs.speculates(context):
            token = step()
            trunk.append(token)
            steps += 1
            costs.note_step(context, time.perf_counter() - round_start)
            done = emit([token])
            continue
        with clock("draft_time"):
            drafted = draft_tree(draft, trunk, spec, sampler, len(generated), generator, costs, draft_on_device)
        stats.draft_passes += drafted.passes
        stats.transfers += drafted.transfers
        offset = len(trunk) - 1  # the root's index in the draft's tree; the target's tree starts at the root
        tokens = drafted.tokens[offset:]
        parents = [p - offset for p in drafted.parents[offset:]]
        with clock("verify_time"):
            logits = target.tree_forward([tokens], [parents])[0]
            scores = sampler.scores(logits, [len(generated) + d for d in drafted.depth[offset:]])  # a tensor if needed
            if sampler.greedy:
                greedy = scores.argmax(-1).tolist()
                accepted, bonus = verify_greedy(tokens, parents, greedy)
                stats.transfers += 1
            else:
                draft_probs = {node - offset: q for node, q in drafted.probs.items()}
                accepted, bonus = verify_sampling(tokens, parents, scores.softmax(-1), draft_probs, generator)
                stats.transfers += len(accepted)
        stats.target_passes += 1
        stats.tree_sizes.append(len(tokens))
        emitted_before = len(generated)
        done = emit([tokens[n] for n in accepted[1:]] + [bonus])
        stats.tokens_per_pass.append(len(generated) - emitted_before)
        if done:
            break
        with clock("commit_time"):
            target.commit([accepted[-1]])
            path = [drafted.pass_index[n + offset] for n in accepted]
            draft.commit([max(path)])
            trunk = [tokens[n] for n, index in zip(accepted, path) if index < 0] + [bonus]
        draft_s, verify_s = stats.draft_time - spent[0], stats.verify_time - spent[1]
        if costs is not None:
            round_s = time.perf_counter() - round_start
            modelled = costs.round_time(drafted.passes, len(tokens))  # before this round's timings move it
            costs.update(draft_s, drafted.passes, drafted.level_seconds, verify_s, len(tokens),
                         round_s - draft_s - verify_s, len(accepted) - 1, drafted.expected)
            costs.note_levels(len(accepted) - 1, accepted[-1] in parents)
            if sampler.greedy:  # every verified node tells how often the target agrees with a draft probability
                costs.note_agreement([(drafted.draft_q[n + offset], greedy[parents[n]] == tokens[n])
                                      for n in range(1, len(tokens))])
            costs.note_round(context, len(accepted), round_s, modelled)
            hit, steps = len(accepted) > 1, 0
    if streamer is not None:
        streamer.end()
    stats.new_tokens = len(generated)
    stats.total_time = time.perf_counter() - start
    output = torch.cat([input_ids, torch.tensor([generated], dtype=torch.long, device=device)], dim=1)
    return (output, stats) if return_stats else output


def _calibrate(costs, target, draft, target_nodes, draft_rows, token):
    """Start the adaptive tree's cost model: time target passes of 1, 2, 4, 8 and `target_nodes` nodes (those up
    to target_nodes: RoundCosts.verify_curve), a draft pass of `draft_rows` nodes (a level's expanded nodes) and a
    plain step (a one-node target pass carrying the last commit, here an empty one), each the faster of two runs;
    both states are left unchanged. Compiled, this also compiles the one-node passes that paced rounds take."""
    def seconds(model, n, carrying=False, **kwargs):
        best = float("inf")
        for _ in range(2):
            if carrying:
                model.tree_forward([[token]], [[-1]])
                model.commit([-1])
            start = time.perf_counter()
            model.tree_forward([[token] * n], [[-1] * n], **kwargs)[0, 0].tolist()
            model.discard()
            best = min(best, time.perf_counter() - start)
        return best

    sizes = sorted({n for n in (1, 2, 4, 8, target_nodes) if n <= target_nodes})
    # a larger pass never costs less: a running maximum irons out timing noise
    times = list(itertools.accumulate((seconds(target, n) for n in sizes), max))
    costs.verify = times[0]
    costs.verify_curve = tuple((n, t - times[0]) for n, t in zip(sizes, times))  # one size (a 1-node target): flat
    costs.draft = seconds(draft, draft_rows)
    costs.step = seconds(target, 1, carrying=True)
    return costs


def _tree_model(model, compile, nodes, pass_width, pad_single=True):
    """A TreeModel of `model`: a new eager one, or with compile (True or torch.compile options) the compiled one
    kept on the model for these shapes and options (so compilation is paid once per model and tree shape). On
    CUDA every pass is padded to `pass_width` nodes (one CUDA graph per shape: extra rows cost a GPU almost
    nothing); on a CPU, where every row costs, the number of nodes stays a dynamic dimension (pad_single: see
    TreeModel.compile; adaptive trees' targets run one-node passes unpadded, warmed up by _calibrate)."""
    if not compile:
        return TreeModel(model, nodes=nodes)
    options = {} if compile is True else dict(compile)
    width = pass_width if model.device.type == "cuda" else None
    kept = model.__dict__.setdefault("_stree_compiled", {})
    # The mode is in the key: a pass traces it as a constant (module attributes are not guarded in the pass's frame).
    key = (nodes, width, pad_single, repr(sorted(options.items())), model.training)  # repr: values may be dicts
    if key not in kept:
        kept[key] = TreeModel(model, nodes=nodes, pass_width=width).compile(pad_single=pad_single, **options)
    return kept[key]
