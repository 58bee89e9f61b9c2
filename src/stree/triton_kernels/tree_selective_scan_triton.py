"""Triton kernel of the Mamba1 tree walk over kept per-slot states (forward only).

One program per (batch row, block of channels) walks the pass's R new rows in pass order (parents first): row i
reads its parent's state from the kept buffer (the committed state, in the last slot, for a root), updates it as
HF's decode step does, h = h_parent * exp(dt*A) + (dt*B) * x in fp32, and stores it in slot i in the buffer's
dtype; a barrier later the next rows (its children, maybe) read it. Channels are independent, hence the blocks;
each program holds all of dstate. Channel d of a (heads, head_dim) layout (Zamba) reads head d // head_dim's B.
"""
import torch
import triton
import triton.language as tl

from .launch import Launch, block, check_int32

MAX_DSTATE = 256  # Mamba1 models use 16


def walk_config(dim, dstate):
    """Block sizes and warps of _selective_rows_kernel (the launcher and aot.py read them): BLOCK_D channels x all of
    dstate, about 2048 fp32 values per program."""
    block_n = triton.next_power_of_2(dstate)
    return dict(BLOCK_D=block(min(dim, 2048 // block_n), hi=128), BLOCK_N=block_n, num_warps=4)


@triton.jit(do_not_specialize=["R", "slots"])
def _selective_rows_kernel(states_ptr, parents_ptr, rows_ptr, dt_ptr, b_ptr, x_ptr, a_ptr, R, slots, dim, head_dim,
                           heads, dstate, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    in_d = offs_d < dim
    in_dn = in_d[:, None] & (offs_n < dstate)[None, :]
    state = offs_d[:, None] * dstate + offs_n[None, :]  # offsets inside one (dim, dstate) state
    A = tl.load(a_ptr + state, mask=in_dn, other=0.0).to(tl.float32)
    head = offs_d // head_dim
    for r in range(R):
        i = tl.load(rows_ptr + r)
        parent = tl.load(parents_ptr + b * (slots - 1) + i)
        source = tl.where(parent >= 0, parent, slots - 1)
        h = tl.load(states_ptr + (b * slots + source) * dim * dstate + state, mask=in_dn, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + (b * R + r) * dim + offs_d, mask=in_d, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + (b * R + r) * dim + offs_d, mask=in_d, other=0.0).to(tl.float32)
        Bv = tl.load(b_ptr + ((b * R + r) * heads + head[:, None]) * dstate + offs_n[None, :], mask=in_dn,
                     other=0.0).to(tl.float32)
        h = h * tl.exp(dt[:, None] * A) + (dt[:, None] * Bv) * x[:, None]
        tl.store(states_ptr + (b * slots + i) * dim * dstate + state, h.to(states_ptr.dtype.element_ty), mask=in_dn)
        tl.debug_barrier()  # row i's state is in the buffer before a later row (a child, maybe) reads it


def check_dstate(dstate):
    if dstate > MAX_DSTATE:
        raise ValueError(f"the Triton selective scan holds a channel's whole state in registers and supports dstate <= "
                         f"{MAX_DSTATE}, got {dstate}; use backend='torch'")


def selective_rows(states, parents, rows, dt, B, x, A):
    """See tree_selective_scan.tree_selective_rows (validated; rows (R,)): the walk, then the rows' states (batch, R,
    heads, head_dim, N) in the buffer's dtype."""
    batch, slots, heads, head_dim, dstate = states.shape
    R, dim = rows.shape[0], heads * head_dim
    check_dstate(dstate)
    if not states.is_contiguous():
        raise ValueError("the Triton selective walk writes states in place and needs it contiguous")
    if R and batch:
        check_int32("tree_selective_rows", states=states, dt=dt, x=x, B=B)
        cfg = walk_config(dim, dstate)
        _selective_rows_kernel[(batch, triton.cdiv(dim, cfg["BLOCK_D"]))](
            states, parents.contiguous(), rows.contiguous(), dt.contiguous(), B.contiguous(), x.contiguous(),
            A.contiguous(), R, slots, dim, head_dim, heads, dstate, **cfg)
    return states.index_select(1, rows)


def compile_specs(shape, T, dtype, batch=1):
    """Every launch of the Mamba1 walk for one layer shape (a dict with HF's config names intermediate_size and
    state_size; other shapes give none) and T slots: dt, x, B and A in fp32 (the compute dtype), the kept states in
    fp32 or the model `dtype`. aot.check compiles them."""
    if "intermediate_size" not in shape or "state_size" not in shape:
        return []
    dim, dstate, f32 = shape["intermediate_size"], shape["state_size"], torch.float32
    cfg = walk_config(dim, dstate)
    grid = (batch, triton.cdiv(dim, cfg["BLOCK_D"]))
    out = []
    for states_dtype in dict.fromkeys((f32, dtype)):
        args = dict(states_ptr=states_dtype, parents_ptr=torch.int64, rows_ptr=torch.int64, dt_ptr=f32, b_ptr=f32,
                    x_ptr=f32, a_ptr=f32, R=T, slots=T + 1, dim=dim, head_dim=dim, heads=1, dstate=dstate)
        out.append(Launch.of(_selective_rows_kernel, args, {}, cfg, grid))
    return out
