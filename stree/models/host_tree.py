"""HostTree: the structure of a growing batch of token trees, kept on the host and extended as nodes arrive.

A pass needs each node's ancestors (the tree mask), its depth (positions) and, per conv width, the window of
earlier inputs it sees. All of it follows from the parent of each new node and what that parent already has, so
it is built here with small numpy operations as the tree grows and copied to the device once per pass, instead
of being solved on the device (and validated with host syncs) every pass.
"""
import numpy as np
import torch



class HostTree:
    """Trees of `batch` rows growing together (every pass adds the same number of nodes to each row).

    parents (batch, n) int64, -1 = child of the committed prefix; mask (batch, n, n) bool, [b, i, k] = k on
    path(i); depth (batch, n); windows[(width, state_len)] (batch, n, width): the columns of cat(conv_state, x)
    node i's conv window reads, as triton_kernels.utils.window_index defines them.
    """

    def __init__(self, batch, window_keys=(), capacity=16):
        self.batch, self.n = batch, 0
        self.window_keys = tuple(window_keys)
        self._alloc(capacity)

    def _alloc(self, capacity):
        old = getattr(self, "_parents", None)
        self._parents = np.full((self.batch, capacity), -1, dtype=np.int64)
        self._mask = np.zeros((self.batch, capacity, capacity), dtype=bool)
        self._depth = np.zeros((self.batch, capacity), dtype=np.int64)
        self._windows = {key: np.zeros((self.batch, capacity, key[0]), dtype=np.int64) for key in self.window_keys}
        if old is not None:
            n = self.n
            self._parents[:, :n], self._depth[:, :n] = old[:, :n], self._old_depth[:, :n]
            self._mask[:, :n, :n] = self._old_mask[:, :n, :n]
            for key in self.window_keys:
                self._windows[key][:, :n] = self._old_windows[key][:, :n]
        self.capacity = capacity

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
        ids = n + np.arange(R)
        bad = (parents < -1) | (parents >= ids)
        if bad.any():
            b, j = map(int, np.argwhere(bad)[0])
            raise ValueError(f"parents must be -1 or an earlier node (topological order): new node {n + j} of row "
                             f"{b} has parent {int(parents[b, j])}")
        self.reserve(max(n + R, 2 * self.capacity) if n + R > self.capacity else 0)
        # Nodes whose parents are all known are filled at once (a drafting level: one wave; a whole new tree: one
        # wave per depth), each from its parent's row: its mask row plus itself, depth + 1, window shifted by one.
        rows = np.arange(self.batch)[:, None]
        done = n
        while done < n + R:
            # the wave runs up to the first later node whose parent is in it (the first node's parent is earlier)
            waits = (parents[:, done - n + 1:] >= done).any(0)
            wave = done + 1 + (int(waits.argmax()) if waits.any() else waits.shape[0])
            ids, p = np.arange(done, wave), parents[:, done - n:wave - n]                      # (W,), (batch, W)
            has = p >= 0
            pc = np.where(has, p, 0)
            new = slice(done, wave)
            self._parents[:, new] = p
            np.logical_and(self._mask[rows, pc], has[..., None], out=self._mask[:, new])
            self._mask[:, ids, ids] = True
            self._depth[:, new] = (self._depth[rows, pc] + 1) * has
            for (width, state_len), windows in self._windows.items():
                # a node's window is its parent's shifted by one; a root's ends with the newest state columns
                root = np.arange(state_len - width + 1, state_len)
                windows[:, new, :width - 1] = np.where(has[..., None], windows[rows, pc, 1:], root)
                windows[:, new, width - 1] = state_len + ids
            done = wave
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
            self._old_mask, self._old_depth, self._old_windows = self._mask, self._depth, self._windows
            self._alloc(capacity)
            del self._old_mask, self._old_depth, self._old_windows

    def pass_inputs(self, start, width, length, device):
        """What a pass over nodes start .. start+width-1 needs, over all `capacity` slots (fixed shapes: slots past
        the tree are nobody's ancestors), copied to `device` in one transfer:

            rows (width,) node ids; positions (batch, width) = length + depth (padding rows: length);
            parents (batch, capacity); mask (batch, capacity, capacity) bool;
            windows {(width, state_len): (batch, capacity, width)}; length () = committed tokens.
        """
        if start + width > self.capacity:
            raise ValueError(f"{start + width} node slots needed, the tree holds {self.capacity}")
        batch, capacity = self.batch, self.capacity
        rows = np.arange(start, start + width)
        depth = np.where(rows < self.n, self._depth[:, rows], 0)
        parts = [rows, length + depth, self._parents, self._mask, *self._windows.values(), np.array([length])]
        packed = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]))
        flat = packed.to(device)
        sizes = [p.size for p in parts]
        pieces = flat.split(sizes)
        out = dict(rows=pieces[0], positions=pieces[1].view(batch, width), parents=pieces[2].view(batch, capacity),
                   mask=pieces[3].view(batch, capacity, capacity).bool(), length=pieces[-1].view(()))
        out["windows"] = {key: piece.view(batch, capacity, key[0])
                          for key, piece in zip(self._windows, pieces[4:-1])}
        return out
