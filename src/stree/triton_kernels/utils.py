"""Shared helpers for the tree kernels: input checks, backend choice, tree structure, dt processing.

Nothing here imports Triton, so the PyTorch references work on machines without it.
"""
import importlib.util
import os

import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend, tensor):
    """Return "triton" or "torch" for a request of "auto" | "triton" | "torch".

    auto picks Triton for CUDA tensors of a dtype Triton handles (fp16/bf16/fp32) and the PyTorch
    reference otherwise (CPU tensors, float64). An explicit "triton" that cannot run raises ValueError.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    runnable = HAS_TRITON and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    if backend == "auto":
        return "triton" if runnable and tensor.is_cuda and tensor.dtype in TRITON_DTYPES else "torch"
    if not HAS_TRITON:
        raise ValueError("backend='triton' requested but triton is not installed")
    if not runnable:
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")
    if tensor.dtype not in TRITON_DTYPES:
        raise ValueError(f"backend='triton' supports float16, bfloat16 and float32 inputs, got {tensor.dtype}; "
                         "use backend='torch' for other dtypes")
    return "triton"


def compute_dtype(tensor):
    """fp64 inputs are computed in fp64, everything else accumulates in fp32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def check_shape(name, tensor, shape):
    """Raise ValueError unless tensor.shape == shape (None entries match anything)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(tensor.shape)}")


def check_float(name, tensor):
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def check_inputs(specs, device, anchor):
    """Each (name, tensor or None, shape) in specs: skip None, else check the shape, a float dtype and `device`
    (the device of the input named `anchor`)."""
    for name, tensor, shape in specs:
        if tensor is None:
            continue
        check_shape(name, tensor, shape)
        check_float(name, tensor)
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but {anchor} is on {device}")


def check_parents(parents, batch, T, device):
    """Validate parents (batch, T): integer, on `device`, -1 <= parents[b, i] < i. Returns int64 parents."""
    check_shape("parents", parents, (batch, T))
    if parents.is_floating_point() or parents.is_complex() or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
    if parents.device != device:
        raise ValueError(f"parents is on {parents.device} but the inputs are on {device}")
    parents = parents.long()
    bad = (parents < -1) | (parents >= torch.arange(T, device=device))
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        if parents[b, i] < -1:
            raise ValueError(f"parents[{b}, {i}] = {parents[b, i].item()} is below -1 (-1 means: child of the prefix)")
        raise ValueError(f"parents must be topological (parents[b, i] < i); parents[{b}, {i}] = "
                         f"{parents[b, i].item()}")
    return parents


def check_nodes(nodes, batch, T, device):
    """Validate nodes (batch,): integer, -1 <= nodes[b] < T. Returns int64 nodes."""
    check_shape("nodes", nodes, (batch,))
    if nodes.is_floating_point() or nodes.dtype == torch.bool:
        raise ValueError(f"nodes must be an integer tensor, got {nodes.dtype}")
    if nodes.device != device:
        raise ValueError(f"nodes is on {nodes.device} but the inputs are on {device}")
    nodes = nodes.long()
    bad = (nodes < -1) | (nodes >= T)
    if bool(bad.any()):
        b = bad.nonzero()[0].item()
        raise ValueError(f"nodes[{b}] = {nodes[b].item()} is out of range [-1, {T}) (-1 = nothing accepted)")
    return nodes


def ancestor_matrix(parents, dtype=torch.float32):
    """Ancestor-or-self relation of a batch of trees as a 0/1 matrix.

    parents (batch, T) int64, topological, -1 = child of the prefix.
    Returns (batch, T, T) in `dtype` with [b, i, k] = 1 if k is on path(i) (path including i itself), else 0.
    With P the parent adjacency (P[i, parent(i)] = 1), (I - P)^-1 = I + P + P^2 + ... counts the paths from i
    to each ancestor, and there is exactly one: one triangular solve, exact in floating point.
    """
    batch, T = parents.shape
    eye = torch.eye(T, dtype=dtype, device=parents.device)
    adjacency = torch.zeros(batch, T, T + 1, dtype=dtype, device=parents.device)  # column T: the prefix
    adjacency.scatter_(2, parents.masked_fill(parents < 0, T)[..., None], 1.0)
    return torch.linalg.solve_triangular(eye - adjacency[..., :T], eye.expand(batch, T, T), upper=False,
                                         unitriangular=True)


def ancestor_mask(parents):
    """(batch, T, T) bool, [b, i, k] = node k is on path(i) (i itself included). See ancestor_matrix."""
    return ancestor_matrix(parents) > 0.5


def window_index(parents, nodes, length, state_len):
    """Where each conv window element lives in cat(conv_state, x) along time (state_len + T columns).

    parents (batch, T); nodes (batch, Q) node ids, -1 = a window made only of state columns.
    Returns (batch, Q, length) int64: column `length - 1` is the node itself, then its parent, ...;
    a path that leaves the tree continues at state column state_len - 1, state_len - 2, ...
    """
    if parents.shape[1] == 0:  # an empty tree: every window lies in the state (and gather needs a column)
        parents = parents.new_full((parents.shape[0], 1), -1)
    cur = nodes
    col = torch.full_like(nodes, state_len)
    cols = []
    for _ in range(length):
        inside = cur >= 0
        col = torch.where(inside, col, col - 1)
        cols.append(torch.where(inside, state_len + cur, col))
        cur = torch.where(inside, parents.gather(1, cur.clamp(min=0)), -1)
    return torch.stack(cols[::-1], dim=-1)


class TreeIndex:
    """A validated batch of trees and what the kernels derive from it, computed once and shared by every layer.

    Every kernel taking `parents` also takes a TreeIndex in its place, so a model's layers (and its commit)
    validate the tree and solve its ancestor relation once per forward pass instead of once per call.

        parents:   (batch, T) int64, checked topological (-1 = child of the prefix)
        mask:      (batch, T, T) bool, [b, i, k] = node k is on path(i)
        ancestors: (batch, T, T) float32 0/1 view of mask (ancestor_matrix)

    TreeIndex(parents) validates and solves; TreeIndex.prebuilt(parents, mask, windows, depth) takes structure its
    caller already derived (stree's drafting builds it on the host as the tree grows) and checks nothing.
    """

    def __init__(self, parents):
        if not isinstance(parents, torch.Tensor) or parents.dim() != 2:
            raise ValueError(f"parents must be a (batch, T) tensor, got {getattr(parents, 'shape', parents)!r}")
        self.parents = check_parents(parents, *parents.shape, parents.device)
        self._ancestors = ancestor_matrix(self.parents)
        self.mask = self._ancestors > 0.5
        self._windows = {}
        self._depth = None

    @classmethod
    def prebuilt(cls, parents, mask, windows=None, depth=None):
        """A TreeIndex from trusted structure: parents (batch, T) int64, mask (batch, T, T) bool as above, windows
        {(length, state_len): (batch, T, length) int64} (see windows()), depth (batch, T) int64 or None (see
        depth). Nothing is validated or solved."""
        self = cls.__new__(cls)
        self.parents, self.mask, self._ancestors = parents, mask, None
        self._windows = dict(windows or {})
        self._depth = depth
        return self

    def queries(self, rows):
        """What kernels derive from a pass's query rows (None = every node), as a RowQueries. The last one is
        remembered, so every layer of a pass that passes the same rows tensor shares it."""
        last = getattr(self, "_queries", None)
        if last is None or last.rows is not rows:
            last = self._queries = RowQueries(self, rows)
        return last

    @property
    def shape(self):
        return self.parents.shape

    @property
    def ancestors(self):
        if self._ancestors is None:
            self._ancestors = self.mask.to(torch.float32)
        return self._ancestors

    def ancestor_matrix(self, dtype):
        return self.ancestors if dtype == torch.float32 else self.ancestors.to(dtype)

    def windows(self, length, state_len):
        """window_index of every node, (batch, T, length), computed once per (length, state_len)."""
        key = (length, state_len)
        if key not in self._windows:
            batch, T = self.parents.shape
            nodes = torch.arange(T, device=self.parents.device).expand(batch, T)
            self._windows[key] = window_index(self.parents, nodes, length, state_len)
        return self._windows[key]

    @property
    def depth(self):
        """(batch, T) int64, the number of proper ancestors of each node inside the tree (a root is 0)."""
        if getattr(self, "_depth", None) is None:
            self._depth = self.mask.sum(-1) - 1
        return self._depth


class RowQueries:
    """The ancestor-mask rows of a set of query nodes, their conv windows and path sums (see TreeIndex.queries).

        mask (batch, R, T) bool; on_path = mask[:, None] (batch, 1, R, T) and off_path = its negation, shaped to
        broadcast over heads; windows(length, state_len) (batch, R, length); path_sums(dtype) a PathSums.
    """

    def __init__(self, index, rows):
        self.index, self.rows = index, rows
        self.mask = gather_node_rows(index.mask, rows)
        self.on_path = self.mask[:, None]
        self.off_path = ~self.on_path
        self._windows = {}
        self._path_sums = {}

    def windows(self, length, state_len):
        key = (length, state_len)
        if key not in self._windows:
            self._windows[key] = gather_node_rows(self.index.windows(length, state_len), self.rows)
        return self._windows[key]

    def path_sums(self, dtype):
        """The rows' PathSums over every slot in `dtype`, made once (every delta-rule layer of a pass shares it)."""
        if dtype not in self._path_sums:
            self._path_sums[dtype] = PathSums(self.mask, self.index.mask, dtype)
        return self._path_sums[dtype]


class PathSums:
    """What the decays of a set of query nodes need from the tree, the same for every layer of a pass.

    on_path (batch, Q, T) bool: the queries' ancestor-mask rows; mask (batch, T, T) bool: every slot's. decays(g)
    gives exp(G_i - G_j) for j on path(i) (0 elsewhere) and exp(G_i), with G_i the sum of g over path(i): G_i - G_j
    is the sum of g over path(i) minus path(j), a 0/1 matmul with `segments` (batch, Q, T, T) and no cancellation
    (garbage where j is off path(i), zeroed). Memory: Q x T x T per batch row.
    """

    def __init__(self, on_path, mask, dtype):
        self.on = on_path.to(dtype)
        self.segments = self.on[:, :, None, :] - mask.to(dtype)[:, None]                  # (batch, Q, T, T)
        self.off = ~on_path[..., None]                                                    # (batch, Q, T, 1)

    def decays(self, gates):
        """gates (..., batch, T, H) -> weights (..., batch, H, Q, T), growth (..., batch, H, Q)."""
        diff = torch.matmul(self.segments, gates[..., None, :, :])                        # (..., batch, Q, T, H)
        weights = diff.masked_fill_(self.off, 0.0).exp_().masked_fill_(self.off, 0.0)
        return weights.movedim(-1, -3), torch.matmul(self.on, gates).exp_().transpose(-1, -2)


def gather_node_rows(t, rows):
    """t (batch, T, ...) at node ids rows: None (all), (R,) shared by every batch row, or (batch, R)."""
    if rows is None:
        return t
    return t.index_select(1, rows) if rows.dim() == 1 else gather_rows(t, rows)


def as_dtype(t, dtype):
    """t in dtype, without an operation when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def check_rows(rows, batch, T, device):
    """Validate `rows`, the node ids whose outputs a kernel computes: None (every node), (R,) (the same nodes of
    every tree) or (batch, R) integer, each in [0, T). Returns None or an int64 tensor of the same shape."""
    if rows is None:
        return None
    if not isinstance(rows, torch.Tensor) or rows.dim() not in (1, 2):
        raise ValueError(f"rows must be a (R,) or (batch, R) tensor of node ids, got {getattr(rows, 'shape', rows)!r}")
    if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
        raise ValueError(f"rows must be an integer tensor, got {rows.dtype}")
    if rows.device != device:
        raise ValueError(f"rows is on {rows.device} but the inputs are on {device}")
    rows = rows.long()
    if rows.dim() == 2 and rows.shape[0] != batch:
        raise ValueError(f"rows has batch {rows.shape[0]}, the inputs have {batch}")
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < T:
        raise ValueError(f"rows must hold node ids in [0, {T}), got {rows.tolist()}")
    return rows


def check_pass_rows(rows, index):
    """Validate the new nodes of an engine pass: rows (R,) distinct integer slot ids in [0, T), in pass order (no
    row is an ancestor of an earlier row in any tree of `index`, a TreeIndex). Returns int64 rows."""
    batch, T = index.shape
    rows = check_rows(rows, batch, T, index.mask.device)
    if rows is None or rows.dim() != 1:
        raise ValueError(f"rows must be a (R,) tensor of slot ids, got {getattr(rows, 'shape', rows)!r}")
    if rows.unique().numel() != rows.numel():
        raise ValueError(f"rows must be distinct slot ids, got {rows.tolist()}")
    later = index.mask.index_select(1, rows).index_select(2, rows).triu(1)  # [b, p, p'] rows[p'] on path(rows[p])
    if bool(later.any()):
        b, p, q = later.nonzero()[0].tolist()
        raise ValueError(f"rows must be in pass order (ancestors first): rows[{q}] = {int(rows[q])} is an ancestor "
                         f"of rows[{p}] = {int(rows[p])} in tree {b}")
    return rows


def gather_rows(t, rows):
    """t (batch, T, ...) -> (batch, R, ...) at node ids rows (batch, R); t itself when rows is None."""
    if rows is None:
        return t
    return t.gather(1, rows.reshape(*rows.shape, *([1] * (t.dim() - 2))).expand(*rows.shape, *t.shape[2:]))


def tree_index(parents, batch, T, device):
    """A TreeIndex for a kernel call: the given one after checking it fits (batch, T) and `device`, or a new one
    built (and validated) from a parents tensor."""
    if not isinstance(parents, TreeIndex):
        check_shape("parents", parents, (batch, T))
        if parents.device != device:
            raise ValueError(f"parents is on {parents.device} but the inputs are on {device}")
        return TreeIndex(parents)
    if tuple(parents.shape) != (batch, T):
        raise ValueError(f"the TreeIndex is for trees of shape {tuple(parents.shape)}, the inputs have "
                         f"({batch}, {T})")
    if parents.parents.device != device:
        raise ValueError(f"the TreeIndex is on {parents.parents.device} but the inputs are on {device}")
    return parents


def process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype):
    """dt (batch, T, nheads) -> clamp(softplus(dt + dt_bias), *dt_limit) in `dtype`."""
    dt = as_dtype(dt, dtype)
    if dt_bias is not None:
        dt = dt + as_dtype(dt_bias, dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, dtype):
    """Processed dt, ancestor mask and path decay s shared by both scan backends.

    dt (batch, T, nheads) raw; A (nheads,); index: the TreeIndex of the trees.
    Returns dt (batch, T, nheads) in `dtype`, mask (batch, T, T) bool, and s (batch, T, nheads) with
    s[b, i, h] = sum of dt[b, k, h] * A[h] over k on path(i): the tree's analogue of cumsum(dt * A).
    """
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype)
    return dt, index.mask, torch.matmul(index.ancestor_matrix(dtype), dt * as_dtype(A, dtype))
