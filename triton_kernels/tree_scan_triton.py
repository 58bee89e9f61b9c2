"""Triton kernels for the tree scan (forward only).

tree_scan tiles the ancestor-masked quadratic form like a causal attention: one program per
(batch*head, block of query nodes, block of headdim) loops over key blocks up to its last query, so any
number of nodes is exact. tree_states is one masked reduction per (batch*head, headdim block).
dt processing, the ancestor mask and the path decay s come from utils.tree_decay (a few small torch ops).
All dots run in fp32 with IEEE precision: trees are small, so exactness is worth more than tensor-core speed.
"""
import torch
import triton
import triton.language as tl

from .utils import tree_decay


def _block(n, lo=16, hi=64):
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _check_dstate(dstate):
    if dstate > 256:
        raise ValueError(f"the Triton tree scan holds the whole state row in registers and supports dstate <= 256, "
                         f"got {dstate}; use backend='torch'")


@triton.jit
def _tree_scan_kernel(x_ptr, dt_ptr, s_ptr, b_ptr, c_ptr, mask_ptr, h0_ptr, d_ptr, rows_ptr, y_ptr,
                      T, R, nheads, ngroups, headdim, dstate,
                      HAS_H0: tl.constexpr, HAS_D: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_p = tl.program_id(2)
    b = pid_bh // nheads
    h = pid_bh % nheads
    g = h // (nheads // ngroups)
    offs_r = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # output rows; their node ids are offs_i
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    in_i = offs_r < R
    in_p = offs_p < headdim
    in_n = offs_n < dstate
    if HAS_ROWS:
        offs_i = tl.load(rows_ptr + b * R + offs_r, mask=in_i, other=0)
    else:
        offs_i = offs_r

    c_rows = tl.load(c_ptr + ((b * T + offs_i[:, None]) * ngroups + g) * dstate + offs_n[None, :],
                     mask=in_i[:, None] & in_n[None, :], other=0.0).to(tl.float32)
    s_i = tl.load(s_ptr + (b * T + offs_i) * nheads + h, mask=in_i, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    if HAS_H0:
        h0 = tl.load(h0_ptr + ((b * nheads + h) * headdim + offs_p[:, None]) * dstate + offs_n[None, :],
                     mask=in_p[:, None] & in_n[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(c_rows, tl.trans(h0), input_precision="ieee") * tl.exp(s_i)[:, None]

    # Ancestors have smaller indices, so keys past this block's last query never contribute (chosen rows may be
    # any nodes: then every key block is visited).
    if HAS_ROWS:
        k_end = T
    else:
        k_end = tl.minimum((pid_t + 1) * BLOCK_T, T)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < T
        b_rows = tl.load(b_ptr + ((b * T + offs_k[:, None]) * ngroups + g) * dstate + offs_n[None, :],
                         mask=in_k[:, None] & in_n[None, :], other=0.0).to(tl.float32)
        x_rows = tl.load(x_ptr + ((b * T + offs_k[:, None]) * nheads + h) * headdim + offs_p[None, :],
                         mask=in_k[:, None] & in_p[None, :], other=0.0).to(tl.float32)
        dt_k = tl.load(dt_ptr + (b * T + offs_k) * nheads + h, mask=in_k, other=0.0)
        s_k = tl.load(s_ptr + (b * T + offs_k) * nheads + h, mask=in_k, other=0.0)
        on_path = tl.load(mask_ptr + (b * T + offs_i[:, None]) * T + offs_k[None, :],
                          mask=in_i[:, None] & in_k[None, :], other=0)
        scores = tl.dot(c_rows, tl.trans(b_rows), input_precision="ieee")
        decay = tl.where(on_path != 0, tl.exp(s_i[:, None] - s_k[None, :]), 0.0) * dt_k[None, :]
        acc += tl.dot(scores * decay, x_rows, input_precision="ieee")

    x_i = tl.load(x_ptr + ((b * T + offs_i[:, None]) * nheads + h) * headdim + offs_p[None, :],
                  mask=in_i[:, None] & in_p[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        d = tl.load(d_ptr + h * headdim + offs_p, mask=in_p, other=0.0)
        acc += x_i * d[None, :]
    tl.store(y_ptr + ((b * R + offs_r[:, None]) * nheads + h) * headdim + offs_p[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=in_i[:, None] & in_p[None, :])


@triton.jit
def _tree_states_kernel(x_ptr, dt_ptr, s_ptr, b_ptr, mask_ptr, nodes_ptr, h0_ptr, out_ptr,
                        T, nheads, ngroups, headdim, dstate,
                        HAS_H0: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = pid_bh // nheads
    h = pid_bh % nheads
    g = h // (nheads // ngroups)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    in_p = offs_p < headdim
    in_n = offs_n < dstate

    node = tl.load(nodes_ptr + b)
    node_safe = tl.maximum(node, 0)
    s_node = tl.load(s_ptr + (b * T + node_safe) * nheads + h)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if HAS_H0:
        h0 = tl.load(h0_ptr + ((b * nheads + h) * headdim + offs_p[:, None]) * dstate + offs_n[None, :],
                     mask=in_p[:, None] & in_n[None, :], other=0.0).to(tl.float32)
        acc = h0 * tl.where(node >= 0, tl.exp(s_node), 1.0)

    # node == -1 runs no iteration: the initial state comes back unchanged.
    for k0 in range(0, node + 1, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < T
        on_path = tl.load(mask_ptr + (b * T + node_safe) * T + offs_k, mask=in_k, other=0)
        dt_k = tl.load(dt_ptr + (b * T + offs_k) * nheads + h, mask=in_k, other=0.0)
        s_k = tl.load(s_ptr + (b * T + offs_k) * nheads + h, mask=in_k, other=0.0)
        weight = tl.where(on_path != 0, tl.exp(s_node - s_k), 0.0) * dt_k
        x_rows = tl.load(x_ptr + ((b * T + offs_k[:, None]) * nheads + h) * headdim + offs_p[None, :],
                         mask=in_k[:, None] & in_p[None, :], other=0.0).to(tl.float32)
        b_rows = tl.load(b_ptr + ((b * T + offs_k[:, None]) * ngroups + g) * dstate + offs_n[None, :],
                         mask=in_k[:, None] & in_n[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(x_rows * weight[:, None]), b_rows, input_precision="ieee")
    tl.store(out_ptr + ((b * nheads + h) * headdim + offs_p[:, None]) * dstate + offs_n[None, :], acc,
             mask=in_p[:, None] & in_n[None, :])


def tree_scan(x, dt, A, B, C, index, *, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None, rows=None):
    """See tree_scan.tree_scan (inputs already validated; rows None or (batch, R) int64)."""
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    _check_dstate(dstate)
    R = T if rows is None else rows.shape[1]
    y = torch.empty(batch, R, nheads, headdim, device=x.device, dtype=x.dtype)
    if T == 0 or R == 0:
        return y
    dt, mask, s = tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, torch.float32)
    d = None if D is None else D.float().reshape(nheads, -1).expand(nheads, headdim).contiguous()
    block_t, block_p = _block(R), _block(headdim)
    grid = (batch * nheads, triton.cdiv(R, block_t), triton.cdiv(headdim, block_p))
    _tree_scan_kernel[grid](
        x.contiguous(), dt.contiguous(), s.contiguous(), B.contiguous(), C.contiguous(),
        mask.to(torch.uint8).contiguous(),
        initial_states.contiguous() if initial_states is not None else x,
        d if d is not None else x, rows.contiguous() if rows is not None else x, y,
        T, R, nheads, ngroups, headdim, dstate,
        HAS_H0=initial_states is not None, HAS_D=D is not None, HAS_ROWS=rows is not None,
        BLOCK_T=block_t, BLOCK_K=block_t if rows is None else _block(T), BLOCK_P=block_p,
        BLOCK_N=_block(dstate, hi=256))
    return y


def tree_states(x, dt, A, B, index, nodes, *, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), initial_states=None):
    """See tree_scan.tree_states (inputs already validated). Returns fp32 states."""
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    _check_dstate(dstate)
    dt, mask, s = tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, torch.float32)
    out = torch.empty(batch, nheads, headdim, dstate, device=x.device, dtype=torch.float32)
    if T == 0:
        return out.zero_() if initial_states is None else out.copy_(initial_states)
    block_p = _block(headdim)
    grid = (batch * nheads, triton.cdiv(headdim, block_p))
    _tree_states_kernel[grid](
        x.contiguous(), dt.contiguous(), s.contiguous(), B.contiguous(), mask.to(torch.uint8).contiguous(),
        nodes.contiguous(), initial_states.contiguous() if initial_states is not None else x, out,
        T, nheads, ngroups, headdim, dstate,
        HAS_H0=initial_states is not None, BLOCK_K=_block(T), BLOCK_P=block_p, BLOCK_N=_block(dstate, hi=256))
    return out
