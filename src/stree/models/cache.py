"""StateCache: what stree keeps of a model between passes, in place of HF's DynamicCache.

Two kinds of layer state, keyed by the HF layer index:
  * recurrent layers (Mamba2 and other mixers): `conv[i]` (batch, channels, K) and `recurrent[i]` (batch, heads,
    ...) or None. Layers whose states have equal shapes are stored as slices of one stacked tensor per group
    (`groups`), so a commit writes a whole group with one kernel call and one copy.
  * attention layers: `keys[i]` / `values[i]`, preallocated buffers (batch, kv_heads, capacity, head_dim); positions
    [0, length) hold the committed sequence, the slots after it the uncommitted tree's nodes.

During a pass the model's own attention modules call `update(k, v, layer_idx)` as they would on HF's cache; the
pass first says where the new keys go (`begin_pass`); attention always sees the whole buffer, so no shape depends on
the sequence length. A StateCache is taken from an HF cache through stree.models.hf_cache.layer_states, the one
reader of HF cache internals.
"""
import numpy as np
import torch

from .hf_cache import layer_states


class StateGroup:
    """Equally shaped recurrent layers stacked along dim 1: conv (batch, n * channels, K), recurrent (batch,
    n * heads, ...) or None. layers[j] is the HF layer index of slice j."""

    def __init__(self, layers, conv, recurrent):
        self.layers, self.conv, self.recurrent = list(layers), conv, recurrent

    def slices(self, j):
        """Layer j's own views of the stacked tensors."""
        c = self.conv.shape[1] // len(self.layers)
        conv = self.conv[:, j * c:(j + 1) * c]
        if self.recurrent is None:
            return conv, None
        h = self.recurrent.shape[1] // len(self.layers)
        return conv, self.recurrent[:, j * h:(j + 1) * h]


