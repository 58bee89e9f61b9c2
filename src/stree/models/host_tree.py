"""HostTree: the structure of a growing batch of token trees, kept on the host and extended as nodes arrive.

A pass needs each node's ancestors (the tree mask), its depth (positions) and, per conv width, the window of
earlier inputs it sees. All of it follows from the parent of each new node and what that parent already has
(its ancestors plus itself, its depth plus one, its window shifted by one), so it is filled in node by node as
the tree grows, in one int64 buffer laid out as a pass wants it, and copied to the device once per pass, instead
of being solved on the device (and validated with host syncs) every pass.
"""
import math
from typing import NamedTuple

import numpy as np
import torch


class PassLayout(NamedTuple):
    """The sizes (plain ints, which a compiled pass specialises on) that place each field of pass_inputs' one
    tensor: see _fields."""
    batch: int
    width: int
    head_rows: int
    extra: int
    capacity: int
    window_keys: tuple


def _structure_fields(batch, capacity, window_keys):
    """[(name, shape)] of a tree's structure as HostTree keeps it (and as a pass's tensor ends with it)."""
    return [("parents", (batch, capacity)), ("mask", (batch, capacity, capacity))] + [
        (key, (batch, capacity, key[0])) for key in window_keys]


def _header_fields(layout):
    """[(name, shape)] of the header of pass_inputs' tensor (what a pass needs besides the tree's structure)."""
    batch, width = layout.batch, layout.width
    return [("rows", (width,)), ("positions", (batch, width)), ("tokens", (batch, width)),
            ("head_rows", (layout.head_rows,)), ("lengths", (batch,)), ("length", ()), ("extra", (layout.extra,))]


def _fields(layout):
    """[(name, shape)] of pass_inputs' tensor, in order: its header, then the structure."""
    return _header_fields(layout) + _structure_fields(layout.batch, layout.capacity, layout.window_keys)


def _size(fields):
    return sum(math.prod(shape) for _, shape in fields)


