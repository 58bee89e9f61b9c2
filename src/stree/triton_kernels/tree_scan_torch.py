"""PyTorch reference of the tree scan: the masked quadratic form as batched tensor ops (no loop over nodes).

This is also the production path on CPU. Inputs are already validated by tree_scan.py.
"""
import torch

from .utils import as_dtype, compute_dtype, gather_node_rows, tree_decay


def tree_scan(x, dt, A, B, C, index, *, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None, rows=None):
    """See tree_scan.tree_scan (index: a utils.TreeIndex; rows: None, (R,) or (batch, R) int64). Returns y
    (batch, T or R, nheads, headdim) in x.dtype.

    Few, large operations (this is the CPU production path, where a small model's pass is bound by the number
    of operations): heads-major (batch, G, heads per group, R, T) weights and two batched matmuls; what depends
    only on the tree and the rows comes from index.queries(rows), shared by every layer of a pass.
    """
    cd = compute_dtype(x)
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    per_group = nheads // ngroups
    queries = index.queries(rows)
    dt, _, s = tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, cd)
    s_q, C_q = gather_node_rows(s, rows), as_dtype(gather_node_rows(C, rows), cd)
    R = s_q.shape[1]
    # Both contiguous: `weight` below takes their layout (with R = 1 that of s_h alone), and a heads-innermost one
    # sends matmul to a per-head copy path (4x slower at a draft's one-node pass).
    s_qh, s_h = s_q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()        # (batch, H, R / T)
    # weight[b, h, i, k] = exp(s_i - s_k)·dt_k·(C_i·B_k) for k on path(i), else 0. Off-path entries are zeroed
    # before exp (s_i - s_k may overflow there) and after it; exp(0) is much cheaper than exp(-inf) on CPU.
    weight = (s_qh[..., :, None] - s_h[..., None, :]).masked_fill_(queries.off_path, 0.0)
    weight = weight.exp_().mul_(queries.on_path).mul_(dt.transpose(1, 2)[:, :, None, :])  # (batch, H, R, T)
    C_g = C_q.transpose(1, 2)                                                           # (batch, G, R, N)
    scores = torch.matmul(C_g, as_dtype(B, cd).permute(0, 2, 3, 1))                     # (batch, G, R, T)
    weight = weight.view(batch, ngroups, per_group, R, T).mul_(scores[:, :, None])
    y = torch.matmul(weight.view(batch, nheads, R, T), as_dtype(x, cd).transpose(1, 2))  # (batch, H, R, P)
    if initial_states is not None:
        y = y.view(batch, ngroups, per_group, R, headdim).addcmul_(
            _from_state(initial_states, C_g, cd), s_qh.exp().view(batch, ngroups, per_group, R, 1)).view(
                batch, nheads, R, headdim)
    y = y.transpose(1, 2)                                                                # (batch, R, H, P)
    if D is not None:
        Df = as_dtype(D, cd)
        y = y.addcmul(as_dtype(gather_node_rows(x, rows), cd), Df[:, None] if Df.dim() == 1 else Df)
    return as_dtype(y, x.dtype)


