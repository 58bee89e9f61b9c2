"""Gated DeltaNet over a token tree (Qwen3-Next, Qwen3.5, OLMo-Hybrid): public entry points, checks, dispatch.

Per value head, state S (Dk, Dv); per node i with q_i, k_i (Dk), v_i (Dv), log decay g_i and beta_i (scalars):

    S = exp(g_i) · S_parent(i)
    S_i = S + k_i ⊗ (beta_i · (v_i − Sᵀ k_i))
    o_i = S_iᵀ q_i                               (q_i already scaled: scale, default Dk^-0.5)

The delta write makes S_i depend on S_parent nonlinearly in the inputs (a product of (I − beta k kᵀ) factors
along the path), so there is no masked quadratic form; both backends run the exact level-by-level recurrence:
all nodes of one depth are updated at once from their parents' states, in `depth` sequential steps, with two
levels of states alive (utils.Levels), never T states. The order of operations is HF's single-token recurrence
(``torch_recurrent_gated_delta_rule``), which HF's generate runs every new token through. Grouped value heads
(Hv > Hk, as Qwen3-Next): q and k keep their Hk key heads and value head h reads key head h // (Hv // Hk),
HF's repeat_interleave; pass already-repeated q and k (Hk = Hv) just as well.
"""
from . import tree_gated_delta_torch
from .utils import (check_float, check_nodes, check_rows, check_shape, compute_dtype, resolve_backend,
                    tree_index)

L2NORM_EPS = 1e-6  # HF's and fla's l2norm: x * rsqrt(sum(x^2) + eps)


def _check_inputs(k, v, g, beta, parents, q=None, initial_state=None, scale=None):
    check_shape("k", k, (None, None, None, None))
    check_float("k", k)
    batch, T, Hk, Dk = k.shape
    check_shape("v", v, (batch, T, None, None))
    Hv, Dv = v.shape[2:]
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"the key heads ({Hk}) must divide the value heads ({Hv})")
    for name, t, shape in (("q", q, (batch, T, Hk, Dk)), ("v", v, (batch, T, Hv, Dv)), ("g", g, (batch, T, Hv)),
                           ("beta", beta, (batch, T, Hv)), ("initial_state", initial_state, (batch, Hv, Dk, Dv))):
        if t is None:
            continue
        check_shape(name, t, shape)
        check_float(name, t)
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number or None, got {type(scale).__name__}")
    return tree_index(parents, batch, T, k.device)


def l2norm(x):
    """x / ||x|| over the last dim, as HF's and fla's l2norm (eps inside the root)."""
    return x * (x * x).sum(-1, keepdim=True).add(L2NORM_EPS).rsqrt()


def prepare_qk(q, k, scale, use_qk_l2norm, dtype):
    """q, k in `dtype`, l2-normalised if asked, q times scale: HF's order (normalise, then q / sqrt(Dk) when
    scale is None). Either may be None."""
    q, k = (None if t is None else t.to(dtype) for t in (q, k))
    if use_qk_l2norm:
        q, k = (None if t is None else l2norm(t) for t in (q, k))
    if q is not None:
        q = q / q.shape[-1] ** 0.5 if scale is None else q * scale
    return q, k


def tree_gated_delta_rule(q, k, v, g, beta, parents, *, initial_state=None, scale=None, use_qk_l2norm=False,
                          rows=None, backend="auto", validate=True):
    """Outputs of a gated delta rule layer over a token tree, every node as if its path had been fed in order.

    Args:
        q, k: (batch, T, Hk, Dk) queries and keys (HF: after the short conv, before any l2norm).
        v: (batch, T, Hv, Dv) values; Hk must divide Hv (value head h reads key head h // (Hv // Hk)).
        g: (batch, T, Hv) log decay (HF: -exp(A_log) * softplus(a + dt_bias)); beta: (batch, T, Hv) write strength.
        parents: (batch, T) integer, parents[b, i] < i, -1 = child of the initial state; or a utils.TreeIndex.
        initial_state: (batch, Hv, Dk, Dv) state before the tree, or None for zeros.
        scale: the query scale, None = Dk^-0.5 (HF always uses that). use_qk_l2norm: l2-normalise q and k first
            (HF's use_qk_l2norm_in_kernel, True in every HF model).
        rows: None (every node) or (R,) / (batch, R) node ids whose outputs to return.
        backend: "auto" (Triton on CUDA, PyTorch otherwise), "triton" or "torch".
        validate: False skips every input check (no host sync), for callers passing a TreeIndex they built.

    Returns:
        o: (batch, T, Hv, Dv), or (batch, R, Hv, Dv) with rows, in q's dtype (accumulated in fp32, or fp64 for
        fp64 inputs; HF computes this rule in fp32 even for fp64 models).
    """
    if validate:
        index = _check_inputs(k, v, g, beta, parents, q=q, initial_state=initial_state, scale=scale)
        rows = check_rows(rows, k.shape[0], k.shape[1], k.device)
    else:
        index = parents
    rows = None if rows is None else rows.long().expand(k.shape[0], -1)  # (R,): the same nodes of every tree
    qs, ks = prepare_qk(q, k, scale, use_qk_l2norm, compute_dtype(q))
    args = (qs, ks, v, g, beta, index)
    if resolve_backend(backend, q) == "triton":
        from . import tree_gated_delta_triton
        o = tree_gated_delta_triton.tree_gated_delta_rule(*args, initial_state=initial_state, rows=rows)
    else:
        o = tree_gated_delta_torch.tree_gated_delta_rule(*args, initial_state=initial_state, rows=rows)
    return o.to(q.dtype)


def tree_gated_delta_states(k, v, g, beta, parents, nodes, *, initial_state=None, use_qk_l2norm=False,
                            backend="auto", validate=True):
    """Gated delta state after consuming path(nodes[b]) from the initial state: the commit of an accepted node.

    Recomputed along the accepted path alone (depth(nodes[b]) + 1 single-node updates per row, the same
    operations as the tree pass, so it is the state that pass used for that node); nothing is kept from the
    pass, whose memory stays at two levels of states.

    Args: as tree_gated_delta_rule (no q, scale or rows), plus
        nodes: (batch,) integer accepted node per row, -1 = nothing accepted (the initial state comes back).
    Returns:
        states: (batch, Hv, Dk, Dv) in initial_state's dtype, or the compute dtype (fp32; fp64 for fp64 inputs)
        when initial_state is None.
    """
    if validate:
        index = _check_inputs(k, v, g, beta, parents, initial_state=initial_state)
        nodes = check_nodes(nodes, k.shape[0], k.shape[1], k.device)
    else:
        index = parents
    out_dtype = initial_state.dtype if initial_state is not None else compute_dtype(k)
    _, ks = prepare_qk(None, k, None, use_qk_l2norm, compute_dtype(k))
    args = (ks, v, g, beta, index, nodes)
    if resolve_backend(backend, k) == "triton":
        from . import tree_gated_delta_triton
        states = tree_gated_delta_triton.tree_gated_delta_states(*args, initial_state=initial_state)
    else:
        states = tree_gated_delta_torch.tree_gated_delta_states(*args, initial_state=initial_state)
    return states.to(out_dtype)
