"""TreeModel: an HF causal LM and its cache, able to run a whole token tree in one forward pass and keep a branch.

The model's own forward runs unchanged except for its Mamba2 mixers, which are swapped for tree mixers for the
duration of a tree pass. Attention layers see a 4D mask (prefix + the node's ancestors + itself) and
position ids = prefix length + depth; they append the tree's K/V to their cache in node order, and commit()
compacts that to prefix + accepted path. SSM layers do not touch the cache during the pass; commit() writes
the accepted node's conv and SSM states (stree.triton_kernels.tree_conv_state / tree_states).
"""
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from ..triton_kernels import TreeIndex
from .mixer import commit_mixers, is_mamba_mixer, mixer_tree_forward

SSM_FAMILIES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")
TRANSFORMER_FAMILIES = ("llama", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = SSM_FAMILIES + TRANSFORMER_FAMILIES


class TreeModel:
    """Wraps a loaded HF model (its modules and weights are used as they are, nothing is copied).

    Flow: prefill(prompt) -> tree_forward(tokens, parents) -> commit(nodes) -> tree_forward(...) -> ...
    `length` counts the tokens in the cache.
    """

    def __init__(self, model):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        attn = getattr(model.config, "_attn_implementation", None) or ""
        if "flash" in attn:
            raise ValueError(f"attn_implementation={attn!r} only takes 2D padding masks, not a tree mask; load the "
                             "model with attn_implementation='sdpa' or 'eager'")
        self.model = model
        self.uses_attention = model_type != "mamba2"
        self.mixers = [m for m in model.modules() if is_mamba_mixer(m)]
        if model_type in SSM_FAMILIES and not self.mixers:
            raise ValueError(f"found no Mamba2 mixer in this {model_type} model")
        self.cache = None
        self.length = 0
        self._tree = None  # (TreeIndex, {layer_idx: MixerTreeInputs}) of the uncommitted tree

    def _forward(self, input_ids, **kwargs):
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True, **kwargs).logits

    @torch.no_grad()
    def prefill(self, input_ids):
        """Start a new cache holding input_ids (batch, P), P >= 1. Returns logits (batch, P, vocab)."""
        batch, P = input_ids.shape
        if P < 1:
            raise ValueError("prefill needs at least one token")
        self.cache = DynamicCache(config=self.model.config)
        self._tree = None
        kwargs = {}
        if self.uses_attention:  # Bamba ignores the cache offset by default: always pass positions
            kwargs["position_ids"] = torch.arange(P, device=input_ids.device).expand(batch, P)
        logits = self._forward(input_ids, **kwargs)
        self.length = P
        return logits

    @torch.no_grad()
    def tree_forward(self, tokens, parents, *, logits_for=None):
        """Logits (batch, T, vocab) of every node of a tree on top of the cache, in one forward pass.

        tokens (batch, T) int64; parents (batch, T) int64, parents[b, i] < i, -1 = child of the cached prefix.
        Node i's logits are those the model gives after prefix + path(i). logits_for: optional (K,) node ids;
        then only their logits are computed (LM head on K rows): (batch, K, vocab). The cache stays the prefix
        until commit() (or discard()) is called; extend() may grow the tree first.
        """
        if self.cache is None:
            raise RuntimeError("call prefill() before tree_forward()")
        if self._tree is not None:
            raise RuntimeError("the previous tree is not committed: call commit() or discard() first")
        return self._grow(tokens, parents, logits_for)

    @torch.no_grad()
    def extend(self, tokens, parents, *, logits_for=None):
        """Grow the uncommitted tree by new nodes and return their logits (batch, T_new or K, vocab).

        tokens (batch, T_new); parents (batch, T_new) index the whole tree: the T_old nodes already passed, then
        these (new node j has id T_old + j, so parents[b, j] < T_old + j; -1 = child of the prefix). Only the new
        nodes go through the layers; their logits equal those of one tree_forward() over the grown tree.
        logits_for: optional (K,) positions in `tokens` whose logits to compute.
        """
        if self._tree is None:
            raise RuntimeError("no tree to extend: call tree_forward() first")
        return self._grow(tokens, parents, logits_for)

    def _grow(self, tokens, parents, logits_for):
        if tokens.shape != parents.shape or tokens.dim() != 2:
            raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must both be (batch, T)")
        old, stash = self._tree or (None, {})
        batch, T_new = tokens.shape
        if old is not None:
            if old.shape[0] != batch:
                raise ValueError(f"the tree has batch {old.shape[0]}, the new nodes have batch {batch}")
            parents = torch.cat([old.parents, parents.to(old.parents.device)], dim=1)
        T_old = parents.shape[1] - T_new
        tree = TreeIndex(parents)  # validated once; every layer's kernels reuse its ancestor relation
        if tree.parents.device != tokens.device:
            raise ValueError(f"parents is on {tree.parents.device} but tokens are on {tokens.device}")
        kwargs = {}
        if logits_for is not None:
            keep = torch.as_tensor(logits_for, device=tokens.device).long().reshape(-1)
            if keep.numel() and not 0 <= int(keep.min()) <= int(keep.max()) < T_new:
                raise ValueError(f"logits_for must hold positions in [0, {T_new}), got {keep.tolist()}")
            kwargs["logits_to_keep"] = keep
        if self.uses_attention:
            new_rows = tree.mask[:, T_old:]                                          # (batch, T_new, T)
            kwargs["position_ids"] = self.length + new_rows.sum(-1) - 1
            allowed = torch.cat([new_rows.new_ones(batch, T_new, self.length), new_rows], dim=-1)
            dtype = self.model.dtype
            kwargs["attention_mask"] = torch.zeros(batch, 1, T_new, self.length + T_old + T_new, dtype=dtype,
                                                   device=tokens.device).masked_fill(~allowed[:, None],
                                                                                     torch.finfo(dtype).min)
        stash = dict(stash)
        try:
            with self._tree_mixers(tree, stash):
                logits = self._forward(tokens, **kwargs)
        except BaseException:  # attention layers may have appended the new nodes' K/V: cut back to the old tree
            self._keep_kv(torch.arange(self.length + T_old, device=tokens.device).expand(batch, -1))
            raise
        self._tree = (tree, stash)
        return logits

    @contextmanager
    def _tree_mixers(self, tree, stash):
        """Swap every mixer's forward for the tree pass; stash[layer] holds the tree's mixer inputs so far."""
        def tree_forward_of(mixer):
            def forward(hidden_states, *args, **kwargs):
                layer = self.cache.layers[mixer.layer_idx]
                out, stash[mixer.layer_idx] = mixer_tree_forward(mixer, hidden_states, layer, tree,
                                                                 stash.get(mixer.layer_idx))
                return out
            return forward

        for mixer in self.mixers:
            mixer.forward = tree_forward_of(mixer)
        try:
            yield
        finally:
            for mixer in self.mixers:
                del mixer.forward

    @torch.no_grad()
    def commit(self, nodes):
        """Make the cache equal to prefix + path(nodes[b]) of the last tree, in place.

        nodes (batch,) int64, -1 = keep only the prefix. Every row must accept a path of the same length.
        """
        if self._tree is None:
            raise RuntimeError("no tree to commit: call tree_forward() first")
        tree, stash = self._tree
        nodes = torch.as_tensor(nodes, device=tree.parents.device).long().reshape(-1)
        batch, T = tree.shape
        if nodes.shape[0] != batch or bool(((nodes < -1) | (nodes >= T)).any()):
            raise ValueError(f"nodes must hold {batch} node ids in [-1, {T}), got {nodes.tolist()}")
        on_path = tree.mask[torch.arange(batch, device=nodes.device), nodes.clamp(min=0)] & (nodes >= 0)[:, None]
        counts = on_path.sum(-1)
        if bool((counts != counts[0]).any()):
            raise ValueError(f"accepted paths of different lengths across the batch ({counts.tolist()}) are not "
                             "supported")
        commit_mixers(self.mixers, self.cache, stash, tree, nodes)
        path = on_path.nonzero()[:, 1].reshape(batch, -1)
        prefix = torch.arange(self.length, device=nodes.device).expand(batch, self.length)
        self._keep_kv(torch.cat([prefix, self.length + path], dim=1))
        self.length += int(counts[0])
        self._tree = None

    def discard(self):
        """Forget the last tree: the cache holds the prefix alone again."""
        if self._tree is not None:
            parents = self._tree[0].parents
            self._keep_kv(torch.arange(self.length, device=parents.device).expand(parents.shape[0], self.length))
            self._tree = None

    def _keep_kv(self, keep):
        """Keep K/V positions keep (batch, n) of every attention cache layer, in that order."""
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if not isinstance(keys, torch.Tensor) or keys.numel() == 0:
                continue
            if getattr(layer, "is_sliding", False):
                raise ValueError("sliding-window attention caches are not supported")
            index = keep[:, None, :, None].expand(keys.shape[0], keys.shape[1], keep.shape[1], keys.shape[3])
            layer.keys = keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
