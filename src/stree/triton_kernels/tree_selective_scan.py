"""Mamba1 selective scan over a token tree (Mamba, FalconMamba, Jamba, Zamba): public entry points, checks, dispatch.

Per channel d of the intermediate size, with a state of N numbers (A = -exp(A_log), shape (dim, N)):

    h_i = exp(dt_i ⊙ A) ⊙ h_parent(i) + (dt_i ⊙ x_i) ⊗ B_i           (h_i, A: (dim, N); B_i, C_i: (N,))
    y_i = (h_i · C_i + D ⊙ x_i) ⊙ silu(z_i)                         (z optional: HF applies the gate here)

With a per-channel A the masked closed form (Mamba2's, docs/design.md §2) needs a decay per (node, ancestor,
channel, state) pair: T x T x dim x N terms against the recurrence's T x dim x N. Measured on CPU at Mamba-130m to
Jamba shapes (benchmarks/scan_kernels/selective_scan_methods.py) it costs 1.0-1.4x the recurrence at T = 1 and
20-70x at T = 16-32, so every node's state is kept in a per-slot buffer and a pass walks its new nodes from their
parents' kept states.
Operations follow HF's single-token decode path (``mamba_selective_state_update``), which HF's greedy generate
runs every new token through: dt gets dt_bias and softplus in dt's own dtype, then the update accumulates in fp32
(fp64 for fp64 inputs; HF's decode step computes in fp32 even for fp64 models).

Two forms:
  engine form  tree_selective_rows: a pass's new rows over the kept states (batch, T + 1, heads, head_dim, N), the
               committed state in the last slot; what stree's Mamba1Layers runs (its commit copies a kept state).
               The torch backend walks the rows level by level (host-given levels), the Triton one row by row in
               pass order.
  node form    tree_selective_scan / tree_selective_states: every node of a tree from an initial state, the engine
               form over fresh states of T + 1 slots (memory: (T + 1) x dim x N values per batch row, in the compute
               dtype). The output dot, D and the gate run after it in the compute dtype and round once (HF rounds
               the state to C's dtype before its dot and applies D and the gate in the model dtype: a bf16 rounding
               apart, 0.5% of the output scale).
"""
import torch
import torch.nn.functional as F

from .tree_selective_scan_torch import row_levels, selective_walk
from .utils import (as_dtype, check_float, check_inputs, check_nodes, check_pass_rows, check_rows, check_shape,
                    compute_dtype, gather_rows, resolve_backend, tree_index)


def _check_inputs(x, dt, A, B, parents, C=None, D=None, z=None, dt_bias=None, initial_states=None):
    check_shape("x", x, (None, None, None))
    check_float("x", x)
    batch, T, dim = x.shape
    check_shape("A", A, (dim, None))
    dstate = A.shape[1]
    check_inputs((("dt", dt, (batch, T, dim)), ("A", A, (dim, dstate)), ("B", B, (batch, T, dstate)),
                  ("C", C, (batch, T, dstate)), ("D", D, (dim,)), ("z", z, (batch, T, dim)),
                  ("dt_bias", dt_bias, (dim,)), ("initial_states", initial_states, (batch, dim, dstate))),
                 x.device, "x")
    return tree_index(parents, batch, T, x.device)


