"""Tree kernels for stateful LMs (installed as ``stree.triton_kernels``): Mamba2's SSD scan, Mamba1's selective
scan, the gated delta rule and short convolutions.

Each op has a Triton kernel and a vectorised PyTorch reference, chosen by ``backend="auto"|"triton"|"torch"``
(auto: Triton for CUDA tensors, PyTorch otherwise). Shapes follow mamba_ssm (Mamba2, Mamba1) and HF / fla (gated
delta rule); see each function's docstring.
"""
from .tree_conv import tree_conv1d, tree_conv_state
from .tree_gated_delta import tree_gated_delta_rule, tree_gated_delta_states
from .tree_scan import tree_scan, tree_states
from .tree_selective_scan import tree_selective_scan, tree_selective_states
from .utils import TreeIndex, ancestor_mask

__all__ = ["tree_scan", "tree_states", "tree_selective_scan", "tree_selective_states", "tree_gated_delta_rule",
           "tree_gated_delta_states", "tree_conv1d", "tree_conv_state", "ancestor_mask", "TreeIndex"]
