"""Triton kernels for the tree conv and the conv-state commit.

Each program walks up the parents of a block of nodes, one conv tap per step, reading the conv state once
the walk leaves the tree: the window is gathered in registers, no index tensor is built.
"""
import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_D = 64


@triton.jit
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


@triton.jit
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


def tree_conv1d(x, weight, bias, parents, conv_state, silu, rows=None):
    """See tree_conv.tree_conv1d (inputs already validated; rows None or (batch, R) int64)."""
    batch, T, dim = x.shape
    R = T if rows is None else rows.shape[1]
    y = torch.empty(batch, R, dim, device=x.device, dtype=x.dtype)
    if T == 0 or R == 0:
        return y
    grid = (batch, triton.cdiv(R, BLOCK_T), triton.cdiv(dim, BLOCK_D))
    _tree_conv_kernel[grid](x.contiguous(), weight.contiguous(), bias if bias is not None else weight,
                            parents.contiguous(), conv_state.contiguous(),
                            rows.contiguous() if rows is not None else parents, y, T, R, dim, conv_state.shape[2],
                            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu,
                            HAS_ROWS=rows is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    return y


def tree_conv_state(x, parents, nodes, conv_state):
    """See tree_conv.tree_conv_state (inputs already validated)."""
    batch, T, dim = x.shape
    out = torch.empty_like(conv_state, memory_format=torch.contiguous_format)
    if T == 0:
        return out.copy_(conv_state)
    grid = (batch, triton.cdiv(dim, BLOCK_D))
    _tree_conv_state_kernel[grid](x.contiguous(), parents.contiguous(), nodes.contiguous(),
                                  conv_state.contiguous(), out, T, dim,
                                  STATE_LEN=conv_state.shape[2], BLOCK_D=BLOCK_D)
    return out
