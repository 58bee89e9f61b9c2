"""Triton kernels for the tree conv and the conv-state commit.

Each program walks up the parents of a block of nodes, one conv tap per step, reading the conv state once
the walk leaves the tree: the window is gathered in registers, no index tensor is built.
"""
import itertools

import torch
import triton
import triton.language as tl

from .launch import Launch, check_int32


# Block sizes and warps of the two kernels, read by the launchers and by the compile check (aot.py). No dots: a
# 16 x 64 fp32 tile is 8 registers per thread.
CONV_CONFIG = dict(BLOCK_T=16, BLOCK_D=64, num_warps=4)
CONV_STATE_CONFIG = dict(BLOCK_D=64, num_warps=4)


@triton.jit(do_not_specialize=["T", "R"])
def _tree_conv_kernel(x_ptr, w_ptr, bias_ptr, parents_ptr, state_ptr, rows_ptr, y_ptr, T, R, dim, state_len,
                      WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_ROWS: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # output rows; their node ids are offs_t
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_t = offs_r < R
    in_d = offs_d < dim
    if HAS_ROWS:
        offs_t = tl.load(rows_ptr + b * R + offs_r, mask=in_t, other=0)
    else:
        offs_t = offs_r
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=in_d, other=0.0).to(tl.float32)[None, :]
    cur = tl.where(in_t, offs_t, -1)
    col = tl.zeros((BLOCK_T,), dtype=tl.int32) + state_len
    for j in tl.static_range(WIDTH):  # tap j = 0 is the node itself, then its ancestors
        inside = cur >= 0
        col = tl.where(inside, col, col - 1)
        from_tree = tl.load(x_ptr + (b * T + cur[:, None]) * dim + offs_d[None, :],
                            mask=inside[:, None] & in_d[None, :], other=0.0)
        from_state = tl.load(state_ptr + (b * dim + offs_d[None, :]) * state_len + col[:, None],
                             mask=(in_t & ~inside)[:, None] & in_d[None, :], other=0.0)
        tap = tl.load(w_ptr + offs_d * WIDTH + (WIDTH - 1 - j), mask=in_d, other=0.0).to(tl.float32)
        acc += (from_tree.to(tl.float32) + from_state.to(tl.float32)) * tap[None, :]
        cur = tl.where(inside, tl.load(parents_ptr + b * T + cur, mask=inside, other=-1), -1)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (b * R + offs_r[:, None]) * dim + offs_d[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=in_t[:, None] & in_d[None, :])


@triton.jit(do_not_specialize=["T"])
def _tree_conv_state_kernel(x_ptr, parents_ptr, nodes_ptr, state_ptr, out_ptr, T, dim,
                            STATE_LEN: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = offs_d < dim
    # The walk is the same for every channel; keep it as a vector so masks have the channels' shape.
    cur = tl.load(nodes_ptr + b + tl.zeros((BLOCK_D,), dtype=tl.int32))
    col = tl.zeros((BLOCK_D,), dtype=tl.int32) + STATE_LEN
    for j in tl.static_range(STATE_LEN):  # output column STATE_LEN - 1 - j, newest first
        inside = cur >= 0
        col = tl.where(inside, col, col - 1)
        from_tree = tl.load(x_ptr + (b * T + cur) * dim + offs_d, mask=in_d & inside, other=0.0)
        from_state = tl.load(state_ptr + (b * dim + offs_d) * STATE_LEN + col, mask=in_d & ~inside, other=0.0)
        value = tl.where(inside, from_tree.to(out_ptr.dtype.element_ty), from_state.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + (b * dim + offs_d) * STATE_LEN + (STATE_LEN - 1 - j), value, mask=in_d)
        cur = tl.where(inside, tl.load(parents_ptr + b * T + cur, mask=in_d & inside, other=-1), -1)


def _conv_grid(batch, R, dim):
    return batch, triton.cdiv(R, CONV_CONFIG["BLOCK_T"]), triton.cdiv(dim, CONV_CONFIG["BLOCK_D"])


def _conv_state_grid(batch, dim):
    return batch, triton.cdiv(dim, CONV_STATE_CONFIG["BLOCK_D"])


def tree_conv1d(x, weight, bias, parents, conv_state, silu, rows=None):
    """See tree_conv.tree_conv1d (inputs already validated; rows None or (batch, R) int64)."""
    batch, T, dim = x.shape
    R = T if rows is None else rows.shape[1]
    y = torch.empty(batch, R, dim, device=x.device, dtype=x.dtype)
    if T == 0 or R == 0:
        return y
    check_int32("tree_conv1d", x=x, y=y, conv_state=conv_state)
    _tree_conv_kernel[_conv_grid(batch, R, dim)](
        x.contiguous(), weight.contiguous(), bias if bias is not None else weight, parents.contiguous(),
        conv_state.contiguous(), rows.contiguous() if rows is not None else parents, y, T, R, dim,
        conv_state.shape[2], WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, HAS_ROWS=rows is not None,
        **CONV_CONFIG)
    return y


def tree_conv_state(x, parents, nodes, conv_state):
    """See tree_conv.tree_conv_state (inputs already validated)."""
    batch, T, dim = x.shape
    out = torch.empty_like(conv_state, memory_format=torch.contiguous_format)
    if T == 0:
        return out.copy_(conv_state)
    check_int32("tree_conv_state", x=x, conv_state=conv_state)
    _tree_conv_state_kernel[_conv_state_grid(batch, dim)](
        x.contiguous(), parents.contiguous(), nodes.contiguous(), conv_state.contiguous(), out, T, dim,
        STATE_LEN=conv_state.shape[2], **CONV_STATE_CONFIG)
    return out


def compile_specs(shape, T, dtype, batch=1):
    """Every launch tree_conv1d and tree_conv_state make for one layer's conv (aot.MODEL_SHAPES: conv_width taps over
    conv_dim channels, a conv state of conv_width columns as HF keeps it), T-node trees and `dtype` inputs, weights
    and state: each flag combination. aot.check compiles them."""
    if "conv_dim" not in shape:
        return []
    dim, width = shape["conv_dim"], shape["conv_width"]
    out = []
    for has_bias, silu, has_rows in itertools.product((False, True), repeat=3):
        args = dict(x_ptr=dtype, w_ptr=dtype, bias_ptr=dtype, parents_ptr=torch.int64, state_ptr=dtype,
                    rows_ptr=torch.int64, y_ptr=dtype, T=T, R=T, dim=dim, state_len=width)
        flags = dict(WIDTH=width, HAS_BIAS=has_bias, SILU=silu, HAS_ROWS=has_rows)
        out.append(Launch.of(_tree_conv_kernel, args, flags, CONV_CONFIG, _conv_grid(batch, T, dim)))
    args = dict(x_ptr=dtype, parents_ptr=torch.int64, nodes_ptr=torch.int64, state_ptr=dtype, out_ptr=dtype, T=T,
                dim=dim)
    out.append(Launch.of(_tree_conv_state_kernel, args, dict(STATE_LEN=width), CONV_STATE_CONFIG,
                         _conv_state_grid(batch, dim)))
    return out
