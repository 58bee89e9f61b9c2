"""Naive per-node sequential loops: the independent references the kernels are tested against.

Every function walks the tree node by node in float64, exactly as the recurrence is written in docs/design.md §2.
"""
import torch
import torch.nn.functional as F

from stree import random_parents

BACKENDS = ["torch", "triton"]
KINDS = ["chain", "star", "random", "deep"]


def random_rows(kind, T, batch, seed):
    """`batch` random parent lists of one kind (see stree.random_parents), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [random_parents(T, g, kind=kind) for _ in range(batch)]


def path_to(parents, i):
    """Node ids from the root down to i."""
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents[i])
    return path[::-1]


def scan_loop(x, dt, A, B, C, parents, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None):
    """Returns (y (batch, T, nheads, headdim), states (batch, T, nheads, headdim, dstate)), both float64."""
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


def conv_windows_loop(x, parents, conv_state, length, nodes):
    """Each requested node's window of the last `length` inputs along its path: (batch, len(nodes), length, dim).

    The sequence seen by node i is conv_state's columns (oldest first) followed by x along path(i).
    nodes: per batch row, a list of node ids (-1 = the state alone).
    """
    out = []
    for b in range(x.shape[0]):
        rows = []
        for i in nodes[b]:
            seq = [conv_state[b, :, c].double() for c in range(conv_state.shape[2])]
            seq += [x[b, k].double() for k in (path_to(parents[b], i) if i >= 0 else [])]
            rows.append(torch.stack(seq[-length:]))
        out.append(torch.stack(rows))
    return torch.stack(out)


def conv_loop(x, weight, bias, parents, conv_state, silu=True):
    """(batch, T, dim) float64: sum over the width of weight * window, plus bias, then silu."""
    T, width = x.shape[1], weight.shape[1]
    windows = conv_windows_loop(x, parents, conv_state, width, [list(range(T))] * x.shape[0])
    out = (windows * weight.double().T[None, None]).sum(2)
    if bias is not None:
        out = out + bias.double()
    return F.silu(out) if silu else out


def selective_scan_loop(x, dt, A, B, C, parents, D=None, z=None, dt_bias=None, dt_softplus=False,
                        initial_states=None):
    """Mamba1 over a tree, node by node in float64. x, dt, z (batch, T, dim); A (dim, N); B, C (batch, T, N).
    Returns (y (batch, T, dim), states (batch, T, dim, N))."""
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


def gated_delta_loop(q, k, v, g, beta, parents, initial_state=None, scale=None, use_qk_l2norm=False):
    """Gated DeltaNet over a tree, node by node in float64. q, k (batch, T, Hk, Dk); v (batch, T, Hv, Dv); g, beta
    (batch, T, Hv); value head h reads key head h // (Hv // Hk). Returns (o (batch, T, Hv, Dv), states
    (batch, T, Hv, Dk, Dv))."""
    batch, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
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


def plain_vote(answers, weights):
    """Weighted majority by hand: the answer with the largest summed weight (None abstains; a tie goes to the answer
    seen first)."""
    best, totals = None, {}
    for answer, weight in zip(answers, weights):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + weight
    for answer in totals:
        if best is None or totals[answer] > totals[best]:
            best = answer
    return best
