"""TreeModel: an HF causal LM plus the state stree keeps for it, able to run a whole token tree in one forward pass
on top of the committed sequence, grow that tree by new nodes, and keep one branch.

A pass calls the model's own base model (its embeddings, decoder layers, attention modules, MLPs and norms run
unchanged; attention-free models' embeddings, blocks and final norm are called directly, without the base forward's
wrappers), through a private copy of its module objects that shares its weights (so that the swaps below are seen by
no one else using the model meanwhile), with three things swapped in:
  * its recurrent mixers, for the duration of the pass, by tree mixers (one adapter class per mixer kind,
    families.MIXER_KINDS) that compute only the pass's new nodes and read earlier nodes from preallocated buffers;
  * the cache, a StateCache whose attention buffers are preallocated: attention modules write the new nodes'
    K/V into tree slots after the committed positions and see a 4D mask (prefix + ancestors + itself);
  * positions = committed length + depth;
  * on a CPU, its nn.Linear layers' forwards, by products on oneDNN-packed copies of their weights where those
    measured faster (packed.py), in prefill and every pass.
The tree's structure (ancestors, conv windows, depths) is kept on the host (HostTree) and copied once per pass.
The LM head runs only on the rows asked for. commit() writes the accepted node's conv and SSM states in place
(one commit per group of equal layers) and moves the path's K/V rows into place; its device part runs at the start
of the next pass, in the same (compiled) call, or when `cache` is read.

This module is the host side; what a pass runs on the device is tree_pass.py (TreePassRunner), growing the tree on
the device device_growth.py (DeviceGrowth), compiling it compile.py.
"""
import weakref

import numpy as np
import torch
from transformers import DynamicCache

from ..checks import check_prompts, check_token_ids, vocab_size
from .cache import StateCache
from .compile import PASS_SIZES, compile_options, own_copy, with_recompile_limit
from .device_growth import DeviceGrowth
from .families import ATTENTION_FREE, LOGIT_SCALE, check_model, find_mixers
from .families import MIXER_KINDS, SSM_FAMILIES, SUPPORTED_MODEL_TYPES, TRANSFORMER_FAMILIES  # noqa: F401 (old home)
from .hf_forward import capturing_forwards, private_modules, swapped, weights_version
from .host_tree import HostTree, to_device
from .packed import packed_linears
from .tree_pass import TreePass, TreePassRunner  # noqa: F401 (TreePass: its old import path)

# Attention positions reserved past the prompt when prefill() is not told the final length.
DEFAULT_RESERVE = 256
# With fixed pass shapes, attention buffers hold a multiple of this many positions.
CAPACITY_STEP = 512


