"""PyTorch reference of the Mamba1 tree selective scan: the exact level-by-level recurrence (also the CPU path).

Every node of one depth is updated at once from its parent's state (utils.walk_levels), in the order of HF's
single-token update (``mamba_selective_state_update``): h = h_parent * exp(dt*A) + (dt*B) * x, y = h @ C.
Inputs are already validated, and dt already processed, by tree_selective_scan.py.
"""
import torch
import torch.nn.functional as F

from .utils import gather_rows, states_or_zeros, walk_levels


def _update(h, dt, x, B, A):
    """h (n, dim, N) parents' states, updated in place: h * exp(dt*A) + (dt*B) * x. dt, x (n, dim); B (n, N)."""
    return h.mul_((dt[..., None] * A).exp_()).add_((dt[..., None] * B[:, None, :]).mul_(x[..., None]))


def tree_selective_scan(x, dt, A, B, C, index, *, D=None, z=None, initial_states=None, rows=None):
    """See tree_selective_scan.tree_selective_scan (index: a utils.TreeIndex; dt processed, in the compute dtype;
    rows None or (batch, R)). Returns y (batch, T or R, dim) in x.dtype."""
    cd = dt.dtype
    batch, T, dim = x.shape
    levels = index.levels()
    xs, dts, Bs, Cs = (levels.gather(t, cd) for t in (x, dt, B, C))
    A = A.to(cd)
    ys = torch.empty(len(levels.order), dim, dtype=cd, device=x.device)

    def step(start, end, h):
        h = _update(h, dts[start:end], xs[start:end], Bs[start:end], A)
        ys[start:end] = torch.matmul(h, Cs[start:end, :, None])[..., 0]
        return h

    walk_levels(levels, states_or_zeros(initial_states, (batch, dim, A.shape[1]), cd, x.device), step)
    y = levels.scatter(ys, batch, T)
    if D is not None:
        y = y + x.to(cd) * D.to(cd)
    if z is not None:
        y = y * F.silu(z.to(cd))
    return gather_rows(y, rows).to(x.dtype)


def tree_selective_states(x, dt, A, B, index, nodes, *, initial_states=None):
    """See tree_selective_scan.tree_selective_states: the walk of path(nodes[b]) alone. Returns (batch, dim, N) in
    the compute dtype (dt's)."""
    cd = dt.dtype
    batch, _, dim = x.shape
    levels = index.levels(nodes)
    xs, dts, Bs = (levels.gather(t, cd) for t in (x, dt, B))
    A = A.to(cd)
    h0 = states_or_zeros(initial_states, (batch, dim, A.shape[1]), cd, x.device)
    return walk_levels(levels, h0, lambda start, end, h: _update(h, dts[start:end], xs[start:end], Bs[start:end], A),
                       last=h0.clone())
