"""Triton kernels for the tree scan (forward only).

tree_scan tiles the ancestor-masked quadratic form like a causal attention: one program per
(batch*head, block of query nodes, block of headdim) loops over key blocks up to its last query (and over dstate
in slices inside each), so any number of nodes and any dstate is exact. tree_states is one masked reduction per
(batch*head, headdim block, dstate block). Block sizes come from scan_config / states_config, which aot.py's
compile check reads too.
dt processing, the ancestor mask and the path decay s come from utils.tree_decay (a few small torch ops).
All dots run in fp32 with IEEE precision: trees are small, so exactness is worth more than tensor-core speed.
"""
import itertools

import torch
import triton
import triton.language as tl

from .launch import Launch, block, check_int32
from .utils import tree_decay


def scan_config(headdim, dstate):
    """Block sizes and warps of _tree_scan_kernel, read by the launcher and by the compile check (aot.py, `python
    benchmarks/gpu.py --compile-only`), which found them free of spills on sm_80 and sm_90 for every supported shape.

    Every dot is an fp32 FMA dot (input_precision="ieee"), which holds its whole K extent per thread: dstate is tiled
    by BLOCK_N (the K of the score and initial-state dots) and query / key blocks are 16 nodes (tl.dot's minimum, the
    lower bound of launch.block). The first version (node tiles of up to 64 x 64, all of dstate at once) spilled up
    to 22 KB per thread and asked for up to 249 KB of shared memory at T=64, dstate=256: more than either target has.
    With 4 warps, triton 3.6's ptxas (the lent GPU's) still spilled 8 bytes in three of the 48 variants; 8 warps
    spill in none, on either version. Nothing depends on the tree size; if a choice ever does, compile_specs must
    enumerate it.
    """
    return dict(BLOCK_T=16, BLOCK_K=16, BLOCK_P=block(headdim), BLOCK_N=block(dstate, hi=32), num_warps=8)


def states_config(headdim, dstate):
    """Block sizes and warps of _tree_states_kernel (launcher and aot.py, as scan_config): 32 x 32 state tiles. The
    first version (64 x all-of-dstate tiles, key blocks of up to 64 nodes) spilled up to 19 KB per thread; 32 x 64
    tiles still spilled 8 bytes on sm_80 in fp32."""
    return dict(BLOCK_K=16, BLOCK_P=block(headdim, hi=32), BLOCK_N=block(dstate, hi=32), num_warps=4)


