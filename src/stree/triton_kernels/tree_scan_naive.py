"""Naive reference of tree_scan / tree_states: a plain per-node loop in float64, exactly as the recurrence is written.

Per head h, with the group g = h // (nheads // ngroups) and node i's parent p (p = -1: the initial state):

    dt_i = clamp(softplus(dt_i + dt_bias), *dt_limit)           (bias, softplus and clamp each optional)
    h_i = exp(dt_i·A_h)·h_p + dt_i·x_i ⊗ B_i[g]                 (h_i (headdim, dstate))
    y_i = h_i·C_i[g] + D·x_i

Slow (a Python loop over rows, nodes and nothing vectorised across them) and independent of the kernels: the
tests compare both backends against it.
"""
import torch
import torch.nn.functional as F


def scan_loop(x, dt, A, B, C, parents, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None):
    """Mamba2's SSD recurrence over a tree, node by node.

    x (batch, T, nheads, headdim); dt (batch, T, nheads) raw; A (nheads,); B, C (batch, T, ngroups, dstate);
    parents: per batch row a sequence of T ints (parents[b][i] < i, -1 = child of the initial state);
    D (nheads,) or (nheads, headdim) or None; dt_bias (nheads,) or None; initial_states (batch, nheads, headdim,
    dstate) or None (zeros). Returns (y (batch, T, nheads, headdim), states (batch, T, nheads, headdim, dstate)),
    both float64: states[b, i] is the state after path(i).
    """
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    group = torch.arange(nheads) // (nheads // ngroups)
    y = torch.zeros(batch, T, nheads, headdim, dtype=torch.float64)
    states = torch.zeros(batch, T, nheads, headdim, dstate, dtype=torch.float64)
    for b in range(batch):
        h_init = (initial_states[b].double() if initial_states is not None
                  else torch.zeros(nheads, headdim, dstate, dtype=torch.float64))
        for i in range(T):
            p = int(parents[b][i])
            h_prev = h_init if p < 0 else states[b, p]
            decay = torch.exp(dt[b, i] * A)[:, None, None]
            h = decay * h_prev + dt[b, i][:, None, None] * x[b, i][:, :, None] * B[b, i, group][:, None, :]
            states[b, i] = h
            y[b, i] = (h * C[b, i, group][:, None, :]).sum(-1)
            if D is not None:
                Dd = D.double()
                y[b, i] += x[b, i] * (Dd[:, None] if Dd.dim() == 1 else Dd)
    return y, states
