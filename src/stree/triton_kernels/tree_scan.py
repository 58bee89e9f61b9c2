"""Tree-masked Mamba2 SSD scan: public entry points, input checks and backend dispatch.

Math (docs/design.md §2), per head, with s_i = sum of dt_k*A over k on path(i):

    y_i = exp(s_i)·(C_i·h0) + sum_{k on path(i)} exp(s_i - s_k)·dt_k·(C_i·B_k)·x_k + D·x_i
    h_a = exp(s_a)·h0       + sum_{k on path(a)} exp(s_a - s_k)·dt_k·x_k ⊗ B_k

Both backends evaluate this masked quadratic form directly over all T nodes (tiled on the GPU), so a tree
of any size is exact: no state is passed between chunks, hence no chunk boundary can cut a tree edge.
The cost is O(T^2) per head, which is small for the trees used in decoding and search.
"""
from . import tree_scan_torch
from .utils import check_float, check_nodes, check_rows, check_shape, compute_dtype, resolve_backend, tree_index


def _check_scan_inputs(x, dt, A, B, parents, C=None, D=None, dt_bias=None, initial_states=None):
    check_shape("x", x, (None, None, None, None))
    batch, T, nheads, headdim = x.shape
    check_float("x", x)
    check_shape("dt", dt, (batch, T, nheads))
    check_float("dt", dt)
    check_shape("A", A, (nheads,))
    check_float("A", A)
    check_shape("B", B, (batch, T, None, None))
    check_float("B", B)
    ngroups, dstate = B.shape[2:]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"ngroups ({ngroups}) must divide nheads ({nheads})")
    if C is not None:
        check_shape("C", C, (batch, T, ngroups, dstate))
        check_float("C", C)
    if D is not None:
        check_float("D", D)
        if tuple(D.shape) not in ((nheads,), (nheads, headdim)):
            raise ValueError(f"D must have shape ({nheads},) or ({nheads}, {headdim}), got {tuple(D.shape)}")
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (nheads,))
        check_float("dt_bias", dt_bias)
    if initial_states is not None:
        check_shape("initial_states", initial_states, (batch, nheads, headdim, dstate))
        check_float("initial_states", initial_states)
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias),
                    ("initial_states", initial_states)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return tree_index(parents, batch, T, x.device)


def _check_dt_limit(dt_limit):
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"dt_limit must be (min, max) with min <= max, got {dt_limit}")


def tree_scan(x, dt, A, B, C, parents, *, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None, rows=None, backend="auto", validate=True):
    """Outputs of a Mamba2 SSD layer over a token tree, every node as if its path had been fed in order.

    Args:
        x: (batch, T, nheads, headdim) inputs.
        dt: (batch, T, nheads) raw time steps (before dt_bias / softplus / clamp).
        A: (nheads,) negative decay rates (A = -exp(A_log)).
        B, C: (batch, T, ngroups, dstate); head h uses group h // (nheads // ngroups).
        parents: (batch, T) integer, parents[b, i] < i, -1 = child of the initial state; or a TreeIndex of
            it (utils.TreeIndex, built once and reused across layers).
        D: (nheads,) or (nheads, headdim) skip connection, or None.
        dt_bias: (nheads,) or None. dt_softplus: apply softplus after the bias.
        dt_limit: (min, max) clamp of the processed dt.
        initial_states: (batch, nheads, headdim, dstate) state before the tree, or None for zeros.
        rows: None (every node) or (R,) / (batch, R) node ids whose outputs to compute: a grown tree's new
            nodes, say. The other nodes still act as their ancestors.
        backend: "auto" (Triton on CUDA, PyTorch otherwise), "triton" or "torch".
        validate: False skips every input check (no host sync): for callers that built the inputs themselves,
            with `parents` a TreeIndex.

    Returns:
        y: (batch, T, nheads, headdim), or (batch, R, nheads, headdim) with rows, in x's dtype (accumulated in
        fp32, or fp64 for fp64 inputs).
    """
    if validate:
        index = _check_scan_inputs(x, dt, A, B, parents, C=C, D=D, dt_bias=dt_bias, initial_states=initial_states)
        _check_dt_limit(dt_limit)
        rows = check_rows(rows, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    args = (x, dt, A, B, C, index)
    kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, initial_states=initial_states,
                  rows=rows)
    if resolve_backend(backend, x) == "triton":
        from . import tree_scan_triton
        if rows is not None and rows.dim() == 1:
            kwargs["rows"] = rows.expand(x.shape[0], -1)
        return tree_scan_triton.tree_scan(*args, **kwargs)
    return tree_scan_torch.tree_scan(*args, **kwargs)


def tree_states(x, dt, A, B, parents, nodes, *, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), initial_states=None, backend="auto", validate=True, out=None):
    """SSM state after consuming path(nodes[b]) from the initial state: the commit of an accepted node.

    Args: as tree_scan (no C or D), plus
        nodes: (batch,) integer accepted node per row, -1 = nothing accepted (the initial state comes back).
        validate: as tree_scan.
        out: optional (batch, nheads, headdim, dstate) tensor the states are written into and returned; it may
            be initial_states itself (a commit then updates the state in place, without a second state-sized
            tensor).
    Returns:
        states: (batch, nheads, headdim, dstate) in initial_states' dtype, or the compute dtype (fp32;
        fp64 for fp64 inputs) when initial_states is None.
    """
    if validate:
        index = _check_scan_inputs(x, dt, A, B, parents, dt_bias=dt_bias, initial_states=initial_states)
        _check_dt_limit(dt_limit)
        nodes = check_nodes(nodes, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    out_dtype = initial_states.dtype if initial_states is not None else compute_dtype(x)
    args = (x, dt, A, B, index, nodes)
    kwargs = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, initial_states=initial_states)
    if resolve_backend(backend, x) == "triton":
        from . import tree_scan_triton
        states = tree_scan_triton.tree_states(*args, **kwargs)
    elif out is not None and out.dtype == compute_dtype(x) and out.is_contiguous():
        return tree_scan_torch.tree_states(*args, **kwargs, out=out)
    else:
        states = tree_scan_torch.tree_states(*args, **kwargs)
    return states.to(out_dtype) if out is None else out.copy_(states)
