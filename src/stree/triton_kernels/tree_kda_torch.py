"""PyTorch path of tree KDA (the CPU path): gated_delta's UT form with per-channel decays, over kept per-slot buffers.

Inputs are already validated, and q / k normalised and scaled, by tree_kda.py. The decays are PathSums over heads
x channels; the couplings a (R x T x Dk) reduction per head.
"""
import torch

from .utils import PathSums


def channel_decays(paths, gates):
    """gates (..., batch, T, H, Dk) -> weights (..., batch, H, Dk, Q, T) and growth (..., batch, H, Dk, Q)."""
    H = gates.shape[-2]
    weights, growth = paths.decays(gates.flatten(-2))
    return weights.unflatten(-3, (H, -1)), growth.unflatten(-2, (H, -1))


def kda_rows(q, k, v, g, beta, state, paths, rows, keys, gates, updates):
    """KDA for a pass's new nodes `rows` (R,) on top of the committed `state`, exact on any tree.

    q, k (batch, R, H, Dk) normalised (q scaled); v (batch, R, H, Dv); g (batch, R, H, Dk); beta (batch, R, H);
    state (batch, H, Dk, Dv); all in one compute dtype. paths: the rows' PathSums over all T slots. keys, gates
    (batch, T, H, Dk), updates (batch, T, H, Dv): every slot's kept k, g and u; the rows' entries are written here.
    Returns o (batch, R, H, Dv).
    """
    keys.index_copy_(1, rows, k)
    gates.index_copy_(1, rows, g)
    updates.index_fill_(1, rows, 0.0)  # unknown yet: the sums below see only the rows' old ancestors
    weights, growth = channel_decays(paths, gates)                                    # (b, H, Dk, R, T), (.., R)
    qk = torch.stack([q, k], dim=2).permute(0, 3, 2, 1, 4)                           # (batch, H, 2, R, Dk)
    from_state = torch.matmul((qk * growth.transpose(-1, -2)[:, :, None]).flatten(2, 3), state)  # (b, H, 2R, Dv)
    from_state = from_state.unflatten(2, (2, -1))
    # scores[b, h, s, i, j] = sum_d qk_i[d] k_j[d] exp(G_i - G_j)[d]
    scores = torch.einsum("bhsid,bjhd,bhdij->bhsij", qk, keys, weights)
    beta_h = beta.transpose(1, 2)[..., None]                                          # (batch, H, R, 1)
    coupling = scores[:, :, 1] * beta_h
    rhs = beta_h * (v.transpose(1, 2) - from_state[:, :, 1]) - torch.matmul(coupling, updates.transpose(1, 2))
    new = torch.linalg.solve_triangular(coupling.index_select(3, rows), rhs, upper=False, unitriangular=True)
    updates.index_copy_(1, rows, new.transpose(1, 2))
    out = from_state[:, :, 0] + torch.matmul(scores[:, :, 0], updates.transpose(1, 2))
    return out.transpose(1, 2)


def kda_states(state, index, nodes, keys, gates, updates):
    """States after path(nodes[b]) for a stack of layers: diag(exp(G_a))·S0 + sum_j (exp(G_a - G_j) ⊙ k_j) ⊗ u_j.
    state (n, batch, H, Dk, Dv); keys, gates (n, batch, T, H, Dk), updates (n, batch, T, H, Dv); nodes (batch,),
    -1 = nothing accepted. Returns (n, batch, H, Dk, Dv) in the compute dtype."""
    batch = nodes.shape[0]
    on_path = index.mask[torch.arange(batch, device=nodes.device), nodes.clamp(min=0)] & (nodes >= 0)[:, None]
    weights, growth = channel_decays(PathSums(on_path[:, None], index.mask, gates.dtype), gates)
    weighted = keys.permute(0, 1, 3, 4, 2) * weights[..., 0, :]                      # (n, batch, H, Dk, T)
    return state.to(gates.dtype) * growth + torch.matmul(weighted, updates.transpose(2, 3))
