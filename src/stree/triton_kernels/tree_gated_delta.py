"""Gated DeltaNet over a token tree (Qwen3-Next, Qwen3.5, OLMo-Hybrid): public entry points, checks, dispatch.

Per value head, state S (Dk, Dv); per node i with q_i, k_i (Dk), v_i (Dv), log decay g_i and beta_i (scalars):

    S' = exp(g_i) · S_parent(i)
    S_i = S' + k_i ⊗ u_i,   u_i = beta_i · (v_i − S'ᵀ k_i)
    o_i = S_iᵀ q_i                               (q_i already scaled: scale, default Dk^-0.5)

Unrolled from the committed state S0 (docs/design.md §2), with G_i the sum of g over path(i) (i included):

    S_i = exp(G_i)·S0 + sum_{j on path(i)} exp(G_i - G_j) · k_j ⊗ u_j
    u_i = beta_i·(v_i - exp(G_i)·S0ᵀk_i) - beta_i·sum_{j on path(i), j != i} exp(G_i - G_j)·(k_i·k_j)·u_j
    o_i = exp(G_i)·S0ᵀq_i + sum_{j on path(i)} exp(G_i - G_j)·(q_i·k_j)·u_j

The u are a unit lower-triangular system whose coupling is the ancestor mask (the chunked "UT" form of the delta
rule with the causal mask replaced by the tree's), so nothing walks the tree level by level and no per-node state
exists: a pass keeps k, g and u of every node in per-slot buffers and solves only its new rows, the older nodes
entering as their ancestors. G_i - G_j is an exact segment sum (g summed over the slots of path(i) below j, never a
difference of prefix sums). Grouped value heads (Hv > Hk, as Qwen3-Next): value head h reads key head
h // (Hv // Hk), HF's repeat_interleave. Everything accumulates in fp32 (fp64 for fp64 inputs; HF computes this rule
in fp32 even for fp64 models).

Two forms:
  engine form  tree_gated_delta_rows (a pass's new rows over the kept buffers) and tree_gated_delta_commit (the
               states after accepted nodes, for a stack of layers): what stree's GatedDeltaLayers runs.
  node form    tree_gated_delta_rule / tree_gated_delta_states: every node of a tree from an initial state, the
               engine form over fresh buffers of T slots. Memory per batch row: T x (Hk·Dk + Hv + Hv·Dv) values in
               the compute dtype, and on the torch backend a T x T x T segment tensor (utils.PathSums).

tree_kda.py (Kimi Delta Attention) shares the dispatch below with a decay per key channel (per_channel=True).
"""
import torch

from .norms import L2NORM_EPS, l2norm_divide, l2norm_rsqrt  # noqa: F401 (L2NORM_EPS: the eps of both forms)
from .tree_gated_delta_torch import delta_rule_rows, delta_rule_states
from .tree_kda_torch import kda_rows, kda_states
from .utils import (as_dtype, check_float, check_inputs, check_nodes, check_pass_rows, check_rows, check_shape,
                    compute_dtype, gather_rows, resolve_backend, tree_index)

l2norm = l2norm_rsqrt  # Gated DeltaNet's form (see norms.py)


def _check_node_inputs(k, v, g, beta, parents, q=None, initial_state=None, scale=None, per_channel=False):
    """The node form's inputs: k (batch, T, Hk, Dk), the rest to match. Returns the TreeIndex."""
    check_shape("k", k, (None, None, None, None))
    check_float("k", k)
    batch, T, Hk, Dk = k.shape
    check_shape("v", v, (batch, T, None, None))
    Hv, Dv = v.shape[2:]
    _check_heads(Hk, Hv, per_channel)
    channel = (Dk,) if per_channel else ()
    check_inputs((("q", q, (batch, T, Hk, Dk)), ("v", v, (batch, T, Hv, Dv)), ("g", g, (batch, T, Hv, *channel)),
                  ("beta", beta, (batch, T, Hv)), ("initial_state", initial_state, (batch, Hv, Dk, Dv))), k.device, "k")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number or None, got {type(scale).__name__}")
    return tree_index(parents, batch, T, k.device)


