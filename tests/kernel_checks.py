"""Shared pieces of the tree-kernel tests: the relative-error check against the naive per-node references (float64,
on the CPU; stree.triton_kernels.<op>_naive, re-exported by loops), random delta-rule inputs, and the engine-form
harness (passes of new nodes over kept per-slot buffers, then the commit). batch rows of T nodes; parents (batch, T)."""
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from stree import random_parents
from stree.triton_kernels import TreeIndex

TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def assert_close(actual, expected, dtype):
    """max |actual - expected| <= TOL[dtype] * (max |expected| + 1e-6); expected is the loop's (CPU, float64)."""
    err = (actual.double().cpu() - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-6
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs scale {scale:.3g}"


def assert_matches_loop(out, loop, inputs, extras, dtype=torch.float32):
    """out (batch, T, ...) is the naive loop's outputs on CPU copies of inputs and extras, to TOL[dtype]."""
    assert_close(out, loop(**cpu(inputs), **cpu(extras))[0], dtype)


def assert_states(states, nodes, h0, all_states, dtype=torch.float32):
    """states[b] is the loop's all_states[b, nodes[b]] (all_states (batch, T, ...)), or h0[b] where nodes[b] < 0."""
    for b in range(len(nodes)):
        want = h0[b].double().cpu() if nodes[b] < 0 else all_states[b, nodes[b]]
        assert_close(states[b], want, dtype)


def pick_rows(ref, rows, per_row):
    """ref (batch, T, ...) at the chosen nodes: rows (batch, R) per batch row, or rows (R,) shared by all."""
    return torch.stack([ref[b, rows[b] if per_row else rows] for b in range(ref.shape[0])])


def chosen_rows(T, per_row, batch=2):
    """Nodes to ask for with rows=: (batch, 7) distinct per batch row, or one shared (5,) list with a repeat."""
    g = torch.Generator().manual_seed(12)
    if per_row:
        return torch.stack([torch.randperm(T, generator=g)[:7] for _ in range(batch)])
    return torch.tensor([T - 1, 0, 5, 5, 12])


def chosen_nodes(T, seed, batch=3):
    """One node per batch row whose state to ask for; row 0 is the empty path (-1) for seed 0, the last node else."""
    nodes = torch.randint(0, T, (batch,), generator=torch.Generator().manual_seed(seed))
    nodes[0] = -1 if seed == 0 else T - 1
    return nodes


def cpu(args):
    """The dict with its tensors moved to the CPU (what the naive loops take)."""
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}


def seeded_trees(T, batch):
    """`batch` random parent lists of T nodes, row s drawn with a generator of its own seeded s."""
    return [random_parents(T, torch.Generator().manual_seed(s)) for s in range(batch)]


def assert_rejects(fn, args, change, message):
    """fn(**args) with `change` applied raises a ValueError matching `message`."""
    args = dict(args, **change)
    with pytest.raises(ValueError, match=message):
        fn(**args)


def grown_passes(parents, passes, capacity):
    """Per pass (start, end) of new nodes, as the engine runs them: (start, end, TreeIndex over `capacity` slots that
    knows the nodes added so far (the other slots -1), rows = arange(start, end)). parents (batch, T)."""
    for start, end in passes:
        grown = torch.full((parents.shape[0], capacity), -1, dtype=torch.long, device=parents.device)
        grown[:, :end] = parents[:, :end]
        yield start, end, TreeIndex(grown), torch.arange(start, end, device=parents.device)


# ---- delta rules (gated delta, KDA) ---------------------------------------------------------------------------------

