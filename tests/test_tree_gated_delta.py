import importlib

import pytest
import torch

from kernel_checks import (DeltaOp, assert_close, assert_matches_hf, assert_rejects, assert_rows_independent,
                           assert_states, check_delta_engine, check_delta_engine_empty, check_delta_engine_exact,
                           check_delta_exact, check_delta_rule, chosen_nodes, chosen_rows, cpu, delta_engine_args,
                           delta_inputs, pick_rows, seeded_trees, state_args)
from loops import BACKENDS, KINDS, gated_delta_loop, path_to, random_rows
from stree.triton_kernels import (TreeIndex, l2norm_rsqrt, tree_gated_delta_commit, tree_gated_delta_rows,
                                  tree_gated_delta_rule, tree_gated_delta_states)

GATED_DELTA = DeltaOp(rule=tree_gated_delta_rule, states=tree_gated_delta_states, rows=tree_gated_delta_rows,
                      commit=tree_gated_delta_commit, loop=gated_delta_loop, l2norm=l2norm_rsqrt)
HF_MODULES = ["qwen3_next", "qwen3_5", "olmo_hybrid"]


def hf_function(module, name):
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def make_inputs(parents_rows, key_heads=1, value_heads=2, dk=8, dv=6, seed=0, dtype=torch.float32, device="cpu",
                h0=True):
    """Gated-DeltaNet-like inputs (kernel_checks.delta_inputs): q, k (batch, T, key_heads, dk), v (batch, T,
    value_heads, dv), g = -exp(A_log) * softplus(a) < 0 and beta = sigmoid(b) in (0, 1), both (batch, T,
    value_heads)."""
    return delta_inputs(parents_rows, key_heads, value_heads, dk, dv, (), seed, dtype, device, h0)


def fp64_inputs(T, seed):
    """make_inputs in float64 on the CPU for a random tree of T nodes (2 rows), tree and inputs seeded `seed`;
    the initial state in float64 too."""
    inputs, extras = make_inputs(random_rows("random", T, batch=2, seed=seed), seed=seed, dtype=torch.float64)
    extras["initial_state"] = extras["initial_state"].double()
    return inputs, extras


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_gated_delta_matches_loop(backend, kind, T, seed, device):
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=seed), seed=seed, device=device)
    o = check_delta_rule(GATED_DELTA, inputs, extras, backend)
    assert o.shape == inputs["v"].shape and o.dtype == inputs["q"].dtype


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
    check_delta_rule(GATED_DELTA, inputs, extras, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_gated_delta_low_precision(backend, dtype, device):
    inputs, extras = make_inputs(random_rows("random", 20, batch=2, seed=7), seed=7, dtype=dtype, device=device)
    o = check_delta_rule(GATED_DELTA, inputs, extras, backend, dtype)
    assert o.dtype == dtype


def test_tree_gated_delta_float64_torch_is_exact():
    check_delta_exact(GATED_DELTA, *fp64_inputs(25, seed=8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", [False, True])
def test_tree_gated_delta_rows_match_loop(backend, kind, per_row, device):
    """rows= returns only the chosen nodes (any order, repeats allowed), each equal to the naive loop's output."""
    T = 23
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=11), seed=11, device=device)
    rows = chosen_rows(T, per_row)
    o = tree_gated_delta_rule(**inputs, **extras, rows=rows.to(device), backend=backend)
    want = pick_rows(gated_delta_loop(**cpu(inputs), **cpu(extras))[0], rows, per_row)
    assert o.shape == want.shape
    assert_close(o, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_gated_delta_states_matches_loop(backend, kind, seed, device):
    T = 23
    inputs, extras = make_inputs(random_rows(kind, T, batch=3, seed=seed), seed=seed, device=device)
    nodes = chosen_nodes(T, seed)
    states = tree_gated_delta_states(**state_args(inputs), nodes=nodes.to(device), **extras, backend=backend)
    assert states.shape == extras["initial_state"].shape and states.dtype == torch.float32
    _, all_states = gated_delta_loop(**cpu(inputs), **cpu(extras))
    assert_states(states, nodes, extras["initial_state"], all_states)


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
    assert_matches_hf(GATED_DELTA, inputs, extras, o, o_hf, torch.full((2,), T - 1, device=device), final, 1e-5,
                      backend)


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
        assert_matches_hf(GATED_DELTA, inputs, extras, o[:, path], o_hf, torch.tensor([a], device=device), final,
                          1e-4, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_trees_are_independent(backend, device):
    """Row b's outputs depend only on row b's tree: a batch equals its rows run one at a time."""
    inputs, extras = make_inputs(seeded_trees(16, batch=3), seed=9, device=device)
    o = tree_gated_delta_rule(**inputs, **extras, backend=backend)
    assert_rows_independent(tree_gated_delta_rule, inputs, extras, o, backend=backend)


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

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_passes_and_commit_match_loop(backend, kind, device):
    """A first pass, then three extends (a pass's nodes may hang under each other and anywhere below the earlier
    ones), over buffers with more slots than the tree, a different tree per batch row and grouped value heads: every
    pass's outputs are the loop's on the grown tree, and the commit of any node (-1: the committed state) is the
    loop's state there, for a stack of two layers whose states are strided as the engine's cache holds them."""
    T, passes = 9, [(0, 1), (1, 4), (4, 5), (5, 9)]
    layers = [make_inputs(random_rows(kind, T, batch=2, seed=3), seed=s, device=device) for s in (3, 4)]
    check_delta_engine(GATED_DELTA, layers, passes, backend)


def test_engine_form_float64_torch_is_exact_and_one_node():
    """fp64 on the torch backend to 1e-10; a tree of one node (T = 1) in one pass."""
    for T, passes in ((10, [(0, 3), (3, 10)]), (1, [(0, 1)])):
        check_delta_engine_exact(GATED_DELTA, *fp64_inputs(T, seed=T), passes, capacity=T, seed=T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_form_empty(backend, device):
    """No slots: a pass of no rows gives no outputs and the commit of -1 the committed state."""
    inputs, extras = make_inputs([[-1]] * 2, device=device)
    check_delta_engine_empty(GATED_DELTA, inputs, extras, backend, out_shape=(2, 0, 2, 6))


def _engine_args():
    """One tree of 3 nodes in one pass; zero buffers keys (1, 3, 1, 8), gates (1, 3, 2), updates (1, 3, 2, 6)."""
    return delta_engine_args(*make_inputs([[-1, 0, 1]], seed=0))


@pytest.mark.parametrize("change, message", [
    (dict(rows=torch.tensor([1, 0, 2])), "pass order"),
    (dict(rows=torch.tensor([0, 0, 1])), "distinct"),
    (dict(rows=torch.tensor([0, 1, 3])), "rows must hold node ids"),
    (dict(k=torch.zeros(1, 3, 1, 7)), "k must have shape"),
    (dict(keys=torch.zeros(1, 3, 2, 8), updates=torch.zeros(1, 3, 3, 6)), "must divide the value heads"),
    (dict(beta=torch.zeros(1, 3, 2, dtype=torch.float64)), "compute"),
])
def test_engine_form_rejects_bad_input(change, message):
    assert_rejects(tree_gated_delta_rows, _engine_args(), change, message)


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
    assert_rejects(tree_gated_delta_rule, _valid(), change, message)


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