class TreeModel(TreePassRunner, DeviceGrowth):
    """Wraps a loaded HF model: its weights are used as they are, on a private copy of its module objects
    (hf_forward.private_modules) on which the tree mixers are swapped in, so that the model itself runs unchanged
    for anyone else meanwhile (HF's generate, another thread, another TreeModel). One TreeModel is one sequence's
    state: use one per thread. It holds no strong reference to the model object.

    Flow: prefill(prompt) -> tree_forward(tokens, parents) -> [extend(...)] -> commit(nodes) -> tree_forward ...
    `length` counts the committed tokens; `cache` is the StateCache (reading it applies a pending commit).
    """
    IS_HEAD = False  # a draft head's (HeadTreeModel): its passes take features

    def __init__(self, model, *, nodes=16, pass_width=None, returns_hidden=False):
        """nodes: node slots the tree buffers start with (they grow when a tree needs more); pass_width: when set,
        every pass is padded to at least this many new nodes, so that with enough slots no shape changes from
        pass to pass (what torch.compile needs). returns_hidden: when True, prefill(), tree_forward() and extend()
        also return the features a draft head (stree.heads) drafts from, at every position they ran: the last hidden
        states (after the final norm) (..., hidden); when a tuple of decoder layer indices, those layers' outputs
        concatenated in that order (..., len(layers) * hidden) (EAGLE-3-style heads)."""
        model_type = check_model(model)
        self._source = weakref.ref(model)  # the model: its packed linears are kept for it (packed.py)
        model, self._copy_of = private_modules(model)
        self.config, self.base, self.head = model.config, model.base_model, model.get_output_embeddings()
        self.vocab = vocab_size(model)
        self.logit_scale = LOGIT_SCALE.get(model_type)  # scale(logits, config, base)
        self.uses_attention = model_type not in ATTENTION_FREE
        # Attention-free models' passes call the base model's modules directly (blocks_forward).
        self._direct = not self.uses_attention and all(hasattr(self.base, name)
                                                       for name in ("embeddings", "layers", "norm_f"))
        # layer_idx -> mixer module / its kind
        self.mixers, self.kinds = find_mixers(model, model_type, required=not self.IS_HEAD)
        self._sequential = any(getattr(kind, "SEQUENTIAL", False) for kind in self.kinds.values())  # needs levels
        self.window_keys = sorted({key for i, m in self.mixers.items() for key in self.kinds[i].window_keys(m)})
        self._tree_forwards = {self.mixers[i]: self._tree_forward_of(i) for i in self.mixers}
        self._linears = {}     # nn.Linear -> its forward on a packed weight (CPU; see packed.py), set by prefill
        self.nodes, self.pass_width, self.returns_hidden = nodes, pass_width, bool(returns_hidden)
        self.feature_layers = tuple(returns_hidden) if isinstance(returns_hidden, (tuple, list)) else None
        self._layer_outputs = {}  # layer index -> its output in the last pass (feature_layers')
        self._feature_forwards = capturing_forwards(self.base, self.feature_layers or (), self._layer_outputs)
        self._min_rows = 1     # fewest new nodes and LM-head rows a pass computes (padded up to them)
        self._compiled = self._static_buffers = False  # static buffers: CUDA graphs replay over fixed addresses
        self._cache = None
        self._weights = None   # weights_version when the mixer adapters were built
        self.tree = None       # HostTree of the uncommitted tree
        self._pending = None   # the last commit's device arguments, until a pass (or reading `cache`) applies them
        self._pass = None
        self._holder = None     # the thread whose generation holds this TreeModel (claim.py)
        self._structure = None  # the tree's structure as the last pass saw it, on the device (extend_on_device's)
        self._unsettled = 0     # nodes extend_on_device added that the host tree does not know yet (settle())
        self._level_widths = []  # compiled: one per level a pass has had (with fixed shapes its widest)
        self._layers = {}      # layer_idx -> (its kind's adapter for its state group, slice j)
        self._bound = None     # (weakref to the StateCache _layers were made or last bound for, (its memory, weights))
        self._marked = None    # the capacities at which _mark_static last marked the buffers
        self.run = self._run   # the device part of a pass, the pending commit's first (torch.compile may replace it)

    @property
    def cache(self):
        """The StateCache, the last commit applied."""
        self._apply_pending()
        return self._cache

    @property
    def length(self):
        return 0 if self._cache is None else self._cache.length

    @property
    def device(self):
        return self.head.weight.device

    @torch.no_grad()
    def prefill(self, input_ids, *, max_length=None, features=None):
        """Start a new state holding input_ids (batch, P), P >= 1, with HF's own forward (its chunked scan).

        max_length: the most tokens the sequence will hold, trees included (attention buffers are sized for it and
        grow by doubling if it is exceeded); default P + 256. features: only for draft heads (HeadTreeModel).
        Returns the last token's logits (batch, vocab), and with returns_hidden the hidden states (batch, P, hidden).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                      torch.int32):
            raise ValueError("input_ids must be an integer tensor of shape (batch, prompt_length)")
        logits, features, cache, weights = self._prefilled(input_ids, features, max_length)
        self._pending = None  # the state is replaced
        if self._cache is None or weights != self._weights or not self._cache.load(cache):
            # new shapes or weights: new buffers (else the existing ones, and anything compiled against them, stay)
            self._use(cache, weights)
        self.tree = None
        return (logits, features) if self.returns_hidden else logits

    def _prefilled(self, input_ids, features, max_length):
        """HF's forward over input_ids (batch, P): (last logits (batch, vocab), features or None, a new StateCache
        holding them, the weights' version)."""
        batch, P = input_ids.shape
        if P < 1:
            raise ValueError("prefill needs at least one token")
        check_token_ids("input_ids", input_ids, self.vocab)
        if not self.IS_HEAD:  # a plain model takes no features (HeadTreeModel.prefill checks its own)
            self._checked_features(features, (batch, P))
        hf_cache = DynamicCache(config=self.config)
        kwargs = {}
        if self.uses_attention:  # Bamba ignores the cache offset by default: always pass positions
            kwargs["position_ids"] = torch.arange(P, device=input_ids.device).expand(batch, P)
        weights = weights_version(self.base, self.head)  # the mixer adapters hold constants derived from them
        if self.device.type == "cpu":
            self._linears = self._packed_linears(weights)
        with swapped({**self._linears, **self._feature_forwards}):
            hidden = self._hidden(input_ids, hf_cache, kwargs, features)
            logits = self.logits(hidden[:, -1])
            features = self._features(hidden)
        capacity = max(max_length or 0, P + DEFAULT_RESERVE)
        if self.pass_width is not None or self._compiled:  # compiled: round the buffers up so that
            # most prompts share them (and the compilation)
            capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        return logits, features if self.returns_hidden else None, StateCache.from_hf(hf_cache, P, capacity), weights

    def _use(self, cache, weights):
        """Make `cache` the state (its mixer adapters follow at the next pass: _bind)."""
        self._cache, self._weights, self._marked = cache, weights, None

    def _bind(self):
        """Mixer adapters for the state: those of the state they were made for where it held the same buffers (rows
        moved within them, however many steps it took: every node buffer keeps its address too, and CUDA graphs
        replay over them), else new ones built for its shapes."""
        cache = self._cache
        if self._bound is not None and self._bound[0]() is cache:
            return
        memory = (cache.memory(), self._weights)
        if self._layers and self._bound is not None and self._bound[1] == memory:
            groups = {tuple(g.layers): g for g in cache.groups}
            for adapter in {id(a): a for a, _ in self._layers.values()}.values():
                adapter.group = groups[tuple(adapter.group.layers)]
        else:
            self._layers = _adapters(cache, self.mixers, self.kinds)
        self._bound, self._marked = (weakref.ref(cache), memory), None

    @torch.no_grad()
    def add_rows(self, prompts, *, max_length=None, features=None):
        """Append one row per prompt to the state (a new state if there is none): each prompt (a 1-D tensor of P_i
        >= 1 token ids, lengths may differ) is prefilled with HF's own forward, prompts of equal length together,
        none padded, so each row's state is exactly its prompt's. Rows keep their own lengths from then on (passes
        place each row's nodes after its own tokens; commits may accept paths of different lengths per row).

        max_length: the most tokens any row will hold, trees included. features: only for draft heads
        (HeadTreeModel.add_rows). Compiled passes see the batch change size (the state's buffers are made anew):
        the first change compiles them again with a dynamic batch size (and a batch of 1 once more); CUDA graphs
        record a graph per size met. Returns the new rows' last logits (len(prompts), vocab) in prompt order, and
        with returns_hidden a list of their features ((P_i, hidden) each)."""
        if self.tree is not None:
            raise RuntimeError("the current tree is not committed: call commit() or discard() first")
        prompts = [p.long().to(self.device) for p in check_prompts(prompts, "add_rows")]
        groups = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(prompt.shape[0], []).append(i)
        caches, order, logits, hidden = [] if self._cache is None else [self.cache], [], [], []
        for P, rows in groups.items():
            given = None if features is None else torch.stack([features[i] for i in rows])
            out, feats, cache, weights = self._prefilled(torch.stack([prompts[i] for i in rows]), given, max_length)
            caches.append(cache)
            order += rows
            logits.append(out)
            hidden += [] if feats is None else list(feats)
        capacity = max(c.capacity or 0 for c in caches)
        cache, where = StateCache.concat(caches, capacity, self._in_place), np.argsort(order)
        if not np.array_equal(where, np.arange(len(prompts))):  # new rows came in group order: back to prompt order
            old = cache.batch - len(prompts)
            cache = cache.select(torch.as_tensor(np.concatenate([np.arange(old), old + where]), device=self.device))
        self._use(cache, weights)
        logits = torch.cat(logits)[torch.as_tensor(where)]
        return (logits, [hidden[i] for i in where]) if self.returns_hidden else logits

    @torch.no_grad()
    def pad_rows(self, count):
        """Append `count` spare rows that hold nothing (zero states, no token). A caller that keeps its batch at a
        few sizes (stree.batch on CUDA graphs: one graph per batch size) runs passes over them and commits them
        with -1, so they stay empty."""
        if self.tree is not None:
            raise RuntimeError("the current tree is not committed: call commit() or discard() first")
        if count:
            cache = self.cache
            padded = StateCache.concat([cache, cache.empty(count)], cache.capacity or 0, self._in_place)
            self._use(padded, self._weights)

    def set_slots(self, nodes):
        """Eager passes: make trees start with `nodes` node slots, smaller or larger than now (the per-node buffers
        are made anew, at the next pass). A commit's work grows with the slots, so a caller that alternates plain
        steps and trees (stree.batch) sizes them per round."""
        if self._compiled or self.pass_width is not None:
            raise ValueError("set_slots is for eager passes (compiled ones keep their shapes)")
        if self.tree is not None:
            raise RuntimeError("the current tree is not committed: call commit() or discard() first")
        if nodes != self.nodes:
            self._apply_pending()  # it reads the buffers about to go
            self.nodes = nodes
            self._layers, self._bound = {}, None  # new ones, for these slots, at the next pass

    def clear(self):
        """Forget the state (and any tree): the next prefill() or add_rows() starts a new one."""
        self._cache = self.tree = self._pending = self._bound = None
        self._layers = {}  # they hold the state's tensors

    @torch.no_grad()
    def keep_rows(self, rows):
        """Keep only rows `rows` (a list of row indices, in the order they become rows 0, 1, ...) of the state. Rows
        in increasing order move within the state's own buffers on a CPU, and on any device with CUDA graphs
        (StateCache.keep: the memory stays with the model, and rows that join later go there); any other order
        makes a new state."""
        if self.tree is not None:
            raise RuntimeError("the current tree is not committed: call commit() or discard() first")
        rows = [int(r) for r in rows]
        if not rows or any(not 0 <= r < self._cache.batch for r in rows):
            raise ValueError(f"rows must be a non-empty list of row indices below {self._cache.batch}, got {rows}")
        self._use(self.cache.keep(rows, self._in_place), self._weights)

    @property
    def _in_place(self):
        """Whether rows that leave or join move within the state's buffers on any device (True: CUDA graphs replay
        over static buffers, which must keep their addresses) or only on a CPU (None: StateCache.keep)."""
        return True if self._static_buffers else None

    def _packed_linears(self, weights):
        """{linear of the copy: its packed forward}, packed once per model (packed.packed_linears) and kept for it."""
        source = self._source()
        if source is None:  # the model object is gone, its weights live on in the copy
            return packed_linears(self.base, weights, self.head)
        packed = packed_linears(source.base_model, weights, source.get_output_embeddings())
        return {self._copy_of[m]: forward for m, forward in packed.items() if m in self._copy_of}

    def compile(self, *, pad_single=True, **options):
        """Compile the device part of every pass (on CUDA with the pending commit's; a CPU commits eagerly first) with
        torch.compile (inductor; on CUDA with mode="reduce-overhead", i.e. CUDA graphs, unless `options` say
        otherwise). Shapes must not change from pass to pass, so the TreeModel needs enough node slots and, for one
        graph per shape, a pass_width; without one the number of new nodes is a dynamic dimension (torch.compile's
        automatic dynamic shapes: one more compilation when it first changes). A buffer that grows recompiles.

        pad_single: without a pass_width, pad passes of one new node and LM heads of one row to two (a dynamic
        dimension is still specialised at size 1: a first one-node pass, rare in a tree model, would compile again
        mid-generation, ~5 s on a CPU); False when one-node passes are frequent and their own graphs are warmed up
        by the caller (a compiled one-node pass costs ~0.8x a padded one)."""
        cuda = self.device.type == "cuda"
        self._static_buffers = cuda
        options.setdefault("dynamic", False if self.pass_width is not None else None)
        if self.pass_width is None and self.nodes > 1 and pad_single:
            self._min_rows = 2
        self.run = with_recompile_limit(torch.compile(own_copy(self._run), **compile_options(options, cuda)),
                                        PASS_SIZES if self.pass_width is None else "")
        self._compiled = True
        return self

    @property
    def compiled(self):
        """Whether compile() has made this model's passes torch.compile'd."""
        return self._compiled

    @torch.no_grad()
    def tree_forward(self, tokens, parents, *, logits_for=None, slots=None, features=None):
        """Logits (batch, T, vocab) of every node of a tree on top of the committed sequence, in one pass.

        tokens (batch, T) ints (tensor or nested lists); parents (batch, T) ints, parents[b, i] < i, -1 = child of
        the committed sequence. Node i's logits are those the model gives after the sequence + path(i).
        logits_for: optional (K,) node ids; then only their logits are computed (LM head on K rows):
        (batch, K, vocab). The state stays the committed one until commit() (or discard()); extend() or
        extend_on_device() may grow the tree first. slots: the most nodes the tree will hold (its buffers are sized
        for them and for padded passes up to them: a tree grown on the device cannot grow its buffers).
        features: only for draft heads (HeadTreeModel). With returns_hidden, returns (logits, the new nodes' last
        hidden states (batch, T, hidden)).
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
            return self._grow(tokens, parents, logits_for, features)
        finally:
            if self.tree is not None and self.tree.n == 0:
                self.tree = None

    @torch.no_grad()
    def extend(self, tokens, parents, *, logits_for=None, features=None):
        """Grow the uncommitted tree by new nodes and return their logits (batch, T_new or K, vocab).

        tokens (batch, T_new); parents (batch, T_new) index the whole tree: the T_old nodes already passed, then
        these (new node j has id T_old + j, so parents[b, j] < T_old + j; -1 = child of the committed sequence).
        Only the new nodes go through the layers; their logits equal those of one tree_forward() over the grown
        tree. logits_for: optional (K,) positions in `tokens` whose logits to compute. features, and what it
        returns with returns_hidden: as tree_forward's.
        """
        if self.tree is None:
            raise RuntimeError("no tree to extend: call tree_forward() first")
        return self._grow(tokens, parents, logits_for, features)

    def _grow(self, tokens, parents, logits_for, features=None):
        self._check_settled()
        tokens, parents, logits_for = _checked_nodes(tokens, parents, logits_for, self._cache.batch, self.vocab)
        tree = self.tree  # a failed pass that carried a commit forgets it (the state is lost)
        start, _ = tree.add(parents)  # raises ValueError unless topological
        try:
            head_rows = list(range(tokens.shape[1])) if logits_for is None else logits_for
            out = self._pass_over(start, tokens, head_rows, self._checked_features(features, tokens.shape))
        except BaseException:  # the buffers' new slots are simply reused by the next pass
            tree.truncate(start)
            raise
        if self.returns_hidden:
            return out[0][:, :len(head_rows)], out[1][:, :tokens.shape[1]]
        return out[:, :len(head_rows)]

    def _checked_features(self, features, shape):
        """A plain model's passes take no features (HeadTreeModel's do)."""
        if features is not None:
            raise ValueError("features are a draft head's input; this TreeModel runs a plain causal LM")
        return None

    def _pass_over(self, start, tokens, head_rows, features=None):
        """The pass over the tree's nodes from `start` on (tokens (batch, R)), its buffers made large enough first."""
        tree, cache = self.tree, self._cache
        width, head_rows = self._shape(tokens.shape[1], head_rows)
        if start + width > tree.capacity:
            tree.reserve(max(start + width, 2 * tree.capacity))
        self.nodes = tree.capacity  # later trees start with as many slots
        if self._pending is not None and (self._pending[1].capacity != tree.capacity or (
                cache.capacity is not None and cache.length + tree.capacity > cache.capacity)):
            self._apply_pending()  # buffers are about to grow: the commit, shaped for the old ones, goes first
        if self._compiled and not self._static_buffers:
            # A CPU commits eagerly, before the compiled pass: compiled, the in-place state updates are functionalized
            # into a new state and a copy back, three passes over the states (10.5 ms against 2.4 at the 0.9B
            # target's shapes). With CUDA graphs the commit rides in the pass's graph (one replay).
            self._apply_pending()
        self._bind()
        for layers, _ in self._layers.values():
            layers.reserve(tree.capacity)
        self._reserve(tree.capacity)
        cache.reserve(cache.length + tree.capacity)
        if self._static_buffers:
            self._mark_static()
        flat, layout = tree.pass_inputs(start, width, cache.lengths, self.device, tokens, head_rows)
        levels = self._level_positions(tree.levels(start, width)) if self._sequential else ()
        pending, self._pending = self._pending, None
        try:
            out = self._call(flat, layout, levels, pending, None, features)
        except BaseException:
            if pending is not None:  # whether the commit was applied is unknown: the state is lost
                self._cache = self.tree = None
            raise
        self._structure = flat[flat.numel() - tree.structure_size:]
        return out

    def _reserve(self, slots):
        """Buffers over the tree's node slots besides the mixers' and the cache's (HeadTreeModel's features)."""

    def _shape(self, R, head_rows):
        """(width, head rows) of a pass over R new nodes whose LM head runs on `head_rows` (a list): at least
        pass_width (fixed shapes) or _min_rows nodes, and with fixed shapes always `width` head rows, else at least
        _min_rows (padding rows repeat row 0)."""
        width = max(R, self.pass_width or self._min_rows)
        rows = width if self.pass_width is not None else self._min_rows
        return width, head_rows + [0] * (rows - len(head_rows))

    def _check_settled(self):
        if self._unsettled:
            raise RuntimeError("nodes added by extend_on_device() are not settled: call settle() first")

    def _level_positions(self, levels):
        """The pass's positions grouped by level (HostTree.levels' list) on the device, in one copy (see
        padded_levels)."""
        levels = padded_levels(levels, self._level_widths, self._compiled, self.pass_width is not None)
        flat = to_device(np.concatenate(levels), self.device)
        return flat.split([len(level) for level in levels])

    @torch.no_grad()
    def commit(self, nodes):
        """Make the state equal to the committed sequence + path(nodes[b]) of the current tree, in place.

        nodes (batch,) ints (tensor or list), -1 = keep only the committed sequence; rows may accept paths of
        different lengths (each row's length advances by its own). The host part (lengths, checks) happens now, the
        device part with the next pass.
        """
        if self.tree is None:
            raise RuntimeError("no tree to commit: call tree_forward() first")
        self._check_settled()
        tree, cache = self.tree, self._cache
        nodes = nodes.reshape(-1).tolist() if isinstance(nodes, torch.Tensor) else [int(n) for n in nodes]
        if len(nodes) != cache.batch or any(not -1 <= n < tree.n for n in nodes):
            raise ValueError(f"nodes must hold {cache.batch} node ids in [-1, {tree.n}), got {nodes}")
        moves, accepted = commit_moves(tree, nodes, cache.lengths)
        # the tree's structure as it is now (a failed pass may have grown its slots since the last good one)
        self._pending = tree.pass_inputs(0, 0, cache.lengths, self.device, extra=moves)
        cache.lengths += accepted
        self.tree = None

    def discard(self):
        """Forget the uncommitted tree: the state is the committed sequence alone again."""
        self.tree = None
        self._unsettled = 0


