"""TreeModel: an HF causal LM plus the state stree keeps for it, able to run a whole token tree in one forward pass
on top of the committed sequence, grow that tree by new nodes, and keep one branch.

A pass calls the model's own base model (its embeddings, decoder layers, attention modules, MLPs and norms run
unchanged; attention-free models' embeddings, blocks and final norm are called directly, without the base forward's
wrappers) with three things swapped in:
  * its recurrent mixers, for the duration of the pass, by tree mixers (one adapter class per mixer kind,
    MIXER_KINDS: Mamba2, Mamba1, Gated DeltaNet, KDA, short conv) that compute only the pass's new nodes and read
    earlier nodes from preallocated buffers;
  * the cache, a StateCache whose attention buffers are preallocated: attention modules write the new nodes'
    K/V into tree slots after the committed positions and see a 4D mask (prefix + ancestors + itself);
  * positions = committed length + depth;
  * on a CPU, its nn.Linear layers' forwards, by products on oneDNN-packed copies of their weights where those
    measured faster (packed.py), in prefill and every pass.
The tree's structure (ancestors, conv windows, depths) is kept on the host (HostTree) and copied once per pass.
The LM head runs only on the rows asked for. commit() writes the accepted node's conv and SSM states in place
(one tree_states / tree_conv_state call per group of equal layers) and moves the path's K/V rows into place; its
device part runs at the start of the next pass, in the same (compiled) call, or when `cache` is read.
"""
import contextlib
import itertools
import types
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map
from transformers import DynamicCache

from ..triton_kernels import TreeIndex
from .cache import StateCache
from .gated_delta import GatedDeltaLayers
from .host_tree import HostTree, PassLayout, to_device
from .kimi_delta import KimiDeltaLayers
from .mamba1 import Mamba1Layers
from .mamba2 import Mamba2Layers
from .packed import packed_linears
from .short_conv import ShortConvLayers

SSM_FAMILIES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2",  # Mamba2
                "mamba", "falcon_mamba", "jamba", "zamba",  # Mamba1 selective scan
                "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid",  # GDN
                "kimi_linear",  # KDA
                "lfm2", "lfm2_moe")  # short convolutions
