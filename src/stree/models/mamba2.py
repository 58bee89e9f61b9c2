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

from .slots import SlotLayers
from ..triton_kernels import tree_conv1d, tree_conv_state, tree_scan, tree_states
from ..triton_kernels.utils import as_dtype

MIXER_ATTRIBUTES = ("A_log", "dt_bias", "D", "conv1d", "in_proj", "out_proj", "norm", "layer_idx")


class Mamba2Layers:
    """The Mamba2 mixers of one StateGroup (mixers[j] owns slice j of group.conv / group.recurrent).

    A mixer kind (see families.MIXER_KINDS and families.MixerKind) provides: matches(module), window_keys(module) (the conv windows
    its passes need, (width, state_len) pairs), construction from (mixers, group), reserve(capacity),
    forward(j, hidden_states, tree_pass, conv_state, recurrent_state) and commit(index, nodes).

    Buffers over the tree's node slots (every pass reads all `capacity` slots, so its shapes never change;
    slots past the tree are nobody's ancestors), per layer j:
        xbc[j]   (batch, capacity, conv_dim)  pre-conv inputs
        conv[j]  (batch, capacity, conv_dim)  post-conv [x | B | C]
        dt[j]    (batch, capacity, nheads)    softplus(dt + dt_bias), in the model dtype as HF's decode step
    """

    @staticmethod
    def matches(module):
        return all(hasattr(module, name) for name in MIXER_ATTRIBUTES)

    window_keys = staticmethod(SlotLayers.window_keys)  # HF keeps K columns of conv state

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        m = mixers[0]
        self.dims = (m.intermediate_size, m.n_groups * m.ssm_state_size, m.num_heads, m.head_dim, m.n_groups,
                     m.ssm_state_size)
        self.A = [-torch.exp(m.A_log.float()) for m in mixers]
        self.A_all = torch.cat(self.A)  # stacked along heads for the commit
        self.conv_weight = [m.conv1d.weight[:, 0] for m in mixers]  # (conv_dim, K) views
        self.capacity = 0

    def reserve(self, capacity):
        """Make the buffers hold at least `capacity` node slots (keeping what they hold)."""
        if capacity <= self.capacity:
            return
        conv = self.group.conv
        n, batch, width = len(self.mixers), conv.shape[0], conv.shape[1] // len(self.mixers)
        old = (self.xbc, self.conv, self.dt) if self.capacity else None
        self.xbc = conv.new_zeros(n, batch, capacity, width)
        self.conv = conv.new_zeros(n, batch, capacity, width)
        self.dt = conv.new_zeros(n, batch, capacity, self.dims[2])
        if old is not None:
            for new, kept in zip((self.xbc, self.conv, self.dt), old):
                new[:, :, :kept.shape[2]] = kept
        self.capacity = capacity
        self.views = [self._views(j) for j in range(n)]  # made once: an eager pass spends no operation on them

    def _views(self, j):
        """Layer j's views of the buffers: xbc, conv, dt and conv's x (batch, capacity, H, P), B and C (.., G, N)."""
        I, GN, H, P, G, N = self.dims
        conv = self.conv[j]
        return dict(xbc=self.xbc[j], conv=conv, dt=self.dt[j], x=conv[..., :I].unflatten(-1, (H, P)),
                    B=conv[..., I:I + GN].unflatten(-1, (G, N)), C=conv[..., I + GN:].unflatten(-1, (G, N)))

    def forward(self, j, hidden_states, tree_pass, conv_state, ssm_state):
        """Layer j over the pass's new nodes. hidden_states (batch, R, hidden) of nodes tree_pass.rows (R,);
        conv_state (batch, conv_dim, K) / ssm_state (batch, nheads, headdim, dstate): the layer's committed states
        (read only). Returns (batch, R, hidden)."""
        mixer = self.mixers[j]
        I, GN, H, P, G, N = self.dims
        batch, R, _ = hidden_states.shape
        rows, index = tree_pass.rows, tree_pass.index
        dtype = hidden_states.dtype
        falcon = hasattr(mixer, "mup_vector")
        if falcon:
            hidden_states = hidden_states * mixer.ssm_in_multiplier
        projected = mixer.in_proj(hidden_states)
        if falcon:
            projected = projected * mixer.mup_vector
        gate, xbc, dt = projected.split([I, I + 2 * GN, H], dim=-1)
        # Compiled, the views are made in the graph: one held from outside would be a graph input of its own, aliasing
        # the buffer it views, and torch.compile merges such inputs into one that is not static (no CUDA graphs).
        view = self._views(j) if torch.compiler.is_compiling() else self.views[j]
        view["xbc"].index_copy_(1, rows, xbc)
        view["dt"].index_copy_(1, rows, F.softplus(dt + as_dtype(mixer.dt_bias, dt.dtype)))
        # Only the new nodes are computed; the earlier ones act as their ancestors through the buffers.
        conv = tree_conv1d(view["xbc"], self.conv_weight[j], mixer.conv1d.bias, index, conv_state,
                           activation=mixer.activation, rows=rows, validate=False)
        view["conv"].index_copy_(1, rows, conv)
        y = tree_scan(view["x"], view["dt"], self.A[j], view["B"], view["C"], index, D=mixer.D,
                      initial_states=ssm_state, rows=rows, validate=False)
        y = y.reshape(batch, R, I)
        if falcon and not mixer.mamba_rms_norm:
            y = y * F.silu(gate)
        else:
            y = mixer.norm(y, gate)
        return mixer.out_proj(as_dtype(y, dtype))

    def commit(self, index, nodes):
        """Overwrite every layer's conv and SSM states, in place, with those after path(nodes[b]) of the tree
        whose TreeIndex (over all capacity slots) is `index`. nodes (batch,) int64 on the device, -1 = none."""
        I, GN, H, P, G, N = self.dims
        n, batch, T, width = self.conv.shape
        layer_major = self.conv.permute(1, 2, 0, 3)                                # (batch, T, n, conv_dim)
        x = layer_major[..., :I].reshape(batch, T, n * H, P)
        B = layer_major[..., I:I + GN].reshape(batch, T, n * G, N)
        dt = self.dt.permute(1, 2, 0, 3).reshape(batch, T, n * H)
        tree_states(x, dt, self.A_all, B, index, nodes, initial_states=self.group.recurrent, validate=False,
                    out=self.group.recurrent)
        xbc = self.xbc.permute(1, 2, 0, 3).reshape(batch, T, n * width)
        conv = tree_conv_state(xbc, index, nodes, self.group.conv, validate=False)
        self.group.conv.copy_(conv)
