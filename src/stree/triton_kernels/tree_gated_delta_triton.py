"""Triton kernels of the delta-rule UT form over kept per-slot buffers (forward only): Gated DeltaNet here, KDA
(tree_kda_triton.py) through the same programs with a decay per key channel.

Rows (a pass's new nodes): one program per (batch row, value head, block of Dv) walks the R new rows in pass order
(parents first). For row i it sums, over the ancestors j != i already in the buffers (the earlier passes' nodes,
and this pass's earlier rows),

    exp(G_i - G_j)·(k_i·k_j)·u_j  and  exp(G_i - G_j)·(q_i·k_j)·u_j          (KDA: sum_d k_i[d] k_j[d] e^(..)[d])

then u_i = beta_i·(v_i - S0ᵀ(exp(G_i)·k_i) - first sum) is forward substitution, o_i = S0ᵀ(exp(G_i)·q_i) +
second sum + (q_i·k_i)·u_i, and u_i is stored in the buffer (a barrier later, the next rows read it). Slots are
visited BLOCK_J at a time, from the chunk holding i down to slot 0 (ancestors have smaller ids). Slot ids increase
along a path, so the segment sum G_i - G_j is the sum of g_t over the slots t on path(i) with t > j: a reverse
cumulative sum inside the chunk plus the path's sum over the later chunks, each adding only its segment's terms
(never a difference of prefix sums).

Commit: one program per (layer x batch row, value head, block of Dv): S = exp(G_a)·S0 + sum_j exp(G_a - G_j)·
k_j ⊗ u_j over j on path(a), one fp32 dot (IEEE) per BLOCK_J slots. Value head h reads key head h // (Hv // Hk).
Everything accumulates in fp32; the buffers hold the compute dtype.
"""
import torch
import triton
import triton.language as tl

from .launch import Launch, block, check_int32

MAX_DK = 512  # each program holds all of Dk (HF's models use 128, OLMo-Hybrid 96)

# tl.sum and tl.cumsum are @jit wrappers around tl.reduce / tl.associative_scan with this combine function (their
# fp32 inputs need no cast). Called directly they compile to the same code, and the interpreter (TRITON_INTERPRET=1:
# the tests on machines without a GPU) skips a ~2 ms patching step that each nested @jit call costs it, which made
# up most of these kernels' test time.
_add = tl.standard._sum_combine


