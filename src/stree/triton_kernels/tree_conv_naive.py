"""Naive reference of tree_conv1d / tree_conv_state: each node's conv window gathered by walking up its path, in
float64.

The sequence node i sees is conv_state's columns (oldest first) followed by x along path(i) (root first); a
width-W depthwise conv reads its last W entries:

    out_i = act(sum_w weight[:, w] · window_i[w] + bias)          (act: silu or identity)

and the conv state after path(a) is the last state_len entries of that sequence.
"""
import torch
import torch.nn.functional as F


def path_to(parents, i):
    """Node ids from the root down to i (a list; [] for i = -1). parents: a sequence of ints, -1 = root."""
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents[i])
    return path[::-1]


def conv_windows_loop(x, parents, conv_state, length, nodes):
    """Each requested node's window of the last `length` inputs along its path: (batch, len(nodes[b]), length, dim)
    float64.

    x (batch, T, dim); parents: per batch row a sequence of T ints; conv_state (batch, dim, L), newest column last;
    nodes: per batch row, a list of node ids (-1 = the state alone, so the state's last `length` columns).
    """
    out = []
    for b in range(x.shape[0]):
        rows = []
        for i in nodes[b]:
            seq = [conv_state[b, :, c].double() for c in range(conv_state.shape[2])]
            seq += [x[b, k].double() for k in (path_to(parents[b], i) if i >= 0 else [])]
            rows.append(torch.stack(seq[-length:]))
        out.append(torch.stack(rows))
    return torch.stack(out)


def conv_loop(x, weight, bias, parents, conv_state, silu=True):
    """The tree conv of every node: (batch, T, dim) float64, sum over the width of weight * window, plus bias, then
    silu (silu=False: no activation). weight (dim, width); bias (dim,) or None; the rest as conv_windows_loop."""
    T, width = x.shape[1], weight.shape[1]
    windows = conv_windows_loop(x, parents, conv_state, width, [list(range(T))] * x.shape[0])
    out = (windows * weight.double().T[None, None]).sum(2)
    if bias is not None:
        out = out + bias.double()
    return F.silu(out) if silu else out
