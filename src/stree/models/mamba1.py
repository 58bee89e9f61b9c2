"""Mamba1 selective-scan mixers over a token tree (Mamba, FalconMamba, Jamba, Zamba), with the modules' own weights,
and the commit of their states.

The layout is the same in all four: in_proj -> [x | z], depthwise conv on x, x_proj -> [dt (rank) | B | C],
dt_proj, the selective scan with a per-channel A (dim, N), D, the silu(z) gate, out_proj. FalconMamba adds
weightless RMS norms on dt, B and C, Jamba RMS norms with weights; both sit on the module (dt_layernorm,
b_layernorm, c_layernorm) and are called as they are. Zamba splits the channels into heads, each with its own x_proj
and dt_proj (so B and C per head), and interleaves x and z in in_proj's output. The pass mirrors HF's single-token
decode step (``mamba_selective_state_update``):
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

from .slots import SlotLayers, check_silu_conv, commit_conv, conv_rows
from ..triton_kernels.utils import as_dtype, compute_dtype

MIXER_ATTRIBUTES = ("A_log", "D", "conv1d", "in_proj", "out_proj", "time_step_rank", "ssm_state_size",
                    "intermediate_size", "layer_idx")


def projections(mixer, hidden_states):
    """in_proj -> (x pre-conv, z) (batch, R, dim): halves (Mamba, FalconMamba, Jamba) or, with Zamba's per-head
    mixer, interleaved channels (x = feature 2c, z = 2c + 1)."""
    projected = mixer.in_proj(hidden_states)
    if hasattr(mixer, "x_proj_weight"):
        projected = projected.unflatten(-1, (-1, 2))
        return projected[..., 0], projected[..., 1]
    return projected.chunk(2, dim=-1)


def time_steps(mixer, x, heads, rank, N):
    """The conv output x (batch, R, dim) -> dt (before bias and softplus) (batch, R, dim), B, C (batch, R, heads, N),
    as HF: x_proj, FalconMamba's / Jamba's norms on dt, B and C, dt_proj's weight (its bias comes with the
    softplus); Zamba's heads each with their own x_proj and dt_proj."""
    if hasattr(mixer, "x_proj_weight"):  # Zamba: per head (heads, rank + 2N, head_dim), (heads, head_dim, rank)
        xh = x.unflatten(-1, (heads, -1))
        dt, B, C = torch.einsum("brgd,gpd->brgp", xh, mixer.x_proj_weight).split([rank, N, N], dim=-1)
        return torch.einsum("brgk,gdk->brgd", dt, mixer.dt_proj_weight).flatten(2), B, C
    dt, B, C = mixer.x_proj(x).split([rank, N, N], dim=-1)
    if hasattr(mixer, "dt_layernorm"):  # FalconMamba, Jamba
        dt, B, C = mixer.dt_layernorm(dt), mixer.b_layernorm(B), mixer.c_layernorm(C)
    return torch.matmul(dt, mixer.dt_proj.weight.t()), B[:, :, None], C[:, :, None]


def dt_bias(mixer):
    """(dim,) fp32 or None: HF's time_proj_bias."""
    bias = mixer.dt_proj_bias if hasattr(mixer, "dt_proj_bias") else mixer.dt_proj.bias
    return None if bias is None else bias.float().reshape(-1)


def selective_walk(states, parents, rows, levels, dt, B, x, A):
    """Mamba1's recurrence for a pass's new nodes, level by level, each from its parent's kept state.

    states (batch, slots, heads, head_dim, N): every node's kept state, the committed one in the last slot (the
    roots' parent); parents (batch, slots) the tree's; rows (R,) the new nodes; levels: positions into rows
    grouped by level (TreePass.levels); dt (softplus applied) and x (batch, R, heads, head_dim), B (batch, R, heads,
    N) in the compute dtype; A (heads, head_dim, N). h = h_parent · exp(dt·A) + (dt·B)·x, HF's decode step. Writes
    the rows' states into `states` and returns them (batch, R, heads, head_dim, N) in its dtype.
    """
    batch, slots = states.shape[:2]
    shape = states.shape[2:]
    offsets = torch.arange(batch, device=states.device)[:, None] * slots
    up = parents.index_select(1, rows)
    up = torch.where(up >= 0, up, slots - 1) + offsets                                    # (batch, R) flat slots
    targets = rows[None] + offsets
    flat = states.view(batch * slots, *shape)
    for level in levels:                                                                  # (W,) pass positions
        dt_l = dt.index_select(1, level)[..., None]                                       # (batch, W, G, hd, 1)
        h = flat.index_select(0, up.index_select(1, level).reshape(-1)).view(batch, -1, *shape)
        h = as_dtype(h, dt.dtype) * torch.exp(dt_l * A) + (dt_l * B.index_select(1, level)[:, :, :, None, :]) * \
            x.index_select(1, level)[..., None]
        flat.index_copy_(0, targets.index_select(1, level).reshape(-1), as_dtype(h, flat.dtype).reshape(-1, *shape))
    return flat.index_select(0, targets.reshape(-1)).view(batch, -1, *shape)


