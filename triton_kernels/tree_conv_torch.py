"""PyTorch reference of the tree conv and the conv-state commit (gathers; loops only over the conv width)."""
import torch
import torch.nn.functional as F

from .utils import compute_dtype, gather_rows


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
    return timeline[torch.arange(batch, device=x.device)[:, None], index].transpose(1, 2).contiguous()
