"""Kimi Delta Attention (KDA, Kimi Linear) over a token tree: public entry points.

KDA is the gated delta rule with one decay per key channel. Per head, state S (Dk, Dv); per node i with q_i, k_i,
g_i (Dk,), v_i (Dv,) and beta_i:

    S' = diag(exp(g_i)) · S_parent(i)
    S_i = S' + k_i ⊗ u_i,   u_i = beta_i · (v_i − S'ᵀ k_i)
    o_i = S_iᵀ q_i                               (q_i already scaled: scale, default Dk^-0.5)

Unrolled from the committed state S0, with G_i (Dk,) the sum of g over path(i) (i included):

    S_i = diag(exp(G_i))·S0 + sum_{j on path(i)} (exp(G_i - G_j) ⊙ k_j) ⊗ u_j
    u_i = beta_i·(v_i - S0ᵀ(exp(G_i) ⊙ k_i)) - beta_i·sum_{j on path(i), j != i} ((exp(G_i-G_j) ⊙ k_j)·k_i)·u_j
    o_i = S0ᵀ(exp(G_i) ⊙ q_i) + sum_{j on path(i)} ((exp(G_i - G_j) ⊙ k_j)·q_i)·u_j

so the ops, their two forms (engine: kda rows and commit over kept per-slot k, g, u; node: every node of a tree
from an initial state) and their memory are tree_gated_delta.py's, with g (and the kept gates) carrying a Dk axis.
q, k and v have the same heads (Kimi Linear's); the l2norm is KDA's own (norms.l2norm_divide). HF computes the rule
in fp32; here fp32 too (fp64 for fp64 inputs).
"""
from .tree_gated_delta import dispatch_commit, dispatch_rows, rule, states


def tree_kda_rows(q, k, v, g, beta, state, parents, rows, keys, gates, updates, *, backend="auto", validate=True):
    """KDA for a pass's new nodes `rows` on top of the committed `state` (engine form).

    Args (one compute dtype for all but state; fp32 for fp16 / bf16 / fp32 models, as HF):
        q, k: (batch, R, H, Dk) the rows' queries and keys, l2-normalised (norms.l2norm_divide), q scaled.
        v: (batch, R, H, Dv); g: (batch, R, H, Dk) per-channel log decays (HF's forget gate); beta: (batch, R, H).
        state: (batch, H, Dk, Dv) the committed state (read only; any float dtype).
        parents: a utils.TreeIndex over the T slots (or (batch, T) parents).
        rows: (R,) the new nodes' slot ids, distinct and in pass order (every ancestor among them first).
        keys, gates (batch, T, H, Dk), updates (batch, T, H, Dv): every slot's kept k, g and u, contiguous; the
            rows' entries are written here.
        backend: "auto" (Triton for CUDA tensors of fp16 / bf16 / fp32, PyTorch otherwise), "triton" or "torch".
        validate: False skips every check (no host sync, nothing that breaks torch.compile).
    Returns:
        o: (batch, R, H, Dv) in the buffers' dtype.
    """
    return dispatch_rows(q, k, v, g, beta, state, parents, rows, keys, gates, updates, backend, validate, True)


def tree_kda_commit(state, parents, nodes, keys, gates, updates, *, backend="auto", validate=True):
    """States after path(nodes[b]) for a stack of n layers (engine form): diag(exp(G_a))·S0 + sum_j (exp(G_a - G_j)
    ⊙ k_j) ⊗ u_j.

    Args:
        state: (n, batch, H, Dk, Dv) the committed states (any float dtype, any strides over n and batch).
        parents: the TreeIndex over the T slots (or (batch, T) parents).
        nodes: (batch,) the accepted slot of each row, -1 = nothing accepted (the state comes back).
        keys, gates, updates: (n, batch, T, H, Dk), (n, batch, T, H, Dk) and (n, batch, T, H, Dv), as
            tree_kda_rows left them.
        backend, validate: as in tree_kda_rows.

    Returns:
        states: (n, batch, H, Dk, Dv) in the buffers' dtype.
    """
    return dispatch_commit(state, parents, nodes, keys, gates, updates, backend, validate, True)


def tree_kda_rule(q, k, v, g, beta, parents, *, initial_state=None, scale=None, use_qk_l2norm=False, rows=None,
                  backend="auto", validate=True):
    """Outputs of a KDA layer over a token tree, every node as if its path had been fed in order.

    Args:
        q, k: (batch, T, H, Dk) queries and keys (HF: after the short conv, before the l2norm).
        v: (batch, T, H, Dv) values; g: (batch, T, H, Dk) per-channel log decays; beta: (batch, T, H).
        parents: (batch, T) integer, parents[b, i] < i, -1 = child of the initial state; or a utils.TreeIndex.
        initial_state: (batch, H, Dk, Dv) state before the tree, or None for zeros.
        scale: the query scale, None = Dk^-0.5 (HF's). use_qk_l2norm: l2-normalise q and k first (HF's
            use_qk_l2norm_in_kernel) with KDA's sqrt-divide form.
        rows: None (every node) or (R,) / (batch, R) node ids whose outputs to return.
        backend, validate: as tree_gated_delta.tree_gated_delta_rule.
    Returns:
        o: (batch, T or R, H, Dv) in q's dtype, computed as tree_kda_rows over every node.
    """
    return rule(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm, rows, backend, validate, True)


def tree_kda_states(k, v, g, beta, parents, nodes, *, initial_state=None, use_qk_l2norm=False, backend="auto",
                    validate=True):
    """KDA state after consuming path(nodes[b]) from the initial state: the commit of an accepted node.

    Args: as tree_kda_rule (no q, scale or rows), plus nodes: (batch,) accepted node per row, -1 = nothing accepted.
    Returns: (batch, H, Dk, Dv) in initial_state's dtype, or the compute dtype when it is None.
    """
    return states(k, v, g, beta, parents, nodes, initial_state, use_qk_l2norm, backend, validate, True)
