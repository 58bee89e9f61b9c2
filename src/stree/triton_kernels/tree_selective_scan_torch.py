"""PyTorch path of the Mamba1 tree walk over kept per-slot states (the CPU path): the new rows level by level.

Inputs are already validated, and dt processed, by tree_selective_scan.py. A level's rows are updated at once from
their parents' kept states, in the order of HF's single-token update (``mamba_selective_state_update``):
h = h_parent * exp(dt*A) + (dt*B) * x.
"""
import torch

from .utils import as_dtype


def selective_walk(states, parents, rows, levels, dt, B, x, A):
    """Mamba1's recurrence for a pass's new nodes, level by level, each from its parent's kept state.

    states (batch, slots, heads, head_dim, N): every node's kept state, the committed one in the last slot (the
    roots' parent); parents (batch, slots - 1) the tree's; rows (R,) the new nodes; levels: positions into rows
    grouped by level (a sequence of (W,) int64 tensors, ancestors' levels first; see row_levels); dt (softplus
    applied) and x (batch, R, heads, head_dim), B (batch, R, heads, N) in the compute dtype; A (heads, head_dim, N).
    h = h_parent · exp(dt·A) + (dt·B)·x, HF's decode step. Writes the rows' states into `states` and returns them
    (batch, R, heads, head_dim, N) in its dtype.
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


def row_levels(mask, rows):
    """rows (R,)'s positions grouped by level, for selective_walk: a position's level is one more than the deepest
    level among its ancestors in rows on any tree (0 without any). mask (batch, T, T) bool, the ancestor mask. Built
    on the host (one synchronisation); a list of int64 tensors on rows' device."""
    within = mask.index_select(1, rows).index_select(2, rows).any(0).cpu()            # (R, R)
    level = [0] * rows.shape[0]
    for p in range(len(level)):
        ancestors = within[p, :p].nonzero().flatten().tolist()
        level[p] = max((level[a] + 1 for a in ancestors), default=0)
    return [torch.tensor([p for p, lv in enumerate(level) if lv == d], device=rows.device)
            for d in range(max(level, default=-1) + 1)]
