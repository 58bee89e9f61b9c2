"""Gated DeltaNet mixers over a token tree (Qwen3-Next, Qwen3.5 / Qwen3.5-MoE, OLMo-Hybrid), with the modules' own
weights, and the commit of their states.

The three families share the mixer: projections -> [q | k | v] (pre-conv), the gate z, b (beta) and a (decay);
a depthwise conv with silu on q, k and v; beta = sigmoid(b) (OLMo-Hybrid: times 2 with allow_neg_eigval);
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule on l2-normalised q, k (q scaled by Dk^-0.5); the
gated RMS norm with z; the output projection. They differ only in how the projections are laid out (Qwen3-Next's
fused, per-key-head interleaved in_proj_qkvz / in_proj_ba; Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a;
OLMo-Hybrid's q/k/v/a/b/g_proj) and in the names of the norm and output projection. dtypes follow HF's decode
step: the rule in fp32 (fp64 for fp64 models, where HF also uses fp32), the norm and projections in the model's.

The tree math (docs/design.md §2, Gated DeltaNet). With G_i the sum of g along path(i) (the node included) and the
committed state S0, every node's state is

    S_i = exp(G_i)·S0 + sum_{j on path(i)} exp(G_i - G_j) · k_j ⊗ u_j,
    u_i = beta_i · (v_i - exp(G_i)·S0ᵀk_i) - beta_i · sum_{j on path(i), j != i} exp(G_i - G_j)·(k_i·k_j) · u_j,
    o_i = S_iᵀ q_i = exp(G_i)·S0ᵀq_i + sum_{j on path(i)} exp(G_i - G_j)·(q_i·k_j) · u_j,

by induction on the depth (u_i is the delta rule's write beta_i (v_i - S'ᵀk_i) on the decayed parent state S').
The u are a unit lower-triangular system whose coupling is the ancestor mask: the chunked ("WY"/UT) form of the
delta rule with the causal mask replaced by the tree's. So a pass needs no level-by-level walk and no per-node
state: it keeps k, g and u of every node (a few vectors per node, not a Dk x Dv state per head), solves only its
new rows (one R x R triangular solve per head; their old ancestors enter the right-hand side), reads S0 once, and
has fixed shapes with no host synchronisation. Decays are sums of g over path(i) minus path(j) taken as exact
segment sums, not as differences of prefix sums. The commit is the same closed form for the accepted node. Both
run as the package's ops, stree.triton_kernels.tree_gated_delta_rows / tree_gated_delta_commit (backend "auto":
the Triton kernels for CUDA tensors, PyTorch otherwise). Memory per node and layer: k (Hk x Dk), u (Hv x Dv) and
g (Hv) in the compute dtype plus the pre-conv q|k|v in the model dtype.
"""
import torch
import torch.nn.functional as F

from .slots import SlotLayers, check_silu_conv, commit_conv, conv_rows
from ..triton_kernels import tree_gated_delta_commit, tree_gated_delta_rows
from ..triton_kernels.norms import l2norm_rsqrt
from ..triton_kernels.tree_gated_delta_torch import delta_rule_rows, delta_rule_states  # noqa: F401 (moved there)
from ..triton_kernels.utils import PathSums, as_dtype, compute_dtype  # noqa: F401 (PathSums moved there)

MIXER_ATTRIBUTES = ("A_log", "dt_bias", "conv1d", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                    "layer_idx")


def projections(mixer, hidden_states):
    """The three projection layouts -> (pre-conv q|k|v (batch, R, conv_dim), z (batch, R, Hv, Dv), beta (batch, R,
    Hv), a (batch, R, Hv)), as each family's HF forward computes them."""
    batch, R, _ = hidden_states.shape
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden_states),
                                                              mixer.in_proj_ba(hidden_states))
        qkv = torch.cat([t.reshape(batch, R, -1) for t in (q, k, v)], dim=-1)
        return qkv, z, b.sigmoid(), a
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5, Qwen3.5-MoE
        z = mixer.in_proj_z(hidden_states).reshape(batch, R, -1, mixer.head_v_dim)
        return (mixer.in_proj_qkv(hidden_states), z, mixer.in_proj_b(hidden_states).sigmoid(),
                mixer.in_proj_a(hidden_states))
    # OLMo-Hybrid
    qkv = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], dim=-1)
    beta = mixer.b_proj(hidden_states).sigmoid()
    if mixer.allow_neg_eigval:
        beta = beta * 2.0
    return qkv, mixer.g_proj(hidden_states).reshape(batch, R, -1, mixer.head_v_dim), beta, mixer.a_proj(hidden_states)