def to_device(array, device):
    """A numpy array or CPU tensor on `device`. On CUDA the copy goes through pinned memory without blocking: a
    copy from ordinary memory waits for every launch queued before it, which would empty the GPU's queue at each
    pass (the caching host allocator keeps the pinned buffer until the copy is done)."""
    tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.as_tensor(array)
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _split(flat, fields):
    """{name: view} of consecutive fields [(name, shape)] of a flat numpy array or tensor."""
    out, offset = {}, 0
    for name, shape in fields:
        size = math.prod(shape)
        out[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    return out


class HostTree:
    """Trees of `batch` rows growing together (every pass adds the same number of nodes to each row).

    parents (batch, n) int64, -1 = child of the committed prefix; mask (batch, n, n) int64 0/1, [b, i, k] = 1 if k
    is on path(i); depth (batch, n); windows[(width, state_len)] (batch, n, width): the columns of
    cat(conv_state, x) node i's conv window reads, as triton_kernels.utils.window_index defines them.
    """

    def __init__(self, batch, window_keys=(), capacity=16):
        self.batch, self.n = batch, 0
        self.window_keys = tuple(window_keys)
        self._alloc(capacity)

    def _alloc(self, capacity):
        """(Re)allocate for `capacity` node slots, keeping the first n nodes. Slots past n may hold anything: add()
        writes every column of a node's rows."""
        old = vars(self).copy() if hasattr(self, "_parents") else None
        batch, C = self.batch, capacity
        fields = _structure_fields(batch, C, self.window_keys)
        self._packed = np.zeros(_size(fields), dtype=np.int64)  # what a pass copies
        views = _split(self._packed, fields)
        self._parents, self._mask = views["parents"], views["mask"]
        self._windows = {key: views[key] for key in self.window_keys}
        self._parents.fill(-1)
        self._depth = np.zeros((batch, C), dtype=np.int64)
        if old is not None:
            n = self.n
            self._parents[:, :n], self._depth[:, :n] = old["_parents"][:, :n], old["_depth"][:, :n]
            self._mask[:, :n, :n] = old["_mask"][:, :n, :n]
            for key in self.window_keys:
                self._windows[key][:, :n] = old["_windows"][key][:, :n]
        self.capacity = capacity

    @property
    def structure_size(self):
        """int64 entries of the structure that ends pass_inputs' tensor."""
        return self._packed.size

    @property
    def parents(self):
        return self._parents[:, :self.n]

    @property
    def mask(self):
        return self._mask[:, :self.n, :self.n]

    @property
    def depth(self):
        return self._depth[:, :self.n]

    def add(self, parents):
        """Append nodes: parents (batch, R) ints, each -1 or the id of an earlier node (ids count from 0 over the
        whole tree, the new nodes being n .. n+R-1). Raises ValueError unless topological. Returns (n_old, n_new)."""
        parents = np.asarray(parents, dtype=np.int64).reshape(self.batch, -1)
        n, R = self.n, parents.shape[1]
        bad = (parents < -1) | (parents >= n + np.arange(R))
        if bad.any():
            b, j = map(int, np.argwhere(bad)[0])
            raise ValueError(f"parents must be -1 or an earlier node (topological order): new node {n + j} of row "
                             f"{b} has parent {int(parents[b, j])}")
        self.reserve(max(n + R, 2 * self.capacity) if n + R > self.capacity else 0)
        self._parents[:, n:n + R] = parents
        windows = [(width, state_len, self._windows[(width, state_len)],
                    np.arange(state_len - width + 1, state_len)) for width, state_len in self.window_keys]
        for b, row in enumerate(parents.tolist()):
            mask, depth = self._mask[b], self._depth[b]
            for i, p in enumerate(row, n):
                if p >= 0:  # path(i) = path(p) + i
                    mask[i] = mask[p]
                    depth[i] = depth[p] + 1
                else:
                    mask[i] = 0
                    depth[i] = 0
                mask[i, i] = 1
                for width, state_len, window, root in windows:
                    # a node's window is its parent's shifted by one; a root's ends with the newest state columns
                    window[b, i, :width - 1] = window[b, p, 1:] if p >= 0 else root
                    window[b, i, width - 1] = state_len + i
        self.n = n + R
        return n, self.n

    def levels(self, start, width):
        """Positions 0 .. width-1 of a pass over nodes start .. start+width-1, grouped by level: a position's level is
        one more than the deepest level among its ancestors in the pass on any row (0 without any; positions past
        the tree are 0), so a walk of the levels in order meets every ancestor first. A list of int64 arrays."""
        real = min(self.n - start, width)
        within = self._mask[:, start:start + real, start:start + real].any(0)
        level = np.zeros(width, dtype=np.int64)
        for p in range(1, real):
            ancestors = np.flatnonzero(within[p, :p])
            level[p] = level[ancestors].max() + 1 if ancestors.size else 0
        return [np.flatnonzero(level == s) for s in range(int(level.max(initial=0)) + 1)]

    def truncate(self, n):
        """Forget every node from n on (a failed pass)."""
        self.n = min(self.n, n)

    def path(self, b, node):
        """Node ids from the root down to `node` on row b ([] for -1)."""
        return [] if node < 0 else np.flatnonzero(self._mask[b, node, :node + 1]).tolist()

    def reserve(self, capacity):
        """Hold at least `capacity` node slots."""
        if capacity > self.capacity:
            self._alloc(capacity)

    def pass_inputs(self, start, width, lengths, device, tokens=None, head_rows=(), extra=()):
        """What a pass over nodes start .. start+width-1 needs, over all `capacity` slots (fixed shapes: slots past
        the tree are nobody's ancestors), as (flat, layout): one int64 tensor on `device`, copied in one transfer,
        and the PassLayout that unpack() reads it with. A compiled pass takes `flat` and unpacks it itself: there
        the views cost nothing, and one input tensor is one guard and no aliased inputs. Holds:

            rows (width,) node ids; positions (batch, width) = lengths + depth (padding rows: lengths);
            tokens (batch, width): the new nodes' tokens ((batch, R) ints, R <= width), zero-padded;
            head_rows (K,): the `head_rows` given (the rows the LM head runs on); lengths (batch,): each row's
            committed tokens (`lengths`, an int or (batch,) ints); length (): their maximum, where node slots start;
            extra (E,): the `extra` ints given (a commit's nodes and K/V moves);
            parents (batch, capacity); mask (batch, capacity, capacity) bool;
            windows {(width, state_len): (batch, capacity, width)}.
        """
        if start + width > self.capacity:
            raise ValueError(f"{start + width} node slots needed, the tree holds {self.capacity}")
        real = max(0, min(self.n - start, width))
        layout = PassLayout(self.batch, width, len(head_rows), len(extra), self.capacity, self.window_keys)
        header = self.header(layout, start, lengths, self._depth[:, start:start + real], tokens, head_rows, extra)
        # a fresh array (so what the device sees never changes with the tree), one transfer
        return to_device(np.concatenate([header, self._packed]), device), layout

    @staticmethod
    def header(layout, start, lengths, depth, tokens=None, head_rows=(), extra=()):
        """The header of pass_inputs' tensor (a numpy int64 array) for a pass over slots start .. start+width-1
        whose first R rows are real nodes at depths `depth` (batch, R) and tokens `tokens` (batch, R) (None:
        zeros); the rest as pass_inputs says."""
        fields = _header_fields(layout)
        host = np.zeros(_size(fields), dtype=np.int64)
        views = _split(host, fields)
        views["rows"][:] = np.arange(start, start + layout.width)
        views["lengths"][:] = lengths
        views["positions"][:] = views["lengths"][:, None]
        views["positions"][:, :depth.shape[1]] += depth
        if tokens is not None and len(tokens):
            tokens = np.asarray(tokens, dtype=np.int64).reshape(layout.batch, -1)
            views["tokens"][:, :tokens.shape[1]] = tokens
        views["head_rows"][:] = head_rows
        views["length"][...] = views["lengths"].max()
        views["extra"][:] = extra
        return host

    @staticmethod
    def extended(header, tokens, parents, structure, layout):
        """A pass's flat tensor (as pass_inputs gives it) for new nodes whose tokens and parents (batch, R) are on
        the device (no host sync): `header` (header()'s, on the device, its rows the new nodes' slots) with the
        tokens written in, then `structure` (the tree's as the last pass's tensor ended with it) with the new nodes
        added by add()'s rule: path(i) = path(p) + i, a node's window is its parent's shifted by one plus its own
        column. Every parent must be an earlier node (>= 0)."""
        batch, R = parents.shape
        C, fields = layout.capacity, _header_fields(layout)
        at = _size(fields[:2])  # the tokens field follows rows and positions
        padded = torch.cat([tokens, tokens.new_zeros(batch, layout.width - R)], 1)
        head = torch.cat([header[:at], padded.reshape(-1), header[at + padded.numel():]])
        old = _split(structure, _structure_fields(batch, C, layout.window_keys))
        slots = header[:R]  # the rows field: the new nodes' ids
        gather = lambda t: t.gather(1, parents[..., None].expand(batch, R, t.shape[-1]))  # noqa: E731 (parents' rows)
        own = (torch.arange(C, device=slots.device) == slots[:, None]).long()
        new = {"parents": old["parents"].index_copy(1, slots, parents),
               "mask": old["mask"].index_copy(1, slots, gather(old["mask"]) | own)}
        for key in layout.window_keys:
            column = (key[1] + slots).expand(batch, R)[..., None]
            new[key] = old[key].index_copy(1, slots, torch.cat([gather(old[key])[..., 1:], column], -1))
        return torch.cat([head] + [new[name].reshape(-1) for name, _ in _structure_fields(batch, C, layout.window_keys)])

    @staticmethod
    def unpack(flat, layout):
        """pass_inputs' tensor as a dict of views (names and shapes as pass_inputs lists them)."""
        out = _split(flat, _fields(layout))
        out["mask"] = out["mask"].bool()
        out["windows"] = {key: out.pop(key) for key in layout.window_keys}
        return out
