"""PyTorch reference of the tree gated delta rule: the exact level-by-level recurrence (also the CPU path).

Every node of one depth is updated at once from its parent's state (utils.walk_levels), in the order of HF's
single-token recurrence (``torch_recurrent_gated_delta_rule``): decay, read, delta write, then the output from
the updated state. Inputs are already validated, and q / k normalised and scaled, by tree_gated_delta.py.
"""
import torch

from .utils import gather_rows, states_or_zeros, walk_levels


def _inputs(q, k, v, g, beta, levels, dtype):
    """Each node's inputs in walk order, q (None: skipped) and k repeated to the value heads (value head h reads
    key head h // (Hv // Hk), as HF's repeat_interleave does), and g as the decay exp(g)."""
    groups = v.shape[2] // k.shape[2]
    q, k = (None if t is None else levels.gather(t, dtype).repeat_interleave(groups, dim=1) for t in (q, k))
    return q, k, levels.gather(v, dtype), levels.gather(g, dtype).exp(), levels.gather(beta, dtype)


def _update(S, k, v, decay, beta):
    """S (n, H, Dk, Dv) parents' states, updated in place: S *= decay; S += k ⊗ beta (v - Sᵀk).
    k (n, H, Dk); v (n, H, Dv); decay, beta (n, H)."""
    n, H, Dk, Dv = S.shape
    S.mul_(decay[..., None, None])
    delta = (v - torch.matmul(k[..., None, :], S)[..., 0, :]) * beta[..., None]
    # The rank-1 write as an in-place batched GEMM: no (n, H, Dk, Dv) temporary (the states are memory-bound).
    return S.view(n * H, Dk, Dv).baddbmm_(k.reshape(n * H, Dk, 1), delta.reshape(n * H, 1, Dv)).view(n, H, Dk, Dv)


def tree_gated_delta_rule(q, k, v, g, beta, index, *, initial_state=None, rows=None):
    """See tree_gated_delta.tree_gated_delta_rule (index: a utils.TreeIndex; q, k prepared, in the compute dtype;
    rows None or (batch, R)). Returns o (batch, T or R, Hv, Dv) in the compute dtype."""
    cd = q.dtype
    batch, T, Hv, Dv = v.shape
    levels = index.levels()
    qs, ks, vs, decays, betas = _inputs(q, k, v, g, beta, levels, cd)
    os = torch.empty_like(vs)

    def step(start, end, S):
        S = _update(S, ks[start:end], vs[start:end], decays[start:end], betas[start:end])
        os[start:end] = torch.matmul(qs[start:end, :, None, :], S)[..., 0, :]
        return S

    walk_levels(levels, states_or_zeros(initial_state, (batch, Hv, k.shape[3], Dv), cd, v.device), step)
    return gather_rows(levels.scatter(os, batch, T), rows)


def tree_gated_delta_states(k, v, g, beta, index, nodes, *, initial_state=None):
    """See tree_gated_delta.tree_gated_delta_states (k prepared): the walk of path(nodes[b]) alone. Returns
    (batch, Hv, Dk, Dv) in the compute dtype."""
    cd = k.dtype
    batch, _, Hv, Dv = v.shape
    levels = index.levels(nodes)
    _, ks, vs, decays, betas = _inputs(None, k, v, g, beta, levels, cd)
    S0 = states_or_zeros(initial_state, (batch, Hv, k.shape[3], Dv), cd, v.device)
    return walk_levels(levels, S0, lambda start, end, S: _update(S, ks[start:end], vs[start:end], decays[start:end],
                                                                 betas[start:end]), last=S0.clone())
