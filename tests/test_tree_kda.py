"""Kimi Delta Attention over a tree: the node form (tree_kda_rule / tree_kda_states) and the engine form (tree_kda_rows
/ tree_kda_commit over kept per-slot buffers), both backends, against the naive per-node loop and HF's own
recurrence. Shapes stay tiny: the Triton kernels run in the interpreter without a GPU."""
import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

from loops import BACKENDS, KINDS, kda_loop, path_to, random_rows
from stree import random_parents
from stree.triton_kernels import (TreeIndex, l2norm_divide, tree_kda_commit, tree_kda_rows, tree_kda_rule,
                                  tree_kda_states)

TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.float16: 2e-2}


def make_inputs(parents_rows, heads=2, dk=8, dv=6, seed=0, dtype=torch.float32, device="cpu", h0=True):
    """KDA-like inputs: per-channel log decays g < 0 (HF: -exp(A_log) * softplus(...)), beta in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    batch, T = len(parents_rows), len(parents_rows[0])

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    inputs = dict(q=rnd(batch, T, heads, dk), k=rnd(batch, T, heads, dk), v=rnd(batch, T, heads, dv),
                  g=(-torch.rand(batch, T, heads, dk, generator=g)).to(device),
                  beta=torch.rand(batch, T, heads, generator=g).to(device, dtype),
                  parents=torch.tensor(parents_rows, device=device, dtype=torch.long))
    extras = dict(use_qk_l2norm=True,
                  initial_state=torch.randn(batch, heads, dk, dv, generator=g).to(device) if h0 else None)
    return inputs, extras


def cpu(args):
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in args.items()}


def state_args(inputs):
    return {k: v for k, v in inputs.items() if k != "q"}


def assert_close(actual, expected, dtype):
    err = (actual.double().cpu() - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-6
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} vs scale {scale:.3g}"


# ---- node form ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T, seed", [(1, 0), (12, 0), (20, 1)])
def test_tree_kda_matches_loop(backend, kind, T, seed, device):
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=seed), seed=seed, device=device)
    o = tree_kda_rule(**inputs, **extras, backend=backend)
    assert o.shape == inputs["v"].shape and o.dtype == inputs["q"].dtype
    assert_close(o, kda_loop(**cpu(inputs), **cpu(extras))[0], torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", ["no_h0", "no_l2norm_scale", "wide"])
def test_tree_kda_options(backend, options, device):
    """No initial state; raw q and k with a given scale; head dims over several blocks and not powers of two."""
    shape = dict(heads=1, dk=20, dv=40) if options == "wide" else {}
    inputs, extras = make_inputs(random_rows("random", 10, batch=2, seed=5), seed=5, device=device,
                                 h0=options != "no_h0", **shape)
    if options == "no_l2norm_scale":
        extras.update(use_qk_l2norm=False, scale=0.1)
    o = tree_kda_rule(**inputs, **extras, backend=backend)
    assert_close(o, kda_loop(**cpu(inputs), **cpu(extras))[0], torch.float32)


def test_tree_kda_float64_torch_is_exact():
    inputs, extras = make_inputs(random_rows("random", 15, batch=2, seed=8), seed=8, dtype=torch.float64)
    extras["initial_state"], inputs["g"] = extras["initial_state"].double(), inputs["g"].double()
    o = tree_kda_rule(**inputs, **extras)
    assert o.dtype == torch.float64
    o_ref, states = kda_loop(**inputs, **extras)
    assert_close(o, o_ref, torch.float64)
    got = tree_kda_states(**state_args(inputs), nodes=torch.tensor([14, -1]), **extras)
    assert_close(got[0], states[0, 14], torch.float64)
    assert_close(got[1], extras["initial_state"][1], torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_row", [False, True])
def test_tree_kda_rows_and_states_match_loop(backend, per_row, device):
    """rows= returns only the chosen nodes (any order, repeats allowed); the states after any node (-1: the initial
    state) are the loop's."""
    T = 14
    inputs, extras = make_inputs(random_rows("deep", T, batch=2, seed=11), seed=11, device=device)
    g = torch.Generator().manual_seed(12)
    rows = (torch.stack([torch.randperm(T, generator=g)[:5] for _ in range(2)]) if per_row
            else torch.tensor([T - 1, 0, 5, 5]))
    o = tree_kda_rule(**inputs, **extras, rows=rows.to(device), backend=backend)
    o_ref, all_states = kda_loop(**cpu(inputs), **cpu(extras))
    assert_close(o, torch.stack([o_ref[b, rows[b] if per_row else rows] for b in range(2)]), torch.float32)
    nodes = torch.tensor([T - 1, -1] if per_row else [-1, 6])
    states = tree_kda_states(**state_args(inputs), nodes=nodes.to(device), **extras, backend=backend)
    assert states.shape == extras["initial_state"].shape and states.dtype == torch.float32
    for b in range(2):
        want = extras["initial_state"][b].double().cpu() if nodes[b] < 0 else all_states[b, nodes[b]]
        assert_close(states[b], want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_equals_hf_recurrent_kda(backend, device):
    """On a chain, tree KDA is HF's own token-by-token recurrence (what its generate runs for each new token) from the
    cache state, its l2norm included; the commit of the last node is HF's final state."""
    T = 7
    inputs, extras = make_inputs([list(range(-1, T - 1))] * 2, seed=11, device=device)
    o = tree_kda_rule(**inputs, **extras, backend=backend)
    args = {k: v for k, v in inputs.items() if k != "parents"}
    o_hf, final = recurrent_kimi_delta_attention(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                                 initial_state=extras["initial_state"], output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    last = tree_kda_states(**state_args(inputs), nodes=torch.full((2,), T - 1, device=device), **extras,
                           backend=backend)
    torch.testing.assert_close(last, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_trees_are_independent_and_empty_tree(backend, device):
    """Row b's outputs depend only on row b's tree; T = 0 gives no outputs and the initial state back."""
    rows = [random_parents(9, torch.Generator().manual_seed(s)) for s in range(2)]
    inputs, extras = make_inputs(rows, seed=9, device=device)
    o = tree_kda_rule(**inputs, **extras, backend=backend)
    for b in range(2):
        one = {k: v[b:b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(tree_kda_rule(**one, **dict(extras, initial_state=extras["initial_state"]
                                                               [b:b + 1]), backend=backend), o[b:b + 1])
    empty = {k: v[:, :0] for k, v in inputs.items()}
    assert tree_kda_rule(**empty, **extras, backend=backend).shape == (2, 0, 2, 6)
    states = tree_kda_states(**state_args(empty), nodes=torch.tensor([-1, -1], device=device), **extras,
                             backend=backend)
    torch.testing.assert_close(states, extras["initial_state"])


# ---- engine form -------------------------------------------------------------------------------------------------

def engine_passes(inputs, extras, passes, capacity, backend, seed):
    """Drive tree_kda_rows as the engine does: passes [(start, end)] of new nodes over buffers of `capacity` slots
    that start with garbage (a finished tree's); the index of each pass knows the nodes added so far. Returns the
    outputs of every pass concatenated, the buffers and the last index."""
    q, k, v, g, beta, parents = (inputs[n] for n in ("q", "k", "v", "g", "beta", "parents"))
    batch, T, H, Dk = k.shape
    gen = torch.Generator().manual_seed(seed)
    keys, gates, updates = (torch.randn(batch, capacity, H, d, generator=gen).to(k.device, k.dtype)
                            for d in (Dk, Dk, v.shape[3]))
    qn, kn = l2norm_divide(q) * Dk ** -0.5, l2norm_divide(k)
    outs = []
    for start, end in passes:
        grown = torch.full((batch, capacity), -1, dtype=torch.long, device=k.device)
        grown[:, :end] = parents[:, :end]
        index = TreeIndex(grown)
        rows = torch.arange(start, end, device=k.device)
        outs.append(tree_kda_rows(qn[:, start:end], kn[:, start:end], v[:, start:end], g[:, start:end],
                                  beta[:, start:end], extras["initial_state"], index, rows, keys, gates, updates,
                                  backend=backend))
    return torch.cat(outs, 1), (keys, gates, updates), index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_passes_and_commit_match_loop(backend, kind, device):
    """A first pass, then three extends (a pass's nodes may hang under each other and anywhere below the earlier
    ones), over buffers with more slots than the tree and a different tree per batch row: every pass's outputs are
    the loop's on the grown tree, and the commit of any node (-1: the committed state) is the loop's state there,
    for a stack of two layers whose states are strided as the engine's cache holds them."""
    T, passes = 9, [(0, 1), (1, 4), (4, 5), (5, 9)]
    layers = [make_inputs(random_rows(kind, T, batch=2, seed=3), seed=s, device=device) for s in (3, 4)]
    results = [engine_passes(*layer, passes, T + 2, backend, seed=s) for s, layer in enumerate(layers)]
    loops = [kda_loop(**cpu(inputs), **cpu(extras)) for inputs, extras in layers]
    for (o, _, _), (o_ref, _) in zip(results, loops):
        assert_close(o, o_ref, torch.float32)
    cache = torch.stack([extras["initial_state"] for _, extras in layers], 1)         # (batch, n, H, Dk, Dv)
    buffers = [torch.stack(b) for b in zip(*(r[1] for r in results))]
    for nodes in ([T - 1, 2], [-1, 5]):
        states = tree_kda_commit(cache.transpose(0, 1), results[0][2], torch.tensor(nodes, device=device), *buffers,
                                 backend=backend)
        for layer, (_, all_states) in enumerate(loops):
            for b, node in enumerate(nodes):
                want = layers[layer][1]["initial_state"][b].cpu().double() if node < 0 else all_states[b, node]
                assert_close(states[layer, b], want, torch.float32)


def test_engine_form_float64_torch_is_exact_and_one_node():
    """fp64 on the torch backend to 1e-10; a tree of one node (T = 1) in one pass."""
    for T, passes in ((10, [(0, 3), (3, 10)]), (1, [(0, 1)])):
        inputs, extras = make_inputs(random_rows("random", T, batch=2, seed=T), seed=T, dtype=torch.float64)
        extras["initial_state"], inputs["g"] = extras["initial_state"].double(), inputs["g"].double()
        o, buffers, index = engine_passes(inputs, extras, passes, T, "torch", seed=T)
        o_ref, all_states = kda_loop(**inputs, **extras)
        assert_close(o, o_ref, torch.float64)
        states = tree_kda_commit(extras["initial_state"][None], index, torch.tensor([T - 1, 0]),
                                 *(t[None].double() for t in buffers))[0]
        for b, node in enumerate([T - 1, 0]):
            assert_close(states[b], all_states[b, node], torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_form_empty(backend, device):
    """No slots: a pass of no rows gives no outputs and the commit of -1 the committed state."""
    inputs, extras = make_inputs([[-1]] * 2, device=device)
    empty = {k: v[:, :0] for k, v in inputs.items()}
    keys, gates = (torch.zeros(2, 0, 2, 8, device=device) for _ in range(2))
    updates = torch.zeros(2, 0, 2, 6, device=device)
    index = TreeIndex(empty["parents"])
    o = tree_kda_rows(empty["q"], empty["k"], empty["v"], empty["g"], empty["beta"], extras["initial_state"], index,
                      torch.arange(0, device=device), keys, gates, updates, backend=backend)
    assert o.shape == (2, 0, 2, 6)
    states = tree_kda_commit(extras["initial_state"][None], index, torch.tensor([-1, -1], device=device),
                             keys[None], gates[None], updates[None], backend=backend)
    torch.testing.assert_close(states[0], extras["initial_state"])


# ---- errors ------------------------------------------------------------------------------------------------------

def _valid(device="cpu"):
    inputs, extras = make_inputs([[-1, 0, 1]], seed=0, device=device)
    return dict(inputs, **extras)


@pytest.mark.parametrize("change, message", [
    (dict(parents=torch.tensor([[-1, 2, 1]])), "topological"),
    (dict(q=torch.zeros(1, 3, 2, 7)), "q must have shape"),
    (dict(g=torch.zeros(1, 3, 2)), "g must have shape"),
    (dict(k=torch.zeros(1, 3, 1, 8), q=torch.zeros(1, 3, 1, 8)), "as many key as value heads"),
    (dict(initial_state=torch.zeros(1, 2, 6, 8)), "initial_state must have shape"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(rows=torch.tensor([[0, 3]])), "rows must hold node ids"),
])
def test_tree_kda_rejects_bad_input(change, message):
    args = _valid()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_kda_rule(**args)


def _engine_args():
    inputs, extras = make_inputs([[-1, 0, 1]], seed=0)
    rows = torch.arange(3)
    buffers = dict(keys=torch.zeros(1, 3, 2, 8), gates=torch.zeros(1, 3, 2, 8), updates=torch.zeros(1, 3, 2, 6))
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], g=inputs["g"], beta=inputs["beta"],
                state=extras["initial_state"], parents=TreeIndex(inputs["parents"]), rows=rows, **buffers)


@pytest.mark.parametrize("change, message", [
    (dict(rows=torch.tensor([1, 0, 2])), "pass order"),
    (dict(rows=torch.tensor([0, 0, 1])), "distinct"),
    (dict(rows=torch.tensor([[0, 1, 2]])), r"\(R,\) tensor"),
    (dict(rows=torch.tensor([0, 1, 3])), "rows must hold node ids"),
    (dict(gates=torch.zeros(1, 3, 2)), "gates must have shape"),
    (dict(v=torch.zeros(1, 3, 2, 6, dtype=torch.float64)), "compute"),
])
def test_engine_form_rejects_bad_input(change, message):
    args = _engine_args()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_kda_rows(**args)


def test_commit_rejects_bad_nodes():
    args = _engine_args()
    with pytest.raises(ValueError, match="out of range"):
        tree_kda_commit(args["state"][None], args["parents"], torch.tensor([3]), args["keys"][None],
                        args["gates"][None], args["updates"][None])


def test_triton_rejects_float64_and_a_large_key_dim(device):
    args = _valid(device)
    args["q"] = args["q"].double()
    with pytest.raises(ValueError, match="float64"):
        tree_kda_rule(**args, backend="triton")
    inputs, extras = make_inputs([[-1, 0]], dk=513, device=device)
    with pytest.raises(ValueError, match="Dk <= 512"):
        tree_kda_rule(**inputs, **extras, backend="triton")
