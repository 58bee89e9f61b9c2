"""PyTorch path of the tree gated delta rule (the CPU path): the UT form over kept per-slot buffers.

Inputs are already validated, and q / k normalised and scaled, by tree_gated_delta.py. See that module for the
math; here each pass solves its new rows with one R x R unit-triangular solve per head, the decays of every (row,
slot) pair coming from a PathSums (exact segment sums, a 0/1 matmul).
"""
import torch

from .utils import PathSums


def delta_rule_rows(q, k, v, g, beta, state, paths, rows, keys, gates, updates):
    """The gated delta rule for a pass's new nodes `rows` (R,) on top of the committed `state`, exact on any tree.

    q, k (batch, R, Hk, Dk) normalised (q scaled); v (batch, R, Hv, Dv); g, beta (batch, R, Hv); state (batch, Hv,
    Dk, Dv); all in one compute dtype. paths: the rows' PathSums over all T slots. keys (batch, T, Hk, Dk), gates
    (batch, T, Hv), updates (batch, T, Hv, Dv): every slot's kept k, g and u; the rows' entries are written here.
    Value head h reads key head h // (Hv // Hk) (HF's repeat_interleave), here by broadcasting (batch, Hk, G, ...).
    Returns o (batch, R, Hv, Dv).
    """
    batch, R, Hk, Dk = k.shape
    Hv = v.shape[2]
    keys.index_copy_(1, rows, k)
    gates.index_copy_(1, rows, g)
    updates.index_fill_(1, rows, 0.0)  # unknown yet: the sums below see only the rows' old ancestors
    weights, growth = paths.decays(gates)                                              # (batch, Hv, R, T), (.., R)
    weights = weights.unflatten(1, (Hk, -1))                                          # (batch, Hk, G, R, T)
    qk = torch.cat([q, k], dim=1).transpose(1, 2)                                     # (batch, Hk, 2R, Dk)
    # What the committed state gives each row, S0ᵀq and S0ᵀk: one read of the state.
    from_state = torch.matmul(qk[:, :, None], state.unflatten(1, (Hk, -1))).view(batch, Hv, 2, R, -1)
    from_state = from_state * growth[:, :, None, :, None]
    scores = torch.matmul(qk, keys.permute(0, 2, 3, 1))[:, :, None]                   # (batch, Hk, 1, 2R, T)
    beta_h = beta.transpose(1, 2)[..., None]                                          # (batch, Hv, R, 1)
    coupling = (scores[..., R:, :] * weights).flatten(1, 2) * beta_h                  # beta_i e^(G_i-G_j) k_i·k_j
    rhs = beta_h * (v.transpose(1, 2) - from_state[:, :, 1]) - torch.matmul(coupling, updates.transpose(1, 2))
    # The rows among themselves: strictly lower triangular in pass order (a parent precedes its children).
    new = torch.linalg.solve_triangular(coupling.index_select(3, rows), rhs, upper=False, unitriangular=True)
    updates.index_copy_(1, rows, new.transpose(1, 2))
    out = from_state[:, :, 0] + torch.matmul((scores[..., :R, :] * weights).flatten(1, 2), updates.transpose(1, 2))
    return out.transpose(1, 2)


def delta_rule_states(state, index, nodes, keys, gates, updates):
    """States after path(nodes[b]) for a stack of layers: exp(G_a)·S0 + sum_j exp(G_a - G_j) k_j ⊗ u_j.

    state (n, batch, Hv, Dk, Dv); keys (n, batch, T, Hk, Dk), gates (n, batch, T, Hv), updates (n, batch, T, Hv,
    Dv) as delta_rule_rows left them; index: the TreeIndex over the T slots; nodes (batch,), -1 = nothing accepted
    (the state comes back). Returns (n, batch, Hv, Dk, Dv) in the compute dtype."""
    n, batch, T, Hk, Dk = keys.shape
    on_path = index.mask[torch.arange(batch, device=nodes.device), nodes.clamp(min=0)] & (nodes >= 0)[:, None]
    weights, growth = PathSums(on_path[:, None], index.mask, gates.dtype).decays(gates)  # (n, batch, Hv, 1, T)
    weighted = keys.permute(0, 1, 3, 4, 2)[:, :, :, None] * weights.unflatten(2, (Hk, -1))  # (n, b, Hk, G, Dk, T)
    return state.to(gates.dtype) * growth[..., None] + torch.matmul(weighted.flatten(2, 3), updates.transpose(2, 3))
