"""LFM2's gated short convolutions over a token tree (LFM2, LFM2-MoE), with the modules' own weights, and their
commit.

HF's layer: in_proj -> [B | C | x], a depthwise causal conv of width L (conv_L_cache, no activation) on B·x, gated
by C, out_proj. Its conv state keeps L columns (the whole window), so the conv windows are (L, L). No recurrent
state: a pass keeps each node's B·x in a per-slot buffer and convolves the new nodes' windows through their
ancestors' (only new nodes computed), and the commit is one tree_conv_state call per group.
"""
from .slots import SlotLayers, commit_conv, conv_rows

MIXER_ATTRIBUTES = ("conv", "in_proj", "out_proj", "conv_kernel_size", "layer_idx")


class ShortConvLayers(SlotLayers):
    """The short-conv mixers of one StateGroup (mixers[j] owns slice j of group.conv); a mixer kind
    (families.MIXER_KINDS, contract in families.MixerKind).

    Buffers over the node slots, per layer j:  bx[j] (batch, capacity, hidden)  the pre-conv B·x
    """

    @staticmethod
    def matches(module):
        return (all(hasattr(module, name) for name in MIXER_ATTRIBUTES) and not hasattr(module, "A_log")
                and module.in_proj.out_features == 3 * module.in_proj.in_features)

    def __init__(self, mixers, group):
        self.mixers, self.group = mixers, group
        self._slot_specs(len(mixers), group.conv.shape[0], group.conv.device,
                         bx=((mixers[0].in_proj.in_features,), group.conv.dtype))

    def forward(self, j, hidden_states, tree_pass, conv_state, recurrent_state=None):
        """Layer j over the pass's new nodes: hidden_states (batch, R, hidden) of nodes tree_pass.rows (R,),
        conv_state (batch, hidden, L) the committed state (read only). Returns (batch, R, hidden)."""
        m = self.mixers[j]
        B, C, x = m.in_proj(hidden_states).chunk(3, dim=-1)
        conv = conv_rows(self.bx[j], B * x, m.conv, None, tree_pass, conv_state)
        return m.out_proj(C * conv)

    def commit(self, index, nodes):
        """Overwrite every layer's conv state, in place, with the one after path(nodes[b]) (-1 = none)."""
        commit_conv(self.group, self.bx, index, nodes)
