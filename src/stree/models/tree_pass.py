"""The device part of a TreeModel's pass: what runs in one (compiled) call. The pending commit first, then the base
model's forward over the pass's nodes with the tree mixers and packed linears swapped in, and the LM head on the rows
asked for (or, for levels grown on the device, one forward per level: device_growth.run_levels). TreeModel inherits
it; the host side (the tree, its checks, the pass's inputs) is tree_model.py.
"""
from dataclasses import dataclass

import torch

from ..triton_kernels import TreeIndex
from .compile import mark_static
from .device_growth import run_levels
from .hf_forward import blocks_forward, swapped, tree_attention_mask
from .host_tree import HostTree


@dataclass
class TreePass:
    """What a pass's tree mixers need: the TreeIndex over all node slots, the new nodes' ids rows (R,), and for
    SEQUENTIAL kinds levels: positions into rows grouped by level, shallowest first (a tuple of (W,) tensors; see
    TreeModel._level_positions), for a recurrence that computes each node from its parent's state."""
    index: object
    rows: torch.Tensor
    levels: tuple = ()


class TreePassRunner:
    """TreeModel's device side: reads the TreeModel's modules (base, head, mixers), buffers (_cache, _layers) and
    the pass being run (_pass); every method runs without a host sync and with fixed shapes."""

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

    def _call(self, *args):
        """self.run(*args) with the tree mixers and packed linears swapped in; the pass's state cleared after."""
        try:
            with swapped({**self._linears, **self._tree_forwards, **self._feature_forwards}):
                return self.run(*args)
        finally:
            self._cache.end_pass()
            self._pass = None

    def _run(self, flat, layout, levels, pending, grown=None, features=None):
        """The device part of a pass (no host sync, shapes fixed by the slots and pass width) over HostTree.pass_inputs'
        (flat, layout) and the levels of _level_positions, after the pending commit's (the arguments of _commit, or
        None). Returns logits (batch, K = the pass's head rows, vocab) (with returns_hidden, and the rows' last hidden
        states (batch, width, hidden)); with `grown` (extend_on_device), what device_growth.run_levels returns.
        features: a draft head's (HeadTreeModel)."""
        if pending is not None:
            self._commit(*pending)
        if grown is None:
            return self._forward(flat, layout, levels, features)
        return run_levels(self._forward, flat, layout, levels, grown)

    def _forward(self, flat, layout, levels, features=None):
        """The model's forward over a pass's tensor: logits (batch, K, vocab) (see _run)."""
        inputs = HostTree.unpack(flat, layout)
        cache, rows, tokens = self._cache, inputs["rows"], inputs["tokens"]
        index = TreeIndex.prebuilt(inputs["parents"], inputs["mask"], inputs["windows"])
        kwargs = dict(position_ids=inputs["positions"])
        if self.uses_attention:
            kwargs["attention_mask"] = tree_attention_mask(inputs["lengths"], inputs["length"], rows, index.mask,
                                                           cache.capacity, self.head.weight.dtype)
            cache.begin_pass(inputs["length"] + rows)
        self._pass = TreePass(index, rows, levels)
        hidden = self._hidden(tokens, cache, kwargs, features, inputs)
        logits = self.logits(hidden.index_select(1, inputs["head_rows"]))
        return (logits, self._features(hidden)) if self.returns_hidden else logits

    def _features(self, hidden):
        """What a pass returns with returns_hidden: the last hidden states `hidden` (batch, R, H), or the outputs of
        the feature layers, which the pass stored while it ran, concatenated (batch, R, len(feature_layers) * H)."""
        if self.feature_layers is None:
            return hidden
        return torch.cat([self._layer_outputs[i] for i in self.feature_layers], -1)

    def _hidden(self, tokens, cache, kwargs, features=None, inputs=None):
        """The base model's last hidden states (batch, R, hidden) over tokens (batch, R) with `cache` (HF's in a
        prefill, the StateCache in a pass; kwargs: positions and mask). HeadTreeModel feeds its fused inputs here."""
        if self._direct and inputs is not None:
            return blocks_forward(self.base, tokens)
        return self.base(input_ids=tokens, cache=cache, use_cache=True, **kwargs).last_hidden_state

    def _mark_static(self):
        """Tell torch.compile that every state and tree buffer keeps its address (so that CUDA graphs may write them
        in place); buffers are reallocated only when they grow, which recompiles anyway. Runs before every pass, but
        walks the buffers only when a capacity changed since it last did (prefill() forgets that on new buffers).
        The views too: eager passes write through them (compiled ones slice their own in the graph, since a view
        from outside would be a graph input aliasing its base; see Mamba2Layers.forward)."""
        adapters = {id(a): a for a, _ in self._layers.values()}.values()
        cache = self._cache
        capacities = (cache.capacity, tuple(a.capacity for a in adapters))
        if capacities != self._marked:
            mark_static([cache.keys, cache.values, cache.conv, cache.recurrent, [vars(a) for a in adapters],
                         [(g.conv, g.recurrent) for g in cache.groups]])
            self._marked = capacities

    def _tree_forward_of(self, layer_idx):
        def forward(hidden_states, *args, **kwargs):
            layers, j = self._layers[layer_idx]
            return layers.forward(j, hidden_states, self._pass, *self._cache.states(layer_idx))
        return forward

    def logits(self, hidden):
        """The model's LM head (with its family's output scaling) on final hidden states (..., hidden)."""
        logits = self.head(hidden.to(self.head.weight.dtype))
        return logits if self.logit_scale is None else self.logit_scale(logits, self.config, self.base)

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
