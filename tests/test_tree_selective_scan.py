import pytest
import torch
from transformers.models.mamba.modeling_mamba import mamba_selective_scan, mamba_selective_state_update

from kernel_checks import (assert_close, assert_matches_loop, assert_rejects, assert_states, chosen_nodes, chosen_rows,
                           cpu, grown_passes, pick_rows, seeded_trees)
from loops import BACKENDS, KINDS, path_to, random_rows, selective_scan_loop
from stree.triton_kernels import TreeIndex, tree_selective_rows, tree_selective_scan, tree_selective_states
from stree.triton_kernels.tree_selective_scan_torch import row_levels


def make_inputs(parents_rows, dim=12, dstate=5, seed=0, dtype=torch.float32, device="cpu", h0=True):
    """Mamba1-like inputs: raw dt around 0 (softplus ~0.7), A = -exp(A_log) in [-1.5, -0.5]."""
    g = torch.Generator().manual_seed(seed)
    batch, T = len(parents_rows), len(parents_rows[0])

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    inputs = dict(x=rnd(batch, T, dim), dt=rnd(batch, T, dim, scale=0.5),
                  A=-torch.rand(dim, dstate, generator=g).add(0.5).to(device), B=rnd(batch, T, dstate),
                  C=rnd(batch, T, dstate), parents=torch.tensor(parents_rows, device=device, dtype=torch.long))
    extras = dict(D=rnd(dim), z=rnd(batch, T, dim), dt_bias=torch.randn(dim, generator=g).mul(0.5).to(device),
                  dt_softplus=True,
                  initial_states=torch.randn(batch, dim, dstate, generator=g).to(device) if h0 else None)
    return inputs, extras


def no_output_args(extras):
    return {k: v for k, v in extras.items() if k not in ("D", "z")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_selective_scan_matches_loop(backend, kind, T, seed, device):
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=seed), seed=seed, device=device)
    y = tree_selective_scan(**inputs, **extras, backend=backend)
    assert y.shape == inputs["x"].shape and y.dtype == inputs["x"].dtype
    assert_matches_loop(y, selective_scan_loop, inputs, extras)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", ["no_h0", "no_gate_no_skip", "raw_dt", "wide"])
def test_tree_selective_scan_options(backend, options, device):
    """No initial state; no D and z; dt taken as given (no bias, no softplus); dim and dstate over several blocks."""
    rows = random_rows("random", 12, batch=3, seed=5)
    shape = dict(dim=70, dstate=16) if options == "wide" else {}
    inputs, extras = make_inputs(rows, seed=5, device=device, h0=options != "no_h0", **shape)
    if options == "no_gate_no_skip":
        extras.update(D=None, z=None)
    if options == "raw_dt":
        extras.update(dt_bias=None, dt_softplus=False)
        inputs["dt"] = inputs["dt"].abs()
    y = tree_selective_scan(**inputs, **extras, backend=backend)
    assert_matches_loop(y, selective_scan_loop, inputs, extras)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_selective_scan_low_precision(backend, dtype, device):
    inputs, extras = make_inputs(random_rows("random", 20, batch=2, seed=7), seed=7, dtype=dtype, device=device)
    y = tree_selective_scan(**inputs, **extras, backend=backend)
    assert y.dtype == dtype
    assert_matches_loop(y, selective_scan_loop, inputs, extras, dtype)