def output_modules(mixer):
    """(gated norm, output projection) of the mixer."""
    return (mixer.o_norm, mixer.o_proj) if hasattr(mixer, "o_norm") else (mixer.norm, mixer.out_proj)


class GatedDeltaLayers(SlotLayers):
    """The Gated DeltaNet mixers of one StateGroup (mixers[j] owns slice j of group.conv / group.recurrent); a mixer
    kind (tree_model.MIXER_KINDS, contract in mamba2.Mamba2Layers).

    Buffers over the node slots, per layer j:
        qkv[j]  (batch, capacity, conv_dim)   pre-conv q|k|v, model dtype
        k[j]    (batch, capacity, Hk, Dk)     normalised keys          } compute dtype
        g[j]    (batch, capacity, Hv)         log decays               }
        u[j]    (batch, capacity, Hv, Dv)     delta-rule writes        }
    """

    @staticmethod
    def matches(module):
        layouts = ("in_proj_qkvz", "in_proj_qkv", "g_proj")
        return all(hasattr(module, name) for name in MIXER_ATTRIBUTES) and any(hasattr(module, n) for n in layouts)

    @staticmethod
    def check(module):
        """Raise ValueError for what the tree pass does not implement."""
        check_silu_conv(module, "Gated DeltaNet")

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        m = mixers[0]
        self.Hk, self.Hv, self.Dk, self.Dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        self.cd = compute_dtype(group.conv)
        self._slot_specs(len(mixers), group.conv.shape[0], group.conv.device, qkv=((m.conv_dim,), group.conv.dtype),
                         k=((self.Hk, self.Dk), self.cd), g=((self.Hv,), self.cd), u=((self.Hv, self.Dv), self.cd))

    def forward(self, j, hidden_states, tree_pass, conv_state, recurrent_state):
        """Layer j over the pass's new nodes. hidden_states (batch, R, hidden) of nodes tree_pass.rows (R,);
        conv_state (batch, conv_dim, K) / recurrent_state (batch, Hv, Dk, Dv): the layer's committed states (read
        only). Returns (batch, R, hidden)."""
        m, cd = self.mixers[j], self.cd
        batch, R, _ = hidden_states.shape
        qkv, z, beta, a = projections(m, hidden_states)
        qkv = conv_rows(self.qkv[j], qkv, m.conv1d, m.activation, tree_pass, conv_state)
        q, k, v = qkv.split([self.Hk * self.Dk, self.Hk * self.Dk, self.Hv * self.Dv], dim=-1)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        q, k = (l2norm_rsqrt(as_dtype(t.reshape(batch, R, self.Hk, self.Dk), cd)) for t in (q, k))
        out = tree_gated_delta_rows(q * self.Dk ** -0.5, k, as_dtype(v.reshape(batch, R, self.Hv, self.Dv), cd),
                                    as_dtype(g, cd), as_dtype(beta, cd), recurrent_state, tree_pass.index,
                                    tree_pass.rows, self.k[j], self.g[j], self.u[j], validate=False)
        norm, out_proj = output_modules(m)
        out = norm(as_dtype(out, hidden_states.dtype).reshape(-1, self.Dv), z.reshape(-1, self.Dv))
        return out_proj(out.reshape(batch, R, -1))

    def commit(self, index, nodes):
        """Overwrite every layer's conv and recurrent states, in place, with those after path(nodes[b]) of the tree
        whose TreeIndex (over all capacity slots) is `index`. nodes (batch,) int64 on the device, -1 = none."""
        n, recurrent = len(self.mixers), self.group.recurrent
        batch = recurrent.shape[0]
        state = recurrent.view(batch, n, self.Hv, self.Dk, self.Dv).transpose(0, 1)
        states = tree_gated_delta_commit(state, index, nodes, self.k, self.g, self.u, validate=False)
        recurrent.copy_(states.transpose(0, 1).reshape(recurrent.shape))
        commit_conv(self.group, self.qkv, index, nodes)