class StateCache:
    """The per-row decoding state of one model. Row b has committed `lengths[b]` tokens; its K/V sit at positions
    [0, lengths[b]) of its row of the attention buffers. `length` = max(lengths), the frontier: a pass writes its
    nodes' K/V at the same positions on every row, from the frontier on (positions between a shorter row's length and
    the frontier are masked out for it)."""

    def __init__(self, groups, keys, values, length):
        """length: an int (every row's) or (batch,) per-row counts."""
        self.groups = groups
        self.keys, self.values = keys, values
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        self.lengths[:] = length
        self.conv, self.recurrent = {}, {}  # layer -> its views (eager passes use them, see states())
        self._slice_of = {}
        for group in groups:
            for j, layer in enumerate(group.layers):
                self.conv[layer], self.recurrent[layer] = group.slices(j)
                self._slice_of[layer] = (group, j)
        self._slots = None      # (R,) positions the current pass writes its keys/values to

    @property
    def batch(self):
        for t in (*self.keys.values(), *(g.conv for g in self.groups)):
            return t.shape[0]
        return 0

    def memory(self):
        """Where and how this cache's state lies: its groups' layers, then every tensor's (address, shape, dtype).
        Rows moved within the same buffers leave it unchanged."""
        return ([tuple(g.layers) for g in self.groups],
                [(t.data_ptr(), tuple(t.shape), t.dtype) for t in self.tensors()])

    def tensors(self):
        """Every state tensor (batch first): the groups' conv and recurrent states, then the attention buffers."""
        return [*(t for g in self.groups for t in (g.conv, g.recurrent) if t is not None),
                *self.keys.values(), *self.values.values()]

    @property
    def length(self):
        """The frontier: the most tokens any row has committed."""
        return int(self.lengths.max(initial=0))

    @length.setter
    def length(self, value):
        self.lengths[:] = value

    @property
    def capacity(self):
        """Positions each attention buffer holds (None without attention layers)."""
        return next((k.shape[2] for k in self.keys.values()), None)

    @classmethod
    def from_hf(cls, hf_cache, length, capacity):
        """Take the states of an HF DynamicCache after a prefill of `length` tokens; attention buffers get
        `capacity` >= length positions."""
        recurrent_layers, keys, values = {}, {}, {}
        for i, states in layer_states(hf_cache).items():
            if states.get("conv_states") is not None:
                recurrent_layers[i] = (states["conv_states"], states.get("recurrent_states"))
            if "keys" in states:
                keys[i], values[i] = _buffer(states["keys"], capacity), _buffer(states["values"], capacity)
        by_shape = {}
        for i, (conv, rec) in recurrent_layers.items():
            key = (conv.shape[0], conv.shape[2:], conv.dtype, None if rec is None else (rec.shape[2:], rec.dtype))
            by_shape.setdefault(key, []).append(i)
        groups = []
        for layers in by_shape.values():
            conv = torch.cat([recurrent_layers[i][0] for i in layers], dim=1)
            recs = [recurrent_layers[i][1] for i in layers]
            groups.append(StateGroup(layers, conv, None if recs[0] is None else torch.cat(recs, dim=1)))
        return cls(groups, keys, values, length)

    def states(self, layer):
        """Layer `layer`'s (conv, recurrent) views. Inside torch.compile they are sliced in the graph: a view held
        from outside would be a graph input of its own, aliasing the stacked tensor a commit writes, and
        torch.compile merges such inputs into one that is not static (then CUDA graphs are skipped)."""
        if torch.compiler.is_compiling():
            group, j = self._slice_of[layer]
            return group.slices(j)
        return self.conv[layer], self.recurrent[layer]

    def load(self, other):
        """Copy `other`'s states into this cache's tensors if every layout and shape agrees (True), else do
        nothing (False). Keeps tensor identities, which compiled passes are specialised on."""
        layouts = [(g.layers, g.conv.shape, None if g.recurrent is None else g.recurrent.shape) for g in self.groups]
        if layouts != [(g.layers, g.conv.shape, None if g.recurrent is None else g.recurrent.shape)
                       for g in other.groups] or {i: t.shape for i, t in self.keys.items()} != {
                           i: t.shape for i, t in other.keys.items()}:
            return False
        for mine, theirs in zip(self.groups, other.groups):
            mine.conv.copy_(theirs.conv)
            if mine.recurrent is not None:
                mine.recurrent.copy_(theirs.recurrent)
        for store, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for i, t in store.items():
                t.copy_(theirs[i])
        self.lengths = other.lengths.copy()
        return True

    def reserve(self, positions):
        """Make every attention buffer hold at least `positions` positions (grows by doubling; eager use only)."""
        capacity = self.capacity
        if capacity is None or positions <= capacity:
            return
        new = max(positions, 2 * capacity)
        for store in (self.keys, self.values):
            for i, t in store.items():
                store[i] = _buffer(t, new)

    # ---- the pass protocol of HF attention modules -------------------------------------------------------------
    def begin_pass(self, slots):
        """The next pass writes its new keys/values at positions `slots` ((R,) int64 on the device); its
        attention modules see every position of the buffers (the pass's mask hides the unused ones)."""
        self._slots = slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """HF's Cache.update: store the pass's new keys/values (batch, kv_heads, R, head_dim) at the pass's slots;
        return the whole buffers (batch, kv_heads, capacity, head_dim)."""
        if self._slots is None:
            raise RuntimeError("StateCache.update outside a pass")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self._slots, key_states)
        values.index_copy_(2, self._slots, value_states)
        return keys, values

    def end_pass(self):
        self._slots = None

    # ---- commit, forking, bytes --------------------------------------------------------------------------------
    def move_positions(self, sources, destinations):
        """Copy the K/V at positions `sources` to `destinations` (both (batch, n) int64 on the cache's device; all
        sources are read before anything is written). A commit moves the accepted path's tree slots to the
        positions after the committed ones; `length` is the caller's to advance."""
        batch, n = sources.shape
        for store in (self.keys, self.values):
            for t in store.values():
                if t.device.type == "cpu":  # scatter_ copies a bf16 buffer whole there (64 rows: 39 ms a call)
                    rows = torch.arange(batch)[:, None]
                    by_position = t.transpose(1, 2)  # (batch, capacity, kv_heads, head_dim), a view
                    by_position[rows, destinations] = by_position[rows, sources]
                elif batch == 1:
                    t.index_copy_(2, destinations[0], t.index_select(2, sources[0]))
                else:
                    shape = (batch, t.shape[1], n, t.shape[3])
                    kept = t.gather(2, sources[:, None, :, None].expand(shape))
                    t.scatter_(2, destinations[:, None, :, None].expand(shape), kept)

    def select(self, rows):
        """A new StateCache holding rows `rows` ((n,) int64) of this one (forking search trajectories)."""
        groups = [StateGroup(g.layers, g.conv.index_select(0, rows),
                             None if g.recurrent is None else g.recurrent.index_select(0, rows)) for g in self.groups]
        keys = {i: t.index_select(0, rows) for i, t in self.keys.items()}
        values = {i: t.index_select(0, rows) for i, t in self.values.items()}
        return StateCache(groups, keys, values, self.lengths[rows.cpu().numpy()])

    def empty(self, rows):
        """A StateCache of `rows` rows shaped as this one's, holding nothing: zero states, no committed token."""
        groups = [StateGroup(g.layers, g.conv.new_zeros(rows, *g.conv.shape[1:]),
                             None if g.recurrent is None else g.recurrent.new_zeros(rows, *g.recurrent.shape[1:]))
                  for g in self.groups]
        keys = {i: t.new_zeros(rows, *t.shape[1:]) for i, t in self.keys.items()}
        values = {i: t.new_zeros(rows, *t.shape[1:]) for i, t in self.values.items()}
        return StateCache(groups, keys, values, 0)

    def keep(self, rows, in_place=None):
        """Rows `rows` (row indices, in the order they become rows 0, 1, ...) of this cache, which is spent. Rows in
        increasing order move to the front of its own buffers (a StateCache of views of them) on a CPU, where fresh
        tensors for a batch's states cost more in page faults than the copy (the 0.9B target's 15 rows: 250 ms
        against 31), and on any device with in_place=True (CUDA graphs replay over buffers that keep their
        addresses; a row a copy). Any other order, or an accelerator's buffers by default, take select()."""
        rows = [int(r) for r in rows]
        tensors = self.tensors()
        if not tensors or not (in_place or tensors[0].device.type == "cpu") or any(b <= a for a, b in zip(rows, rows[1:])):
            return self.select(torch.tensor(rows, dtype=torch.long, device=tensors[0].device if tensors else None))

        def front(t):  # row j takes row rows[j] >= j: a row is read before any later row is written over it
            for j, i in enumerate(rows):
                if i != j:
                    t[j].copy_(t[i])
            return t[:len(rows)]

        groups = [StateGroup(g.layers, front(g.conv), None if g.recurrent is None else front(g.recurrent))
                  for g in self.groups]
        keys = {i: front(t) for i, t in self.keys.items()}
        values = {i: front(t) for i, t in self.values.items()}
        return StateCache(groups, keys, values, self.lengths[rows])

    @classmethod
    def concat(cls, caches, capacity, in_place=None):
        """One StateCache holding the rows of `caches` in order (equal layouts; attention buffers of `capacity`
        positions, at least each one's committed lengths), each row keeping its own length. Where the first
        cache's buffers have room for the others' rows (rows it kept in place, see keep) they go there: on a CPU,
        and on any device with in_place=True."""
        first, rows = caches[0], sum(c.batch for c in caches)
        if _has_room(first, rows, capacity, in_place):
            return cls._concat_in_place(caches, rows)
        groups = [StateGroup(g.layers, torch.cat([c.groups[k].conv for c in caches]),
                             None if g.recurrent is None else torch.cat([c.groups[k].recurrent for c in caches]))
                  for k, g in enumerate(first.groups)]
        keys = {i: torch.cat([_buffer(c.keys[i][:, :, :c.length], capacity) for c in caches]) for i in first.keys}
        values = {i: torch.cat([_buffer(c.values[i][:, :, :c.length], capacity) for c in caches]) for i in first.keys}
        return cls(groups, keys, values, np.concatenate([c.lengths for c in caches]))

    @classmethod
    def _concat_in_place(cls, caches, rows):
        """concat() of `rows` rows in all into the first cache's buffers, which have room (_has_room)."""
        first = caches[0]

        def fill(t, parts, attention=False):  # t: the first cache's (front) view; parts: the others' tensors
            out, start = t._base[:rows], t.shape[0]
            for part, cache in zip(parts, caches[1:]):
                end = start + part.shape[0]
                if not attention:
                    out[start:end].copy_(part)
                else:  # attention buffers: the committed positions, zeros after them
                    out[start:end, :, :cache.length].copy_(part[:, :, :cache.length])
                    out[start:end, :, cache.length:].zero_()
                start = end
            return out

        groups = [StateGroup(g.layers, fill(g.conv, [c.groups[k].conv for c in caches[1:]]),
                             None if g.recurrent is None else fill(g.recurrent,
                                                                   [c.groups[k].recurrent for c in caches[1:]]))
                  for k, g in enumerate(first.groups)]
        keys = {i: fill(t, [c.keys[i] for c in caches[1:]], True) for i, t in first.keys.items()}
        values = {i: fill(t, [c.values[i] for c in caches[1:]], True) for i, t in first.values.items()}
        return cls(groups, keys, values, np.concatenate([c.lengths for c in caches]))

    def nbytes(self, positions=None):
        """Bytes of state per row: every recurrent state, plus `positions` (default: length) attention positions."""
        positions = self.length if positions is None else positions
        total = sum(g.conv[0].nbytes + (0 if g.recurrent is None else g.recurrent[0].nbytes) for g in self.groups)
        for store in (self.keys, self.values):
            total += sum(t[0, :, :positions].nbytes for t in store.values())
        return total


def _has_room(cache, rows, capacity, in_place=None):
    """Whether every buffer of `cache` is the front of a buffer of at least `rows` rows (and attention buffers of at
    least `capacity` positions), on a CPU unless in_place."""
    tensors = cache.tensors()
    return bool(tensors) and all(
        (in_place or t.device.type == "cpu") and t._base is not None and t._base.shape[1:] == t.shape[1:]
        and t._base.data_ptr() == t.data_ptr() and t._base.shape[0] >= rows for t in tensors) and all(
        t.shape[2] >= capacity for t in (*cache.keys.values(), *cache.values.values()))


def _buffer(t, capacity):
    """A (batch, heads, capacity, dim) buffer whose first t.shape[2] positions are t."""
    out = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
    out[:, :, :t.shape[2]] = t
    return out