def rows_config(dk, dv, per_channel):
    """Block sizes and warps of the rows kernels (launchers and aot.py read them): BLOCK_J = 16 slots at a time, all
    of Dk, BLOCK_V columns such that the state slice and a slot tile stay near 2048 fp32 values each. Checked with
    aot.py at Qwen3-Next's and Kimi Linear's shapes (Dk = Dv = 128): 168 registers and no spill on sm_80 and sm_90
    with 4 warps; KDA's per-channel decay tiles run with 8 (128 / 188 registers; 4 warps took 252 on sm_80)."""
    block_k = block(dk, hi=1024)
    return dict(BLOCK_J=16, BLOCK_K=block_k, BLOCK_C=block_k if per_channel else 1,
                BLOCK_V=block(min(dv, 2048 // block_k)), num_warps=8 if per_channel else 4)


def commit_config(dk, dv, per_channel):
    """Block sizes and warps of the commit kernels: a Dk x BLOCK_V fp32 accumulator of about 4096 values."""
    block_k = block(dk, hi=1024)
    return dict(BLOCK_J=16, BLOCK_K=block_k, BLOCK_C=block_k if per_channel else 1,
                BLOCK_V=block(min(dv, 4096 // block_k)), num_warps=4)


@triton.jit
def _decays(gates_ptr, mask_ptr, gate_row0, mask_row0, T, node, j0, later, h, value_heads, channels,
            BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr):
    """The slots j = j0 .. j0 + BLOCK_J - 1 seen from `node`: on_j (BLOCK_J,) whether j is on path(node); exp(G_node -
    G_j) there, else 0 (BLOCK_J, BLOCK_C); and later + the log decays on path(node) in the chunk. later: the log
    decays summed over path(node) past the chunk. gate_row0 / mask_row0: this tree's slot 0 in the gates / mask;
    the gates hold `channels` values per (slot, value head): Dk for KDA, 1 for Gated DeltaNet.

    Slot ids increase along a path, so G_node - G_j is the sum of g_t over t on path(node) with t > j: within the
    chunk a reverse cumulative sum of g shifted by one slot (j itself left out), plus `later`. Each adds only its
    segment's terms, never a difference of prefix sums."""
    offs_j = j0 + tl.arange(0, BLOCK_J)
    offs_c = tl.arange(0, BLOCK_C)
    path = mask_ptr + (mask_row0 + node) * T
    on_j = tl.load(path + offs_j, mask=offs_j <= node, other=0) != 0
    on_next = tl.load(path + offs_j + 1, mask=(offs_j + 1 <= node) & (offs_j + 1 < j0 + BLOCK_J), other=0) != 0
    gates = gates_ptr + ((gate_row0 + offs_j[:, None]) * value_heads + h) * channels + offs_c[None, :]
    in_c = (offs_c < channels)[None, :]
    own = tl.load(gates, mask=on_j[:, None] & in_c, other=0.0).to(tl.float32)
    after = tl.load(gates + value_heads * channels, mask=on_next[:, None] & in_c, other=0.0).to(tl.float32)
    segment = later[None, :] + tl.associative_scan(after, 0, _add, reverse=True)
    decay = tl.where(on_j[:, None], tl.exp(tl.where(on_j[:, None], segment, 0.0)), 0.0)
    return on_j, decay, later + tl.reduce(own, 0, _add)


@triton.jit
def _rows_program(q_ptr, keys_ptr, gates_ptr, updates_ptr, v_ptr, beta_ptr, state_ptr, mask_ptr, rows_ptr, o_ptr,
                  R, T, state_stride, key_heads, value_heads, dk, dv, channels, BLOCK_J: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (batch row, value head, Dv block) of a pass: see the module docstring."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (value_heads // key_heads)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_k = offs_k < dk
    in_v = offs_v < dv
    state = state_ptr + b * state_stride + (h * dk + offs_k[:, None]) * dv + offs_v[None, :]
    keys = keys_ptr + (b * T * key_heads + hk) * dk             # slot t's key: keys + t * key_heads * dk
    updates = updates_ptr + (b * T * value_heads + h) * dv       # slot t's u: updates + t * value_heads * dv
    for r in range(R):
        i = tl.load(rows_ptr + r)
        k_i = tl.load(keys + i * key_heads * dk + offs_k, mask=in_k, other=0.0).to(tl.float32)
        q_i = tl.load(q_ptr + ((b * R + r) * key_heads + hk) * dk + offs_k, mask=in_k, other=0.0).to(tl.float32)
        # sum_j exp(G_i - G_j)·(k_i·k_j)·u_j and the same with q_i, over the ancestors j != i: (BLOCK_V,) each
        from_keys = tl.full((BLOCK_V,), 0.0, tl.float32)
        from_queries = tl.full((BLOCK_V,), 0.0, tl.float32)
        log_growth = tl.full((BLOCK_C,), 0.0, tl.float32)
        chunks = (i + BLOCK_J) // BLOCK_J
        for c in range(chunks):  # last chunk first: `log_growth` sums the path past the chunk
            j0 = (chunks - 1 - c) * BLOCK_J
            on_j, decay, log_growth = _decays(gates_ptr, mask_ptr, b * T, b * T, T, i, j0, log_growth, h,
                                              value_heads, channels, BLOCK_J, BLOCK_C)
            offs_j = j0 + tl.arange(0, BLOCK_J)
            on_j = on_j & (offs_j != i)
            keys_j = tl.load(keys + offs_j[:, None] * key_heads * dk + offs_k[None, :],
                             mask=on_j[:, None] & in_k[None, :], other=0.0).to(tl.float32)
            weighted = keys_j * decay
            u_j = tl.load(updates + offs_j[:, None] * value_heads * dv + offs_v[None, :],
                          mask=on_j[:, None] & in_v[None, :], other=0.0).to(tl.float32)
            from_keys += tl.reduce(tl.reduce(weighted * k_i[None, :], 1, _add)[:, None] * u_j, 0, _add)
            from_queries += tl.reduce(tl.reduce(weighted * q_i[None, :], 1, _add)[:, None] * u_j, 0, _add)
        # What the committed state gives, S0ᵀ(exp(G_i)·k_i) and S0ᵀ(exp(G_i)·q_i) (S0 read again for each row: held
        # across the loop it would take registers the slot tiles need)
        S0 = tl.load(state, mask=in_k[:, None] & in_v[None, :], other=0.0).to(tl.float32)
        growth = tl.exp(log_growth)
        from_keys += tl.reduce(S0 * (k_i * growth)[:, None], 0, _add)
        from_queries += tl.reduce(S0 * (q_i * growth)[:, None], 0, _add)
        at = (b * R + r) * value_heads + h
        beta = tl.load(beta_ptr + at).to(tl.float32)
        v_i = tl.load(v_ptr + at * dv + offs_v, mask=in_v, other=0.0).to(tl.float32)
        u_i = beta * (v_i - from_keys)
        o_i = from_queries + tl.reduce(q_i * k_i, 0, _add) * u_i
        tl.store(updates + i * value_heads * dv + offs_v, u_i.to(updates_ptr.dtype.element_ty), mask=in_v)
        tl.store(o_ptr + at * dv + offs_v, o_i.to(o_ptr.dtype.element_ty), mask=in_v)
        tl.debug_barrier()  # u_i is in the buffer before a later row (a child, maybe) reads it


@triton.jit
def _commit_program(keys_ptr, gates_ptr, updates_ptr, state_ptr, mask_ptr, nodes_ptr, out_ptr, batch, T,
                    layer_stride, batch_stride, key_heads, value_heads, dk, dv, channels, BLOCK_J: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (layer x batch row, value head, Dv block) of a commit: see the module docstring."""
    lb = tl.program_id(0)
    b = lb % batch
    h = tl.program_id(1)
    hk = h // (value_heads // key_heads)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_kv = (offs_k < dk)[:, None] & (offs_v < dv)[None, :]
    node = tl.load(nodes_ptr + b)  # -1: no slot is on the path, the state comes back
    S = tl.full((BLOCK_K, BLOCK_V), 0.0, tl.float32)
    log_growth = tl.full((BLOCK_C,), 0.0, tl.float32)
    chunks = (node + BLOCK_J) // BLOCK_J
    for c in range(chunks):  # last chunk first, as in _rows_program
        j0 = (chunks - 1 - c) * BLOCK_J
        on_j, decay, log_growth = _decays(gates_ptr, mask_ptr, lb * T, b * T, T, node, j0, log_growth, h,
                                          value_heads, channels, BLOCK_J, BLOCK_C)
        offs_j = j0 + tl.arange(0, BLOCK_J)
        keys_j = tl.load(keys_ptr + ((lb * T + offs_j[:, None]) * key_heads + hk) * dk + offs_k[None, :],
                         mask=on_j[:, None] & (offs_k < dk)[None, :], other=0.0).to(tl.float32)
        u_j = tl.load(updates_ptr + ((lb * T + offs_j[:, None]) * value_heads + h) * dv + offs_v[None, :],
                      mask=on_j[:, None] & (offs_v < dv)[None, :], other=0.0).to(tl.float32)
        S += tl.dot(tl.trans(keys_j * decay), u_j, input_precision="ieee")
    S0 = tl.load(state_ptr + (lb // batch) * layer_stride + b * batch_stride + (h * dk + offs_k[:, None]) * dv
                 + offs_v[None, :], mask=in_kv, other=0.0).to(tl.float32)
    S += S0 * tl.exp(log_growth)[:, None]
    tl.store(out_ptr + ((lb * value_heads + h) * dk + offs_k[:, None]) * dv + offs_v[None, :], S, mask=in_kv)


@triton.jit(do_not_specialize=["R", "T"])
def _gated_delta_rows_kernel(q_ptr, keys_ptr, gates_ptr, updates_ptr, v_ptr, beta_ptr, state_ptr, mask_ptr, rows_ptr,
                             o_ptr, R, T, state_stride, key_heads, value_heads, dk, dv, BLOCK_J: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    _rows_program(q_ptr, keys_ptr, gates_ptr, updates_ptr, v_ptr, beta_ptr, state_ptr, mask_ptr, rows_ptr, o_ptr, R,
                  T, state_stride, key_heads, value_heads, dk, dv, 1, BLOCK_J, BLOCK_K, BLOCK_C, BLOCK_V)


@triton.jit(do_not_specialize=["batch", "T"])
def _gated_delta_commit_kernel(keys_ptr, gates_ptr, updates_ptr, state_ptr, mask_ptr, nodes_ptr, out_ptr, batch, T,
                               layer_stride, batch_stride, key_heads, value_heads, dk, dv, BLOCK_J: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    _commit_program(keys_ptr, gates_ptr, updates_ptr, state_ptr, mask_ptr, nodes_ptr, out_ptr, batch, T, layer_stride,
                    batch_stride, key_heads, value_heads, dk, dv, 1, BLOCK_J, BLOCK_K, BLOCK_C, BLOCK_V)


def check_dk(dk):
    if dk > MAX_DK:
        raise ValueError(f"the Triton gated delta rule holds a state's whole key dimension in registers and supports "
                         f"Dk <= {MAX_DK}, got {dk}; use backend='torch'")


def _trailing_contiguous(t, lead):
    """t if its dims after the first `lead` are laid out contiguously (the kernels take strides for the first ones
    only), else a contiguous copy."""
    want = 1
    for size, stride in reversed(list(zip(t.shape[lead:], t.stride()[lead:]))):
        if size != 1 and stride != want:
            return t.contiguous()
        want *= size
    return t


def _check_buffers(**buffers):
    for name, t in buffers.items():
        if not t.is_contiguous():
            raise ValueError(f"the Triton delta rule writes {name} in place and needs it contiguous")


def delta_rows(kernel, q, k, v, g, beta, state, index, rows, keys, gates, updates, per_channel=False):
    """The rows kernel `kernel` (gated delta or KDA) for a pass: arguments as tree_gated_delta.tree_gated_delta_rows
    (validated; rows (R,)). Writes the rows' k, g (here, with torch) and u into the buffers; returns o (batch, R, Hv,
    Dv) in the buffers' dtype."""
    batch, R, key_heads, dk = q.shape
    T, (value_heads, dv) = keys.shape[1], v.shape[2:]
    check_dk(dk)
    _check_buffers(keys=keys, gates=gates, updates=updates)
    o = torch.empty(batch, R, value_heads, dv, device=v.device, dtype=updates.dtype)
    if R == 0 or batch == 0:
        return o
    keys.index_copy_(1, rows, k)
    gates.index_copy_(1, rows, g)
    mask, state = index.mask.contiguous().view(torch.uint8), _trailing_contiguous(state, 1)
    check_int32(kernel.__name__, keys=keys, gates=gates, updates=updates, state=state, mask=mask, q=q, v=v)
    cfg = rows_config(dk, dv, per_channel)
    kernel[(batch, value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))](
        q.contiguous(), keys, gates, updates, v.contiguous(), beta.contiguous(), state, mask, rows.contiguous(), o, R,
        T, state.stride(0), key_heads, value_heads, dk, dv, **cfg)
    return o


def delta_commit(kernel, state, index, nodes, keys, gates, updates, per_channel=False):
    """The commit kernel `kernel` (gated delta or KDA): arguments as tree_gated_delta.tree_gated_delta_commit
    (validated). Returns the states after path(nodes[b]), (n, batch, Hv, Dk, Dv) in the buffers' dtype."""
    n, batch, T, key_heads, dk = keys.shape
    value_heads, dv = updates.shape[3:]
    check_dk(dk)
    if T == 0 or n * batch == 0:  # every node is -1
        return state.to(updates.dtype, copy=True)
    out = torch.empty(n, batch, value_heads, dk, dv, device=updates.device, dtype=updates.dtype)
    mask, state = index.mask.contiguous().view(torch.uint8), _trailing_contiguous(state, 2)
    keys, gates, updates = keys.contiguous(), gates.contiguous(), updates.contiguous()
    check_int32(kernel.__name__, keys=keys, gates=gates, updates=updates, state=state, out=out, mask=mask)
    cfg = commit_config(dk, dv, per_channel)
    kernel[(n * batch, value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))](
        keys, gates, updates, state, mask, nodes.contiguous(), out, batch, T, state.stride(0), state.stride(1),
        key_heads, value_heads, dk, dv, **cfg)
    return out


def delta_launches(rows_kernel, commit_kernel, key_heads, value_heads, dk, dv, T, per_channel, batch=1):
    """The two launches of one layer shape with T slots (every buffer fp32, the compute dtype of fp16 / bf16 / fp32
    models; the block sizes depend on Dk and Dv only)."""
    f32, i64, u8 = torch.float32, torch.int64, torch.uint8
    common = dict(keys_ptr=f32, gates_ptr=f32, updates_ptr=f32, state_ptr=f32, mask_ptr=u8, T=T,
                  key_heads=key_heads, value_heads=value_heads, dk=dk, dv=dv)
    cfg = rows_config(dk, dv, per_channel)
    args = dict(common, q_ptr=f32, v_ptr=f32, beta_ptr=f32, rows_ptr=i64, o_ptr=f32, R=T,
                state_stride=value_heads * dk * dv)
    out = [Launch.of(rows_kernel, args, {}, cfg, (batch, value_heads, triton.cdiv(dv, cfg["BLOCK_V"])))]
    cfg = commit_config(dk, dv, per_channel)
    args = dict(common, nodes_ptr=i64, out_ptr=f32, batch=batch, layer_stride=batch * value_heads * dk * dv,
                batch_stride=value_heads * dk * dv)
    out.append(Launch.of(commit_kernel, args, {}, cfg, (batch, value_heads, triton.cdiv(dv, cfg["BLOCK_V"]))))
    return out


def compile_specs(shape, T, dtype, batch=1):
    """Every launch of the gated delta rule's rows and commit for one Gated DeltaNet layer shape (a dict with HF's
    config names linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim; other
    shapes give none) and T slots. The buffers hold fp32 whatever the model `dtype`. aot.check compiles them."""
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if not all(n in shape for n in names):
        return []
    return delta_launches(_gated_delta_rows_kernel, _gated_delta_commit_kernel, *(shape[n] for n in names), T,
                          per_channel=False, batch=batch)
