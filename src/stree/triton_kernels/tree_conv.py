"""Depthwise causal conv1d over a token tree, and the conv-state commit: public entry points and checks.

Node i's window is [u_{a_{W-1}}, ..., u_{a_1}, u_i] with a_1 = parent(i), a_2 = parent(a_1), ...; once the
path leaves the tree the window continues into conv_state, newest column last (docs/design.md §2).
"""
from . import tree_conv_torch
from .utils import check_float, check_nodes, check_rows, check_shape, resolve_backend, tree_index

ACTIVATIONS = ("silu", "swish", None, "identity")


def _check_conv_inputs(x, parents, conv_state):
    check_shape("x", x, (None, None, None))
    check_float("x", x)
    batch, T, dim = x.shape
    check_shape("conv_state", conv_state, (batch, dim, None))
    check_float("conv_state", conv_state)
    if conv_state.device != x.device:
        raise ValueError(f"conv_state is on {conv_state.device} but x is on {x.device}")
    return tree_index(parents, batch, T, x.device)


def _check_conv_weights(x, weight, bias, conv_state, activation):
    dim = x.shape[2]
    check_shape("weight", weight, (dim, None))
    check_float("weight", weight)
    width = weight.shape[1]
    if width < 1 or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state holds {conv_state.shape[2]} columns but a width-{width} conv needs at "
                         f"least {width - 1}")
    if bias is not None:
        check_shape("bias", bias, (dim,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def tree_conv1d(x, weight, bias, parents, conv_state, *, activation="silu", rows=None, backend="auto",
                validate=True):
    """Causal depthwise conv over a tree: each node sees its own ancestors, then the conv state.

    Args:
        x: (batch, T, dim) pre-conv inputs of the tree's nodes (HF's xBC, token-major).
        weight: (dim, width) depthwise taps, weight[:, -1] multiplies the node itself (HF: conv1d.weight[:, 0]).
        bias: (dim,) or None.
        parents: (batch, T) integer, parents[b, i] < i, -1 = child of the prefix; or a utils.TreeIndex of it.
        conv_state: (batch, dim, L) with L >= width - 1, the last L inputs before the tree, newest last.
        activation: "silu" (= "swish") or None / "identity".
        rows: None (every node) or (R,) / (batch, R) node ids whose outputs to compute.
        backend: "auto" | "triton" | "torch".
        validate: False skips every input check (no host sync), for callers passing a TreeIndex they built.
    Returns:
        (batch, T, dim), or (batch, R, dim) with rows, in x's dtype.
    """
    if validate:
        index = _check_conv_inputs(x, parents, conv_state)
        _check_conv_weights(x, weight, bias, conv_state, activation)
        rows = check_rows(rows, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    silu = activation in ("silu", "swish")
    if resolve_backend(backend, x) == "triton":
        from . import tree_conv_triton
        rows = rows.expand(x.shape[0], -1) if rows is not None and rows.dim() == 1 else rows
        return tree_conv_triton.tree_conv1d(x, weight, bias, index.parents, conv_state, silu, rows)
    return tree_conv_torch.tree_conv1d(x, weight, bias, index, conv_state, silu, rows)


def tree_conv_state(x, parents, nodes, conv_state, *, backend="auto", validate=True):
    """Conv state after accepting node nodes[b]: the last L inputs along its path, topped up from conv_state.

    Args:
        x: (batch, T, dim) the tree's pre-conv inputs; parents: (batch, T);
        nodes: (batch,) accepted node per row, -1 = nothing accepted (conv_state comes back unchanged);
        conv_state: (batch, dim, L) state before the tree, newest column last.
        validate: as tree_conv1d.
    Returns:
        new conv state, same shape and dtype as conv_state (a new tensor; conv_state is not modified).
    """
    if validate:
        index = _check_conv_inputs(x, parents, conv_state)
        nodes = check_nodes(nodes, x.shape[0], x.shape[1], x.device)
    else:
        index = parents
    if resolve_backend(backend, x) == "triton":
        from . import tree_conv_triton
        return tree_conv_triton.tree_conv_state(x, index.parents, nodes, conv_state)
    return tree_conv_torch.tree_conv_state(x, index, nodes, conv_state)
