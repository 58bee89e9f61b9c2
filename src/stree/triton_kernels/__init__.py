"""Tree kernels for stateful LMs (installed as ``stree.triton_kernels``): Mamba2's SSD scan, Mamba1's selective
scan, the gated delta rule, Kimi Delta Attention (KDA) and short convolutions.

Each op has a Triton kernel and a PyTorch path, chosen by ``backend="auto"|"triton"|"torch"`` (auto: Triton for
CUDA tensors of fp16 / bf16 / fp32, PyTorch otherwise), and a naive float64 reference in ``<op>_naive.py`` (a plain
per-node loop, what the tests compare against). The recurrent families have two forms: the engine form (``*_rows``
and ``*_commit``: a pass's new nodes over per-slot buffers kept across passes, what stree's TreeModel runs) and the
node form (every node of a tree from an initial state). Shapes follow mamba_ssm (Mamba2, Mamba1) and HF / fla
(delta rules); see each function's docstring.
"""
from .norms import l2norm_divide, l2norm_rsqrt
from .tree_conv import tree_conv1d, tree_conv_state
from .tree_gated_delta import (tree_gated_delta_commit, tree_gated_delta_rows, tree_gated_delta_rule,
                               tree_gated_delta_states)
from .tree_kda import tree_kda_commit, tree_kda_rows, tree_kda_rule, tree_kda_states
from .tree_scan import tree_scan, tree_states
from .tree_selective_scan import tree_selective_rows, tree_selective_scan, tree_selective_states
from .utils import TreeIndex, ancestor_mask

__all__ = ["tree_scan", "tree_states", "tree_selective_scan", "tree_selective_states", "tree_selective_rows",
           "tree_gated_delta_rule", "tree_gated_delta_states", "tree_gated_delta_rows", "tree_gated_delta_commit",
           "tree_kda_rule", "tree_kda_states", "tree_kda_rows", "tree_kda_commit", "tree_conv1d", "tree_conv_state",
           "l2norm_rsqrt", "l2norm_divide", "ancestor_mask", "TreeIndex"]
