"""Mamba2 mixers over a token tree, with the modules' own weights, and the commit of their states.

All six HF Mamba2 families share the mixer layout (in_proj -> [gate | xBC | dt], depthwise conv on xBC, SSD, gated
norm, out_proj); FalconH1 adds an input multiplier, a per-segment mup_vector on in_proj's output and an optional
norm. The tree pass mirrors HF's single-token *decode* path (no dt clamp: the decode path has none), because HF's
greedy generate runs every new token through it.

Layers whose states have equal shapes form one `Mamba2Layers`: their cached states are slices of one stacked tensor
(cache.StateGroup), and what the tree pass computed for them (pre-conv inputs, conv outputs, dt) lands in stacked
preallocated buffers, so the commit of the whole group is one tree_states and one tree_conv_state call.
"""
import torch
import torch.nn.functional as F

from ..triton_kernels import tree_conv1d, tree_conv_state, tree_scan, tree_states

MIXER_ATTRIBUTES = ("A_log", "dt_bias", "D", "conv1d", "in_proj", "out_proj", "norm", "layer_idx")


def is_mamba2_mixer(module):
    return all(hasattr(module, name) for name in MIXER_ATTRIBUTES)


class Mamba2Layers:
    """The Mamba2 mixers of one StateGroup (mixers[j] owns slice j of group.conv / group.recurrent).

    Buffers over the tree's node slots (capacity >= nodes in the tree), per layer j:
        xbc[:, :, j]   (batch, capacity, conv_dim)  pre-conv inputs
        conv[:, :, j]  (batch, capacity, conv_dim)  post-conv [x | B | C]
        dt[:, :, j]    (batch, capacity, nheads)    softplus(dt + dt_bias), in the model dtype as HF's decode step
    """

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        m = mixers[0]
        self.dims = (m.intermediate_size, m.n_groups * m.ssm_state_size, m.num_heads, m.head_dim, m.n_groups,
                     m.ssm_state_size)
        # Per-layer constants, stacked along heads for the commit.
        self.A = [-torch.exp(m.A_log.float()) for m in mixers]
        self.A_all = torch.cat(self.A)
        self.capacity = 0

    def reserve(self, capacity):
        """Make the buffers hold at least `capacity` node slots (keeping what they hold)."""
        if capacity <= self.capacity:
            return
        conv = self.group.conv
        batch, n, width = conv.shape[0], len(self.mixers), conv.shape[1] // len(self.mixers)
        old = (self.xbc, self.conv, self.dt) if self.capacity else None
        self.xbc = conv.new_zeros(batch, capacity, n, width)
        self.conv = conv.new_zeros(batch, capacity, n, width)
        self.dt = conv.new_zeros(batch, capacity, n, self.dims[2])
        if old is not None:
            for new, kept in zip((self.xbc, self.conv, self.dt), old):
                new[:, :kept.shape[1]] = kept
        self.capacity = capacity

    def forward(self, j, hidden_states, tree_pass, conv_state, ssm_state):
        """Layer j over the pass's new nodes. hidden_states (batch, R, hidden) of nodes tree_pass.start..end-1;
        conv_state (batch, conv_dim, K) / ssm_state (batch, nheads, headdim, dstate): the layer's cached states
        (read only). Returns (batch, R, hidden)."""
        mixer = self.mixers[j]
        I, GN, H, P, G, N = self.dims
        batch, R, _ = hidden_states.shape
        start, end = tree_pass.start, tree_pass.end
        dtype = hidden_states.dtype
        falcon = hasattr(mixer, "mup_vector")
        if falcon:
            hidden_states = hidden_states * mixer.ssm_in_multiplier
        projected = mixer.in_proj(hidden_states)
        if falcon:
            projected = projected * mixer.mup_vector
        gate, xbc, dt = projected.split([I, I + 2 * GN, H], dim=-1)
        self.xbc[:, start:end, j] = xbc
        self.dt[:, start:end, j] = F.softplus(dt + mixer.dt_bias.to(dt.dtype))
        # Only the new nodes are computed; the earlier ones act as their ancestors through the buffers.
        conv = tree_conv1d(self.xbc[:, :end, j], mixer.conv1d.weight[:, 0], mixer.conv1d.bias, tree_pass.index,
                           conv_state, activation=mixer.activation, rows=tree_pass.rows, validate=False)
        self.conv[:, start:end, j] = conv
        seen = self.conv[:, :end, j]
        y = tree_scan(seen[..., :I].unflatten(-1, (H, P)), self.dt[:, :end, j], self.A[j],
                      seen[..., I:I + GN].unflatten(-1, (G, N)), seen[..., I + GN:].unflatten(-1, (G, N)),
                      tree_pass.index, D=mixer.D, initial_states=ssm_state, rows=tree_pass.rows, validate=False)
        y = y.reshape(batch, R, I)
        if falcon and not mixer.mamba_rms_norm:
            y = y * F.silu(gate)
        else:
            y = mixer.norm(y, gate)
        return mixer.out_proj(y.to(dtype))

    def commit(self, index, nodes):
        """Overwrite every layer's conv and SSM states, in place, with those after path(nodes[b]) of the tree
        whose TreeIndex is `index` (T nodes in the buffers). nodes (batch,) int64 on the device, -1 = none."""
        I, GN, H, P, G, N = self.dims
        batch, T = index.shape
        n = len(self.mixers)
        seen = self.conv[:, :T]
        x = seen[..., :I].reshape(batch, T, n * H, P)
        B = seen[..., I:I + GN].reshape(batch, T, n * G, N)
        states = tree_states(x, self.dt[:, :T].reshape(batch, T, n * H), self.A_all, B, index, nodes,
                             initial_states=self.group.recurrent, validate=False)
        conv = tree_conv_state(self.xbc[:, :T].reshape(batch, T, -1), index, nodes, self.group.conv, validate=False)
        self.group.recurrent.copy_(states)
        self.group.conv.copy_(conv)
