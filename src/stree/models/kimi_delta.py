"""Kimi Delta Attention (Kimi Linear's KDA) over a token tree, with the modules' own weights, and its commit.

KDA is the gated delta rule with a decay per key channel instead of per head: S' = diag(exp(g_i))·S_parent(i),
g_i (Dk,) from the layer's forget gate. HF's layer: q/k/v projections, a depthwise conv with silu on them, the forget
gate, beta = sigmoid(b_proj), the rule in fp32 on l2-normalised q, k (q scaled by Dk^-0.5), the sigmoid-gated RMS
norm with g_b_proj(g_a_proj(x)), o_proj. The forget gate and the norm run as the modules they are.

The tree form is gated_delta's UT form with per-channel decays (G_i the sum of g along path(i), per channel):

    S_i = diag(exp(G_i))·S0 + sum_{j on path(i)} (exp(G_i - G_j) ⊙ k_j) ⊗ u_j
    u_i = beta_i·(v_i - S0ᵀ(exp(G_i) ⊙ k_i)) - beta_i·sum_{j on path(i), j != i} ((exp(G_i-G_j) ⊙ k_j)·k_i)·u_j
    o_i = S0ᵀ(exp(G_i) ⊙ q_i) + sum_{j on path(i)} ((exp(G_i - G_j) ⊙ k_j)·q_i)·u_j

so a pass keeps k, g (Dk per head) and u per node, solves only its new rows and reads S0 once; the decays are
exact segment sums. Both run as the package's ops, stree.triton_kernels.tree_kda_rows / tree_kda_commit (backend
"auto": the Triton kernels for CUDA tensors, PyTorch otherwise); q and k are normalised with HF's KDA l2norm
(norms.l2norm_divide, not Gated DeltaNet's rsqrt form).
"""
import torch

from .slots import SlotLayers, check_silu_conv, commit_conv, conv_rows
from ..triton_kernels import tree_kda_commit, tree_kda_rows
from ..triton_kernels.norms import L2NORM_EPS, l2norm_divide  # noqa: F401 (L2NORM_EPS: moved there)
from ..triton_kernels.tree_kda_torch import channel_decays, kda_rows, kda_states  # noqa: F401 (moved there)
from ..triton_kernels.utils import as_dtype, compute_dtype

l2norm = l2norm_divide  # HF's KDA l2norm (norms.py), kept importable here

MIXER_ATTRIBUTES = ("forget_gate", "q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "conv1d",
                    "o_norm", "o_proj", "num_heads", "head_dim", "layer_idx")
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
        q, k = l2norm_divide(q), l2norm_divide(k)
        out = tree_kda_rows(q * self.D ** -0.5, k, v, as_dtype(m.forget_gate(hidden_states), cd),
                            as_dtype(m.b_proj(hidden_states).sigmoid(), cd), recurrent_state, tree_pass.index,
                            tree_pass.rows, self.k[j], self.g[j], self.u[j], validate=False)
        gate = m.g_b_proj(m.g_a_proj(hidden_states)).view(batch, R, self.H, self.D)
        return m.o_proj(m.o_norm(as_dtype(out, hidden_states.dtype), gate).reshape(batch, R, -1))

    def commit(self, index, nodes):
        """Overwrite every layer's conv and recurrent states, in place, with those after path(nodes[b])."""
        n, recurrent = len(self.mixers), self.group.recurrent
        batch = recurrent.shape[0]
        state = recurrent.view(batch, n, self.H, self.D, self.D).transpose(0, 1)
        states = tree_kda_commit(state, index, nodes, self.k, self.g, self.u, validate=False)
        recurrent.copy_(states.transpose(0, 1).reshape(recurrent.shape))
        commit_conv(self.group, self.qkv, index, nodes)