def _checked_nodes(tokens, parents, logits_for, batch, vocab):
    """tokens and parents (batch, R) as int64 numpy arrays and logits_for as a list of ints in [0, R) (or None),
    after checking their shapes and the token ids (ValueError)."""
    tokens, parents = (np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x) for x in (tokens, parents))
    if tokens.ndim != 2 or tokens.shape[0] != batch or parents.shape != tokens.shape:
        raise ValueError(f"tokens {tokens.shape} and parents {parents.shape} must both be (batch={batch}, T)")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    check_token_ids("tokens", tokens, vocab)
    R = tokens.shape[1]
    if logits_for is not None:
        logits_for = [int(i) for i in (logits_for.reshape(-1).tolist() if isinstance(logits_for, torch.Tensor)
                                       else logits_for)]
        if any(not 0 <= i < R for i in logits_for):
            raise ValueError(f"logits_for must hold positions in [0, {R}), got {logits_for}")
    return tokens, parents, logits_for


def _adapters(cache, mixers, kinds):
    """{layer_idx: (its kind's adapter for its state group, slice j)} for a new StateCache's groups."""
    layers = {}
    for group in cache.groups:
        group_kinds = {kinds.get(i) for i in group.layers}
        if len(group_kinds) != 1 or None in group_kinds:
            raise ValueError(f"layers {group.layers} hold recurrent states of one shape but not one supported mixer "
                             "kind")
        adapter = group_kinds.pop()([mixers[i] for i in group.layers], group)
        layers.update({i: (adapter, j) for j, i in enumerate(group.layers)})
    return layers


