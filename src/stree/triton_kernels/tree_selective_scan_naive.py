"""Naive reference of the Mamba1 selective scan over a tree: a plain per-node loop in float64.

Per channel d, with node i's parent p (p = -1: the initial state):

    dt_i = softplus(dt_i + dt_bias)                                 (bias and softplus optional)
    h_i = exp(dt_i ⊙ A) ⊙ h_p + (dt_i ⊙ x_i) ⊗ B_i                  (h_i, A (dim, N))
    y_i = (h_i · C_i + D ⊙ x_i) ⊙ silu(z_i)                         (D and z optional)
"""
import torch
import torch.nn.functional as F


def selective_scan_loop(x, dt, A, B, C, parents, D=None, z=None, dt_bias=None, dt_softplus=False,
                        initial_states=None):
    """Mamba1 over a tree, node by node. x, dt, z (batch, T, dim); A (dim, N); B, C (batch, T, N); parents: per batch
    row a sequence of T ints (parents[b][i] < i, -1 = child of the initial state); D, dt_bias (dim,) or None;
    initial_states (batch, dim, N) or None (zeros). Returns (y (batch, T, dim), states (batch, T, dim, N)), float64:
    states[b, i] is the state after path(i)."""
    batch, T, dim = x.shape
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    y = torch.zeros(batch, T, dim, dtype=torch.float64)
    states = torch.zeros(batch, T, dim, A.shape[1], dtype=torch.float64)
    for b in range(batch):
        h_init = initial_states[b].double() if initial_states is not None else torch.zeros_like(A)
        for i in range(T):
            p = int(parents[b][i])
            h = torch.exp(dt[b, i][:, None] * A) * (h_init if p < 0 else states[b, p])
            h = h + (dt[b, i] * x[b, i])[:, None] * B[b, i][None, :]
            states[b, i] = h
            y[b, i] = h @ C[b, i]
            if D is not None:
                y[b, i] += D.double() * x[b, i]
            if z is not None:
                y[b, i] *= F.silu(z[b, i].double())
    return y, states
