"""What the mixer kinds share: per-node buffers over the tree's node slots, and the short causal conv over kept
pre-conv inputs with its commit.

A tree pass computes only its new nodes (rows); earlier nodes of the tree act as their ancestors through what the
earlier passes left in these buffers. Every pass reads all `capacity` slots, so no shape depends on the tree (slots
past the tree are nobody's ancestor). The buffers of the n layers of a StateGroup are stacked, so that a commit
reads them for the whole group at once.
"""
import torch

from ..triton_kernels import tree_conv1d, tree_conv_state


class SlotLayers:
    """Base of the mixer kinds that keep per-node buffers: named tensors (n, batch, capacity + extra, *shape) for
    the n layers of a group, held as attributes of the adapter (so that whatever scans an adapter's tensors, e.g.
    TreeModel._mark_static, finds them); self.<name>[j] is layer j's (batch, slots, *shape) view.

    Call _slot_specs(n, batch, device, name=(shape, dtype[, extra]), ...) from __init__; `extra` slots past the
    capacity hold whatever a kind keeps there (Mamba1: the committed state).
    """

    def _slot_specs(self, n, batch, device, **specs):
        self._slots = (n, batch, device, {name: (tuple(spec[0]), spec[1], spec[2] if len(spec) > 2 else 0)
                                          for name, spec in specs.items()})
        self.capacity = 0

    def reserve(self, capacity):
        """Hold at least `capacity` node slots, keeping what the slots and the extra slots hold."""
        if capacity <= self.capacity:
            return
        n, batch, device, specs = self._slots
        for name, (shape, dtype, extra) in specs.items():
            new = torch.zeros(n, batch, capacity + extra, *shape, dtype=dtype, device=device)
            if self.capacity:
                old = getattr(self, name)
                new[:, :, :self.capacity] = old[:, :, :self.capacity]
                # The extra slots too: a pass may fail before it rewrites them, and a commit of none reads them.
                new[:, :, capacity:] = old[:, :, self.capacity:]
            setattr(self, name, new)
        self.capacity = capacity

    @staticmethod
    def window_keys(module):
        """The conv windows a layer reads: HF keeps K = conv_kernel_size columns of conv state."""
        return [(module.conv_kernel_size, module.conv_kernel_size)]

    def slot_nbytes(self):
        """Bytes one node slot takes over the whole group (every buffer and layer, one batch row)."""
        n, _, _, specs = self._slots
        return sum(n * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype, _ in specs.values())


def check_silu_conv(module, kind):
    """Raise ValueError unless the layer's conv activation is silu, the one the tree conv implements."""
    if module.activation not in ("silu", "swish"):
        raise ValueError(f"{kind} layer {module.layer_idx}: the tree conv implements a silu activation, the model "
                         f"uses {module.activation!r}")


def conv_rows(buffer, inputs, conv, activation, tree_pass, conv_state):
    """A short causal conv over the pass's new nodes.

    buffer (batch, capacity, channels): the layer's kept pre-conv inputs, where inputs (batch, R, channels) of
    the nodes tree_pass.rows are stored first; conv: the HF nn.Conv1d (depthwise, weight (channels, 1, width));
    conv_state (batch, channels, L): the committed state, newest column last. Returns the rows' conv outputs
    (batch, R, channels): each window runs through the node's ancestors' kept inputs, then the conv state.
    """
    buffer.index_copy_(1, tree_pass.rows, inputs)
    return tree_conv1d(buffer, conv.weight[:, 0], conv.bias, tree_pass.index, conv_state, activation=activation,
                       rows=tree_pass.rows, validate=False)


def commit_conv(group, inputs, index, nodes):
    """Overwrite group.conv (batch, n * channels, L) in place with the conv states after path(nodes[b]): one
    tree_conv_state call for the group. inputs (n, batch, capacity, channels): the group's kept pre-conv inputs."""
    n, batch, T, width = inputs.shape
    x = inputs.permute(1, 2, 0, 3).reshape(batch, T, n * width)  # layer-major channels, as group.conv stacks them
    group.conv.copy_(tree_conv_state(x, index, nodes, group.conv, validate=False))
