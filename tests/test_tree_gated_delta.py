import importlib

import pytest
import torch

from loops import BACKENDS, KINDS, gated_delta_loop, path_to, random_rows
from stree import random_parents
from stree.triton_kernels import (TreeIndex, l2norm_rsqrt, tree_gated_delta_commit, tree_gated_delta_rows,
                                  tree_gated_delta_rule, tree_gated_delta_states)

TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 6e-2}
HF_MODULES = ["qwen3_next", "qwen3_5", "olmo_hybrid"]


def hf_function(module, name):
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def make_inputs(parents_rows, key_heads=1, value_heads=2, dk=8, dv=6, seed=0, dtype=torch.float32, device="cpu",
                h0=True):
    """Gated-DeltaNet-like inputs: g = -exp(A_log) * softplus(a) < 0, beta = sigmoid(b) in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    batch, T = len(parents_rows), len(parents_rows[0])

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    inputs = dict(q=rnd(batch, T, key_heads, dk), k=rnd(batch, T, key_heads, dk), v=rnd(batch, T, value_heads, dv),
                  g=(-torch.rand(batch, T, value_heads, generator=g)).to(device),
                  beta=torch.rand(batch, T, value_heads, generator=g).to(device, dtype),
                  parents=torch.tensor(parents_rows, device=device, dtype=torch.long))
    extras = dict(use_qk_l2norm=True,
                  initial_state=torch.randn(batch, value_heads, dk, dv, generator=g).to(device) if h0 else None)
    return inputs, extras


def cpu(args):
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}


def state_args(inputs):
    return {k: v for k, v in inputs.items() if k != "q"}


def assert_close(actual, expected, dtype):
    err = (actual.double().cpu() - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-6
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_gated_delta_matches_loop(backend, kind, T, seed, device):
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=seed), seed=seed, device=device)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    assert o.shape == inputs["v"].shape and o.dtype == inputs["q"].dtype
    assert_close(o, gated_delta_loop(**cpu(inputs), **cpu(extras))[0], torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", ["no_h0", "no_l2norm_scale", "equal_heads", "wide"])
def test_tree_gated_delta_options(backend, options, device):
    """No initial state; raw q and k with a given scale; as many key as value heads; head dims over several blocks
    and not powers of two."""
    rows = random_rows("random", 12, batch=3, seed=5)
    shape = dict(equal_heads=dict(key_heads=2, value_heads=2),
                 wide=dict(value_heads=1, dk=40, dv=70)).get(options, {})
    inputs, extras = make_inputs(rows, seed=5, device=device, h0=options != "no_h0", **shape)
    if options == "no_l2norm_scale":
        extras.update(use_qk_l2norm=False, scale=0.1)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    assert_close(o, gated_delta_loop(**cpu(inputs), **cpu(extras))[0], torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_gated_delta_low_precision(backend, dtype, device):
    inputs, extras = make_inputs(random_rows("random", 20, batch=2, seed=7), seed=7, dtype=dtype, device=device)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    assert o.dtype == dtype
    assert_close(o, gated_delta_loop(**cpu(inputs), **cpu(extras))[0], dtype)


def test_tree_gated_delta_float64_torch_is_exact():
    inputs, extras = make_inputs(random_rows("random", 25, batch=2, seed=8), seed=8, dtype=torch.float64)
    extras["initial_state"] = extras["initial_state"].double()
    o = tree_gated_delta_rule(**inputs, **extras)
    assert o.dtype == torch.float64
    o_ref, states = gated_delta_loop(**inputs, **extras)
    assert_close(o, o_ref, torch.float64)
    got = tree_gated_delta_states(**state_args(inputs), nodes=torch.tensor([24, -1]), **extras)
    assert_close(got[0], states[0, 24], torch.float64)
    assert_close(got[1], extras["initial_state"][1], torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", [False, True])
def test_tree_gated_delta_rows_match_loop(backend, kind, per_row, device):
    """rows= returns only the chosen nodes (any order, repeats allowed), each equal to the naive loop's output."""
    T = 23
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=11), seed=11, device=device)
    g = torch.Generator().manual_seed(12)
    rows = (torch.stack([torch.randperm(T, generator=g)[:7] for _ in range(2)]) if per_row
            else torch.tensor([T - 1, 0, 5, 5, 12]))
    o = tree_gated_delta_rule(**inputs, **extras, rows=rows.to(device), backend=backend)
    o_ref = gated_delta_loop(**cpu(inputs), **cpu(extras))[0]
    want = torch.stack([o_ref[b, rows[b] if per_row else rows] for b in range(2)])
    assert o.shape == want.shape
    assert_close(o, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_gated_delta_states_matches_loop(backend, kind, seed, device):
    T = 23
    inputs, extras = make_inputs(random_rows(kind, T, batch=3, seed=seed), seed=seed, device=device)
    g = torch.Generator().manual_seed(seed)
    nodes = torch.randint(0, T, (3,), generator=g)
    nodes[0] = -1 if seed == 0 else T - 1
    states = tree_gated_delta_states(**state_args(inputs), nodes=nodes.to(device), **extras, backend=backend)
    assert states.shape == extras["initial_state"].shape and states.dtype == torch.float32
    _, all_states = gated_delta_loop(**cpu(inputs), **cpu(extras))
    for b in range(3):
        want = extras["initial_state"][b].double().cpu() if nodes[b] < 0 else all_states[b, nodes[b]]
        assert_close(states[b], want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("module", HF_MODULES)
def test_chain_equals_hf_recurrent_rule(backend, module, device):
    """On a chain, the tree rule is HF's own token-by-token recurrence (the path its generate takes for each new
    token) from the cache state, grouped value heads and l2norm included; the commit of the last node is HF's final
    state. Checked against each model's copy of the function."""
    T = 9
    inputs, extras = make_inputs([list(range(-1, T - 1))] * 2, seed=11, device=device)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    args = {k: v for k, v in inputs.items() if k != "parents"}
    o_hf, final = hf_function(module, "torch_recurrent_gated_delta_rule")(
        args["q"], args["k"], args["v"], g=args["g"], beta=args["beta"], initial_state=extras["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    last = tree_gated_delta_states(**state_args(inputs), nodes=torch.full((2,), T - 1, device=device), **extras,
                                   backend=backend)
    torch.testing.assert_close(last, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_path_equals_hf_chunked_rule(backend, device):
    """Outputs along path(a), and the state after it, equal HF's chunked (prefill) rule over path(a) as a sequence."""
    T = 30
    rows = random_rows("random", T, batch=1, seed=4)
    inputs, extras = make_inputs(rows, seed=4, device=device)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    chunked = hf_function("qwen3_next", "torch_chunk_gated_delta_rule")
    for a in [0, 9, T - 1]:
        path = torch.tensor(path_to(rows[0], a), device=device)
        seq = {k: inputs[k][:, path] for k in ("q", "k", "v", "g", "beta")}
        o_hf, final = chunked(seq["q"], seq["k"], seq["v"], g=seq["g"], beta=seq["beta"], chunk_size=4,
                              initial_state=extras["initial_state"], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, path], o_hf, rtol=1e-4, atol=1e-4)
        got = tree_gated_delta_states(**state_args(inputs), nodes=torch.tensor([a], device=device), **extras,
                                      backend=backend)
        torch.testing.assert_close(got, final, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_trees_are_independent(backend, device):
    """Row b's outputs depend only on row b's tree: a batch equals its rows run one at a time."""
    rows = [random_parents(16, torch.Generator().manual_seed(s)) for s in range(3)]
    inputs, extras = make_inputs(rows, seed=9, device=device)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    for b in range(3):
        one = {k: v[b:b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(tree_gated_delta_rule(**one, **dict(extras, initial_state=extras["initial_state"]
                                                                       [b:b + 1]), backend=backend), o[b:b + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_tree_prebuilt_index_and_permuted_inputs(backend, device):
    """T = 0 gives no outputs and the initial state back; a prebuilt TreeIndex (with a given depth) computes what a
    solved one does; inputs with permuted strides equal contiguous ones."""
    inputs, extras = make_inputs(random_rows("random", 10, batch=2, seed=6), seed=6, device=device)
    empty = {k: v[:, :0] for k, v in inputs.items()}
    assert tree_gated_delta_rule(**empty, **extras, backend=backend).shape == (2, 0, 2, 6)
    states = tree_gated_delta_states(**state_args(empty), nodes=torch.tensor([-1, -1], device=device), **extras,
                                     backend=backend)
    torch.testing.assert_close(states, extras["initial_state"])
    solved = TreeIndex(inputs["parents"])
    prebuilt = TreeIndex.prebuilt(inputs["parents"], solved.mask.clone(), depth=solved.depth.clone())
    want = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    torch.testing.assert_close(tree_gated_delta_rule(**dict(inputs, parents=prebuilt), **extras, backend=backend,
                                                     validate=False), want)
    permuted = inputs["v"].transpose(0, 3).contiguous().transpose(0, 3)  # same values, other strides
    torch.testing.assert_close(tree_gated_delta_rule(**dict(inputs, v=permuted), **extras, backend=backend), want)


# ---- engine form: a pass's new rows over kept per-slot buffers, and the commit -------------------------------------

def engine_passes(inputs, extras, passes, capacity, backend, seed):
    """Drive tree_gated_delta_rows as the engine does: passes [(start, end)] of new nodes over buffers of `capacity`
    slots that start with garbage (a finished tree's); each pass's index knows the nodes added so far. Returns the
    outputs of every pass concatenated, the buffers and the last index."""
    q, k, v, g, beta, parents = (inputs[n] for n in ("q", "k", "v", "g", "beta", "parents"))
    batch, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    gen = torch.Generator().manual_seed(seed)
    keys, gates, updates = (torch.randn(batch, capacity, *shape, generator=gen).to(k.device, k.dtype)
                            for shape in ((Hk, Dk), (Hv,), (Hv, Dv)))
    qn, kn = l2norm_rsqrt(q.to(k.dtype)) * Dk ** -0.5, l2norm_rsqrt(k)
    outs = []
    for start, end in passes:
        grown = torch.full((batch, capacity), -1, dtype=torch.long, device=k.device)
        grown[:, :end] = parents[:, :end]
        index = TreeIndex(grown)
        new = slice(start, end)
        outs.append(tree_gated_delta_rows(qn[:, new], kn[:, new], v[:, new].to(k.dtype), g[:, new].to(k.dtype),
                                          beta[:, new].to(k.dtype), extras["initial_state"], index,
                                          torch.arange(start, end, device=k.device), keys, gates, updates,
                                          backend=backend))
    return torch.cat(outs, 1), (keys, gates, updates), index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_passes_and_commit_match_loop(backend, kind, device):
    """A first pass, then three extends (a pass's nodes may hang under each other and anywhere below the earlier
    ones), over buffers with more slots than the tree, a different tree per batch row and grouped value heads: every
    pass's outputs are the loop's on the grown tree, and the commit of any node (-1: the committed state) is the
    loop's state there, for a stack of two layers whose states are strided as the engine's cache holds them."""
    T, passes = 9, [(0, 1), (1, 4), (4, 5), (5, 9)]
    layers = [make_inputs(random_rows(kind, T, batch=2, seed=3), seed=s, device=device) for s in (3, 4)]
    results = [engine_passes(*layer, passes, T + 2, backend, seed=s) for s, layer in enumerate(layers)]
    loops = [gated_delta_loop(**cpu(inputs), **cpu(extras)) for inputs, extras in layers]
    for (o, _, _), (o_ref, _) in zip(results, loops):
        assert_close(o, o_ref, torch.float32)
    cache = torch.stack([extras["initial_state"] for _, extras in layers], 1)         # (batch, n, Hv, Dk, Dv)
    buffers = [torch.stack(b) for b in zip(*(r[1] for r in results))]
    for nodes in ([T - 1, 2], [-1, 5]):
        states = tree_gated_delta_commit(cache.transpose(0, 1), results[0][2], torch.tensor(nodes, device=device),
                                         *buffers, backend=backend)
        for layer, (_, all_states) in enumerate(loops):
            for b, node in enumerate(nodes):
                want = layers[layer][1]["initial_state"][b].cpu().double() if node < 0 else all_states[b, node]
                assert_close(states[layer, b], want, torch.float32)


def test_engine_form_float64_torch_is_exact_and_one_node():
    """fp64 on the torch backend to 1e-10; a tree of one node (T = 1) in one pass."""
    for T, passes in ((10, [(0, 3), (3, 10)]), (1, [(0, 1)])):
        inputs, extras = make_inputs(random_rows("random", T, batch=2, seed=T), seed=T, dtype=torch.float64)
        extras["initial_state"] = extras["initial_state"].double()
        o, buffers, index = engine_passes(inputs, extras, passes, T, "torch", seed=T)
        o_ref, all_states = gated_delta_loop(**inputs, **extras)
        assert_close(o, o_ref, torch.float64)
        states = tree_gated_delta_commit(extras["initial_state"][None], index, torch.tensor([T - 1, 0]),
                                         *(t[None] for t in buffers))[0]
        for b, node in enumerate([T - 1, 0]):
            assert_close(states[b], all_states[b, node], torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_form_empty(backend, device):
    """No slots: a pass of no rows gives no outputs and the commit of -1 the committed state."""
    inputs, extras = make_inputs([[-1]] * 2, device=device)
    e = {k: v[:, :0] for k, v in inputs.items()}
    keys, gates, updates = (torch.zeros(2, 0, *shape, device=device) for shape in ((1, 8), (2,), (2, 6)))
    index = TreeIndex(e["parents"])
    o = tree_gated_delta_rows(e["q"], e["k"], e["v"], e["g"], e["beta"], extras["initial_state"], index,
                              torch.arange(0, device=device), keys, gates, updates, backend=backend)
    assert o.shape == (2, 0, 2, 6)
    states = tree_gated_delta_commit(extras["initial_state"][None], index, torch.tensor([-1, -1], device=device),
                                     keys[None], gates[None], updates[None], backend=backend)
    torch.testing.assert_close(states[0], extras["initial_state"])


def _engine_args():
    inputs, extras = make_inputs([[-1, 0, 1]], seed=0)
    buffers = dict(keys=torch.zeros(1, 3, 1, 8), gates=torch.zeros(1, 3, 2), updates=torch.zeros(1, 3, 2, 6))
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], g=inputs["g"], beta=inputs["beta"],
                state=extras["initial_state"], parents=TreeIndex(inputs["parents"]), rows=torch.arange(3), **buffers)


@pytest.mark.parametrize("change, message", [
    (dict(rows=torch.tensor([1, 0, 2])), "pass order"),
    (dict(rows=torch.tensor([0, 0, 1])), "distinct"),
    (dict(rows=torch.tensor([0, 1, 3])), "rows must hold node ids"),
    (dict(k=torch.zeros(1, 3, 1, 7)), "k must have shape"),
    (dict(keys=torch.zeros(1, 3, 2, 8), updates=torch.zeros(1, 3, 3, 6)), "must divide the value heads"),
    (dict(beta=torch.zeros(1, 3, 2, dtype=torch.float64)), "compute"),
])
def test_engine_form_rejects_bad_input(change, message):
    args = _engine_args()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_gated_delta_rows(**args)


def test_engine_commit_rejects_bad_nodes_and_shapes():
    args = _engine_args()
    buffers = [args[n][None] for n in ("keys", "gates", "updates")]
    with pytest.raises(ValueError, match="out of range"):
        tree_gated_delta_commit(args["state"][None], args["parents"], torch.tensor([3]), *buffers)
    with pytest.raises(ValueError, match="state must have shape"):
        tree_gated_delta_commit(args["state"], args["parents"], torch.tensor([0]), *buffers)


def _valid(device="cpu"):
    inputs, extras = make_inputs([[-1, 0, 1]], seed=0, device=device)
    return dict(inputs, **extras)


@pytest.mark.parametrize("change, message", [
    (dict(parents=torch.tensor([[-1, 2, 1]])), "topological"),
    (dict(parents=torch.tensor([[-1, 0]])), "parents must have shape"),
    (dict(q=torch.zeros(1, 3, 1, 7)), "q must have shape"),
    (dict(k=torch.zeros(1, 3, 3, 8), q=torch.zeros(1, 3, 3, 8)), "must divide the value heads"),
    (dict(v=torch.zeros(1, 2, 2, 6)), "v must have shape"),
    (dict(g=torch.zeros(1, 3, 1)), "g must have shape"),
    (dict(beta=torch.zeros(1, 3)), "beta must have shape"),
    (dict(initial_state=torch.zeros(1, 2, 6, 8)), "initial_state must have shape"),
    (dict(k=torch.zeros(1, 3, 1, 8, dtype=torch.long)), "floating-point"),
    (dict(scale="0.1"), "scale must be a number"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(rows=torch.tensor([[0, 3]])), "rows must hold node ids"),
])
def test_tree_gated_delta_rejects_bad_input(change, message):
    args = _valid()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_gated_delta_rule(**args)


@pytest.mark.parametrize("nodes, message", [(torch.tensor([3]), "out of range"), (torch.tensor([-2]), "out of range"),
                                            (torch.tensor([0.0]), "integer")])
def test_tree_gated_delta_states_rejects_bad_nodes(nodes, message):
    args = state_args(_valid())
    with pytest.raises(ValueError, match=message):
        tree_gated_delta_states(**args, nodes=nodes)


def test_triton_rejects_float64(device):  # on the test device: a CPU tensor would be refused first on a GPU
    args = _valid(device)
    args["q"] = args["q"].double()
    with pytest.raises(ValueError, match="float64"):
        tree_gated_delta_rule(**args, backend="triton")


def test_triton_rejects_a_large_key_dim(device):
    inputs, extras = make_inputs([[-1, 0]], dk=513, device=device)
    with pytest.raises(ValueError, match="Dk <= 512"):
        tree_gated_delta_rule(**inputs, **extras, backend="triton")