class Mamba1Layers(SlotLayers):
    """The Mamba1 mixers of one StateGroup (mixers[j] owns slice j of group.conv / group.recurrent); a mixer kind
    (tree_model.MIXER_KINDS, contract in mamba2.Mamba2Layers).

    Buffers over the node slots, per layer j (the layer's state: (dim, N), Zamba's (heads, head_dim, N)):
        x[j]  (batch, capacity, dim)               pre-conv inputs
        h[j]  (batch, capacity + 1, *state shape)  every node's state; slot `capacity` holds the committed state
    """

    SEQUENTIAL = True  # a pass walks tree_pass.levels

    @staticmethod
    def matches(module):
        return (all(hasattr(module, name) for name in MIXER_ATTRIBUTES)
                and (hasattr(module, "x_proj") or hasattr(module, "x_proj_weight"))
                and module.A_log.dim() == (3 if hasattr(module, "x_proj_weight") else 2))

    @staticmethod
    def check(module):
        """Raise ValueError for what the tree pass does not implement."""
        check_silu_conv(module, "Mamba1")
        if hasattr(module.config, "_is_quantized"):
            raise ValueError("quantized Mamba1 models (HF's dt_proj workaround for them) are not supported")

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        m = mixers[0]
        self.dim, self.rank, self.N = m.intermediate_size, m.time_step_rank, m.ssm_state_size
        self.heads = getattr(m, "n_mamba_heads", 1) if hasattr(m, "x_proj_weight") else 1
        self.cd = compute_dtype(group.conv)
        self.A = [-torch.exp(m.A_log.float()).to(self.cd).view(self.heads, -1, self.N) for m in mixers]
        self.D = [m.D.reshape(-1) for m in mixers]
        self.dt_bias = [dt_bias(m) for m in mixers]
        state = (group.recurrent.shape[1] // len(mixers), *group.recurrent.shape[2:])
        self._slot_specs(len(mixers), group.conv.shape[0], group.conv.device, x=((self.dim,), group.conv.dtype),
                         h=(state, group.recurrent.dtype, 1))

    def forward(self, j, hidden_states, tree_pass, conv_state, ssm_state):
        """Layer j over the pass's new nodes. hidden_states (batch, R, hidden) of nodes tree_pass.rows (R,);
        conv_state (batch, dim, K) / ssm_state (batch, dim, N) or (batch, heads, head_dim, N): the layer's committed
        states (read only). Returns (batch, R, hidden)."""
        m, cd, G = self.mixers[j], self.cd, self.heads
        dtype = hidden_states.dtype
        x, z = projections(m, hidden_states)
        x = conv_rows(self.x[j], x, m.conv1d, m.activation, tree_pass, conv_state)
        dt, B, C = time_steps(m, x, G, self.rank, self.N)
        if self.dt_bias[j] is not None:
            dt = dt + self.dt_bias[j].to(dt.dtype)
        dt = F.softplus(dt)
        H = self.h[j]
        H[:, H.shape[1] - 1] = ssm_state
        h = selective_walk(H.view(*H.shape[:2], G, -1, self.N), tree_pass.index.parents, tree_pass.rows,
                           tree_pass.levels, as_dtype(dt, cd).unflatten(-1, (G, -1)), as_dtype(B, cd),
                           as_dtype(x, cd).unflatten(-1, (G, -1)), self.A[j])             # (batch, R, G, hd, N)
        y = torch.matmul(h.to(C.dtype), C[..., None]).flatten(2)                           # (batch, R, dim)
        y = (y + x * self.D[j]) * F.silu(z)
        return m.out_proj(y.to(dtype))

    def commit(self, index, nodes):
        """Overwrite every layer's conv and SSM states, in place, with those after path(nodes[b]) of the tree whose
        TreeIndex (over all capacity slots) is `index`. nodes (batch,) int64 on the device, -1 = none."""
        h = self.h                                                                   # (n, batch, slots, *state)
        n, batch, slots = h.shape[:3]
        kept = torch.where(nodes >= 0, nodes, slots - 1)  # -1: the committed state, which the last pass stored
        states = h[:, torch.arange(batch, device=h.device), kept]                    # (n, batch, *state)
        self.group.recurrent.copy_(states.transpose(0, 1).reshape(self.group.recurrent.shape))
        commit_conv(self.group, self.x, index, nodes)