@triton.jit(do_not_specialize=["T", "R", "nheads", "ngroups"])
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
    in_i = offs_r < R
    in_p = offs_p < headdim
    if HAS_ROWS:
        offs_i = tl.load(rows_ptr + b * R + offs_r, mask=in_i, other=0)
    else:
        offs_i = offs_r
    c_base = c_ptr + ((b * T + offs_i[:, None]) * ngroups + g) * dstate

    s_i = tl.load(s_ptr + (b * T + offs_i) * nheads + h, mask=in_i, other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    if HAS_H0:
        for n0 in range(0, dstate, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_n = offs_n < dstate
            c_rows = tl.load(c_base + offs_n[None, :], mask=in_i[:, None] & in_n[None, :], other=0.0).to(tl.float32)
            h0 = tl.load(h0_ptr + ((b * nheads + h) * headdim + offs_p[:, None]) * dstate + offs_n[None, :],
                         mask=in_p[:, None] & in_n[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(c_rows, tl.trans(h0), input_precision="ieee")
        acc = acc * tl.exp(s_i)[:, None]

    # Ancestors have smaller indices, so keys past this block's last query never contribute (chosen rows may be
    # any nodes: then every key block is visited).
    if HAS_ROWS:
        k_end = T
    else:
        k_end = tl.minimum((pid_t + 1) * BLOCK_T, T)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < T
        b_base = b_ptr + ((b * T + offs_k[:, None]) * ngroups + g) * dstate
        scores = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, dstate, BLOCK_N):  # C_i . B_k, dstate in BLOCK_N slices
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_n = offs_n < dstate
            c_rows = tl.load(c_base + offs_n[None, :], mask=in_i[:, None] & in_n[None, :], other=0.0).to(tl.float32)
            b_rows = tl.load(b_base + offs_n[None, :], mask=in_k[:, None] & in_n[None, :], other=0.0).to(tl.float32)
            scores += tl.dot(c_rows, tl.trans(b_rows), input_precision="ieee")
        x_rows = tl.load(x_ptr + ((b * T + offs_k[:, None]) * nheads + h) * headdim + offs_p[None, :],
                         mask=in_k[:, None] & in_p[None, :], other=0.0).to(tl.float32)
        dt_k = tl.load(dt_ptr + (b * T + offs_k) * nheads + h, mask=in_k, other=0.0)
        s_k = tl.load(s_ptr + (b * T + offs_k) * nheads + h, mask=in_k, other=0.0)
        on_path = tl.load(mask_ptr + (b * T + offs_i[:, None]) * T + offs_k[None, :],
                          mask=in_i[:, None] & in_k[None, :], other=0)
        decay = tl.where(on_path != 0, tl.exp(s_i[:, None] - s_k[None, :]), 0.0) * dt_k[None, :]
        acc += tl.dot(scores * decay, x_rows, input_precision="ieee")

    x_i = tl.load(x_ptr + ((b * T + offs_i[:, None]) * nheads + h) * headdim + offs_p[None, :],
                  mask=in_i[:, None] & in_p[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        d = tl.load(d_ptr + h * headdim + offs_p, mask=in_p, other=0.0)
        acc += x_i * d[None, :]
    tl.store(y_ptr + ((b * R + offs_r[:, None]) * nheads + h) * headdim + offs_p[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=in_i[:, None] & in_p[None, :])


@triton.jit(do_not_specialize=["T", "nheads", "ngroups"])
def _tree_states_kernel(x_ptr, dt_ptr, s_ptr, b_ptr, mask_ptr, nodes_ptr, h0_ptr, out_ptr,
                        T, nheads, ngroups, headdim, dstate,
                        HAS_H0: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_n = tl.program_id(2)
    b = pid_bh // nheads
    h = pid_bh % nheads
    g = h // (nheads // ngroups)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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


def _scan_grid(batch, nheads, R, headdim, cfg):
    return batch * nheads, triton.cdiv(R, cfg["BLOCK_T"]), triton.cdiv(headdim, cfg["BLOCK_P"])


def _states_grid(batch, nheads, headdim, dstate, cfg):
    return batch * nheads, triton.cdiv(headdim, cfg["BLOCK_P"]), triton.cdiv(dstate, cfg["BLOCK_N"])


def tree_scan(x, dt, A, B, C, index, *, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None, rows=None):
    """See tree_scan.tree_scan (inputs already validated; rows None or (batch, R) int64)."""
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    R = T if rows is None else rows.shape[1]
    y = torch.empty(batch, R, nheads, headdim, device=x.device, dtype=x.dtype)
    if T == 0 or R == 0:
        return y
    check_int32("tree_scan", x=x, y=y, B=B, initial_states=initial_states, mask=index.mask)
    dt, mask, s = tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, torch.float32)
    d = None if D is None else D.float().reshape(nheads, -1).expand(nheads, headdim).contiguous()
    cfg = scan_config(headdim, dstate)
    _tree_scan_kernel[_scan_grid(batch, nheads, R, headdim, cfg)](
        x.contiguous(), dt.contiguous(), s.contiguous(), B.contiguous(), C.contiguous(),
        mask.to(torch.uint8).contiguous(),
        initial_states.contiguous() if initial_states is not None else x,
        d if d is not None else x, rows.contiguous() if rows is not None else x, y,
        T, R, nheads, ngroups, headdim, dstate,
        HAS_H0=initial_states is not None, HAS_D=D is not None, HAS_ROWS=rows is not None, **cfg)
    return y


def tree_states(x, dt, A, B, index, nodes, *, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), initial_states=None):
    """See tree_scan.tree_states (inputs already validated). Returns fp32 states."""
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    out = torch.empty(batch, nheads, headdim, dstate, device=x.device, dtype=torch.float32)
    if T == 0:
        return out.zero_() if initial_states is None else out.copy_(initial_states)
    check_int32("tree_states", x=x, B=B, states=out, mask=index.mask)
    dt, mask, s = tree_decay(dt, A, index, dt_bias, dt_softplus, dt_limit, torch.float32)
    cfg = states_config(headdim, dstate)
    _tree_states_kernel[_states_grid(batch, nheads, headdim, dstate, cfg)](
        x.contiguous(), dt.contiguous(), s.contiguous(), B.contiguous(), mask.to(torch.uint8).contiguous(),
        nodes.contiguous(), initial_states.contiguous() if initial_states is not None else x, out,
        T, nheads, ngroups, headdim, dstate, HAS_H0=initial_states is not None, **cfg)
    return out


def compile_specs(shape, T, dtype, batch=1):
    """Every launch tree_scan and tree_states make for one Mamba2 layer shape (aot.MODEL_SHAPES), T-node trees and
    `dtype` inputs: each flag combination (rows= chooses T rows here; the row count changes no compiled code).
    Initial states are fp32 (HF keeps the recurrent state in fp32). aot.check compiles them."""
    if "dstate" not in shape:
        return []
    nheads, headdim, dstate, ngroups = (shape[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    f32, common = torch.float32, dict(T=T, nheads=nheads, ngroups=ngroups, headdim=headdim, dstate=dstate)
    out = []
    cfg = scan_config(headdim, dstate)
    for has_h0, has_d, has_rows in itertools.product((False, True), repeat=3):
        args = dict(x_ptr=dtype, dt_ptr=f32, s_ptr=f32, b_ptr=dtype, c_ptr=dtype, mask_ptr=torch.uint8,
                    h0_ptr=f32 if has_h0 else dtype, d_ptr=f32 if has_d else dtype,
                    rows_ptr=torch.int64 if has_rows else dtype, y_ptr=dtype, R=T, **common)
        out.append(Launch.of(_tree_scan_kernel, args, dict(HAS_H0=has_h0, HAS_D=has_d, HAS_ROWS=has_rows), cfg,
                             _scan_grid(batch, nheads, T, headdim, cfg)))
    cfg = states_config(headdim, dstate)
    for has_h0 in (False, True):
        args = dict(x_ptr=dtype, dt_ptr=f32, s_ptr=f32, b_ptr=dtype, mask_ptr=torch.uint8, nodes_ptr=torch.int64,
                    h0_ptr=f32 if has_h0 else dtype, out_ptr=f32, **common)
        out.append(Launch.of(_tree_states_kernel, args, dict(HAS_H0=has_h0), cfg,
                             _states_grid(batch, nheads, headdim, dstate, cfg)))
    return out