def _from_state(initial_states, C_g, cd):
    """C·h0 for every query row: (batch, G, heads in group, R, headdim) from initial_states (batch, nheads,
    headdim, dstate) and C_g (batch, G, R, dstate).

    Eager, read straight from the state, row by row (h0 @ C^T): once the states are out of cache (a pass reads every
    layer's), C @ h0^T costs 3-4x as much on a CPU. A single query row of a single batch row would go through a
    matrix-vector product about as slow, so it takes a multiply-and-sum, whose state-sized product is one row's and
    stays in cache; a batch's one-row passes keep the product (16 rows of the 0.9B target: a one-node pass 202-230 ms
    with a multiply-and-sum, 187-211 with the product, in alternating runs). Compiled, one broadcast
    multiply-and-sum, which inductor fuses into a reduction with a row-major output (nothing materialised): a
    product's (heads * P, R) output made inductor tile the kernel that reads it along the 1-4 rows (a 61M draft's
    pass: 1.6 ms of that kernel against 0.3)."""
    batch, G, R, dstate = C_g.shape
    nheads, headdim = initial_states.shape[1:3]
    h0 = as_dtype(initial_states, cd).view(batch, G, nheads // G * headdim, dstate)  # (batch, G, heads * P, N)
    if batch * R == 1 or torch.compiler.is_compiling():
        from_h0 = (h0[:, :, None] * C_g[..., None, :]).sum(-1)                    # (batch, G, R, heads * P)
        return from_h0.view(batch, G, R, nheads // G, headdim).transpose(2, 3)
    from_h0 = torch.matmul(h0, C_g.transpose(2, 3))                              # (batch, G, heads * P, R)
    return from_h0.view(batch, G, nheads // G, headdim, R).transpose(3, 4)


def tree_states(x, dt, A, B, index, nodes, *, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), initial_states=None, out=None):
    """See tree_scan.tree_states. Returns states (batch, nheads, headdim, dstate) in the compute dtype, written into
    `out` when given (a contiguous tensor of the compute dtype; it may be initial_states itself)."""
    cd = compute_dtype(x)
    batch, T, nheads, headdim = x.shape
    if T == 0:  # nothing can be accepted: the initial state comes back
        if initial_states is not None:
            return initial_states.to(cd) if out is None else _into(out, initial_states)
        zeros = torch.zeros(batch, nheads, headdim, B.shape[-1], dtype=cd, device=x.device)
        return zeros if out is None else out.zero_()
    dt, mask, s = tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, cd)
    rows = torch.arange(batch, device=x.device)
    accepted = nodes >= 0
    node = nodes.clamp(min=0)
    on_path = mask[rows, node] & accepted[:, None]                                 # (batch, T)
    s_node = s[rows, node]                                                         # (batch, nheads)
    log_w = (s_node[:, None, :] - s).masked_fill(~on_path[..., None], float("-inf"))
    weight = torch.exp(log_w) * dt                                                 # (batch, T, nheads)
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        # Only the slots on some row's path (the rest weigh 0): a product over a 5-node path of a 33-slot tree costs
        # a seventh of one over every slot (a 61M draft's commit: 0.4 ms against 2.9). Not on an accelerator, where
        # the count would cost a host sync.
        on = on_path.any(0).nonzero()[:, 0]
        x, B, weight, T = x.index_select(1, on), B.index_select(1, on), weight.index_select(1, on), on.numel()
    # One GEMM per group: (heads_in_group * headdim, T) @ (T, dstate), nothing of size T x state materialised.
    ngroups, dstate = B.shape[2:]
    xw = (as_dtype(x, cd) * weight[..., None]).view(batch, T, ngroups, nheads // ngroups * headdim).permute(
        0, 2, 3, 1)                                                                           # (b, G, heads*P, T)
    Bt = as_dtype(B, cd).transpose(1, 2)                                                        # (b, G, T, N)
    if initial_states is None:
        states = torch.matmul(xw, Bt).view(batch, nheads, headdim, dstate)
        return states if out is None else out.copy_(states)
    carry = torch.where(accepted[:, None], torch.exp(s_node), torch.ones_like(s_node))
    if out is None:
        return torch.matmul(xw, Bt).view(batch, nheads, headdim, dstate).addcmul_(
            carry[..., None, None], as_dtype(initial_states, cd))
    # In place: a new state the size of the old one (tens of MB at batch > 1) costs its allocation and a copy.
    _into(out, initial_states).mul_(carry[..., None, None])
    out.view(batch * ngroups, -1, dstate).baddbmm_(xw.reshape(batch * ngroups, xw.shape[2], T),
                                                   Bt.reshape(batch * ngroups, T, dstate))
    return out


def _into(out, initial_states):
    """`out` holding initial_states (no copy when they are one tensor)."""
    return out if out is initial_states else out.copy_(initial_states)
