"""Triton kernels of tree KDA (forward only): the delta-rule programs of tree_gated_delta_triton.py with a decay
per key channel, so that every segment sum G_i - G_j is a (Dk,) vector and the couplings read sum_d k_i[d] k_j[d]
exp(G_i - G_j)[d]. See that module for the layout of the programs.
"""
import triton
import triton.language as tl

from .tree_gated_delta_triton import _commit_program, _rows_program, delta_launches


@triton.jit(do_not_specialize=["R", "T"])
def _kda_rows_kernel(q_ptr, keys_ptr, gates_ptr, updates_ptr, v_ptr, beta_ptr, state_ptr, mask_ptr, rows_ptr, o_ptr,
                     R, T, state_stride, key_heads, value_heads, dk, dv, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    _rows_program(q_ptr, keys_ptr, gates_ptr, updates_ptr, v_ptr, beta_ptr, state_ptr, mask_ptr, rows_ptr, o_ptr, R,
                  T, state_stride, key_heads, value_heads, dk, dv, dk, BLOCK_J, BLOCK_K, BLOCK_C, BLOCK_V)


@triton.jit(do_not_specialize=["batch", "T"])
def _kda_commit_kernel(keys_ptr, gates_ptr, updates_ptr, state_ptr, mask_ptr, nodes_ptr, out_ptr, batch, T,
                       layer_stride, batch_stride, key_heads, value_heads, dk, dv, BLOCK_J: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    _commit_program(keys_ptr, gates_ptr, updates_ptr, state_ptr, mask_ptr, nodes_ptr, out_ptr, batch, T, layer_stride,
                    batch_stride, key_heads, value_heads, dk, dv, dk, BLOCK_J, BLOCK_K, BLOCK_C, BLOCK_V)


def compile_specs(shape, T, dtype, batch=1):
    """Every launch of KDA's rows and commit for one Kimi Linear layer shape (a dict with HF's KimiLinearConfig names
    linear_num_heads and linear_head_dim; other shapes give none) and T slots; the buffers hold fp32 whatever the
    model `dtype`. aot.check compiles them."""
    if "linear_num_heads" not in shape or "linear_head_dim" not in shape:
        return []
    heads, dim = shape["linear_num_heads"], shape["linear_head_dim"]
    return delta_launches(_kda_rows_kernel, _kda_commit_kernel, heads, heads, dim, dim, T, per_channel=True,
                          batch=batch)
