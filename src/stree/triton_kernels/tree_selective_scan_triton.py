"""Triton kernels for the Mamba1 tree selective scan (forward only).

tree_selective_scan: one program per (batch row, block of channels) walks the row's levels (utils.Levels) in
order; all of a level's nodes (BLOCK_W at a time) are updated at once from their parents' states, which the
previous level left in a scratch buffer of two levels x row_width states per row (a barrier separates levels).
tree_selective_states: one program per (batch row, block of channels) walks path(nodes[b]) root first with the
state in registers (the ancestor mask says which nodes are on it), so the commit needs no level structure.
dt arrives processed (tree_selective_scan.selective_dt); everything accumulates in fp32.
"""
import itertools

import torch
import triton
import triton.language as tl

from .utils import gather_rows, states_or_zeros

MAX_DSTATE = 256  # Mamba1 models use 16


def scan_config(dim, dstate, row_width):
    """Block sizes and warps of _tree_selective_scan_kernel (the launcher and the ahead-of-time check read it):
    a level tile of BLOCK_W nodes x BLOCK_D channels x all of dstate, about 2048 fp32 values per program (4096
    spilled a few bytes on sm_80 / sm_90 at ~170 registers)."""
    block_n = triton.next_power_of_2(dstate)
    block_w = min(4, triton.next_power_of_2(max(row_width, 1)), max(1, 2048 // (16 * block_n)))
    block_d = max(16, min(128, 2048 // (block_w * block_n), triton.next_power_of_2(dim)))
    return dict(BLOCK_W=block_w, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4)


def states_config(dim, dstate):
    """Block sizes and warps of _tree_selective_states_kernel (one node at a time, BLOCK_D x dstate in registers)."""
    block_n = triton.next_power_of_2(dstate)
    return dict(BLOCK_D=max(16, min(128, 2048 // block_n, triton.next_power_of_2(dim))), BLOCK_N=block_n,
                num_warps=4)


@triton.jit
def _update(h, dt, x, B, A):
    """h (W, D, N) parents' states -> h * exp(dt*A) + (dt*B) * x (HF's decode order); dt, x (W, D); B (W, N)."""
    return h * tl.exp(dt[:, :, None] * A[None, :, :]) + (dt[:, :, None] * B[:, None, :]) * x[:, :, None]


@triton.jit(do_not_specialize=["batch", "num_levels", "row_width"])
def _tree_selective_scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, h0_ptr, order_ptr, slot_ptr,
                                offsets_ptr, scratch_ptr, y_ptr, batch, num_levels, row_width, dim, dstate,
                                HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_W: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    in_d = offs_d < dim
    in_dn = in_d[:, None] & (offs_n < dstate)[None, :]
    state = offs_d[:, None] * dstate + offs_n[None, :]  # offsets inside one (dim, dstate) state
    A = tl.load(a_ptr + state, mask=in_dn, other=0.0).to(tl.float32)
    if HAS_D:
        d_skip = tl.load(d_ptr + offs_d, mask=in_d, other=0.0).to(tl.float32)
    state_size = dim * dstate
    for level in range(num_levels):
        start = tl.load(offsets_ptr + level * (batch + 1) + b)
        end = tl.load(offsets_ptr + level * (batch + 1) + b + 1)
        buf = level % 2  # this level's half of the scratch; the parents' states are in the other
        # A parent's slot counts from its level's start; the scratch counts from this row's first node there.
        prev = offsets_ptr + tl.maximum(level - 1, 0) * (batch + 1)
        prev_shift = tl.load(prev + b) - tl.load(prev)
        for p0 in range(start, end, BLOCK_W):
            p = p0 + tl.arange(0, BLOCK_W)
            in_w = p < end
            m3 = in_w[:, None, None] & in_dn[None, :, :]
            node = tl.load(order_ptr + p, mask=in_w, other=0)  # flat id b * T + i
            # The parents' states: the scratch's other half, or at level 0 the initial state (fp32).
            parent = tl.load(slot_ptr + p, mask=in_w, other=0) - prev_shift
            h_ptr = (scratch_ptr + (((1 - buf) * batch + b) * row_width + parent[:, None, None]) * state_size
                     + state[None, :, :])
            h_ptr = tl.where(level == 0, h0_ptr + b * state_size + state[None, :, :] + 0 * p[:, None, None], h_ptr)
            h = tl.load(h_ptr, mask=m3, other=0.0)
            m2 = in_w[:, None] & in_d[None, :]
            dt = tl.load(dt_ptr + node[:, None] * dim + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + node[:, None] * dim + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
            mn = in_w[:, None] & (offs_n < dstate)[None, :]
            Bv = tl.load(b_ptr + node[:, None] * dstate + offs_n[None, :], mask=mn, other=0.0).to(tl.float32)
            Cv = tl.load(c_ptr + node[:, None] * dstate + offs_n[None, :], mask=mn, other=0.0).to(tl.float32)
            h = _update(h, dt, x, Bv, A)
            y = tl.sum(h * Cv[:, None, :], axis=2)
            if HAS_D:
                y += d_skip[None, :] * x
            if HAS_Z:
                z = tl.load(z_ptr + node[:, None] * dim + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
                y = y * (z * tl.sigmoid(z))
            tl.store(y_ptr + node[:, None] * dim + offs_d[None, :], y.to(y_ptr.dtype.element_ty), mask=m2)
            tl.store(scratch_ptr + ((buf * batch + b) * row_width + (p - start)[:, None, None]) * state_size
                     + state[None, :, :], h, mask=m3)
        tl.debug_barrier()  # this level's states are written before the next level reads them


@triton.jit(do_not_specialize=["T"])
def _tree_selective_states_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, mask_ptr, nodes_ptr, h0_ptr, out_ptr, T, dim, dstate,
                                  HAS_H0: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    in_d = offs_d < dim
    in_n = offs_n < dstate
    in_dn = in_d[:, None] & in_n[None, :]
    state = offs_d[:, None] * dstate + offs_n[None, :]
    A = tl.load(a_ptr + state, mask=in_dn, other=0.0).to(tl.float32)
    if HAS_H0:
        h = tl.load(h0_ptr + b * dim * dstate + state[None, :, :], mask=in_dn[None, :, :], other=0.0).to(tl.float32)
    else:
        h = tl.zeros((1, BLOCK_D, BLOCK_N), dtype=tl.float32)
    node = tl.load(nodes_ptr + b)
    for k in range(0, node + 1):  # the path in root-first order: node's ancestors by increasing id; -1: no step
        if tl.load(mask_ptr + (b * T + node) * T + k) != 0:
            row = b * T + k
            dt = tl.load(dt_ptr + row * dim + offs_d, mask=in_d, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * dim + offs_d, mask=in_d, other=0.0).to(tl.float32)
            Bv = tl.load(b_ptr + row * dstate + offs_n, mask=in_n, other=0.0).to(tl.float32)
            h = _update(h, dt[None, :], x[None, :], Bv[None, :], A)
    tl.store(out_ptr + b * dim * dstate + state[None, :, :], h, mask=in_dn[None, :, :])


def _check_dstate(dstate):
    if dstate > MAX_DSTATE:
        raise ValueError(f"the Triton selective scan holds a channel's whole state in registers and supports dstate <= "
                         f"{MAX_DSTATE}, got {dstate}; use backend='torch'")


def tree_selective_scan(x, dt, A, B, C, index, *, D=None, z=None, initial_states=None, rows=None):
    """See tree_selective_scan.tree_selective_scan (inputs validated, dt processed fp32; rows None or (batch, R))."""
    batch, T, dim = x.shape
    dstate = A.shape[1]
    _check_dstate(dstate)
    y = torch.empty(batch, T, dim, device=x.device, dtype=x.dtype)
    levels = index.levels()
    if levels.sizes:
        cfg = scan_config(dim, dstate, levels.row_width)
        scratch = torch.empty(2, batch, levels.row_width, dim, dstate, device=x.device, dtype=torch.float32)
        grid = (batch, triton.cdiv(dim, cfg["BLOCK_D"]))
        _tree_selective_scan_kernel[grid](
            x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(),
            D.contiguous() if D is not None else x, z.contiguous() if z is not None else x,
            states_or_zeros(initial_states, (batch, dim, dstate), torch.float32, x.device), levels.order, levels.parent_slot,
            levels.offsets.contiguous(), scratch, y, batch, len(levels.sizes), levels.row_width, dim, dstate,
            HAS_D=D is not None, HAS_Z=z is not None, **cfg)
    return gather_rows(y, rows)


def tree_selective_states(x, dt, A, B, index, nodes, *, initial_states=None):
    """See tree_selective_scan.tree_selective_states (inputs validated, dt processed fp32). Returns fp32 states."""
    batch, T, dim = x.shape
    dstate = A.shape[1]
    _check_dstate(dstate)
    out = torch.empty(batch, dim, dstate, device=x.device, dtype=torch.float32)
    if T == 0:
        return out.zero_() if initial_states is None else out.copy_(initial_states)
    cfg = states_config(dim, dstate)
    _tree_selective_states_kernel[(batch, triton.cdiv(dim, cfg["BLOCK_D"]))](
        x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), index.mask.to(torch.uint8).contiguous(),
        nodes.contiguous(), initial_states.contiguous() if initial_states is not None else x, out, T, dim, dstate,
        HAS_H0=initial_states is not None, **cfg)
    return out


def compile_specs(shape, T, dtype, batch=1):
    """Every launch tree_selective_scan and tree_selective_states make for one Mamba1 layer shape (a dict with HF's
    config names intermediate_size and state_size; other shapes give none), T-node trees and `dtype` inputs: each
    flag combination and each level width 1..T. Initial states and dt are fp32. aot.check compiles them."""
    if "intermediate_size" not in shape or "state_size" not in shape:
        return []
    from .launch import Launch
    dim, dstate, f32 = shape["intermediate_size"], shape["state_size"], torch.float32
    common = dict(x_ptr=dtype, dt_ptr=f32, a_ptr=f32, b_ptr=dtype, dim=dim, dstate=dstate)
    out, configs = [], {tuple(scan_config(dim, dstate, w).items()) for w in range(1, T + 1)}
    for (has_d, has_z), cfg in itertools.product(itertools.product((False, True), repeat=2), configs):
        cfg = dict(cfg)
        args = dict(common, c_ptr=dtype, d_ptr=f32 if has_d else dtype, z_ptr=dtype, h0_ptr=f32,
                    order_ptr=torch.int64, slot_ptr=torch.int64, offsets_ptr=torch.int64, scratch_ptr=f32,
                    y_ptr=dtype, batch=batch, num_levels=T, row_width=T)
        out.append(Launch.of(_tree_selective_scan_kernel, args, dict(HAS_D=has_d, HAS_Z=has_z), cfg,
                             (batch, triton.cdiv(dim, cfg["BLOCK_D"]))))
    cfg = states_config(dim, dstate)
    for has_h0 in (False, True):
        args = dict(common, mask_ptr=torch.uint8, nodes_ptr=torch.int64, h0_ptr=f32 if has_h0 else dtype,
                    out_ptr=f32, T=T)
        out.append(Launch.of(_tree_selective_states_kernel, args, dict(HAS_H0=has_h0), cfg,
                             (batch, triton.cdiv(dim, cfg["BLOCK_D"]))))
    return out