def test_tree_selective_scan_float64_torch_is_exact():
    inputs, extras = make_inputs(random_rows("random", 25, batch=2, seed=8), seed=8, dtype=torch.float64)
    extras["initial_states"] = extras["initial_states"].double()
    y = tree_selective_scan(**inputs, **extras)
    assert y.dtype == torch.float64
    y_ref, states = selective_scan_loop(**inputs, **extras)
    assert_close(y, y_ref, torch.float64)
    nodes = torch.tensor([24, -1])
    got = tree_selective_states(**{k: v for k, v in inputs.items() if k != "C"}, nodes=nodes,
                                **no_output_args(extras))
    assert_close(got[0], states[0, 24], torch.float64)
    assert_close(got[1], extras["initial_states"][1], torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", [False, True])
def test_tree_selective_scan_rows_match_loop(backend, kind, per_row, device):
    """rows= returns only the chosen nodes (any order, repeats allowed), each equal to the naive loop's output."""
    T = 23
    inputs, extras = make_inputs(random_rows(kind, T, batch=2, seed=11), seed=11, device=device)
    rows = chosen_rows(T, per_row)
    y = tree_selective_scan(**inputs, **extras, rows=rows.to(device), backend=backend)
    want = pick_rows(selective_scan_loop(**cpu(inputs), **cpu(extras))[0], rows, per_row)
    assert y.shape == want.shape
    assert_close(y, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_selective_states_matches_loop(backend, kind, seed, device):
    T = 23
    inputs, extras = make_inputs(random_rows(kind, T, batch=3, seed=seed), seed=seed, device=device)
    nodes = chosen_nodes(T, seed)
    states = tree_selective_states(**{k: v for k, v in inputs.items() if k != "C"}, nodes=nodes.to(device),
                                   **no_output_args(extras), backend=backend)
    assert states.shape == extras["initial_states"].shape and states.dtype == torch.float32
    _, all_states = selective_scan_loop(**cpu(inputs), **cpu(extras))
    assert_states(states, nodes, extras["initial_states"], all_states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_equals_hf_decode_steps(backend, device):
    """On a chain, the tree scan is HF's own single-token update (the path greedy generate takes) run token by
    token from the cache state, gate and skip included; the commit of the last node is HF's final state."""
    T = 9
    inputs, extras = make_inputs([list(range(-1, T - 1))] * 2, seed=11, device=device)
    y = tree_selective_scan(**inputs, **extras, backend=backend)
    state = extras["initial_states"].clone()
    steps = [mamba_selective_state_update(state, inputs["x"][:, t], inputs["dt"][:, t], inputs["A"],
                                          inputs["B"][:, t], inputs["C"][:, t], extras["D"], z=extras["z"][:, t],
                                          dt_bias=extras["dt_bias"], dt_softplus=True) for t in range(T)]
    torch.testing.assert_close(y, torch.stack(steps, 1), rtol=1e-5, atol=1e-5)
    last = tree_selective_states(**{k: v for k, v in inputs.items() if k != "C"}, nodes=torch.full((2,), T - 1,
                                 device=device), **no_output_args(extras), backend=backend)
    torch.testing.assert_close(last, state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_path_equals_hf_sequence_scan(backend, device):
    """tree outputs along path(a), and the state after it, equal HF's sequence scan over path(a) from zeros."""
    T = 30
    rows = random_rows("random", T, batch=1, seed=4)
    inputs, extras = make_inputs(rows, seed=4, device=device, h0=False)
    y = tree_selective_scan(**inputs, **extras, backend=backend)
    for a in [0, 9, T - 1]:
        path = torch.tensor(path_to(rows[0], a), device=device)
        seq = {k: inputs[k][:, path].transpose(1, 2) for k in ("x", "dt", "B", "C")}
        y_hf, final = mamba_selective_scan(seq["x"], seq["dt"], inputs["A"], seq["B"], seq["C"], D=extras["D"],
                                           z=extras["z"][:, path].transpose(1, 2), delta_bias=extras["dt_bias"],
                                           delta_softplus=True, return_last_state=True)
        torch.testing.assert_close(y[:, path], y_hf.transpose(1, 2), rtol=1e-5, atol=1e-5)
        got = tree_selective_states(**{k: v for k, v in inputs.items() if k != "C"},
                                    nodes=torch.tensor([a], device=device), **no_output_args(extras), backend=backend)
        torch.testing.assert_close(got, final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_trees_are_independent(backend, device):
    """Row b's outputs depend only on row b's tree: a batch equals its rows run one at a time."""
    inputs, extras = make_inputs(seeded_trees(16, batch=3), seed=9, device=device)
    y = tree_selective_scan(**inputs, **extras, backend=backend)
    for b in range(3):
        one = {k: v if k == "A" else v[b:b + 1] for k, v in inputs.items()}
        one_extra = {k: v[b:b + 1] if k in ("z", "initial_states") else v for k, v in extras.items()}
        torch.testing.assert_close(tree_selective_scan(**one, **one_extra, backend=backend), y[b:b + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_tree_prebuilt_index_and_permuted_inputs(backend, device):
    """T = 0 gives no outputs and the initial state back; a prebuilt TreeIndex (with a given depth) computes what a
    solved one does; inputs with permuted strides equal contiguous ones."""
    inputs, extras = make_inputs(random_rows("random", 10, batch=2, seed=6), seed=6, device=device)
    empty = {k: v[:, :0] if k != "A" else v for k, v in inputs.items()}
    assert tree_selective_scan(**empty, **{k: v[:, :0] if k == "z" else v for k, v in extras.items()},
                               backend=backend).shape == (2, 0, 12)
    states = tree_selective_states(**{k: v for k, v in empty.items() if k != "C"}, nodes=torch.tensor([-1, -1],
                                   device=device), **no_output_args(extras), backend=backend)
    torch.testing.assert_close(states, extras["initial_states"])
    solved = TreeIndex(inputs["parents"])
    prebuilt = TreeIndex.prebuilt(inputs["parents"], solved.mask.clone(), depth=solved.depth.clone())
    want = tree_selective_scan(**inputs, **extras, backend=backend)
    torch.testing.assert_close(tree_selective_scan(**dict(inputs, parents=prebuilt), **extras, backend=backend,
                                                   validate=False), want)
    permuted = inputs["x"].transpose(0, 2).contiguous().transpose(0, 2)  # same values, other strides
    torch.testing.assert_close(tree_selective_scan(**dict(inputs, x=permuted), **extras, backend=backend), want)


# ---- engine form: a pass's new rows over kept per-slot states -------------------------------------------------------

def engine_inputs(parents_rows, heads=2, head_dim=3, N=5, seed=0, dtype=torch.float32, device="cpu"):
    """Zamba-like per-head inputs (B per head): dt after softplus, x, B (batch, T, heads, ...), A (heads, head_dim,
    N), the committed state h0 (batch, heads, head_dim, N)."""
    g = torch.Generator().manual_seed(seed)
    batch, T = len(parents_rows), len(parents_rows[0])

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return dict(dt=torch.nn.functional.softplus(rnd(batch, T, heads, head_dim)), x=rnd(batch, T, heads, head_dim),
                B=rnd(batch, T, heads, N), A=-torch.rand(heads, head_dim, N, generator=g).add(0.5).to(device, dtype),
                h0=rnd(batch, heads, head_dim, N), parents=torch.tensor(parents_rows, device=device))


def loop_states(case):
    """The naive loop's state after every node (batch, T, heads, head_dim, N), one head at a time."""
    c = cpu(case)
    per_head = [selective_scan_loop(c["x"][:, :, h], c["dt"][:, :, h], c["A"][h], c["B"][:, :, h], c["B"][:, :, h],
                                    c["parents"].tolist(), initial_states=c["h0"][:, h])[1]
                for h in range(c["A"].shape[0])]
    return torch.stack(per_head, 2)


def run_passes(case, passes, capacity, backend, engine_levels, seed=0):
    """tree_selective_rows as the engine drives it: passes [(start, end)] over kept states of capacity + 1 slots that
    start with garbage, the committed state in the last one. Returns every pass's states concatenated and the
    buffer."""
    batch, T = case["parents"].shape
    device = case["x"].device
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(batch, capacity + 1, *case["A"].shape, generator=gen).to(device, case["x"].dtype)
    states[:, capacity] = case["h0"]
    outs = []
    for start, end, index, rows in grown_passes(case["parents"], passes, capacity):
        levels = row_levels(index.mask, rows) if engine_levels else None
        outs.append(tree_selective_rows(states, index, rows, *(case[n][:, start:end] for n in ("dt", "B", "x")),
                                        case["A"], levels=levels, backend=backend))
    return torch.cat(outs, 1), states


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_passes_match_loop(backend, kind, device):
    """A first pass, then three extends over kept states with more slots than the tree and a different tree per
    batch row, two heads with their own B (Zamba's layout): every pass's states are the loop's on the grown tree, and
    the kept state of any node (the commit's copy; -1: the committed state, in the last slot) is the loop's."""
    T, passes = 9, [(0, 1), (1, 4), (4, 5), (5, 9)]
    case = engine_inputs(random_rows(kind, T, batch=2, seed=3), seed=3, device=device)
    got, states = run_passes(case, passes, T + 2, backend, engine_levels=kind == "deep")
    want = loop_states(case)
    assert got.shape == want.shape
    assert_close(got, want, torch.float32)
    for node in (T - 1, 3, -1):
        for b in range(2):
            assert_close(states[b, node], case["h0"][b].double().cpu() if node < 0 else want[b, node], torch.float32)


def test_engine_form_float64_torch_is_exact_one_node_and_empty():
    """fp64 on the torch backend to 1e-10; a tree of one node; a pass of no rows."""
    for T, passes in ((10, [(0, 3), (3, 10)]), (1, [(0, 1)])):
        case = engine_inputs(random_rows("random", T, batch=2, seed=T), seed=T, dtype=torch.float64)
        got, _ = run_passes(case, passes, T, "torch", engine_levels=False)
        assert_close(got, loop_states(case), torch.float64)
    case = engine_inputs([[-1]] * 2)
    states = torch.zeros(2, 1, *case["A"].shape)
    empty = tree_selective_rows(states, TreeIndex(case["parents"][:, :0]), torch.arange(0),
                                *(case[n][:, :0] for n in ("dt", "B", "x")), case["A"])
    assert empty.shape == (2, 0, 2, 3, 5)


@pytest.mark.parametrize("change, message", [
    (dict(rows=torch.tensor([1, 0, 2])), "pass order"),
    (dict(rows=torch.tensor([0, 0])), "distinct"),
    (dict(dt=torch.zeros(1, 3, 2, 4)), "dt must have shape"),
    (dict(A=torch.zeros(2, 3, 5, dtype=torch.float64)), "one compute dtype"),
    (dict(states=torch.zeros(1, 5, 2, 3, 5)), "TreeIndex is for trees of shape"),
])
def test_engine_form_rejects_bad_input(change, message):
    case = engine_inputs([[-1, 0, 1]])
    args = dict(states=torch.zeros(1, 4, 2, 3, 5), parents=TreeIndex(case["parents"]), rows=torch.arange(3),
                dt=case["dt"], B=case["B"], x=case["x"], A=case["A"])
    args.update(change)
    if args["rows"].numel() != 3:
        args.update({n: args[n][:, :args["rows"].numel()] for n in ("dt", "B", "x")})
    with pytest.raises(ValueError, match=message):
        tree_selective_rows(**args)


def _valid(device="cpu"):
    inputs, extras = make_inputs([[-1, 0, 1]], seed=0, device=device)
    return dict(inputs, **extras)


@pytest.mark.parametrize("change, message", [
    (dict(parents=torch.tensor([[-1, 2, 1]])), "topological"),
    (dict(parents=torch.tensor([[-1, 0]])), "parents must have shape"),
    (dict(dt=torch.zeros(1, 3, 5)), "dt must have shape"),
    (dict(A=torch.zeros(12)), "A must have shape"),
    (dict(B=torch.zeros(1, 3, 4)), "B must have shape"),
    (dict(C=torch.zeros(1, 3, 4)), "C must have shape"),
    (dict(D=torch.zeros(12, 5)), "D must have shape"),
    (dict(z=torch.zeros(1, 3, 11)), "z must have shape"),
    (dict(dt_bias=torch.zeros(5)), "dt_bias must have shape"),
    (dict(initial_states=torch.zeros(1, 12, 4)), "initial_states must have shape"),
    (dict(x=torch.zeros(1, 3, 12, dtype=torch.long)), "floating-point"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(rows=torch.tensor([3])), "rows must hold node ids"),
])
def test_tree_selective_scan_rejects_bad_input(change, message):
    assert_rejects(tree_selective_scan, _valid(), change, message)


@pytest.mark.parametrize("nodes, message", [(torch.tensor([3]), "out of range"), (torch.tensor([0.0]), "integer"),
                                            (torch.tensor([0, 1]), "nodes must have shape")])
def test_tree_selective_states_rejects_bad_nodes(nodes, message):
    args = {k: v for k, v in _valid().items() if k not in ("C", "D", "z")}
    with pytest.raises(ValueError, match=message):
        tree_selective_states(**args, nodes=nodes)


def test_triton_rejects_float64(device):  # on the test device: a CPU tensor would be refused first on a GPU
    args = _valid(device)
    args["x"] = args["x"].double()
    with pytest.raises(ValueError, match="float64"):
        tree_selective_scan(**args, backend="triton")


def test_triton_rejects_a_large_dstate(device):
    inputs, extras = make_inputs([[-1, 0]], dstate=257, device=device)
    with pytest.raises(ValueError, match="dstate <= 256"):
        tree_selective_scan(**inputs, **extras, backend="triton")