def _check_heads(Hk, Hv, per_channel):
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"the key heads ({Hk}) must divide the value heads ({Hv})")
    if per_channel and Hk != Hv:
        raise ValueError(f"KDA takes as many key as value heads (Kimi Linear), got {Hk} and {Hv}")


def _check_engine_tensors(device, dtype, **tensors):
    """Each name=(tensor, shape): the shape, a float dtype equal to `dtype` (state: any float) and `device`."""
    check_inputs([(name, t, shape) for name, (t, shape) in tensors.items()], device, "keys")
    for name, (t, _) in tensors.items():
        if name != "state" and t.dtype != dtype:
            raise ValueError(f"{name} is {t.dtype} but keys is {dtype}: the engine form takes every input in the "
                             "buffers' (compute) dtype")


def check_rows_inputs(q, k, v, g, beta, state, parents, rows, keys, gates, updates, per_channel):
    """Validate an engine-form pass (see tree_gated_delta_rows). Returns (TreeIndex, rows (R,) int64)."""
    check_shape("keys", keys, (None, None, None, None))
    batch, T, Hk, Dk = keys.shape
    check_shape("updates", updates, (batch, T, None, None))
    Hv, Dv = updates.shape[2:]
    _check_heads(Hk, Hv, per_channel)
    index = tree_index(parents, batch, T, keys.device)
    rows = check_pass_rows(rows, index)
    R, channel = rows.shape[0], (Dk,) if per_channel else ()
    _check_engine_tensors(keys.device, keys.dtype, keys=(keys, (batch, T, Hk, Dk)), q=(q, (batch, R, Hk, Dk)),
                          k=(k, (batch, R, Hk, Dk)), v=(v, (batch, R, Hv, Dv)), g=(g, (batch, R, Hv, *channel)),
                          beta=(beta, (batch, R, Hv)), state=(state, (batch, Hv, Dk, Dv)),
                          gates=(gates, (batch, T, Hv, *channel)), updates=(updates, (batch, T, Hv, Dv)))
    return index, rows


def check_commit_inputs(state, parents, nodes, keys, gates, updates, per_channel):
    """Validate an engine-form commit (see tree_gated_delta_commit). Returns (TreeIndex, nodes (batch,) int64)."""
    check_shape("keys", keys, (None, None, None, None, None))
    n, batch, T, Hk, Dk = keys.shape
    check_shape("updates", updates, (n, batch, T, None, None))
    Hv, Dv = updates.shape[3:]
    _check_heads(Hk, Hv, per_channel)
    index = tree_index(parents, batch, T, keys.device)
    nodes = check_nodes(nodes, batch, T, keys.device)
    _check_engine_tensors(keys.device, keys.dtype, keys=(keys, (n, batch, T, Hk, Dk)),
                          gates=(gates, (n, batch, T, Hv, *((Dk,) if per_channel else ()))),
                          updates=(updates, (n, batch, T, Hv, Dv)), state=(state, (n, batch, Hv, Dk, Dv)))
    return index, nodes


def _kernels(per_channel):
    """The Triton (rows kernel, commit kernel) of the family."""
    if per_channel:
        from . import tree_kda_triton as module
        return module._kda_rows_kernel, module._kda_commit_kernel
    from . import tree_gated_delta_triton as module
    return module._gated_delta_rows_kernel, module._gated_delta_commit_kernel


def dispatch_rows(q, k, v, g, beta, state, parents, rows, keys, gates, updates, backend, validate, per_channel):
    """tree_gated_delta_rows (per_channel=False) or tree_kda.tree_kda_rows (True): check, then run a backend."""
    if validate:
        index, rows = check_rows_inputs(q, k, v, g, beta, state, parents, rows, keys, gates, updates, per_channel)
    else:
        index = parents
    if resolve_backend(backend, keys) == "triton":
        from .tree_gated_delta_triton import delta_rows
        return delta_rows(_kernels(per_channel)[0], q, k, v, g, beta, state, index, rows, keys, gates, updates,
                          per_channel)
    if rows.shape[0] == 0:
        return v.new_empty(v.shape)
    paths = index.queries(rows).path_sums(keys.dtype)
    rule = kda_rows if per_channel else delta_rule_rows
    return rule(q, k, v, g, beta, as_dtype(state, keys.dtype), paths, rows, keys, gates, updates)


