import functools

import pytest
import torch
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

from kernel_checks import chosen_nodes, chosen_rows, cpu
from loops import BACKENDS, KINDS, path_to, random_rows, scan_loop
from stree import random_parents
from stree.triton_kernels import TreeIndex, tree_scan, tree_states

def make_inputs(parents_rows, nheads=4, ngroups=2, headdim=8, dstate=16, seed=0, dtype=torch.float32,
                device="cpu", h0=True, d_per_channel=False):
    g = torch.Generator().manual_seed(seed)
    batch, T = len(parents_rows), len(parents_rows[0])

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    inputs = dict(
        x=rnd(batch, T, nheads, headdim), dt=rnd(batch, T, nheads, scale=0.5),
        A=-torch.rand(nheads, generator=g).add(0.5).to(device), B=rnd(batch, T, ngroups, dstate),
        C=rnd(batch, T, ngroups, dstate), parents=torch.tensor(parents_rows, device=device))
    extras = dict(D=rnd(nheads, headdim) if d_per_channel else rnd(nheads), dt_bias=rnd(nheads, scale=0.5),
                  dt_softplus=True,
                  initial_states=rnd(batch, nheads, headdim, dstate).float() if h0 else None)
    return inputs, extras


def assert_close(actual, expected, dtype):
    tol = {torch.float32: 2e-4, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    err = (actual.double().cpu() - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-6
    assert err <= tol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_scan_matches_loop(backend, kind, T, seed, device):
    rows = random_rows(kind, T, batch=2, seed=seed)
    inputs, extras = make_inputs(rows, seed=seed, device=device)
    y = tree_scan(**inputs, **extras, backend=backend)
    y_ref, _ = scan_loop(**{k: v.cpu() for k, v in inputs.items()},
                         **{k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()})
    assert y.shape == inputs["x"].shape and y.dtype == inputs["x"].dtype
    assert_close(y, y_ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_scan_many_blocks_and_odd_sizes(backend, device):
    """T spans several Triton query/key blocks; headdim and dstate are not powers of two."""
    rows = random_rows("random", 150, batch=2, seed=3) if backend == "torch" else random_rows("random", 90, 2, 3)
    inputs, extras = make_inputs(rows, nheads=3, ngroups=1, headdim=20, dstate=24, seed=3, device=device,
                                 d_per_channel=True)
    y = tree_scan(**inputs, **extras, backend=backend)
    y_ref, _ = scan_loop(**{k: v.cpu() for k, v in inputs.items()},
                         **{k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()})
    assert_close(y, y_ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", ["plain", "no_h0", "limit", "d_channel"])
def test_tree_scan_options(backend, options, device):
    rows = random_rows("random", 12, batch=3, seed=5)
    inputs, extras = make_inputs(rows, nheads=6, ngroups=3, seed=5, device=device, h0=options != "no_h0",
                                 d_per_channel=options == "d_channel")
    if options == "plain":
        extras = dict(initial_states=extras["initial_states"])
        inputs["dt"] = inputs["dt"].abs()
    if options == "limit":
        extras["dt_limit"] = (0.3, 0.9)
    y = tree_scan(**inputs, **extras, backend=backend)
    y_ref, _ = scan_loop(**{k: v.cpu() for k, v in inputs.items()},
                         **{k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()})
    assert_close(y, y_ref, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_scan_low_precision(backend, dtype, device):
    rows = random_rows("random", 20, batch=2, seed=7)
    inputs, extras = make_inputs(rows, seed=7, dtype=dtype, device=device)
    y = tree_scan(**inputs, **extras, backend=backend)
    assert y.dtype == dtype
    y_ref, _ = scan_loop(**{k: v.cpu() for k, v in inputs.items()},
                         **{k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()})
    assert_close(y, y_ref, dtype)


def test_tree_scan_float64_torch_is_exact():
    rows = random_rows("random", 25, batch=2, seed=8)
    inputs, extras = make_inputs(rows, seed=8, dtype=torch.float64)
    extras["initial_states"] = extras["initial_states"].double()
    y = tree_scan(**inputs, **extras)
    assert y.dtype == torch.float64
    assert_close(y, scan_loop(**inputs, **extras)[0], torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_scan_per_row_trees_are_independent(backend, device):
    """Row b's outputs depend only on row b's tree: a batch equals its rows run one at a time."""
    rows = [random_parents(16, torch.Generator().manual_seed(s)) for s in range(3)]
    inputs, extras = make_inputs(rows, seed=9, device=device)
    y = tree_scan(**inputs, **extras, backend=backend)
    for b in range(3):
        one = {k: v[b:b + 1] if k not in ("A",) else v for k, v in inputs.items()}
        one_extra = dict(extras, initial_states=extras["initial_states"][b:b + 1])
        torch.testing.assert_close(tree_scan(**one, **one_extra, backend=backend), y[b:b + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_equals_hf_sequential_chunk_scan(backend, device):
    """On a chain the tree scan is the ordinary Mamba2 scan (HF's own torch chunk scan, chunk 8 < T)."""
    T = 29
    inputs, extras = make_inputs([list(range(-1, T - 1))] * 2, seed=11, device=device)
    extras["dt_limit"] = (0.05, 2.0)
    y = tree_scan(**inputs, **extras, backend=backend)
    args = {k: v for k, v in inputs.items() if k != "parents"}
    y_hf, final_hf = mamba2_chunk_scan(args["x"], args["dt"], args["A"], args["B"], args["C"], chunk_size=8,
                                       return_final_states=True, **extras)
    torch.testing.assert_close(y, y_hf.to(y.dtype), rtol=1e-4, atol=1e-4)
    last = torch.full((2,), T - 1, device=device)
    states = tree_states(**{k: v for k, v in inputs.items() if k != "C"}, nodes=last,
                         **{k: v for k, v in extras.items() if k != "D"}, backend=backend)
    torch.testing.assert_close(states, final_hf.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_states_matches_loop(backend, kind, seed, device):
    T = 23
    rows = random_rows(kind, T, batch=3, seed=seed)
    inputs, extras = make_inputs(rows, seed=seed, device=device)
    extras.pop("D")
    inputs.pop("C")
    nodes = chosen_nodes(T, seed)
    states = tree_states(**inputs, nodes=nodes.to(device), **extras, backend=backend)
    _, all_states = scan_loop(**{k: v.cpu() for k, v in inputs.items()},
                              C=torch.zeros_like(inputs["B"]).cpu(),
                              **{k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()})
    for b in range(3):
        want = extras["initial_states"][b].double().cpu() if nodes[b] < 0 else all_states[b, nodes[b]]
        assert_close(states[b], want, torch.float32)
    # in place (a commit): out = initial_states itself gives the same states and returns that tensor
    held = extras.pop("initial_states").float().clone()
    again = tree_states(**inputs, nodes=nodes.to(device), **extras, initial_states=held, out=held, backend=backend)
    assert again is held
    torch.testing.assert_close(held, states.float(), rtol=1e-6, atol=1e-6)
    # no row accepts a node (on a CPU no slot is then read): the states stay as they were
    before = held.clone()
    tree_states(**inputs, nodes=torch.full((3,), -1, device=device), **extras, initial_states=held, out=held,
                backend=backend)
    torch.testing.assert_close(held, before, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_states_equals_feeding_the_path(backend, device):
    """tree_states(node=a) equals running the plain scan over path(a) as a sequence."""
    T = 30
    rows = random_rows("random", T, batch=1, seed=4)
    inputs, extras = make_inputs(rows, seed=4, device=device, h0=True)
    extras.pop("D")
    for a in [0, 9, T - 1]:
        path = torch.tensor(path_to(rows[0], a), device=device)
        seq = {k: inputs[k][:, path] for k in ("x", "dt", "B", "C")}
        _, final = mamba2_chunk_scan(seq["x"], seq["dt"], inputs["A"], seq["B"], seq["C"], chunk_size=4,
                                     return_final_states=True, **extras)
        got = tree_states(**{k: v for k, v in inputs.items() if k != "C"}, nodes=torch.tensor([a], device=device),
                          **extras, backend=backend)
        torch.testing.assert_close(got, final.float(), rtol=1e-4, atol=1e-4)


def test_tree_states_without_initial_state_returns_fp32(device):
    rows = random_rows("random", 5, batch=1, seed=0)
    inputs, _ = make_inputs(rows, device=device, dtype=torch.float16)
    inputs.pop("C")
    states = tree_states(**inputs, nodes=torch.tensor([-1], device=device))
    assert states.dtype == torch.float32 and bool((states == 0).all())


def _valid(device="cpu"):
    inputs, extras = make_inputs([[-1, 0, 1]], seed=0, device=device)
    return dict(inputs, **extras)


@pytest.mark.parametrize("change, message", [
    (dict(parents=torch.tensor([[-1, 2, 1]])), "topological"),
    (dict(parents=torch.tensor([[-1, 0, 1]]).float()), "integer"),
    (dict(parents=torch.tensor([[-1, -2, 0]])), "below -1"),
    (dict(parents=torch.tensor([[-1, 0]])), "parents must have shape"),
    (dict(dt=torch.zeros(1, 3, 5)), "dt must have shape"),
    (dict(A=torch.zeros(3)), "A must have shape"),
    (dict(B=torch.zeros(1, 3, 3, 16), C=torch.zeros(1, 3, 3, 16)), "must divide nheads"),
    (dict(C=torch.zeros(1, 3, 2, 8)), "C must have shape"),
    (dict(D=torch.zeros(4, 3)), "D must have shape"),
    (dict(initial_states=torch.zeros(1, 4, 8, 8)), "initial_states must have shape"),
    (dict(x=torch.zeros(1, 3, 4, 8, dtype=torch.long)), "floating-point"),
    (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_tree_scan_rejects_bad_input(change, message):
    args = _valid()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        tree_scan(**args)


@pytest.mark.parametrize("nodes, message", [
    (torch.tensor([3]), "out of range"), (torch.tensor([-2]), "out of range"),
    (torch.tensor([0, 1]), "nodes must have shape"), (torch.tensor([0.0]), "integer")])
def test_tree_states_rejects_bad_nodes(nodes, message):
    args = _valid()
    for k in ("C", "D"):
        args.pop(k)
    with pytest.raises(ValueError, match=message):
        tree_states(**args, nodes=nodes)


def test_triton_rejects_float64(device):  # on the test device: a CPU tensor would be refused first on a GPU
    args = _valid(device)
    args["x"] = args["x"].double()
    with pytest.raises(ValueError, match="float64"):
        tree_scan(**args, backend="triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_tree_and_permuted_inputs(backend, device):
    """T = 0 returns the initial state; inputs with permuted strides give the same outputs as contiguous ones."""
    inputs, extras = make_inputs([[-1, 0, 0]], seed=6, device=device)
    empty = {k: v[:, :0] for k, v in inputs.items() if k in ("x", "dt", "B", "parents")}
    states = tree_states(**empty, A=inputs["A"], nodes=torch.tensor([-1], device=device),
                         initial_states=extras["initial_states"], backend=backend)
    torch.testing.assert_close(states, extras["initial_states"])
    empty_y = tree_scan(**empty, A=inputs["A"], C=inputs["C"][:, :0], initial_states=extras["initial_states"],
                        backend=backend)
    assert empty_y.shape == (1, 0) + inputs["x"].shape[2:]
    x = inputs["x"]
    permuted = x.transpose(2, 3).contiguous().transpose(2, 3)  # same values, non-contiguous strides
    torch.testing.assert_close(tree_scan(**dict(inputs, x=permuted), **extras, backend=backend),
                               tree_scan(**inputs, **extras, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tree_index_is_reused_across_calls(backend, device):
    """One TreeIndex serves every kernel call on the same trees with the same results as raw parents; a TreeIndex
    of other trees is refused."""
    from stree.triton_kernels import tree_conv1d, tree_conv_state
    rows = random_rows("random", 9, batch=2, seed=3)
    inputs, extras = make_inputs(rows, device=device)
    parents = inputs.pop("parents")
    index = TreeIndex(parents)
    nodes = torch.tensor([8, -1], device=device)
    xbc = torch.randn(2, 9, 6, device=device)
    conv_state, weight = torch.randn(2, 6, 4, device=device), torch.randn(6, 4, device=device)
    for _ in range(2):  # the second round reuses what the index cached
        torch.testing.assert_close(tree_scan(**inputs, parents=index, **extras, backend=backend),
                                   tree_scan(**inputs, parents=parents, **extras, backend=backend))
        for width in (4, 2):  # two conv widths: two cached window tables on one index
            torch.testing.assert_close(tree_conv1d(xbc, weight[:, :width], None, index, conv_state, backend=backend),
                                       tree_conv1d(xbc, weight[:, :width], None, parents, conv_state, backend=backend))
    torch.testing.assert_close(
        tree_states(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], index, nodes, backend=backend),
        tree_states(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], parents, nodes, backend=backend))
    torch.testing.assert_close(tree_conv_state(xbc, index, nodes, conv_state, backend=backend),
                               tree_conv_state(xbc, parents, nodes, conv_state, backend=backend))
    with pytest.raises(ValueError, match="TreeIndex is for trees of shape"):
        tree_scan(**inputs, parents=TreeIndex(parents[:, :5]), **extras, backend=backend)
    with pytest.raises(ValueError, match="topological"):
        TreeIndex(torch.tensor([[-1, 1]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", [False, True])
def test_tree_scan_rows_match_loop(backend, kind, per_row, device):
    """rows= computes only the chosen nodes (any order, repeats allowed), each equal to the naive loop's output."""
    T = 23
    parents_rows = random_rows(kind, T, batch=2, seed=11)
    inputs, extras = make_inputs(parents_rows, seed=11, device=device)
    rows = chosen_rows(T, per_row)
    y = tree_scan(**inputs, **extras, rows=rows.to(device), backend=backend)
    y_ref, _ = scan_loop(**{k: v.cpu() for k, v in inputs.items()},
                         **{k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()})
    want = torch.stack([y_ref[b, rows[b] if per_row else rows] for b in range(2)])
    assert y.shape == want.shape
    assert_close(y, want, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("batch", [1, 2])
def test_tree_scan_one_row_matches_loop(backend, per_row, seed, batch, device):
    """One node asked for (a drafting level's pass: the CPU path reads one batch row's state by a multiply-and-sum
    there, a batch's by a product, as for several rows), with several heads per group, equals the naive loop's
    output at that node."""
    _check_few_rows(tree_scan, 1, per_row, seed, device, batch=batch, backend=backend)


@pytest.mark.parametrize("count", [1, 3])
def test_compiled_torch_tree_scan_matches_loop(count):
    """Compiled, the CPU path reads the state its own way (a fused multiply-and-sum, see _from_state): one and three
    rows, one graph each, equal the naive loop."""
    compiled = torch.compile(functools.partial(tree_scan, backend="torch", validate=False), dynamic=False)
    _check_few_rows(compiled, count, True, count, "cpu")


def _check_few_rows(scan, count, per_row, seed, device, batch=2, **options):
    """scan's outputs at `count` random nodes per batch row (shared by the rows unless per_row) equal the loop's."""
    T = 9
    parents_rows = random_rows("random", T, batch=batch, seed=seed)
    inputs, extras = make_inputs(parents_rows, nheads=6, ngroups=2, seed=seed, device=device)
    nodes = torch.randint(0, T, (batch, count), generator=torch.Generator().manual_seed(seed))
    rows = nodes if per_row else nodes[0]
    y = scan(**dict(inputs, parents=TreeIndex(inputs["parents"])), **extras, rows=rows.to(device), **options)
    y_ref, _ = scan_loop(**cpu(inputs), **cpu(extras))
    want = torch.stack([y_ref[b, rows[b] if per_row else rows] for b in range(batch)])
    assert y.shape == want.shape == (batch, count, 6, 8)
    assert_close(y, want, torch.float32)


def test_prebuilt_tree_index_equals_a_solved_one(device):
    """TreeIndex.prebuilt takes a caller's structure unchecked; given the right mask it computes what TreeIndex does."""
    parents = torch.tensor(random_rows("random", 10, batch=2, seed=2), device=device)
    solved = TreeIndex(parents)
    prebuilt = TreeIndex.prebuilt(parents, solved.mask.clone())
    inputs, extras = make_inputs(parents.tolist(), seed=2, device=device)
    inputs.pop("parents")
    torch.testing.assert_close(tree_scan(**inputs, parents=prebuilt, **extras), tree_scan(**inputs, parents=solved,
                                                                                            **extras))
    torch.testing.assert_close(prebuilt.windows(4, 4), solved.windows(4, 4))


def test_tree_scan_rejects_bad_rows():
    args = _valid()
    with pytest.raises(ValueError, match=r"rows must hold node ids in \[0, "):
        tree_scan(**args, rows=torch.tensor([0, args["x"].shape[1]]))
    with pytest.raises(ValueError, match="integer"):
        tree_scan(**args, rows=torch.tensor([0.0]))
