"""Kimi Delta Attention (Kimi Linear's KDA) over a token tree, with the modules' own weights, and its commit.

KDA is the gated delta rule with a decay per key channel instead of per head: S' = diag(exp(g_i))·S_parent(i),
g_i (Dk,) from the layer's forget gate. HF's layer: q/k/v projections, a depthwise conv with silu on them, the forget
gate, beta = sigmoid(b_proj), the rule in fp32 on l2-normalised q, k (q scaled by Dk^-0.5), the sigmoid-gated RMS
norm with g_b_proj(g_a_proj(x)), o_proj. The forget gate and the norm run as the modules they are.

The tree form is gated_delta's UT form with per-channel decays (G_i the sum of g along path(i), per channel):

    S_i = diag(exp(G_i))·S0 + sum_{j on path(i)} (exp(G_i - G_j) ⊙ k_j) ⊗ u_j
    u_i = beta_i·(v_i - S0ᵀ(exp(G_i) ⊙ k_i)) - beta_i·sum_{j on path(i), j != i} ((exp(G_i - G_j) ⊙ k_j)·k_i)·u_j
    o_i = S0ᵀ(exp(G_i) ⊙ q_i) + sum_{j on path(i)} ((exp(G_i - G_j) ⊙ k_j)·q_i)·u_j

so a pass keeps k, g (Dk per head) and u per node, solves only its new rows and reads S0 once; the decays are
exact segment sums (PathSums over heads x channels), the couplings a (R x T x Dk) reduction per head.
"""
import torch

from .gated_delta import PathSums
from .slots import SlotLayers, check_silu_conv, commit_conv, conv_rows
from ..triton_kernels.utils import as_dtype, compute_dtype

MIXER_ATTRIBUTES = ("forget_gate", "q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "conv1d",
                    "o_norm", "o_proj", "num_heads", "head_dim", "layer_idx")
L2NORM_EPS = 1e-6


def l2norm(x):
    """HF's KDA l2norm: x / sqrt(sum(x^2) + eps) (the gated delta rule's multiplies by rsqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


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


class KimiDeltaLayers(SlotLayers):
    """The KDA mixers of one StateGroup (mixers[j] owns slice j of group.conv / group.recurrent); a mixer kind
    (tree_model.MIXER_KINDS, contract in mamba2.Mamba2Layers).

    Buffers over the node slots, per layer j:
        qkv[j]  (batch, capacity, 3 * H * D)  pre-conv q|k|v, model dtype
        k[j], g[j]  (batch, capacity, H, Dk)  normalised keys, log decays   } compute dtype
        u[j]    (batch, capacity, H, Dv)      delta-rule writes             }
    """

    @staticmethod
    def matches(module):
        return all(hasattr(module, name) for name in MIXER_ATTRIBUTES)

    @staticmethod
    def check(module):
        check_silu_conv(module, "KDA")

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        m = mixers[0]
        self.H, self.D = m.num_heads, m.head_dim
        self.cd = compute_dtype(group.conv)
        shape = (self.H, self.D)
        self._slot_specs(len(mixers), group.conv.shape[0], group.conv.device, qkv=((m.conv_dim,), group.conv.dtype),
                         k=(shape, self.cd), g=(shape, self.cd), u=(shape, self.cd))

    def forward(self, j, hidden_states, tree_pass, conv_state, recurrent_state):
        """Layer j over the pass's new nodes. hidden_states (batch, R, hidden) of nodes tree_pass.rows (R,);
        conv_state (batch, 3 * H * D, K) / recurrent_state (batch, H, D, D): the layer's committed states (read
        only). Returns (batch, R, hidden)."""
        m, cd = self.mixers[j], self.cd
        batch, R, _ = hidden_states.shape
        qkv = torch.cat([m.q_proj(hidden_states), m.k_proj(hidden_states), m.v_proj(hidden_states)], dim=-1)
        qkv = conv_rows(self.qkv[j], qkv, m.conv1d, m.activation, tree_pass, conv_state)
        q, k, v = (as_dtype(t.reshape(batch, R, self.H, self.D), cd) for t in qkv.chunk(3, dim=-1))
        q, k = l2norm(q), l2norm(k)
        paths = tree_pass.shared.get("path_sums")
        if paths is None:  # the same for every layer of the pass (and gated_delta's layers)
            paths = tree_pass.shared["path_sums"] = PathSums(tree_pass.index.mask.index_select(1, tree_pass.rows),
                                                             tree_pass.index.mask, cd)
        out = kda_rows(q * self.D ** -0.5, k, v, as_dtype(m.forget_gate(hidden_states), cd),
                       as_dtype(m.b_proj(hidden_states).sigmoid(), cd), as_dtype(recurrent_state, cd), paths,
                       tree_pass.rows, self.k[j], self.g[j], self.u[j])
        gate = m.g_b_proj(m.g_a_proj(hidden_states)).view(batch, R, self.H, self.D)
        return m.o_proj(m.o_norm(as_dtype(out, hidden_states.dtype), gate).reshape(batch, R, -1))

    def commit(self, index, nodes):
        """Overwrite every layer's conv and recurrent states, in place, with those after path(nodes[b])."""
        n, recurrent = len(self.mixers), self.group.recurrent
        batch = recurrent.shape[0]
        state = recurrent.view(batch, n, self.H, self.D, self.D).transpose(0, 1)
        states = kda_states(state, index, nodes, self.k, self.g, self.u)
        recurrent.copy_(states.transpose(0, 1).reshape(recurrent.shape))
        commit_conv(self.group, self.qkv, index, nodes)
