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
16-32 nodes, benchmarks/scan_kernels/selective_scan_methods.py), so every node's state is kept in a per-slot buffer:
a pass computes only its new nodes from their parents' kept states (an extend, one new level, is a single batched
update) and the commit copies the accepted node's state (no replay). The new nodes of one pass can form chains (the
target's verify pass holds the whole tree): the package's stree.triton_kernels.tree_selective_rows walks them, on
CUDA as a Triton kernel row by row in pass order, elsewhere level by level in PyTorch (TreePass.levels, built on the
host), each level's nodes at once from their parents' kept states; a pass costs one update per new node. Memory:
(capacity + 1) x dim x N states per layer in the state's dtype (HF keeps fp32; Jamba-1.5-Mini, dim 8192, N 16: 512
KB per node and layer).
"""
import torch
import torch.nn.functional as F

from .slots import SlotLayers, check_silu_conv, commit_conv, conv_rows
from ..triton_kernels import tree_selective_rows
from ..triton_kernels.tree_selective_scan_torch import selective_walk  # noqa: F401 (moved there)
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
        h = tree_selective_rows(H.view(*H.shape[:2], G, -1, self.N), tree_pass.index, tree_pass.rows,
                                as_dtype(dt, cd).unflatten(-1, (G, -1)), as_dtype(B, cd),
                                as_dtype(x, cd).unflatten(-1, (G, -1)), self.A[j], levels=tree_pass.levels,
                                validate=False)                                   # (batch, R, G, hd, N)
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