TRANSFORMER_FAMILIES = ("llama", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = SSM_FAMILIES + TRANSFORMER_FAMILIES
# Families without attention layers (no attention buffers, no mask).
ATTENTION_FREE = ("mamba2", "mamba", "falcon_mamba")
# Mixer kinds, each one adapter class for every model whose mixers it matches (see mamba2.Mamba2Layers); a kind may
# also provide check(module), raising ValueError at construction for a configuration it does not implement, and
# SEQUENTIAL = True when its passes walk the new nodes level by level (TreePass.levels).
MIXER_KINDS = (Mamba2Layers, Mamba1Layers, GatedDeltaLayers, KimiDeltaLayers, ShortConvLayers)
# Families whose CausalLM forward rescales the LM head's output.
LOGIT_SCALE = {"granitemoehybrid": lambda model: 1.0 / model.config.logits_scaling,
               "falcon_h1": lambda model: model.model.lm_head_multiplier}
# Attention positions reserved past the prompt when prefill() is not told the final length.
DEFAULT_RESERVE = 256
# With fixed pass shapes, attention buffers hold a multiple of this many positions.
CAPACITY_STEP = 512


_copies = itertools.count()


def _skip_module_guards_of_own_frames(entries):
    """torch.compile's guard_filter_fn: drop the guards on module attributes in a TreeModel's own frames (the pass,
    whose `self` is the TreeModel), keep every guard elsewhere. Checking every module attribute on every call costs
    more than a small model's pass (1.8 ms of a 15 ms pass measured), and a pass reaches one model's modules, whose
    attributes decoding never replaces. Where the model's forward breaks the graph (e.g. HF's MoE blocks, on
    `nonzero`), dynamo traces the layers' own methods as frames of their own, one code object for every layer:
    there only the module guards tell the layers apart (dropping them replayed one layer's graph for all of them)."""
    own = any(e.name == "self" and e.has_value and isinstance(e.value, TreeModel) for e in entries)
    return [not (own and e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


def _weights_version(model):
    """Where every parameter lives and how often it was modified in place (an optimizer step, load_state_dict):
    the adapters are rebuilt when this changes. (Writes through `.data` are not counted.)"""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


@contextlib.contextmanager
def _swapped(forwards):
    """Modules' forwards replaced by the given ones ({module: forward}) for the duration of the block. (Written to
    the instances' __dict__ directly: nn.Module's __setattr__ / __delattr__ would look for a parameter, buffer or
    submodule of that name first, which costs more than a small model's pass can spare, for the same effect.)"""
    for module, forward in forwards.items():
        module.__dict__["forward"] = forward
    try:
        yield
    finally:
        for module in forwards:
            del module.__dict__["forward"]


def _compile_options(options, cuda):
    """torch.compile's keyword arguments for a pass from TreeModel.compile's: inductor's options (`options`) get the
    guard filter above, and on CUDA the inductor backend runs with mode="reduce-overhead" (CUDA graphs) unless a
    mode is given. torch.compile takes a mode or options, not both, so a mode is turned into its options."""
    options = dict(options)
    extra = dict(options.pop("options", None) or {})
    extra.setdefault("guard_filter_fn", _skip_module_guards_of_own_frames)
    inductor = options.get("backend", "inductor") == "inductor"
    mode = options.pop("mode", "reduce-overhead" if cuda and inductor else None)
    if mode is not None:
        if not inductor:
            raise ValueError(f"mode={mode!r} is an inductor setting; backend {options['backend']!r} takes none")
        from torch._inductor import list_mode_options
        extra = {**list_mode_options(mode, options.get("dynamic")), **extra}
    return {**options, "options": extra}


def _own_copy(method):
    """The bound method with a code object of its own, under a name of its own. Dynamo keeps its graphs and guards
    per code object, and what it has learnt about which sizes vary per (file, line, name) of the code: with one
    function shared by every TreeModel, one model's other slot count or node count made another model's first
    compilation dynamic (measured: the autoregressive loop's compiled commit 0.6 -> 7.6 ms once a tree model had
    compiled first), and every call walked the other models' guards."""
    f = method.__func__
    n = next(_copies)
    name = f"{f.__name__}_{n}"
    code = f.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        code = code.replace(co_qualname=f"{f.__qualname__}_{n}")
    copy = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
    return types.MethodType(copy, method.__self__)


@dataclass
class TreePass:
    """What a pass's tree mixers need: the TreeIndex over all node slots, the new nodes' ids rows (R,), and for
    SEQUENTIAL kinds levels: positions into rows grouped by level, shallowest first (a tuple of (W,) tensors; see
    TreeModel._level_positions), for a recurrence that computes each node from its parent's state."""
    index: object
    rows: torch.Tensor
    levels: tuple = ()
    shared: dict = field(default_factory=dict)  # what kinds derive from the tree once for every layer of the pass


class TreeModel:
    """Wraps a loaded HF model (its modules and weights are used as they are, nothing is copied).

    Flow: prefill(prompt) -> tree_forward(tokens, parents) -> [extend(...)] -> commit(nodes) -> tree_forward ...
    `length` counts the committed tokens; `cache` is the StateCache (reading it applies a pending commit).
    """

    def __init__(self, model, *, nodes=16, pass_width=None):
        """nodes: node slots the tree buffers start with (they grow when a tree needs more); pass_width: when set,
        every pass is padded to at least this many new nodes, so that with enough slots no shape changes from
        pass to pass (what torch.compile needs)."""
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        attn = getattr(model.config, "_attn_implementation", None) or ""
        if "flash" in attn:
            raise ValueError(f"attn_implementation={attn!r} only takes 2D padding masks, not a tree mask; load the "
                             "model with attn_implementation='sdpa' or 'eager'")
        self.model = model
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        self.logit_scale = LOGIT_SCALE.get(model_type)
        self.uses_attention = model_type not in ATTENTION_FREE
        # Attention-free models' passes call the base model's modules directly (_blocks_forward).
        self._direct = not self.uses_attention and all(hasattr(self.base, name)
                                                       for name in ("embeddings", "layers", "norm_f"))
        self.mixers, self.kinds = {}, {}  # layer_idx -> mixer module / its kind
        for module in model.modules():
            kind = next((k for k in MIXER_KINDS if k.matches(module)), None)
            if kind is not None:
                self.mixers[module.layer_idx], self.kinds[module.layer_idx] = module, kind
        if model_type in SSM_FAMILIES and not self.mixers:
            raise ValueError(f"found no supported mixer in this {model_type} model")
        for i, mixer in self.mixers.items():
            getattr(self.kinds[i], "check", lambda module: None)(mixer)
        self._sequential = any(getattr(kind, "SEQUENTIAL", False) for kind in self.kinds.values())  # needs levels
        self.window_keys = sorted({key for i, m in self.mixers.items() for key in self.kinds[i].window_keys(m)})
        self._tree_forwards = {self.mixers[i]: self._tree_forward_of(i) for i in self.mixers}
        self._linears = {}     # nn.Linear -> its forward on a packed weight (CPU; see packed.py), set by prefill
        self.nodes, self.pass_width = nodes, pass_width
        self._min_rows = 1     # fewest new nodes and LM-head rows a pass computes (padded up to them)
        self._compiled = False
        self._cache = None
        self._weights = None   # _weights_version(model) when the mixer adapters were built
        self.tree = None       # HostTree of the uncommitted tree
        self._pending = None   # the last commit's device arguments, until a pass (or reading `cache`) applies them
        self._pass = None
        self._structure = None  # the tree's structure as the last pass saw it, on the device (extend_on_device's)
        self._unsettled = 0     # nodes extend_on_device added that the host tree does not know yet (settle())
        self._level_widths = []  # compiled: one per level a pass has had (with fixed shapes its widest)
        self._layers = {}      # layer_idx -> (its kind's adapter for its state group, slice j)
        self._marked = None    # the capacities at which _mark_static last marked the buffers
        self.run = self._run   # the device part of a pass, the pending commit's first (torch.compile may replace it)

    @property
    def cache(self):
        """The StateCache, the last commit applied."""
        self._apply_pending()
        return self._cache

    def _apply_pending(self):
        """Run the pending commit's device part now (eagerly) rather than with the next pass."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                with torch.no_grad():
                    self._commit(*pending)
            except BaseException:  # whether it was applied is unknown: the state is lost
                self._cache = self.tree = None
                raise

    @property
    def length(self):
        return 0 if self._cache is None else self._cache.length

    @property
    def device(self):
        return self.head.weight.device

    @torch.no_grad()
    def prefill(self, input_ids, *, max_length=None):
        """Start a new state holding input_ids (batch, P), P >= 1, with HF's own forward (its chunked scan).

        max_length: the most tokens the sequence will hold, trees included (attention buffers are sized for it and
        grow by doubling if it is exceeded); default P + 256. Returns the last token's logits (batch, vocab).
        """
        batch, P = input_ids.shape
        if P < 1:
            raise ValueError("prefill needs at least one token")
        hf_cache = DynamicCache(config=self.model.config)
        kwargs = {}
        if self.uses_attention:  # Bamba ignores the cache offset by default: always pass positions
            kwargs["position_ids"] = torch.arange(P, device=input_ids.device).expand(batch, P)
        weights = _weights_version(self.model)  # the mixer adapters hold constants derived from the weights
        if self.device.type == "cpu":
            self._linears = packed_linears(self.model, weights)
        with _swapped(self._linears):
            logits = self.model(input_ids=input_ids, cache=hf_cache, use_cache=True, logits_to_keep=1,
                                **kwargs).logits
        capacity = max(max_length or 0, P + DEFAULT_RESERVE)
        if self.pass_width is not None or self._compiled:  # compiled: round the buffers up so that
            # most prompts share them (and the compilation)
            capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        cache = StateCache.from_hf(hf_cache, P, capacity)
        self._pending = None  # the state is replaced
        if self._cache is not None and weights == self._weights and self._cache.load(cache):
            pass  # same shapes and weights: the existing buffers (and anything compiled against them) are kept
        else:
            self._cache, self._weights = cache, weights
            self._layers, self._marked = {}, None
            for group in cache.groups:
                kinds = {self.kinds.get(i) for i in group.layers}
                if len(kinds) != 1 or None in kinds:
                    raise ValueError(f"layers {group.layers} hold recurrent states of one shape but not one supported "
                                     "mixer kind")
                layers = kinds.pop()([self.mixers[i] for i in group.layers], group)
                self._layers.update({i: (layers, j) for j, i in enumerate(group.layers)})
        self.tree = None
        return logits[:, -1]

    def compile(self, *, pad_single=True, **options):
        """Compile the device part of every pass (with the pending commit's) with torch.compile (inductor; on CUDA
        with mode="reduce-overhead", i.e. CUDA graphs, unless `options` say otherwise). Shapes must not change from
        pass to pass, so the TreeModel needs enough node slots and, for one graph per shape, a pass_width; without
        one the number of new nodes is a dynamic dimension (torch.compile's automatic dynamic shapes: one more
        compilation when it first changes). A buffer that grows recompiles.

        pad_single: without a pass_width, pad passes of one new node and LM heads of one row to two (see below);
        False when one-node passes are frequent and their own graphs are warmed up by the caller (a compiled
        one-node pass costs ~0.8x a padded one)."""
        if self.device.type == "cuda":
            self._static_buffers = True  # CUDA graphs replay only over buffers at fixed addresses
        # Sequential kinds unroll their levels into the graph (one graph per tree depth met), which can pass dynamo's
        # default limit of 8 graphs per function.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        options.setdefault("dynamic", False if self.pass_width is not None else None)
        options = _compile_options(options, cuda=self.device.type == "cuda")
        if self.pass_width is None and self.nodes > 1 and pad_single:
            # A dynamic dimension is still specialised at size 1: a first one-node pass or one-row LM head, rare in a
            # tree model, would compile again mid-generation (measured: ~5 s inside a 3 s benchmark run). Padding
            # such passes to two rows keeps them on the dynamic graph.
            self._min_rows = 2
        self.run = torch.compile(_own_copy(self._run), **options)
        self._compiled = True
        return self

    @property
    def compiled(self):
        """Whether compile() has made this model's passes torch.compile'd."""
        return self._compiled

    @torch.no_grad()
    def tree_forward(self, tokens, parents, *, logits_for=None, slots=None):
        """Logits (batch, T, vocab) of every node of a tree on top of the committed sequence, in one pass.

        tokens (batch, T) ints (tensor or nested lists); parents (batch, T) ints, parents[b, i] < i, -1 = child of
        the committed sequence. Node i's logits are those the model gives after the sequence + path(i).
        logits_for: optional (K,) node ids; then only their logits are computed (LM head on K rows):
        (batch, K, vocab). The state stays the committed one until commit() (or discard()); extend() or
        extend_on_device() may grow the tree first. slots: the most nodes the tree will hold (its buffers are sized
        for them and for padded passes up to them: a tree grown on the device cannot grow its buffers).
        """
        if self._cache is None:
            raise RuntimeError("call prefill() before tree_forward()")
        if self.tree is not None:
            raise RuntimeError("the previous tree is not committed: call commit() or discard() first")
        padding = max(self.pass_width or 1, self._min_rows) - 1  # a pass is at least that wide
        self.tree = HostTree(self._cache.batch, self.window_keys,
                             capacity=max(self.nodes, slots + padding if slots else 0))
        self._unsettled = 0
        try:
            return self._grow(tokens, parents, logits_for)
        finally:
            if self.tree is not None and self.tree.n == 0:
                self.tree = None

    @torch.no_grad()
    def extend(self, tokens, parents, *, logits_for=None):
        """Grow the uncommitted tree by new nodes and return their logits (batch, T_new or K, vocab).

        tokens (batch, T_new); parents (batch, T_new) index the whole tree: the T_old nodes already passed, then
        these (new node j has id T_old + j, so parents[b, j] < T_old + j; -1 = child of the committed sequence).
        Only the new nodes go through the layers; their logits equal those of one tree_forward() over the grown
        tree. logits_for: optional (K,) positions in `tokens` whose logits to compute.
        """
        if self.tree is None:
            raise RuntimeError("no tree to extend: call tree_forward() first")
        return self._grow(tokens, parents, logits_for)

    def _grow(self, tokens, parents, logits_for):
        device, cache, tree = self.device, self._cache, self.tree
        self._check_settled()
        tokens, parents = (np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x) for x in (tokens, parents))
        if tokens.ndim != 2 or tokens.shape[0] != cache.batch or parents.shape != tokens.shape:
            raise ValueError(f"tokens {tokens.shape} and parents {parents.shape} must both be (batch={cache.batch}, T)")
        if tokens.size and tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        R = tokens.shape[1]
        if logits_for is not None:
            logits_for = [int(i) for i in (logits_for.reshape(-1).tolist() if isinstance(logits_for, torch.Tensor)
                                           else logits_for)]
            if any(not 0 <= i < R for i in logits_for):
                raise ValueError(f"logits_for must hold positions in [0, {R}), got {logits_for}")
        start, end = tree.add(parents)  # raises ValueError unless topological
        try:
            head_rows = list(range(R)) if logits_for is None else logits_for
            K = len(head_rows)
            width, head_rows = self._shape(R, head_rows)
            if start + width > tree.capacity:
                tree.reserve(max(start + width, 2 * tree.capacity))
            self.nodes = tree.capacity  # later trees start with as many slots
            if self._pending is not None and (self._pending[1].capacity != tree.capacity or (
                    cache.capacity is not None and cache.length + tree.capacity > cache.capacity)):
                self._apply_pending()  # buffers are about to grow: the commit, shaped for the old ones, goes first
            for layers, _ in self._layers.values():
                layers.reserve(tree.capacity)
            cache.reserve(cache.length + tree.capacity)
            if getattr(self, "_static_buffers", False):
                self._mark_static()
            flat, layout = tree.pass_inputs(start, width, cache.length, device, tokens, head_rows)
            levels = self._level_positions(tree.levels(start, width)) if self._sequential else ()
            pending, self._pending = self._pending, None
            try:
                logits = self._call(flat, layout, levels, pending)
            except BaseException:
                if pending is not None:  # whether the commit was applied is unknown: the state is lost
                    self._cache = self.tree = None
                raise
        except BaseException:  # the buffers' new slots are simply reused by the next pass
            tree.truncate(start)
            raise
        self._structure = flat[flat.numel() - tree.structure_size:]
        return logits[:, :K]

    def _shape(self, R, head_rows):
        """(width, head rows) of a pass over R new nodes whose LM head runs on `head_rows` (a list): at least
        pass_width (fixed shapes) or _min_rows nodes, and with fixed shapes always `width` head rows, else at least
        _min_rows (padding rows repeat row 0)."""
        width = max(R, self.pass_width or self._min_rows)
        rows = width if self.pass_width is not None else self._min_rows
        return width, head_rows + [0] * (rows - len(head_rows))

    def _call(self, *args):
        """self.run(*args) with the tree mixers and packed linears swapped in; the pass's state cleared after."""
        try:
            with _swapped({**self._linears, **self._tree_forwards}):
                return self.run(*args)
        finally:
            self._cache.end_pass()
            self._pass = None

    @torch.no_grad()
    def extend_on_device(self, R, depth, choose, args=(), then=None, *, more=None):
        """Grow the uncommitted tree by one level of R new nodes chosen on the device, without a host sync.

        choose(ids, *args) -> (tokens, parents, carry): ids (R,) the new nodes' ids on the device (the next R ids, as
        in extend()); the new nodes' tokens and parents, (batch, R) int64 tensors on the model's device, parents
        ids of nodes already in the tree. Every new node is `depth` below the committed sequence (position
        length + depth).
        then(logits, carry) -> out, logits (batch, R, vocab) of the new nodes; without it out = logits.
        Both run inside the pass's call (compiled with it: a level of drafting is one call). Returns out.
        more: further levels grown in the same call (compiled: one graph, on CUDA one replay, for them all),
        ((R, depth, choose, then, args_of), ...): the next level's choose() gets args_of(out) of the level before
        it. Then (even when empty) returns [out of every level].
        The host tree learns the new nodes in settle(), which extend(), commit() and host-built passes need
        first; the tree cannot grow its slots here (tree_forward's `slots`).
        """
        if self.tree is None:
            raise RuntimeError("no tree to extend: call tree_forward() first")
        tree, cache = self.tree, self._cache
        start = tree.n + self._unsettled
        headers, layouts, levels, plan = [], [], [], []
        for R_i, depth_i, choose_i, then_i, args_of in [(R, depth, choose, then, None), *(more or ())]:
            width, head_rows = self._shape(R_i, list(range(R_i)))
            if start + width > tree.capacity:
                raise ValueError(f"{start + width} node slots needed, the tree holds {tree.capacity}: pass slots= to "
                                 "tree_forward()")
            layout = PassLayout(cache.batch, width, len(head_rows), 0, tree.capacity, tree.window_keys)
            headers.append(HostTree.header(layout, start, cache.length, np.full((cache.batch, R_i), depth_i),
                                           head_rows=head_rows))
            layouts.append(layout)
            # no new node is another's ancestor
            levels.append(self._level_positions([np.arange(width)]) if self._sequential else ())
            plan.append((R_i, headers[-1].size, choose_i, then_i, args_of))
            start += R_i
        header = to_device(np.concatenate(headers), self.device)
        outs, structure = self._call(header, layouts, levels, None, (plan, args, self._structure))
        if getattr(self, "_static_buffers", False):
            # CUDA graphs: a graph's outputs are overwritten by its next replay, which the next level is (the
            # caller keeps every level's outputs until it copies them over)
            outs, structure = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (outs, structure))
        self._structure = structure
        self._unsettled += sum(level[0] for level in plan)
        return outs if more is not None else outs[0]

    def settle(self, parents):
        """Tell the host tree the parents of the nodes extend_on_device() added since tree_forward() or the last
        settle(): parents (batch, n), in the order the nodes were added (the caller has them on the host; nothing
        is copied here)."""
        parents = np.asarray(parents, dtype=np.int64).reshape(self._cache.batch, -1)
        if parents.shape[1] != self._unsettled:
            raise ValueError(f"{self._unsettled} nodes were added on the device, got parents for {parents.shape[1]}")
        self.tree.add(parents)
        self._unsettled = 0

    def _check_settled(self):
        if self._unsettled:
            raise RuntimeError("nodes added by extend_on_device() are not settled: call settle() first")

    def _level_positions(self, levels):
        """The pass's positions grouped by level (HostTree.levels' list) on the device, in one copy. A compiled pass has as
        many levels as the deepest before it (the walk is unrolled in its graph; extra levels repeat position 0),
        and with fixed shapes each level is padded to the widest it has been by repeating its own positions:
        recomputing a node whose parent is final is idempotent."""
        if self._compiled or self.pass_width is not None:
            widths = self._level_widths
            widths += [1] * (len(levels) - len(widths))
            sizes = [len(levels[s]) if s < len(levels) else 1 for s in range(len(widths))]
            if self.pass_width is not None:
                widths[:] = sizes = [max(w, n) for w, n in zip(widths, sizes)]
            levels = [np.resize(levels[s] if s < len(levels) else levels[0][:1], n) for s, n in enumerate(sizes)]
        flat = to_device(np.concatenate(levels), self.device)
        return flat.split([len(level) for level in levels])

    def _run(self, flat, layout, levels, pending, grown=None):
        """The device part of a pass (no host sync, shapes fixed by the slots and pass width) over HostTree.pass_inputs'
        (flat, layout) and the levels of _level_positions, after the pending commit's (the arguments of _commit, or
        None). Returns logits (batch, K = the pass's head rows, vocab).

        grown (extend_on_device): (plan, args, structure), one pass per level of plan, [(R, header size, choose, then,
        args_of)]; `flat` holds the levels' HostTree.header()s one after another, and layout and levels are lists
        with one entry per level; a level's pass tensor is HostTree.extended()'s. Returns ([then's output of every
        level], the extended structure)."""
        if pending is not None:
            self._commit(*pending)
        if grown is None:
            return self._forward(flat, layout, levels)
        plan, args, structure = grown
        headers = flat.split([size for _, size, *_ in plan])
        outs = []
        for (R, _, choose, then, args_of), header, level_layout, level_positions in zip(plan, headers, layout, levels):
            if args_of is not None:
                args = args_of(outs[-1])
            tokens, parents, carry = choose(header[:R], *args)  # the header's first field: the new nodes' ids
            if tokens.shape != (level_layout.batch, R) or parents.shape != tokens.shape:
                raise ValueError(f"choose() gave tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)}; "
                                 f"expected both (batch={level_layout.batch}, R={R})")
            flat = HostTree.extended(header, tokens, parents, structure, level_layout)
            logits = self._forward(flat, level_layout, level_positions)[:, :R]
            outs.append(logits if then is None else then(logits, carry))
            structure = flat[flat.numel() - structure.numel():]
        return outs, structure

    def _forward(self, flat, layout, levels):
        """The model's forward over a pass's tensor: logits (batch, K, vocab)."""
        inputs = HostTree.unpack(flat, layout)
        cache, rows, tokens = self._cache, inputs["rows"], inputs["tokens"]
        index = TreeIndex.prebuilt(inputs["parents"], inputs["mask"], inputs["windows"])
        kwargs = dict(position_ids=inputs["positions"])
        if self.uses_attention:
            # Position p is visible to row r if p < length (committed) or p = length + k with k an ancestor of r.
            batch, width, slots = tokens.shape[0], rows.shape[0], index.shape[1]
            positions = torch.arange(cache.capacity, device=tokens.device)
            allowed = (positions < inputs["length"]).expand(batch, width, -1).clone()
            tree_cols = (inputs["length"] + torch.arange(slots, device=tokens.device)).expand(batch, width, -1)
            allowed.scatter_(2, tree_cols, index.mask.index_select(1, rows))
            dtype = self.head.weight.dtype
            kwargs["attention_mask"] = torch.zeros(batch, 1, width, cache.capacity, dtype=dtype,
                                                   device=tokens.device).masked_fill_(~allowed[:, None],
                                                                                      torch.finfo(dtype).min)
            cache.begin_pass(inputs["length"] + rows)
        self._pass = TreePass(index, rows, levels)
        if self._direct:
            hidden = self._blocks_forward(tokens)
        else:
            hidden = self.base(input_ids=tokens, cache=cache, use_cache=True, **kwargs).last_hidden_state
        return self.logits(hidden.index_select(1, inputs["head_rows"]))

    def _blocks_forward(self, tokens):
        """An attention-free base model's forward over tokens (batch, R), its modules called directly: embeddings,
        each block (its norm, the swapped-in tree mixer, the residual), the final norm. That is all HF's forward
        does for these families when nothing is padded; its wrappers (output capture, config defaults, the
        padding mask) cost a one-layer draft's pass ~0.2-0.3 ms on a CPU."""
        hidden = self.base.embeddings(tokens)
        for block in self.base.layers:
            hidden = block(hidden)
        return self.base.norm_f(hidden)

    def _mark_static(self):
        """Tell torch.compile that every state and tree buffer keeps its address (so that CUDA graphs may write them
        in place); buffers are reallocated only when they grow, which recompiles anyway. Runs before every pass, but
        walks the buffers only when a capacity changed since it last did (prefill() forgets that on new buffers)."""
        adapters = {id(a): a for a, _ in self._layers.values()}.values()
        cache = self._cache
        capacities = (cache.capacity, tuple(a.capacity for a in adapters))
        if capacities == self._marked:
            return
        # the views too: eager passes write through them (compiled ones slice their own in the graph, since a
        # view from outside would be a graph input aliasing its base; see Mamba2Layers.forward)
        for t in tree_leaves([cache.keys, cache.values, cache.conv, cache.recurrent, [vars(a) for a in adapters],
                              [(g.conv, g.recurrent) for g in cache.groups]]):
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t)
        self._marked = capacities

    def _tree_forward_of(self, layer_idx):
        def forward(hidden_states, *args, **kwargs):
            layers, j = self._layers[layer_idx]
            return layers.forward(j, hidden_states, self._pass, *self._cache.states(layer_idx))
        return forward

    def logits(self, hidden):
        """The model's LM head (with its family's output scaling) on final hidden states (..., hidden)."""
        logits = self.head(hidden.to(self.head.weight.dtype))
        return logits if self.logit_scale is None else logits * self.logit_scale(self.model)

    @torch.no_grad()
    def commit(self, nodes):
        """Make the state equal to the committed sequence + path(nodes[b]) of the current tree, in place.

        nodes (batch,) ints (tensor or list), -1 = keep only the committed sequence. Every row must accept a path
        of the same length. The host part (length, checks) happens now, the device part with the next pass.
        """
        if self.tree is None:
            raise RuntimeError("no tree to commit: call tree_forward() first")
        self._check_settled()
        tree, cache = self.tree, self._cache
        nodes = nodes.reshape(-1).tolist() if isinstance(nodes, torch.Tensor) else [int(n) for n in nodes]
        if len(nodes) != cache.batch or any(not -1 <= n < tree.n for n in nodes):
            raise ValueError(f"nodes must hold {cache.batch} node ids in [-1, {tree.n}), got {nodes}")
        paths = [tree.path(b, n) for b, n in enumerate(nodes)]
        if any(len(p) != len(paths[0]) for p in paths):
            raise ValueError(f"accepted paths of different lengths across the batch ({[len(p) for p in paths]}) "
                             "are not supported")
        # One transfer: the nodes, then each row's path slots (sources) and where they go (destinations). Paths are
        # padded to the tree's slot count (padding copies a position onto itself), so no shape depends on the path.
        n, width = len(paths[0]), self.tree.capacity
        destinations = cache.length + np.arange(width)
        sources = np.tile(destinations, (cache.batch, 1))
        sources[:, :n] = cache.length + np.asarray(paths, dtype=np.int64).reshape(cache.batch, n)
        moves = np.concatenate([np.asarray(nodes, dtype=np.int64), sources.reshape(-1),
                                np.tile(destinations, cache.batch)])
        # the tree's structure as it is now (a failed pass may have grown its slots since the last good one)
        self._pending = tree.pass_inputs(0, 0, cache.length, self.device, extra=moves)
        cache.length += n
        self.tree = None

    def _commit(self, flat, layout):
        """The device part of a commit (no host sync; fixed shapes): every state group to path(nodes) of the tree, and
        the K/V moves, all read from HostTree.pass_inputs' (flat, layout) of commit(): the tree's structure, then as
        `extra` the nodes (batch,) and the moves (2, batch, slots): source and destination positions. (Not the last
        pass's inputs: the TreeIndex a pass builds also caches what depended on its rows, which would make the
        commit's graph depend on them.)"""
        inputs = HostTree.unpack(flat, layout)
        batch, slots = layout.batch, layout.capacity
        nodes, moves = inputs["extra"][:batch], inputs["extra"][batch:].view(2, batch, slots)
        index = TreeIndex.prebuilt(inputs["parents"], inputs["mask"], inputs["windows"])
        for layers in {id(layers): layers for layers, _ in self._layers.values()}.values():
            layers.commit(index, nodes)
        self._cache.move_positions(moves[0], moves[1])

    def discard(self):
        """Forget the uncommitted tree: the state is the committed sequence alone again."""
        self.tree = None
        self._unsettled = 0
