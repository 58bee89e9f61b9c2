"""Shared helpers for the tree kernels: input checks, backend choice, tree structure, dt processing.

Nothing here imports Triton, so the PyTorch references work on machines without it.
"""
import importlib.util
import os

import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend, tensor):
    """Return "triton" or "torch" for a request of "auto" | "triton" | "torch".

    auto picks Triton for CUDA tensors of a dtype Triton handles (fp16/bf16/fp32) and the PyTorch
    reference otherwise (CPU tensors, float64). An explicit "triton" that cannot run raises ValueError.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    runnable = HAS_TRITON and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    if backend == "auto":
        return "triton" if runnable and tensor.is_cuda and tensor.dtype in TRITON_DTYPES else "torch"
    if not HAS_TRITON:
        raise ValueError("backend='triton' requested but triton is not installed")
    if not runnable:
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)")
    if tensor.dtype not in TRITON_DTYPES:
        raise ValueError(f"backend='triton' supports float16, bfloat16 and float32 inputs, got {tensor.dtype}; "
                         "use backend='torch' for other dtypes")
    return "triton"


def compute_dtype(tensor):
    """fp64 inputs are computed in fp64, everything else accumulates in fp32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def check_shape(name, tensor, shape):
    """Raise ValueError unless tensor.shape == shape (None entries match anything)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {tuple(tensor.shape)}")


def check_float(name, tensor):
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def check_parents(parents, batch, T, device):
    """Validate parents (batch, T): integer, on `device`, -1 <= parents[b, i] < i. Returns int64 parents."""
    check_shape("parents", parents, (batch, T))
    if parents.is_floating_point() or parents.is_complex() or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
    if parents.device != device:
        raise ValueError(f"parents is on {parents.device} but the inputs are on {device}")
    parents = parents.long()
    bad = (parents < -1) | (parents >= torch.arange(T, device=device))
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        if parents[b, i] < -1:
            raise ValueError(f"parents[{b}, {i}] = {parents[b, i].item()} is below -1 (-1 means: child of the prefix)")
        raise ValueError(f"parents must be topological (parents[b, i] < i); parents[{b}, {i}] = "
                         f"{parents[b, i].item()}")
    return parents


def check_nodes(nodes, batch, T, device):
    """Validate nodes (batch,): integer, -1 <= nodes[b] < T. Returns int64 nodes."""
    check_shape("nodes", nodes, (batch,))
    if nodes.is_floating_point() or nodes.dtype == torch.bool:
        raise ValueError(f"nodes must be an integer tensor, got {nodes.dtype}")
    if nodes.device != device:
        raise ValueError(f"nodes is on {nodes.device} but the inputs are on {device}")
    nodes = nodes.long()
    bad = (nodes < -1) | (nodes >= T)
    if bool(bad.any()):
        b = bad.nonzero()[0].item()
        raise ValueError(f"nodes[{b}] = {nodes[b].item()} is out of range [-1, {T}) (-1 = nothing accepted)")
    return nodes


def ancestor_matrix(parents, dtype=torch.float32):
    """Ancestor-or-self relation of a batch of trees as a 0/1 matrix.

    parents (batch, T) int64, topological, -1 = child of the prefix.
    Returns (batch, T, T) in `dtype` with [b, i, k] = 1 if k is on path(i) (path including i itself), else 0.
    With P the parent adjacency (P[i, parent(i)] = 1), (I - P)^-1 = I + P + P^2 + ... counts the paths from i
    to each ancestor, and there is exactly one: one triangular solve, exact in floating point.
    """
    batch, T = parents.shape
    eye = torch.eye(T, dtype=dtype, device=parents.device)
    adjacency = torch.zeros(batch, T, T + 1, dtype=dtype, device=parents.device)  # column T: the prefix
    adjacency.scatter_(2, parents.masked_fill(parents < 0, T)[..., None], 1.0)
    return torch.linalg.solve_triangular(eye - adjacency[..., :T], eye.expand(batch, T, T), upper=False,
                                         unitriangular=True)


def ancestor_mask(parents):
    """(batch, T, T) bool, [b, i, k] = node k is on path(i) (i itself included). See ancestor_matrix."""
    return ancestor_matrix(parents) > 0.5


def process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype):
    """dt (batch, T, nheads) -> clamp(softplus(dt + dt_bias), *dt_limit) in `dtype`."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def tree_decay(dt, A, parents, dt_bias, dt_softplus, dt_limit, dtype):
    """Processed dt, ancestor mask and path decay s shared by both scan backends.

    dt (batch, T, nheads) raw; A (nheads,); parents (batch, T).
    Returns dt (batch, T, nheads) in `dtype`, mask (batch, T, T) bool, and s (batch, T, nheads) with
    s[b, i, h] = sum of dt[b, k, h] * A[h] over k on path(i): the tree's analogue of cumsum(dt * A).
    """
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype)
    ancestors = ancestor_matrix(parents, dtype)
    return dt, ancestors > 0.5, torch.matmul(ancestors, dt * A.to(dtype))