def padded_levels(levels, widths, compiled, fixed):
    """A pass's positions grouped by level (HostTree.levels' list), as a compiled pass needs them: as many levels as
    the deepest pass before it (the walk is unrolled in its graph; extra levels repeat position 0), and with fixed
    shapes each level padded to the widest it has been by repeating its own positions (recomputing a node whose
    parent is final is idempotent). widths: the widths seen so far, one per level, updated in place."""
    if not (compiled or fixed):
        return levels
    widths += [1] * (len(levels) - len(widths))
    sizes = [len(levels[s]) if s < len(levels) else 1 for s in range(len(widths))]
    if fixed:
        widths[:] = sizes = [max(w, n) for w, n in zip(widths, sizes)]
    return [np.resize(levels[s] if s < len(levels) else levels[0][:1], n) for s, n in enumerate(sizes)]


def commit_moves(tree, nodes, lengths):
    """(the ints a commit sends, each row's accepted path length (batch,)): the nodes, then each row's path slots
    (sources: node slots start at max(lengths)) and where they go (destinations: after the row's own length). Paths
    are padded to the tree's slot count (padding copies a position onto itself), so no shape depends on a path."""
    paths = [tree.path(b, n) for b, n in enumerate(nodes)]
    batch, width, frontier = len(nodes), tree.capacity, int(lengths.max())
    destinations = lengths[:, None] + np.arange(width)
    sources = destinations.copy()
    for b, path in enumerate(paths):
        sources[b, :len(path)] = frontier + np.asarray(path, dtype=np.int64)
    moves = np.concatenate([np.asarray(nodes, dtype=np.int64), sources.reshape(-1), destinations.reshape(-1)])
    return moves, np.array([len(p) for p in paths], dtype=np.int64)
