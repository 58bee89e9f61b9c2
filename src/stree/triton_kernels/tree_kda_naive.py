"""Naive reference of Kimi Delta Attention (KDA) over a tree: a plain per-node, per-head loop in float64.

KDA is the gated delta rule with one decay per key channel. Per head h, with node i's parent p (p = -1: the
initial state) and g_i (Dk,) its log decays:

    S' = diag(exp(g_i)) · S_p                                       (S (Dk, Dv))
    u_i = beta_i · (v_i - S'ᵀ k_i)
    S_i = S' + k_i ⊗ u_i
    o_i = S_iᵀ q_i                                                  (q_i scaled, by default by Dk^-0.5)

with q and k first l2-normalised when asked (HF's KDA form: x / sqrt(sum x^2 + 1e-6)).
"""
import torch


def kda_loop(q, k, v, g, beta, parents, initial_state=None, scale=None, use_qk_l2norm=False):
    """KDA over a tree, node by node. q, k (batch, T, H, Dk); v (batch, T, H, Dv); g (batch, T, H, Dk) per-channel
    log decays; beta (batch, T, H); parents: per batch row a sequence of T ints (-1 = child of the initial state);
    initial_state (batch, H, Dk, Dv) or None (zeros); scale None = Dk^-0.5. Returns (o (batch, T, H, Dv), states
    (batch, T, H, Dk, Dv)), float64: states[b, i] is the state after path(i)."""
    batch, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (Dk ** -0.5 if scale is None else scale)
    o = torch.zeros(batch, T, H, Dv, dtype=torch.float64)
    states = torch.zeros(batch, T, H, Dk, Dv, dtype=torch.float64)
    for b in range(batch):
        s_init = initial_state[b].double() if initial_state is not None else torch.zeros(H, Dk, Dv,
                                                                                         dtype=torch.float64)
        for i in range(T):
            p = int(parents[b][i])
            for h in range(H):
                S = torch.exp(g[b, i, h])[:, None] * (s_init[h] if p < 0 else states[b, p, h])
                u = beta[b, i, h] * (v[b, i, h] - S.T @ k[b, i, h])
                S = S + torch.outer(k[b, i, h], u)
                states[b, i, h] = S
                o[b, i, h] = S.T @ q[b, i, h]
    return o, states
