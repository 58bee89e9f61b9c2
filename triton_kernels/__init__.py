"""Tree-masked Mamba2 kernels (installed as ``stree.triton_kernels``).

Each op has a Triton kernel and a vectorised PyTorch reference, chosen by ``backend="auto"|"triton"|"torch"``
(auto: Triton for CUDA tensors, PyTorch otherwise). Shapes follow mamba_ssm; see each function's docstring.
"""
from .tree_conv import tree_conv1d, tree_conv_state
from .tree_scan import tree_scan, tree_states
from .utils import TreeIndex, ancestor_mask

__all__ = ["tree_scan", "tree_states", "tree_conv1d", "tree_conv_state", "ancestor_mask", "TreeIndex"]