def selective_dt(dt, dt_bias, dt_softplus, dtype):
    """dt (batch, T, dim) -> softplus(dt + dt_bias) in `dtype`, the bias and softplus taken in dt's own dtype as
    HF's decode step does (for bf16 models that rounding is visible in the outputs)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.to(dtype)


def _check_rows_inputs(states, parents, rows, dt, B, x, A):
    """Validate an engine-form pass (see tree_selective_rows). Returns (TreeIndex, rows (R,) int64)."""
    check_shape("states", states, (None, None, None, None, None))
    check_float("states", states)
    batch, slots, heads, head_dim, N = states.shape
    if slots < 1:
        raise ValueError("states needs a last slot for the committed state")
    index = tree_index(parents, batch, slots - 1, states.device)
    rows = check_pass_rows(rows, index)
    R = rows.shape[0]
    specs = (("dt", dt, (batch, R, heads, head_dim)), ("B", B, (batch, R, heads, N)),
             ("x", x, (batch, R, heads, head_dim)), ("A", A, (heads, head_dim, N)))
    check_inputs(specs, states.device, "states")
    for name, t, _ in specs:
        if t.dtype != dt.dtype:
            raise ValueError(f"{name} is {t.dtype} but dt is {dt.dtype}: dt, B, x and A take one compute dtype")
    return index, rows


def tree_selective_rows(states, parents, rows, dt, B, x, A, *, levels=None, backend="auto", validate=True):
    """Mamba1's recurrence for a pass's new nodes `rows`, each from its parent's kept state (engine form).

    Args:
        states: (batch, T + 1, heads, head_dim, N) every slot's kept state (fp32 in HF's cache, or the model's
            dtype), contiguous; slot T holds the committed state, the roots' parent. The rows' states are written.
        parents: a utils.TreeIndex over the T slots (or (batch, T) parents).
        rows: (R,) the new nodes' slot ids, distinct and in pass order (every ancestor among them first).
        dt: (batch, R, heads, head_dim) time steps, dt_bias and softplus applied; x: (batch, R, heads, head_dim)
            inputs; B: (batch, R, heads, N); A: (heads, head_dim, N). One compute dtype (fp32; fp64 for fp64
            models). Mamba1's (dim, N) layers are heads = 1.
        levels: for the torch backend, rows' positions grouped by level, ancestors' levels first (a sequence of
            (W,) int64 tensors, as stree builds them on the host); None: derived from the tree (a host sync).
        backend: "auto" (Triton for CUDA tensors of fp16 / bf16 / fp32, PyTorch otherwise), "triton" or "torch".
        validate: False skips every check (no host sync, nothing that breaks torch.compile); then parents must be a
            TreeIndex.
    Returns:
        the rows' states (batch, R, heads, head_dim, N) in states' dtype.
    """
    if validate:
        index, rows = _check_rows_inputs(states, parents, rows, dt, B, x, A)
    else:
        index = parents
    if resolve_backend(backend, dt) == "triton":
        from .tree_selective_scan_triton import selective_rows
        return selective_rows(states, index.parents, rows, dt, B, x, A)
    levels = row_levels(index.mask, rows) if levels is None else levels
    return selective_walk(states, index.parents, rows, levels, dt, B, x, A)


def _walk_every_node(x, dt, A, B, index, initial_states, backend):
    """The engine form over every node from fresh slots: the kept states (batch, T + 1, dim, N) in dt's dtype,
    slot T the initial state."""
    batch, T, dim = x.shape
    states = torch.zeros(batch, T + 1, 1, dim, A.shape[1], dtype=dt.dtype, device=x.device)
    if initial_states is not None:
        states[:, T, 0] = initial_states
    cd = dt.dtype
    tree_selective_rows(states, index, torch.arange(T, device=x.device), dt[:, :, None], as_dtype(B, cd)[:, :, None],
                        as_dtype(x, cd)[:, :, None], as_dtype(A, cd)[None], backend=backend, validate=False)
    return states[:, :, 0]


def tree_selective_scan(x, dt, A, B, C, parents, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                        initial_states=None, rows=None, backend="auto", validate=True):
    """Outputs of a Mamba1 selective scan over a token tree, every node as if its path had been fed in order.

    Args:
        x: (batch, T, dim) inputs (HF: the conv output, token-major).
        dt: (batch, T, dim) time steps after dt_proj, before dt_bias / softplus.
        A: (dim, dstate) negative decay rates (-exp(A_log)).
        B, C: (batch, T, dstate) input and output projections of each node.
        parents: (batch, T) integer, parents[b, i] < i, -1 = child of the initial state; or a utils.TreeIndex.
        D: (dim,) skip connection, or None. z: (batch, T, dim) gate (y *= silu(z)), or None.
        dt_bias: (dim,) or None. dt_softplus: apply softplus after the bias (HF: True).
        initial_states: (batch, dim, dstate) state before the tree, or None for zeros.
        rows: None (every node) or (R,) / (batch, R) node ids whose outputs to return.
        backend: "auto" (Triton on CUDA, PyTorch otherwise), "triton" or "torch".
        validate: False skips every input check (no host sync), for callers passing a TreeIndex they built.

    Returns:
        y: (batch, T, dim), or (batch, R, dim) with rows, in x's dtype; computed as tree_selective_rows over every
        node, then the output dot, D and the gate (see the module docstring for memory).
    """
    if validate:
        index = _check_inputs(x, dt, A, B, parents, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
        rows = check_rows(rows, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    backend = resolve_backend(backend, x)
    cd = compute_dtype(x)
    dt = selective_dt(dt, dt_bias, dt_softplus, cd)
    h = _walk_every_node(x, dt, A, B, index, initial_states, backend)[:, :x.shape[1]]   # (batch, T, dim, N)
    y = torch.matmul(h, as_dtype(C, cd)[..., None])[..., 0]
    if D is not None:
        y = y + as_dtype(x, cd) * as_dtype(D, cd)
    if z is not None:
        y = y * F.silu(as_dtype(z, cd))
    rows = None if rows is None else rows.long().expand(x.shape[0], -1)  # (R,): the same nodes of every tree
    return gather_rows(y, rows).to(x.dtype)


def tree_selective_states(x, dt, A, B, parents, nodes, *, dt_bias=None, dt_softplus=False, initial_states=None,
                          backend="auto", validate=True):
    """Selective-scan state after consuming path(nodes[b]) from the initial state: the commit of an accepted node.

    The kept state of the node after tree_selective_rows over every node (the same operations as
    tree_selective_scan, so it equals the state that pass used for that node).

    Args: as tree_selective_scan (no C, D or z), plus
        nodes: (batch,) integer accepted node per row, -1 = nothing accepted (the initial state comes back).
    Returns:
        states: (batch, dim, dstate) in initial_states' dtype, or the compute dtype (fp32; fp64 for fp64 inputs)
        when initial_states is None.
    """
    if validate:
        index = _check_inputs(x, dt, A, B, parents, dt_bias=dt_bias, initial_states=initial_states)
        nodes = check_nodes(nodes, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    backend = resolve_backend(backend, x)
    out_dtype = initial_states.dtype if initial_states is not None else compute_dtype(x)
    dt = selective_dt(dt, dt_bias, dt_softplus, compute_dtype(x))
    kept = _walk_every_node(x, dt, A, B, index, initial_states, backend)               # (batch, T + 1, dim, N)
    slot = torch.where(nodes >= 0, nodes, x.shape[1])  # -1: the initial state, in the last slot
    return kept[torch.arange(x.shape[0], device=x.device), slot].to(out_dtype)
