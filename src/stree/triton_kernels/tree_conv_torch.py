"""PyTorch reference of the tree conv and the conv-state commit (gathers; loops only over the conv width)."""
import torch
import torch.nn.functional as F

from .utils import as_dtype, compute_dtype


def _timeline(x, conv_state, dtype):
    """(batch, L + T, dim): the conv state's columns followed by the tree's inputs."""
    return torch.cat([as_dtype(conv_state.transpose(1, 2), dtype), as_dtype(x, dtype)], dim=1)


def _windows(timeline, index):
    """timeline (batch, L + T, dim) at index (batch, Q, W) -> (batch, Q, W, dim)."""
    batch, Q, W = index.shape
    if batch == 1:
        return timeline[0].index_select(0, index.reshape(-1)).view(1, Q, W, timeline.shape[2])
    return timeline[torch.arange(batch, device=timeline.device)[:, None, None], index]


def tree_conv1d(x, weight, bias, tree, conv_state, silu, rows=None):
    """See tree_conv.tree_conv1d (inputs already validated; tree: a utils.TreeIndex; rows: None, (R,) or
    (batch, R)). Returns (batch, T or R, dim) in x.dtype."""
    cd = compute_dtype(x)
    index = tree.queries(rows).windows(weight.shape[1], conv_state.shape[2])
    out = (_windows(_timeline(x, conv_state, cd), index) * as_dtype(weight, cd).T).sum(2)
    if bias is not None:
        out = out + as_dtype(bias, cd)
    return as_dtype(F.silu(out) if silu else out, x.dtype)


def tree_conv_state(x, tree, nodes, conv_state):
    """See tree_conv.tree_conv_state (inputs already validated; tree: a utils.TreeIndex)."""
    batch, T, _ = x.shape
    state_len = conv_state.shape[2]
    timeline = _timeline(x, conv_state, conv_state.dtype)
    if T == 0:
        return conv_state.clone()
    windows = tree.windows(state_len, state_len)                                        # (batch, T, L)
    index = windows.gather(1, nodes.clamp(min=0)[:, None, None].expand(batch, 1, state_len))[:, 0]
    keep = torch.arange(state_len, device=x.device).expand(batch, state_len)           # nothing accepted
    index = torch.where((nodes >= 0)[:, None], index, keep)
    return _windows(timeline, index[:, None])[:, 0].transpose(1, 2).contiguous()
