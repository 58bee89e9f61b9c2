"""Naive reference of the gated delta rule over a tree: a plain per-node, per-head loop in float64.

Per value head h (reading key head h // (Hv // Hk)), with node i's parent p (p = -1: the initial state):

    S' = exp(g_i) · S_p                                             (S (Dk, Dv))
    S_i = S' + k_i ⊗ (beta_i · (v_i - S'ᵀ k_i))
    o_i = S_iᵀ q_i                                                  (q_i scaled, by default by Dk^-0.5)

with q and k first l2-normalised when asked (HF's Gated DeltaNet form: x · rsqrt(sum x^2 + 1e-6)).
"""
import torch


def gated_delta_loop(q, k, v, g, beta, parents, initial_state=None, scale=None, use_qk_l2norm=False):
    """Gated DeltaNet over a tree, node by node. q, k (batch, T, Hk, Dk); v (batch, T, Hv, Dv); g, beta (batch, T,
    Hv); parents: per batch row a sequence of T ints (-1 = child of the initial state); initial_state (batch, Hv, Dk,
    Dv) or None (zeros); scale None = Dk^-0.5. Returns (o (batch, T, Hv, Dv), states (batch, T, Hv, Dk, Dv)),
    float64: states[b, i] is the state after path(i)."""
    batch, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (Dk ** -0.5 if scale is None else scale)
    head = torch.arange(Hv) // (Hv // Hk)
    o = torch.zeros(batch, T, Hv, Dv, dtype=torch.float64)
    states = torch.zeros(batch, T, Hv, Dk, Dv, dtype=torch.float64)
    for b in range(batch):
        s_init = (initial_state[b].double() if initial_state is not None
                  else torch.zeros(Hv, Dk, Dv, dtype=torch.float64))
        for i in range(T):
            p = int(parents[b][i])
            for h in range(Hv):
                kh, qh = k[b, i, head[h]], q[b, i, head[h]]
                S = torch.exp(g[b, i, h]) * (s_init[h] if p < 0 else states[b, p, h])
                S = S + torch.outer(kh, beta[b, i, h] * (v[b, i, h] - S.T @ kh))
                states[b, i, h] = S
                o[b, i, h] = S.T @ qh
    return o, states
