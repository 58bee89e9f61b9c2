"""Growing a TreeModel's tree on the device: levels of new nodes whose tokens and parents are chosen on the device from
the last level's logits, with no host sync, several levels in one call (compiled: one graph, on CUDA one replay).
The host tree learns the new nodes afterwards (TreeModel.settle)."""
import numpy as np
import torch
from torch.utils._pytree import tree_map

from .host_tree import HostTree, PassLayout, to_device


def extend_on_device(tm, levels, args):
    """TreeModel.extend_on_device's work: `levels` [(R, depth, choose, then, args_of)] (the first args_of None, its
    choose() gets `args`). Returns [then's output of every level]."""
    tree, cache = tm.tree, tm._cache
    start = tree.n + tm._unsettled
    headers, layouts, positions, plan = [], [], [], []
    for R, depth, choose, then, args_of in levels:
        width, head_rows = tm._shape(R, list(range(R)))
        if start + width > tree.capacity:
            raise ValueError(f"{start + width} node slots needed, the tree holds {tree.capacity}: pass slots= to "
                             "tree_forward()")
        layout = PassLayout(cache.batch, width, len(head_rows), 0, tree.capacity, tree.window_keys)
        headers.append(HostTree.header(layout, start, cache.length, np.full((cache.batch, R), depth),
                                       head_rows=head_rows))
        layouts.append(layout)
        # no new node is another's ancestor
        positions.append(tm._level_positions([np.arange(width)]) if tm._sequential else ())
        plan.append((R, headers[-1].size, choose, then, args_of))
        start += R
    header = to_device(np.concatenate(headers), tm.device)
    outs, structure = tm._call(header, layouts, positions, None, (plan, args, tm._structure))
    if tm._static_buffers:
        # CUDA graphs: a graph's outputs are overwritten by its next replay, which the next level is (the caller
        # keeps every level's outputs until it copies them over)
        outs, structure = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (outs, structure))
    tm._structure = structure
    tm._unsettled += sum(level[0] for level in plan)
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
