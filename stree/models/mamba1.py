"""Mamba1 selective-scan mixers over a token tree (Mamba, FalconMamba, Jamba), with the modules' own weights, and
the commit of their states.

The layout is the same in all three: in_proj -> [x | z], depthwise conv on x, x_proj -> [dt (rank) | B | C], dt_proj,
the selective scan with a per-channel A (dim, N), D, the silu(z) gate, out_proj. FalconMamba adds weightless RMS
norms on dt, B and C, Jamba RMS norms with weights; both sit on the module (dt_layernorm, b_layernorm, c_layernorm)
and are called as they are. The pass mirrors HF's single-token decode step (``mamba_selective_state_update``):
softplus(dt + dt_bias) in the model dtype, then

    h = h_parent · exp(dt·A) + (dt·B)·x          (in fp32, fp64 for fp64 models; stored in the state's dtype)
    y = (h @ C + D·x) · silu(z)                   (in the model dtype, as HF)

Kept states. A per-channel decay has no cheap masked closed form (T x T x dim x N terms, 20-70x the recurrence at
16-32 nodes, benchmarks/selective_scan_methods.py), so every node's state is kept in a per-slot buffer: a pass
computes only its new nodes from their parents' kept states (an extend, one new level, is a single batched update)
and the commit copies the accepted node's state (no replay). The new nodes of one pass can form chains (the
target's verify pass holds the whole tree): they are walked level by level (TreePass.levels, built on the host),
each level's nodes at once from their parents' kept states, so a pass costs one update per new node plus a few
operations per level. Memory: (capacity + 1) x dim x N states per layer in the state's dtype (HF keeps fp32;
Jamba-1.5-Mini, dim 8192, N 16: 512 KB per node and layer).
"""
import torch
import torch.nn.functional as F

from .slots import SlotLayers, commit_conv, conv_rows
from ..triton_kernels.utils import as_dtype, compute_dtype

MIXER_ATTRIBUTES = ("A_log", "D", "conv1d", "in_proj", "x_proj", "dt_proj", "out_proj", "time_step_rank",
                    "ssm_state_size", "intermediate_size", "layer_idx")


def selective_walk(states, parents, rows, levels, dt, B, x, A):
    """Mamba1's recurrence for a pass's new nodes, level by level, each from its parent's kept state.

    states (batch, slots, dim, N): every node's kept state, the committed one in the last slot (roots' parent);
    parents (batch, slots) the tree's; rows (R,) the new nodes; levels: positions into rows grouped by level
    (TreePass.levels); dt (softplus applied), x (batch, R, dim) and B (batch, R, N) in the compute dtype; A (dim, N).
    h = h_parent · exp(dt·A) + (dt·B)·x, HF's decode step. Writes the rows' states into `states` and returns them
    (batch, R, dim, N) in its dtype.
    """
    batch, slots, dim, N = states.shape
    offsets = torch.arange(batch, device=states.device)[:, None] * slots
    up = parents.index_select(1, rows)
    up = torch.where(up >= 0, up, slots - 1) + offsets                                    # (batch, R) flat slots
    targets = rows[None] + offsets
    flat = states.view(batch * slots, dim, N)
    for level in levels:                                                                  # (W,) pass positions
        dt_l = dt.index_select(1, level)[..., None]                                       # (batch, W, dim, 1)
        h = flat.index_select(0, up.index_select(1, level).reshape(-1)).view(batch, -1, dim, N)
        h = as_dtype(h, dt.dtype) * torch.exp(dt_l * A) + (dt_l * B.index_select(1, level)[:, :, None, :]) * \
            x.index_select(1, level)[..., None]
        flat.index_copy_(0, targets.index_select(1, level).reshape(-1), as_dtype(h, flat.dtype).reshape(-1, dim, N))
    return flat.index_select(0, targets.reshape(-1)).view(batch, -1, dim, N)


