"""Triton kernels for the tree gated delta rule (forward only).

tree_gated_delta_rule: one program per (batch row x value head, block of Dv) walks the row's levels (utils.Levels)
in order; all of a level's nodes (BLOCK_W at a time) are updated at once from their parents' (Dk, BLOCK_V) state
slices, which the previous level left in a scratch buffer of two levels x row_width states per row (a barrier
separates levels). tree_gated_delta_states: one program per (batch row x value head, block of Dv) walks
path(nodes[b]) root first with the state slice in registers (the ancestor mask says which nodes are on it).
The Dv columns of a state are independent given q and k, hence the Dv blocks; Dk is reduced over, so each
program holds all of it. q and k arrive prepared in fp32 (tree_gated_delta.prepare_qk); value head h reads key
head h // (Hv // Hk).
"""
import torch
import triton
import triton.language as tl

from .utils import gather_rows, states_or_zeros

MAX_DK = 512  # each program holds all of Dk (HF's models use 128, OLMo-Hybrid 96)


def _check_dk(dk):
    if dk > MAX_DK:
        raise ValueError(f"the Triton gated delta rule holds a state's whole key dimension in registers and supports "
                         f"Dk <= {MAX_DK}, got {dk}; use backend='torch'")


def rule_config(dk, dv, row_width):
    """Block sizes and warps of _tree_gated_delta_kernel (the launcher and the ahead-of-time check read it): a level
    tile of BLOCK_W nodes x all of Dk x BLOCK_V columns, about 2048 fp32 values per program over 8 warps (4 warps
    left a 16-byte stack frame on sm_90 at Dk = 128)."""
    block_k = triton.next_power_of_2(dk)
    block_w = min(4, triton.next_power_of_2(max(row_width, 1)), max(1, 2048 // (4 * block_k)))
    block_v = max(4, min(64, 2048 // (block_w * block_k), triton.next_power_of_2(dv)))
    return dict(BLOCK_W=block_w, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=8)


def states_config(dk, dv):
    """Block sizes and warps of _tree_gated_delta_states_kernel (one node at a time, Dk x BLOCK_V in registers)."""
    block_k = triton.next_power_of_2(dk)
    return dict(BLOCK_K=block_k, BLOCK_V=max(4, min(64, 2048 // block_k, triton.next_power_of_2(dv))), num_warps=4)


@triton.jit
def _update(S, k, v, decay, beta):
    """S (W, K, V) parents' states -> decay * S + k ⊗ beta (v - (decay * S)ᵀ k) (HF's order); k (W, K); v (W, V);
    decay, beta (W,)."""
    S = S * decay[:, None, None]
    delta = (v - tl.sum(S * k[:, :, None], axis=1)) * beta[:, None]
    return S + k[:, :, None] * delta[:, None, :]


@triton.jit(do_not_specialize=["batch", "num_levels", "row_width"])
def _tree_gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, order_ptr, slot_ptr, offsets_ptr,
                             scratch_ptr, o_ptr, batch, num_levels, row_width, key_heads, value_heads, dk, dv,
                             BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0) // value_heads
    h = tl.program_id(0) % value_heads
    hk = h // (value_heads // key_heads)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_k = offs_k < dk
    in_v = offs_v < dv
    in_kv = in_k[:, None] & in_v[None, :]
    state = h * dk * dv + offs_k[:, None] * dv + offs_v[None, :]  # offsets inside one (Hv, Dk, Dv) state
    state_size = value_heads * dk * dv
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
            m3 = in_w[:, None, None] & in_kv[None, :, :]
            node = tl.load(order_ptr + p, mask=in_w, other=0)  # flat id b * T + i
            # The parents' states: the scratch's other half, or at level 0 the initial state (fp32).
            parent = tl.load(slot_ptr + p, mask=in_w, other=0) - prev_shift
            s_ptr = (scratch_ptr + (((1 - buf) * batch + b) * row_width + parent[:, None, None]) * state_size
                     + state[None, :, :])
            s_ptr = tl.where(level == 0, h0_ptr + b * state_size + state[None, :, :] + 0 * p[:, None, None], s_ptr)
            S = tl.load(s_ptr, mask=m3, other=0.0)
            qk = (node[:, None] * key_heads + hk) * dk + offs_k[None, :]
            q = tl.load(q_ptr + qk, mask=in_w[:, None] & in_k[None, :], other=0.0)
            k = tl.load(k_ptr + qk, mask=in_w[:, None] & in_k[None, :], other=0.0)
            mv = in_w[:, None] & in_v[None, :]
            v = tl.load(v_ptr + (node[:, None] * value_heads + h) * dv + offs_v[None, :], mask=mv,
                        other=0.0).to(tl.float32)
            g = tl.load(g_ptr + node * value_heads + h, mask=in_w, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + node * value_heads + h, mask=in_w, other=0.0).to(tl.float32)
            S = _update(S, k, v, tl.exp(g), beta)
            o = tl.sum(S * q[:, :, None], axis=1)
            tl.store(o_ptr + (node[:, None] * value_heads + h) * dv + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=mv)
            tl.store(scratch_ptr + ((buf * batch + b) * row_width + (p - start)[:, None, None]) * state_size
                     + state[None, :, :], S, mask=m3)
        tl.debug_barrier()  # this level's states are written before the next level reads them


@triton.jit(do_not_specialize=["T"])
def _tree_gated_delta_states_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, mask_ptr, nodes_ptr, h0_ptr, out_ptr, T,
                                    key_heads, value_heads, dk, dv, HAS_H0: tl.constexpr, BLOCK_K: tl.constexpr,
                                    BLOCK_V: tl.constexpr):
    b = tl.program_id(0) // value_heads
    h = tl.program_id(0) % value_heads
    hk = h // (value_heads // key_heads)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_k = offs_k < dk
    in_v = offs_v < dv
    in_kv = in_k[:, None] & in_v[None, :]
    state = (b * value_heads + h) * dk * dv + offs_k[:, None] * dv + offs_v[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + state[None, :, :], mask=in_kv[None, :, :], other=0.0).to(tl.float32)
    else:
        S = tl.zeros((1, BLOCK_K, BLOCK_V), dtype=tl.float32)
    node = tl.load(nodes_ptr + b)
    for i in range(0, node + 1):  # the path in root-first order: node's ancestors by increasing id; -1: no step
        if tl.load(mask_ptr + (b * T + node) * T + i) != 0:
            row = b * T + i
            k = tl.load(k_ptr + (row * key_heads + hk) * dk + offs_k, mask=in_k, other=0.0)
            v = tl.load(v_ptr + (row * value_heads + h) * dv + offs_v, mask=in_v, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * value_heads + h + tl.zeros((1,), dtype=tl.int32)).to(tl.float32)
            beta = tl.load(beta_ptr + row * value_heads + h + tl.zeros((1,), dtype=tl.int32)).to(tl.float32)
            S = _update(S, k[None, :], v[None, :], tl.exp(g), beta)
    tl.store(out_ptr + state[None, :, :], S, mask=in_kv[None, :, :])


def tree_gated_delta_rule(q, k, v, g, beta, index, *, initial_state=None, rows=None):
    """See tree_gated_delta.tree_gated_delta_rule (inputs validated; q, k prepared fp32; rows None or (batch, R)).
    Returns o (batch, T or R, Hv, Dv) in v's dtype."""
    batch, T, key_heads, dk = k.shape
    value_heads, dv = v.shape[2:]
    _check_dk(dk)
    o = torch.empty(batch, T, value_heads, dv, device=v.device, dtype=v.dtype)
    levels = index.levels()
    if levels.sizes:
        cfg = rule_config(dk, dv, levels.row_width)
        scratch = torch.empty(2, batch, levels.row_width, value_heads, dk, dv, device=v.device, dtype=torch.float32)
        grid = (batch * value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))
        _tree_gated_delta_kernel[grid](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            states_or_zeros(initial_state, (batch, value_heads, dk, dv), torch.float32, v.device), levels.order, levels.parent_slot,
            levels.offsets.contiguous(), scratch, o, batch, len(levels.sizes), levels.row_width, key_heads,
            value_heads, dk, dv, **cfg)
    return gather_rows(o, rows)


def tree_gated_delta_states(k, v, g, beta, index, nodes, *, initial_state=None):
    """See tree_gated_delta.tree_gated_delta_states (inputs validated, k prepared fp32). Returns fp32 states."""
    batch, T, key_heads, dk = k.shape
    value_heads, dv = v.shape[2:]
    _check_dk(dk)
    out = torch.empty(batch, value_heads, dk, dv, device=v.device, dtype=torch.float32)
    if T == 0:
        return out.zero_() if initial_state is None else out.copy_(initial_state)
    cfg = states_config(dk, dv)
    _tree_gated_delta_states_kernel[(batch * value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))](
        k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), index.mask.to(torch.uint8).contiguous(),
        nodes.contiguous(), initial_state.contiguous() if initial_state is not None else v, out, T, key_heads,
        value_heads, dk, dv, HAS_H0=initial_state is not None, **cfg)
    return out


def compile_specs(shape, T, dtype, batch=1):
    """Every launch tree_gated_delta_rule and tree_gated_delta_states make for one Gated DeltaNet layer shape (a dict
    with HF's config names linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim;
    other shapes give none), T-node trees and `dtype` inputs (q, k prepared in fp32; g fp32 as HF computes it;
    initial states fp32): each level width 1..T, the commit with and without an initial state. aot.check compiles
    them."""
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if not all(n in shape for n in names):
        return []
    from .launch import Launch
    key_heads, value_heads, dk, dv = (shape[n] for n in names)
    f32 = torch.float32
    common = dict(k_ptr=f32, v_ptr=dtype, g_ptr=f32, beta_ptr=dtype, key_heads=key_heads, value_heads=value_heads,
                  dk=dk, dv=dv)
    out = []
    for cfg in {tuple(rule_config(dk, dv, w).items()) for w in range(1, T + 1)}:
        cfg = dict(cfg)
        args = dict(common, q_ptr=f32, h0_ptr=f32, order_ptr=torch.int64, slot_ptr=torch.int64,
                    offsets_ptr=torch.int64, scratch_ptr=f32, o_ptr=dtype, batch=batch, num_levels=T, row_width=T)
        out.append(Launch.of(_tree_gated_delta_kernel, args, {}, cfg,
                             (batch * value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))))
    cfg = states_config(dk, dv)
    for has_h0 in (False, True):
        args = dict(common, mask_ptr=torch.uint8, nodes_ptr=torch.int64, h0_ptr=f32 if has_h0 else dtype, out_ptr=f32,
                    T=T)
        out.append(Launch.of(_tree_gated_delta_states_kernel, args, dict(HAS_H0=has_h0), cfg,
                             (batch * value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))))
    return out
