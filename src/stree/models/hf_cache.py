"""Where an HF cache keeps its per-row tensors: the only code in stree that touches HF cache internals.

An HF cache (transformers' DynamicCache) keeps, per layer, SSM conv / recurrent states in dicts
(`layer.conv_states[0]` (batch, channels, K), `layer.recurrent_states[0]` (batch, heads, ...)) and attention K/V
as attributes (`layer.keys` / `layer.values` (batch, kv_heads, length, head_dim)). Everything else in stree reads
or writes them through this module: StateCache.from_hf takes its states through `layer_states`, and the search rows
(stree.search.rows.RowBatch) read and replace them through `cache_slots`.
"""
from dataclasses import dataclass

import torch

KV_NAMES = ("keys", "values")
STATE_NAMES = ("conv_states", "recurrent_states")


@dataclass(frozen=True, eq=False)
class CacheSlot:
    """One per-row tensor of an HF cache (dim 0 is the batch): layer `layer`'s `name`, held in `container` (the
    layer for K/V, its state dict for SSM states) under `key`."""
    layer: int
    name: str
    container: object
    key: object

    @property
    def is_kv(self):
        return self.name in KV_NAMES

    def get(self):
        return self.container[self.key] if isinstance(self.container, dict) else getattr(self.container, self.key)

    def put(self, tensor):
        if isinstance(self.container, dict):
            self.container[self.key] = tensor
        else:
            setattr(self.container, self.key, tensor)


def cache_slots(cache):
    """Every per-row tensor of an HF cache (a list of CacheSlots), SSM states first within a layer, layers in order.
    Sliding-window attention layers (whose K/V drop old columns) are refused."""
    slots = []
    for i, layer in enumerate(cache.layers):
        for name in STATE_NAMES:
            states = getattr(layer, name, None) or {}
            slots += [CacheSlot(i, name, states, key) for key, t in states.items() if isinstance(t, torch.Tensor)]
        if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4:
            if getattr(layer, "is_sliding", False):
                raise ValueError("sliding-window attention caches are not supported")
            slots += [CacheSlot(i, name, layer, name) for name in KV_NAMES]
    return slots


def layer_states(cache):
    """{layer index: {name: tensor}} of an HF cache, for the layers that hold state: "conv_states" /
    "recurrent_states" (each layer's first state) and "keys" / "values"."""
    out = {}
    for slot in cache_slots(cache):
        if slot.is_kv or slot.key == 0:
            out.setdefault(slot.layer, {})[slot.name] = slot.get()
    return out
