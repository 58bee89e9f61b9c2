"""PyTorch reference of the tree conv and the conv-state commit (gathers; loops only over the conv width)."""
import torch
import torch.nn.functional as F

from .utils import compute_dtype, gather_rows, window_index


def _timeline(x, conv_state, dtype):
    """(batch, L + T, dim): the conv state's columns followed by the tree's inputs."""
    return torch.cat([conv_state.transpose(1, 2).to(dtype), x.to(dtype)], dim=1)


def tree_conv1d(x, weight, bias, tree, conv_state, silu, rows=None):
    """See tree_conv.tree_conv1d (inputs already validated; tree: a utils.TreeIndex; rows: None or (batch, R)).
    Returns (batch, T or R, dim) in x.dtype."""
    batch = x.shape[0]
    cd = compute_dtype(x)
    timeline = _timeline(x, conv_state, cd)
    index = gather_rows(tree.windows(weight.shape[1], conv_state.shape[2]), rows)
    windows = timeline[torch.arange(batch, device=x.device)[:, None, None], index]      # (batch, T, W, dim)
    out = torch.einsum("btwd,dw->btd", windows, weight.to(cd))
    if bias is not None:
        out = out + bias.to(cd)
    return (F.silu(out) if silu else out).to(x.dtype)


def tree_conv_state(x, parents, nodes, conv_state):
    """See tree_conv.tree_conv_state (inputs already validated)."""
    batch, _, state_len = conv_state.shape
    timeline = _timeline(x, conv_state, conv_state.dtype)
    index = window_index(parents, nodes[:, None], state_len, state_len)[:, 0]           # (batch, L)
    return timeline[torch.arange(batch, device=x.device)[:, None], index].transpose(1, 2).contiguous()
