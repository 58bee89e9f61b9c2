"""Kimi Delta Attention over a tree: the node form (tree_kda_rule / tree_kda_states) and the engine form (tree_kda_rows
/ tree_kda_commit over kept per-slot buffers), both backends, against the naive per-node loop and HF's own
recurrence. Shapes stay tiny: the Triton kernels run in the interpreter without a GPU."""
import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

from kernel_checks import (DeltaOp, assert_close, assert_matches_hf, assert_rejects, assert_rows_independent,
                           assert_states, check_delta_engine, check_delta_engine_empty, check_delta_engine_exact,
                           check_delta_exact, check_delta_rule, cpu, delta_engine_args, delta_inputs, pick_rows,
                           seeded_trees, state_args)
from loops import BACKENDS, KINDS, kda_loop, random_rows
from stree.triton_kernels import l2norm_divide, tree_kda_commit, tree_kda_rows, tree_kda_rule, tree_kda_states

KDA = DeltaOp(rule=tree_kda_rule, states=tree_kda_states, rows=tree_kda_rows, commit=tree_kda_commit, loop=kda_loop,
              l2norm=l2norm_divide)


def make_inputs(parents_rows, heads=2, dk=8, dv=6, seed=0, dtype=torch.float32, device="cpu", h0=True):
    """KDA-like inputs (kernel_checks.delta_inputs): q, k (batch, T, heads, dk), v (batch, T, heads, dv), per-channel
    log decays g (batch, T, heads, dk) < 0 (HF: -exp(A_log) * softplus(...)), beta (batch, T, heads) in (0, 1)."""
    return delta_inputs(parents_rows, heads, heads, dk, dv, (dk,), seed, dtype, device, h0)


def fp64_inputs(T, seed):
    """make_inputs in float64 on the CPU for a random tree of T nodes (2 rows), tree and inputs seeded `seed`;
    the initial state and g in float64 too."""
    inputs, extras = make_inputs(random_rows("random", T, batch=2, seed=seed), seed=seed, dtype=torch.float64)
    extras["initial_state"], inputs["g"] = extras["initial_state"].double(), inputs["g"].double()
    return inputs, extras


# ---- node form ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T, seed", [(1, 0), (12, 0), (20, 1)])
def test_tree_kda_matches_loop(backend, kind, T, seed, device):
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=seed), seed=seed, device=device)
    o = check_delta_rule(KDA, inputs, extras, backend)
    assert o.shape == inputs["v"].shape and o.dtype == inputs["q"].dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", ["no_h0", "no_l2norm_scale", "wide"])
def test_tree_kda_options(backend, options, device):
    """No initial state; raw q and k with a given scale; head dims over several blocks and not powers of two."""
    shape = dict(heads=1, dk=20, dv=40) if options == "wide" else {}
    inputs, extras = make_inputs(random_rows("random", 10, batch=2, seed=5), seed=5, device=device,
                                 h0=options != "no_h0", **shape)
    if options == "no_l2norm_scale":
        extras.update(use_qk_l2norm=False, scale=0.1)
    check_delta_rule(KDA, inputs, extras, backend)


def test_tree_kda_float64_torch_is_exact():
    check_delta_exact(KDA, *fp64_inputs(15, seed=8))


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
    assert_close(o, pick_rows(o_ref, rows, per_row), torch.float32)
    nodes = torch.tensor([T - 1, -1] if per_row else [-1, 6])
    states = tree_kda_states(**state_args(inputs), nodes=nodes.to(device), **extras, backend=backend)
    assert states.shape == extras["initial_state"].shape and states.dtype == torch.float32
    assert_states(states, nodes, extras["initial_state"], all_states)


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
    assert_matches_hf(KDA, inputs, extras, o, o_hf, torch.full((2,), T - 1, device=device), final, 1e-5, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_trees_are_independent_and_empty_tree(backend, device):
    """Row b's outputs depend only on row b's tree; T = 0 gives no outputs and the initial state back."""
    inputs, extras = make_inputs(seeded_trees(9, batch=2), seed=9, device=device)
    o = tree_kda_rule(**inputs, **extras, backend=backend)
    assert_rows_independent(tree_kda_rule, inputs, extras, o, backend=backend)
    empty = {k: v[:, :0] for k, v in inputs.items()}
    assert tree_kda_rule(**empty, **extras, backend=backend).shape == (2, 0, 2, 6)
    states = tree_kda_states(**state_args(empty), nodes=torch.tensor([-1, -1], device=device), **extras,
                             backend=backend)
    torch.testing.assert_close(states, extras["initial_state"])


# ---- engine form -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_passes_and_commit_match_loop(backend, kind, device):
    """A first pass, then three extends (a pass's nodes may hang under each other and anywhere below the earlier
    ones), over buffers with more slots than the tree and a different tree per batch row: every pass's outputs are
    the loop's on the grown tree, and the commit of any node (-1: the committed state) is the loop's state there,
    for a stack of two layers whose states are strided as the engine's cache holds them."""
    T, passes = 9, [(0, 1), (1, 4), (4, 5), (5, 9)]
    layers = [make_inputs(random_rows(kind, T, batch=2, seed=3), seed=s, device=device) for s in (3, 4)]
    check_delta_engine(KDA, layers, passes, backend)


def test_engine_form_float64_torch_is_exact_and_one_node():
    """fp64 on the torch backend to 1e-10; a tree of one node (T = 1) in one pass."""
    for T, passes in ((10, [(0, 3), (3, 10)]), (1, [(0, 1)])):
        check_delta_engine_exact(KDA, *fp64_inputs(T, seed=T), passes, capacity=T, seed=T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_form_empty(backend, device):
    """No slots: a pass of no rows gives no outputs and the commit of -1 the committed state."""
    inputs, extras = make_inputs([[-1]] * 2, device=device)
    check_delta_engine_empty(KDA, inputs, extras, backend, out_shape=(2, 0, 2, 6))


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
    assert_rejects(tree_kda_rule, _valid(), change, message)


def _engine_args():
    """One tree of 3 nodes in one pass; zero buffers keys, gates (1, 3, 2, 8), updates (1, 3, 2, 6)."""
    return delta_engine_args(*make_inputs([[-1, 0, 1]], seed=0))


@pytest.mark.parametrize("change, message", [
    (dict(rows=torch.tensor([1, 0, 2])), "pass order"),
    (dict(rows=torch.tensor([0, 0, 1])), "distinct"),
    (dict(rows=torch.tensor([[0, 1, 2]])), r"\(R,\) tensor"),
    (dict(rows=torch.tensor([0, 1, 3])), "rows must hold node ids"),
    (dict(gates=torch.zeros(1, 3, 2)), "gates must have shape"),
    (dict(v=torch.zeros(1, 3, 2, 6, dtype=torch.float64)), "compute"),
])
def test_engine_form_rejects_bad_input(change, message):
    assert_rejects(tree_kda_rows, _engine_args(), change, message)


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
