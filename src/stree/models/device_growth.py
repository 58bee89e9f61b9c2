"""Growing a TreeModel's tree on the device: levels of new nodes whose tokens and parents are chosen on the device from
the last level's logits, with no host sync, several levels in one call (compiled: one graph, on CUDA one replay).
The host tree learns the new nodes afterwards (TreeModel.settle)."""
import numpy as np
import torch
from torch.utils._pytree import tree_map

from .host_tree import HostTree, PassLayout, to_device


class DeviceGrowth:
    """TreeModel's methods that grow the tree on the device (extend_on_device) and tell the host tree afterwards
    (settle)."""

    @torch.no_grad()
    def extend_on_device(self, R, depth, choose, args=(), then=None, *, more=None):
        """Grow the uncommitted tree by one level of R new nodes chosen on the device, without a host sync.

        choose(ids, *args) -> (tokens, parents, carry): ids (R,) the new nodes' ids on the device (the next R ids, as
        in extend()); the new nodes' tokens and parents, (batch, R) int64 tensors on the model's device, parents
        ids of nodes already in the tree. Every new node is `depth` below the committed sequence (position
        length + depth).
        then(logits, carry) -> out, logits (batch, R, vocab) of the new nodes; without it out = logits.
        Both run inside the pass's call (compiled with it: a level of drafting is one call). Returns out.
        more: further levels grown in the same call (compiled: one graph, on CUDA one replay, for them all),
        ((R, depth, choose, then, args_of), ...): the next level's choose() gets args_of(out) of the level before
        it. Then (even when empty) returns [out of every level].
        The host tree learns the new nodes in settle(), which extend(), commit() and host-built passes need
        first; the tree cannot grow its slots here (tree_forward's `slots`).
        """
        if self.tree is None:
            raise RuntimeError("no tree to extend: call tree_forward() first")
        outs = self._grow_levels([(R, depth, choose, then, None), *(more or ())], args)
        return outs if more is not None else outs[0]

    def settle(self, parents):
        """Tell the host tree the parents of the nodes extend_on_device() added since tree_forward() or the last
        settle(): parents (batch, n), in the order the nodes were added (the caller has them on the host; nothing
        is copied here)."""
        parents = np.asarray(parents, dtype=np.int64).reshape(self._cache.batch, -1)
        if parents.shape[1] != self._unsettled:
            raise ValueError(f"{self._unsettled} nodes were added on the device, got parents for {parents.shape[1]}")
        self.tree.add(parents)
        self._unsettled = 0

    def _grow_levels(self, levels, args):
        """extend_on_device's work: `levels` [(R, depth, choose, then, args_of)] (the first args_of None, its
        choose() gets `args`). Returns [then's output of every level]."""
        tree, cache = self.tree, self._cache
        start = tree.n + self._unsettled
        headers, layouts, positions, plan = [], [], [], []
        for R, depth, choose, then, args_of in levels:
            width, head_rows = self._shape(R, list(range(R)))
            if start + width > tree.capacity:
                raise ValueError(f"{start + width} node slots needed, the tree holds {tree.capacity}: pass slots= to "
                                 "tree_forward()")
            layout = PassLayout(cache.batch, width, len(head_rows), 0, tree.capacity, tree.window_keys)
            headers.append(HostTree.header(layout, start, cache.lengths, np.full((cache.batch, R), depth),
                                           head_rows=head_rows))
            layouts.append(layout)
            # no new node is another's ancestor
            positions.append(self._level_positions([np.arange(width)]) if self._sequential else ())
            plan.append((R, headers[-1].size, choose, then, args_of))
            start += R
        header = to_device(np.concatenate(headers), self.device)
        outs, structure = self._call(header, layouts, positions, None, (plan, args, self._structure))
        if self._static_buffers:
            # CUDA graphs: a graph's outputs are overwritten by its next replay, which the next level is (the caller
            # keeps every level's outputs until it copies them over)
            outs, structure = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (outs, structure))
        self._structure = structure
        self._unsettled += sum(level[0] for level in plan)
        return outs


def run_levels(forward, flat, layouts, positions, grown):
    """The device part of extend_on_device's call (inside TreeModel._run, compiled with it): one pass per level of
    grown = (plan, args, structure), plan [(R, header size, choose, then, args_of)]; `flat` holds the levels'
    HostTree.header()s one after another, layouts and positions one entry per level; forward(flat, layout,
    positions) is the model's forward over a pass's tensor. Returns ([then's output of every level], the extended
    structure)."""
    plan, args, structure = grown
    headers = flat.split([size for _, size, *_ in plan])
    outs = []
    for (R, _, choose, then, args_of), header, layout, level_positions in zip(plan, headers, layouts, positions):
        if args_of is not None:
            args = args_of(outs[-1])
        tokens, parents, carry = choose(header[:R], *args)  # the header's first field: the new nodes' ids
        if tokens.shape != (layout.batch, R) or parents.shape != tokens.shape:
            raise ValueError(f"choose() gave tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)}; "
                             f"expected both (batch={layout.batch}, R={R})")
        flat = HostTree.extended(header, tokens, parents, structure, layout)
        logits = forward(flat, layout, level_positions)[:, :R]
        outs.append(logits if then is None else then(logits, carry))
        structure = flat[flat.numel() - structure.numel():]
    return outs, structure