class Mamba1Layers(SlotLayers):
    """The Mamba1 mixers of one StateGroup (mixers[j] owns slice j of group.conv / group.recurrent); a mixer kind
    (tree_model.MIXER_KINDS, contract in mamba2.Mamba2Layers).

    Buffers over the node slots, per layer j:
        x[j]  (batch, capacity, dim)          pre-conv inputs
        h[j]  (batch, capacity + 1, dim, N)   every node's state; slot `capacity` holds the committed state
    """

    SEQUENTIAL = True  # a pass walks tree_pass.levels

    @staticmethod
    def matches(module):
        return all(hasattr(module, name) for name in MIXER_ATTRIBUTES) and module.A_log.dim() == 2

    @staticmethod
    def check(module):
        """Raise ValueError for what the tree pass does not implement."""
        if module.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba1 layer {module.layer_idx}: the tree conv implements a silu activation, the "
                             f"model uses {module.activation!r}")
        if hasattr(module.config, "_is_quantized"):
            raise ValueError("quantized Mamba1 models (HF's dt_proj workaround for them) are not supported")

    @staticmethod
    def window_keys(module):
        return [(module.conv_kernel_size, module.conv_kernel_size)]  # HF keeps K columns of conv state

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        m = mixers[0]
        self.dim, self.rank, self.N = m.intermediate_size, m.time_step_rank, m.ssm_state_size
        self.cd = compute_dtype(group.conv)
        self.A = [-torch.exp(m.A_log.float()).to(self.cd) for m in mixers]
        self._slot_specs(len(mixers), group.conv.shape[0], group.conv.device, x=((self.dim,), group.conv.dtype),
                         h=((self.dim, self.N), group.recurrent.dtype, 1))

    def forward(self, j, hidden_states, tree_pass, conv_state, ssm_state):
        """Layer j over the pass's new nodes. hidden_states (batch, R, hidden) of nodes tree_pass.rows (R,);
        conv_state (batch, dim, K) / ssm_state (batch, dim, N): the layer's committed states (read only).
        Returns (batch, R, hidden)."""
        m = self.mixers[j]
        dtype = hidden_states.dtype
        x, z = m.in_proj(hidden_states).chunk(2, dim=-1)
        x = conv_rows(self.x[j], x, m.conv1d, m.activation, tree_pass, conv_state)
        dt, B, C = m.x_proj(x).split([self.rank, self.N, self.N], dim=-1)
        if hasattr(m, "dt_layernorm"):  # FalconMamba, Jamba
            dt, B, C = m.dt_layernorm(dt), m.b_layernorm(B), m.c_layernorm(C)
        dt = torch.matmul(dt, m.dt_proj.weight.t())  # HF: dt_proj.weight @ dt, the bias added with the softplus
        if m.dt_proj.bias is not None:
            dt = dt + m.dt_proj.bias.float().to(dt.dtype)
        dt = F.softplus(dt)
        h = self._states(j, dt, B, x, tree_pass, ssm_state)                        # (batch, R, dim, N)
        y = torch.matmul(h.to(C.dtype), C[..., None])[..., 0]
        y = (y + x * m.D) * F.silu(z)
        return m.out_proj(y.to(dtype))

    def _states(self, j, dt, B, x, tree_pass, ssm_state):
        """The new nodes' states (batch, R, dim, N), walked from their parents' kept states and stored in h[j]."""
        H = self.h[j]
        H[:, H.shape[1] - 1] = ssm_state
        return selective_walk(H, tree_pass.index.parents, tree_pass.rows, tree_pass.levels, as_dtype(dt, self.cd),
                              as_dtype(B, self.cd), as_dtype(x, self.cd), self.A[j])

    def commit(self, index, nodes):
        """Overwrite every layer's conv and SSM states, in place, with those after path(nodes[b]) of the tree whose
        TreeIndex (over all capacity slots) is `index`. nodes (batch,) int64 on the device, -1 = none."""
        h = self.h                                                             # (n, batch, slots, dim, N)
        n, batch, slots = h.shape[:3]
        kept = torch.where(nodes >= 0, nodes, slots - 1)  # -1: the committed state, which the last pass stored
        states = h[:, torch.arange(batch, device=h.device), kept]                    # (n, batch, dim, N)
        self.group.recurrent.copy_(states.transpose(0, 1).reshape(batch, n * self.dim, self.N))
        commit_conv(self.group, self.x, index, nodes)