def dispatch_commit(state, parents, nodes, keys, gates, updates, backend, validate, per_channel):
    """tree_gated_delta_commit (per_channel=False) or tree_kda.tree_kda_commit (True): check, then run a backend."""
    if validate:
        index, nodes = check_commit_inputs(state, parents, nodes, keys, gates, updates, per_channel)
    else:
        index = parents
    if resolve_backend(backend, keys) == "triton":
        from .tree_gated_delta_triton import delta_commit
        return delta_commit(_kernels(per_channel)[1], state, index, nodes, keys, gates, updates, per_channel)
    if keys.shape[2] == 0:  # no slot: every node is -1
        return state.to(keys.dtype, copy=True)
    return (kda_states if per_channel else delta_rule_states)(state, index, nodes, keys, gates, updates)


def prepare_qk(q, k, scale, use_qk_l2norm, dtype, norm=l2norm_rsqrt):
    """q, k in `dtype`, l2-normalised with `norm` if asked, q times scale: HF's order (normalise, then q / sqrt(Dk)
    when scale is None). Either may be None."""
    q, k = (None if t is None else t.to(dtype) for t in (q, k))
    if use_qk_l2norm:
        q, k = (None if t is None else norm(t) for t in (q, k))
    if q is not None:
        q = q / q.shape[-1] ** 0.5 if scale is None else q * scale
    return q, k


def node_form(q, k, v, g, beta, index, initial_state, scale, use_qk_l2norm, backend, per_channel):
    """The engine form over every node of a tree, from fresh buffers of T slots: (o (batch, T, Hv, Dv), (keys,
    gates, updates), S0), all in the compute dtype of k. q None: no outputs are needed (k stands in for q)."""
    cd = compute_dtype(k)
    qs, ks = prepare_qk(q, k, scale, use_qk_l2norm, cd, l2norm_divide if per_channel else l2norm_rsqrt)
    batch, T, _, Dk = k.shape
    Hv, Dv = v.shape[2:]
    keys, gates, updates = (torch.zeros(batch, T, *shape, dtype=cd, device=k.device)
                            for shape in ((k.shape[2], Dk), g.shape[2:], (Hv, Dv)))
    S0 = (torch.zeros(batch, Hv, Dk, Dv, dtype=cd, device=k.device) if initial_state is None
          else as_dtype(initial_state, cd))
    o = dispatch_rows(ks if qs is None else qs, ks, as_dtype(v, cd), as_dtype(g, cd), as_dtype(beta, cd), S0, index,
                      torch.arange(T, device=k.device), keys, gates, updates, backend, False, per_channel)
    return o, (keys, gates, updates), S0


def rule(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm, rows, backend, validate, per_channel):
    """tree_gated_delta_rule (per_channel=False) or tree_kda.tree_kda_rule (True)."""
    if validate:
        index = _check_node_inputs(k, v, g, beta, parents, q=q, initial_state=initial_state, scale=scale,
                                   per_channel=per_channel)
        rows = check_rows(rows, k.shape[0], k.shape[1], k.device)
    else:
        index = parents
    backend = resolve_backend(backend, q)
    o = node_form(q, k, v, g, beta, index, initial_state, scale, use_qk_l2norm, backend, per_channel)[0]
    rows = None if rows is None else rows.long().expand(k.shape[0], -1)  # (R,): the same nodes of every tree
    return gather_rows(o, rows).to(q.dtype)


def states(k, v, g, beta, parents, nodes, initial_state, use_qk_l2norm, backend, validate, per_channel):
    """tree_gated_delta_states (per_channel=False) or tree_kda.tree_kda_states (True)."""
    if validate:
        index = _check_node_inputs(k, v, g, beta, parents, initial_state=initial_state, per_channel=per_channel)
        nodes = check_nodes(nodes, k.shape[0], k.shape[1], k.device)
    else:
        index = parents
    backend = resolve_backend(backend, k)
    _, buffers, S0 = node_form(None, k, v, g, beta, index, initial_state, None, use_qk_l2norm, backend, per_channel)
    out = dispatch_commit(S0[None], index, nodes, *(t[None] for t in buffers), backend, False, per_channel)[0]
    return out.to(initial_state.dtype if initial_state is not None else compute_dtype(k))