def delta_inputs(parents_rows, key_heads, value_heads, dk, dv, gate_dims, seed, dtype, device, h0):
    """Random delta-rule inputs, drawn in this order from one generator seeded `seed`: q, k (batch, T, key_heads, dk),
    v (batch, T, value_heads, dv) in dtype; log decays g < 0 (batch, T, value_heads, *gate_dims) in float32; beta
    (batch, T, value_heads) in (0, 1); parents (batch, T). Extras: use_qk_l2norm=True and initial_state (batch,
    value_heads, dk, dv) float32, or None without h0."""
    g = torch.Generator().manual_seed(seed)
    batch, T = len(parents_rows), len(parents_rows[0])

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    inputs = dict(q=rnd(batch, T, key_heads, dk), k=rnd(batch, T, key_heads, dk), v=rnd(batch, T, value_heads, dv),
                  g=(-torch.rand(batch, T, value_heads, *gate_dims, generator=g)).to(device),
                  beta=torch.rand(batch, T, value_heads, generator=g).to(device, dtype),
                  parents=torch.tensor(parents_rows, device=device, dtype=torch.long))
    extras = dict(use_qk_l2norm=True,
                  initial_state=torch.randn(batch, value_heads, dk, dv, generator=g).to(device) if h0 else None)
    return inputs, extras


def state_args(inputs):
    """The node-form inputs a states call takes (all but q)."""
    return {k: v for k, v in inputs.items() if k != "q"}


