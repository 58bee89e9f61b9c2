"""Mamba1 selective scan over a token tree (Mamba, FalconMamba, Jamba): public entry points, checks, dispatch.

Per channel d of the intermediate size, with a state of N numbers (A = -exp(A_log), shape (dim, N)):

    h_i = exp(dt_i ⊙ A) ⊙ h_parent(i) + (dt_i ⊙ x_i) ⊗ B_i           (h_i, A: (dim, N); B_i, C_i: (N,))
    y_i = (h_i · C_i + D ⊙ x_i) ⊙ silu(z_i)                         (z optional: HF applies the gate here)

With a per-channel A the masked closed form (Mamba2's, docs/design.md §2) needs a decay per (node, ancestor, channel,
state) pair: T x T x dim x N terms against the recurrence's T x dim x N. Measured on CPU at Mamba-130m to Jamba
shapes (benchmarks/selective_scan_methods.py) it costs 1.0-1.4x the recurrence at T = 1 and 20-70x at T = 16-32,
so both backends run the exact level-by-level recurrence: all nodes of one depth are updated at once from their
parents' states, in `depth` sequential steps, holding two levels of states (see utils.Levels). Operations follow HF's single-token decode path (``mamba_selective_state_update``), which
HF's greedy generate runs every new token through: dt gets dt_bias and softplus in dt's own dtype, then
everything accumulates in fp32 (fp64 for fp64 inputs; HF's decode step computes in fp32 even for fp64 models).
The output dot, D and the gate stay in that precision and round once (HF rounds the state to C's dtype before
its dot and applies D and the gate in the model dtype: a bf16 rounding apart, 0.5% of the output scale).
"""
import torch.nn.functional as F

from . import tree_selective_scan_torch
from .utils import (check_float, check_nodes, check_rows, check_shape, compute_dtype, resolve_backend,
                    tree_index)


def _check_inputs(x, dt, A, B, parents, C=None, D=None, z=None, dt_bias=None, initial_states=None):
    check_shape("x", x, (None, None, None))
    check_float("x", x)
    batch, T, dim = x.shape
    check_shape("A", A, (dim, None))
    dstate = A.shape[1]
    for name, t, shape in (("dt", dt, (batch, T, dim)), ("A", A, (dim, dstate)), ("B", B, (batch, T, dstate)),
                           ("C", C, (batch, T, dstate)), ("D", D, (dim,)), ("z", z, (batch, T, dim)),
                           ("dt_bias", dt_bias, (dim,)), ("initial_states", initial_states, (batch, dim, dstate))):
        if t is None:
            continue
        check_shape(name, t, shape)
        check_float(name, t)
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return tree_index(parents, batch, T, x.device)


def selective_dt(dt, dt_bias, dt_softplus, dtype):
    """dt (batch, T, dim) -> softplus(dt + dt_bias) in `dtype`, the bias and softplus taken in dt's own dtype as
    HF's decode step does (for bf16 models that rounding is visible in the outputs)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.to(dtype)


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
        y: (batch, T, dim), or (batch, R, dim) with rows, in x's dtype.
    """
    if validate:
        index = _check_inputs(x, dt, A, B, parents, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
        rows = check_rows(rows, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    rows = None if rows is None else rows.long().expand(x.shape[0], -1)  # (R,): the same nodes of every tree
    dt = selective_dt(dt, dt_bias, dt_softplus, compute_dtype(x))
    kwargs = dict(D=D, z=z, initial_states=initial_states, rows=rows)
    if resolve_backend(backend, x) == "triton":
        from . import tree_selective_scan_triton
        return tree_selective_scan_triton.tree_selective_scan(x, dt, A, B, C, index, **kwargs)
    return tree_selective_scan_torch.tree_selective_scan(x, dt, A, B, C, index, **kwargs)


def tree_selective_states(x, dt, A, B, parents, nodes, *, dt_bias=None, dt_softplus=False, initial_states=None,
                          backend="auto", validate=True):
    """Selective-scan state after consuming path(nodes[b]) from the initial state: the commit of an accepted node.

    Recomputed along the accepted path alone (depth(nodes[b]) + 1 single-node updates per row, with the same
    operations as the tree pass, so it equals the state that pass used for that node); nothing is kept from
    the pass.

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
    out_dtype = initial_states.dtype if initial_states is not None else compute_dtype(x)
    dt = selective_dt(dt, dt_bias, dt_softplus, compute_dtype(x))
    if resolve_backend(backend, x) == "triton":
        from . import tree_selective_scan_triton
        states = tree_selective_scan_triton.tree_selective_states(x, dt, A, B, index, nodes,
                                                                  initial_states=initial_states)
    else:
        states = tree_selective_scan_torch.tree_selective_states(x, dt, A, B, index, nodes,
                                                                 initial_states=initial_states)
    return states.to(out_dtype)