def tree_gated_delta_rows(q, k, v, g, beta, state, parents, rows, keys, gates, updates, *, backend="auto",
                          validate=True):
    """The gated delta rule for a pass's new nodes `rows` on top of the committed `state` (engine form).

    Args (one compute dtype for all but state; fp32 for fp16 / bf16 / fp32 models, as HF):
        q, k: (batch, R, Hk, Dk) the rows' queries and keys, l2-normalised (l2norm), q scaled (Dk^-0.5).
        v: (batch, R, Hv, Dv); g: (batch, R, Hv) log decays; beta: (batch, R, Hv); Hk divides Hv.
        state: (batch, Hv, Dk, Dv) the committed state (read only; any float dtype).
        parents: a utils.TreeIndex over the T slots (or (batch, T) parents); slots past the tree are nobody's
            ancestor.
        rows: (R,) the new nodes' slot ids, distinct and in pass order (every ancestor among them first).
        keys (batch, T, Hk, Dk), gates (batch, T, Hv), updates (batch, T, Hv, Dv): every slot's kept k, g and the
            delta write u, contiguous; the earlier passes' nodes hold theirs, and the rows' are written here.
        backend: "auto" (Triton for CUDA tensors of fp16 / bf16 / fp32, PyTorch otherwise), "triton" or "torch".
        validate: False skips every check (no host sync, nothing that breaks torch.compile).
    Returns:
        o: (batch, R, Hv, Dv) in the buffers' dtype.
    """
    return dispatch_rows(q, k, v, g, beta, state, parents, rows, keys, gates, updates, backend, validate, False)


def tree_gated_delta_commit(state, parents, nodes, keys, gates, updates, *, backend="auto", validate=True):
    """States after path(nodes[b]) for a stack of n layers (engine form): exp(G_a)·S0 + sum_j exp(G_a - G_j)·k_j ⊗
    u_j over the kept buffers.

    Args:
        state: (n, batch, Hv, Dk, Dv) the committed states (any float dtype, any strides over n and batch).
        parents: the TreeIndex over the T slots (or (batch, T) parents).
        nodes: (batch,) the accepted slot of each row, -1 = nothing accepted (the state comes back).
        keys, gates, updates: (n, batch, T, Hk, Dk), (n, batch, T, Hv) and (n, batch, T, Hv, Dv), as
            tree_gated_delta_rows left them.
        backend, validate: as in tree_gated_delta_rows.

    Returns:
        states: (n, batch, Hv, Dk, Dv) in the buffers' dtype.
    """
    return dispatch_commit(state, parents, nodes, keys, gates, updates, backend, validate, False)


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
            (HF's use_qk_l2norm_in_kernel, True in every HF model; norms.l2norm_rsqrt).
        rows: None (every node) or (R,) / (batch, R) node ids whose outputs to return.
        backend: "auto" (Triton on CUDA, PyTorch otherwise), "triton" or "torch".
        validate: False skips every input check, for callers passing a TreeIndex they built.

    Returns:
        o: (batch, T, Hv, Dv), or (batch, R, Hv, Dv) with rows, in q's dtype (accumulated in fp32, or fp64 for
        fp64 inputs). Computed as tree_gated_delta_rows over every node (see the module docstring for memory).
    """
    return rule(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm, rows, backend, validate, False)


def tree_gated_delta_states(k, v, g, beta, parents, nodes, *, initial_state=None, use_qk_l2norm=False,
                            backend="auto", validate=True):
    """Gated delta state after consuming path(nodes[b]) from the initial state: the commit of an accepted node.

    Args: as tree_gated_delta_rule (no q, scale or rows), plus
        nodes: (batch,) integer accepted node per row, -1 = nothing accepted (the initial state comes back).
    Returns:
        states: (batch, Hv, Dk, Dv) in initial_state's dtype, or the compute dtype (fp32; fp64 for fp64 inputs)
        when initial_state is None. Computed as the engine form's rows over every node, then its commit.
    """
    return states(k, v, g, beta, parents, nodes, initial_state, use_qk_l2norm, backend, validate, False)