def assert_rows_independent(fn, inputs, extras, out, **kw):
    """Each batch row run alone (every input and the initial_state sliced to it) gives that row of `out`."""
    for b in range(out.shape[0]):
        one = {k: v[b:b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(fn(**one, **dict(extras, initial_state=extras["initial_state"][b:b + 1]), **kw),
                                   out[b:b + 1])


class DeltaOp(NamedTuple):
    """One delta rule: its node-form rule and states, its engine-form rows and commit, the naive loop (the oracle) and
    its q/k l2norm."""
    rule: Callable
    states: Callable
    rows: Callable
    commit: Callable
    loop: Callable
    l2norm: Callable


def check_delta_rule(op, inputs, extras, backend, dtype=torch.float32):
    """op.rule's outputs on inputs and extras are op.loop's to TOL[dtype]; returns them (batch, T, Hv, Dv)."""
    o = op.rule(**inputs, **extras, backend=backend)
    assert_matches_loop(o, op.loop, inputs, extras, dtype)
    return o


def check_delta_exact(op, inputs, extras):
    """fp64 on the torch backend: op.rule's outputs (float64) are op.loop's to 1e-10, and op.states of nodes
    [T - 1, -1] the loop's state after node T - 1 in row 0 and the initial state in row 1."""
    T = inputs["parents"].shape[1]
    o = op.rule(**inputs, **extras)
    assert o.dtype == torch.float64
    o_ref, states = op.loop(**inputs, **extras)
    assert_close(o, o_ref, torch.float64)
    got = op.states(**state_args(inputs), nodes=torch.tensor([T - 1, -1]), **extras)
    assert_close(got[0], states[0, T - 1], torch.float64)
    assert_close(got[1], extras["initial_state"][1], torch.float64)


def assert_matches_hf(op, inputs, extras, out, out_hf, nodes, final, tol, backend):
    """out equals HF's outputs out_hf, and op.states after nodes (batch,) equals HF's final state (batch, Hv, Dk, Dv),
    both to rtol = atol = tol."""
    torch.testing.assert_close(out, out_hf, rtol=tol, atol=tol)
    got = op.states(**state_args(inputs), nodes=nodes, **extras, backend=backend)
    torch.testing.assert_close(got, final, rtol=tol, atol=tol)


def delta_engine_passes(op, inputs, extras, passes, capacity, backend, seed):
    """Drive op.rows as the engine does: passes [(start, end)] of new nodes over buffers of `capacity` slots that
    start with garbage (a finished tree's, seeded `seed`): keys, gates, updates (batch, capacity, *X.shape[2:]) for X
    = k, g, v. q, v, g, beta are taken in k's dtype. Returns the outputs of every pass concatenated (batch, T, Hv,
    Dv), the buffers and the last pass's index."""
    q, k, v, g, beta = (inputs[n].to(inputs["k"].dtype) for n in ("q", "k", "v", "g", "beta"))
    gen = torch.Generator().manual_seed(seed)
    buffers = tuple(torch.randn(k.shape[0], capacity, *t.shape[2:], generator=gen).to(k.device, k.dtype)
                    for t in (k, g, v))
    qn, kn = op.l2norm(q) * k.shape[3] ** -0.5, op.l2norm(k)
    outs = []
    for start, end, index, rows in grown_passes(inputs["parents"], passes, capacity):
        new = slice(start, end)
        outs.append(op.rows(qn[:, new], kn[:, new], v[:, new], g[:, new], beta[:, new], extras["initial_state"], index,
                            rows, *buffers, backend=backend))
    return torch.cat(outs, 1), buffers, index


def check_delta_engine(op, layers, passes, backend):
    """Engine form over a stack of layers [(inputs, extras)] sharing one tree of T nodes, each over T + 2 slots
    (buffers seeded by the layer's place): every pass's outputs are op.loop's on the grown tree, and op.commit of
    nodes [T - 1, 2] and [-1, 5] (-1: the committed state) over the stacked buffers, with the committed states
    (n, batch, Hv, Dk, Dv) strided as the engine's cache holds them, is op.loop's state there."""
    T = layers[0][0]["parents"].shape[1]
    results = [delta_engine_passes(op, *layer, passes, T + 2, backend, seed=s) for s, layer in enumerate(layers)]
    loops = [op.loop(**cpu(inputs), **cpu(extras)) for inputs, extras in layers]
    for (o, _, _), (o_ref, _) in zip(results, loops):
        assert_close(o, o_ref, torch.float32)
    cache = torch.stack([extras["initial_state"] for _, extras in layers], 1)         # (batch, n, Hv, Dk, Dv)
    buffers = [torch.stack(b) for b in zip(*(r[1] for r in results))]
    for nodes in ([T - 1, 2], [-1, 5]):
        states = op.commit(cache.transpose(0, 1), results[0][2], torch.tensor(nodes, device=cache.device), *buffers,
                           backend=backend)
        for layer, (_, all_states) in enumerate(loops):
            assert_states(states[layer], nodes, layers[layer][1]["initial_state"], all_states)


def check_delta_engine_exact(op, inputs, extras, passes, capacity, seed):
    """fp64 on the torch backend: the passes give op.loop's outputs to 1e-10, and op.commit (one layer) of nodes
    [T - 1, 0] its states there."""
    T = inputs["parents"].shape[1]
    o, buffers, index = delta_engine_passes(op, inputs, extras, passes, capacity, "torch", seed=seed)
    o_ref, all_states = op.loop(**inputs, **extras)
    assert_close(o, o_ref, torch.float64)
    states = op.commit(extras["initial_state"][None], index, torch.tensor([T - 1, 0]),
                       *(t[None] for t in buffers))[0]
    for b, node in enumerate([T - 1, 0]):
        assert_close(states[b], all_states[b, node], torch.float64)


def check_delta_engine_empty(op, inputs, extras, backend, out_shape):
    """No slots: a pass of no rows over zero-slot buffers gives outputs of out_shape (batch, 0, Hv, Dv), and the commit
    of -1 the committed state."""
    device = inputs["k"].device
    e = {k: v[:, :0] for k, v in inputs.items()}
    keys, gates, updates = (torch.zeros(e[n].shape, device=device) for n in ("k", "g", "v"))
    index = TreeIndex(e["parents"])
    o = op.rows(e["q"], e["k"], e["v"], e["g"], e["beta"], extras["initial_state"], index,
                torch.arange(0, device=device), keys, gates, updates, backend=backend)
    assert o.shape == out_shape
    states = op.commit(extras["initial_state"][None], index, torch.tensor([-1, -1], device=device),
                       keys[None], gates[None], updates[None], backend=backend)
    torch.testing.assert_close(states[0], extras["initial_state"])


def delta_engine_args(inputs, extras):
    """Valid op.rows arguments for all T nodes of `inputs` in one pass: zero buffers keys, gates, updates (batch, T,
    *X.shape[2:]) for X = k, g, v."""
    batch, T = inputs["parents"].shape
    buffers = {name: torch.zeros(batch, T, *inputs[n].shape[2:]) for name, n in (("keys", "k"), ("gates", "g"),
                                                                                ("updates", "v"))}
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], g=inputs["g"], beta=inputs["beta"],
                state=extras["initial_state"], parents=TreeIndex(inputs["parents"]), rows=torch.arange(T), **buffers)
