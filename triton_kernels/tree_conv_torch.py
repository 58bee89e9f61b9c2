"""PyTorch reference of the tree conv and the conv-state commit (gathers; loops only over the conv width)."""
import torch
import torch.nn.functional as F

from .utils import compute_dtype


def window_index(parents, nodes, length, state_len):
    """Where each window element lives in cat(conv_state, x) along time (state_len + T columns).

    parents (batch, T); nodes (batch, Q) node ids, -1 = a window made only of state columns.
    Returns (batch, Q, length) int64: column `length - 1` is the node itself, then its parent, ...;
    a path that leaves the tree continues at state column state_len - 1, state_len - 2, ...
    """
    cur = nodes
    col = torch.full_like(nodes, state_len)
    cols = []
    for _ in range(length):
        inside = cur >= 0
        col = torch.where(inside, col, col - 1)
        cols.append(torch.where(inside, state_len + cur, col))
        cur = torch.where(inside, parents.gather(1, cur.clamp(min=0)), -1)
    return torch.stack(cols[::-1], dim=-1)


def _timeline(x, conv_state, dtype):
    """(batch, L + T, dim): the conv state's columns followed by the tree's inputs."""
    return torch.cat([conv_state.transpose(1, 2).to(dtype), x.to(dtype)], dim=1)


def tree_conv1d(x, weight, bias, parents, conv_state, silu):
    """See tree_conv.tree_conv1d (inputs already validated). Returns (batch, T, dim) in x.dtype."""
    batch, T, _ = x.shape
    cd = compute_dtype(x)
    timeline = _timeline(x, conv_state, cd)
    nodes = torch.arange(T, device=x.device).expand(batch, T)
    index = window_index(parents, nodes, weight.shape[1], conv_state.shape[2])
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
