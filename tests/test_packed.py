"""Linear layers on packed oneDNN weights (stree/models/packed.py), checked against torch's own F.linear and against
HF's decoding. Whether packing pays is measured per machine, so these tests force it (MIN_GAIN = inf: the packed
product is taken for every shape and row count) and also check the switches that turn it off."""
import pytest
import torch
import torch.nn.functional as F

import stree
from stree.models import TreeModel, packed, tiny_model
from stree.models.hf_forward import weights_version as _weights_version
from test_generate import hf_greedy, noisy_copy, prompts, without_eos
from test_tree_model import assert_tree_logits_match_sequential

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(packed, "MIN_GAIN", float("inf"))
    monkeypatch.delenv("STREE_PACK_LINEARS", raising=False)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_forward_equals_torch_linear(forced, dtype, tol, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    model = torch.nn.Sequential(layer)
    forwards = packed.packed_linears(model, _weights_version(model))
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert layer not in forwards  # oneDNN has no bf16 product on this CPU (AVX2): the layer keeps F.linear
        return
    forward = forwards[layer]
    inputs = [torch.randn(1, 48), torch.randn(17, 48), torch.randn(2, 5, 48), torch.randn(7, 3, 48).transpose(0, 1),
              torch.randn(0, 48)]
    for x in inputs:
        x = x.to(dtype)
        out = forward(x)
        assert out.shape == (*x.shape[:-1], 80)
        torch.testing.assert_close(out.float(), F.linear(x, layer.weight, layer.bias).float(), rtol=tol, atol=tol)


def test_tree_passes_on_packed_weights_equal_sequential_decoding(forced):
    """float32 tree passes with every Linear packed equal HF's sequential decode of each path (HF unpacked)."""
    for family in ("bamba", "mamba2"):
        model = tiny_model(family, dtype=torch.float32)
        assert_tree_logits_match_sequential(model, prompt_len=7, T=10, seed=2, tol=1e-4)
        forwards = packed.kept_linears(model)
        assert set(forwards) == {m for m in model.modules() if isinstance(m, torch.nn.Linear)}
        assert all("forward" not in vars(m) for m in model.modules())  # HF's own forwards are back after a pass


def test_greedy_generate_on_packed_weights_equals_hf(forced):
    target = without_eos(tiny_model("bamba", dtype=torch.float32, seed=11))
    draft = noisy_copy(target, 0.02, 3)
    for prompt in prompts([2, 12], seed=12):
        assert torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=48),
                           hf_greedy(target, prompt, 48))
    assert packed.kept_linears(target) and packed.kept_linears(draft)


def test_packed_weights_follow_weights_changed_in_place(forced):
    model = tiny_model("bamba", dtype=torch.float32)
    tm = TreeModel(model)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    tm.prefill(prompt)
    first = packed.kept_linears(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    assert_tree_logits_match_sequential(model, prompt_len=5, T=6, seed=4, tol=1e-4)
    assert packed.kept_linears(model) is not first


def test_packing_is_off_by_switch_when_it_does_not_fit_and_in_float64(forced, monkeypatch):
    def forwards(model):
        packed.drop_packed_linears(model)
        return packed.packed_linears(model, _weights_version(model))
    model = tiny_model("bamba", dtype=torch.float32)
    assert forwards(model)
    monkeypatch.setattr(packed, "_available_bytes", lambda: 1000)
    assert forwards(model) == {}
    monkeypatch.undo()
    monkeypatch.setattr(packed, "MIN_GAIN", float("inf"))
    monkeypatch.setenv("STREE_PACK_LINEARS", "0")
    assert forwards(model) == {}
    monkeypatch.delenv("STREE_PACK_LINEARS")
    assert forwards(tiny_model("bamba", dtype=torch.float64)) == {}


def test_packing_is_skipped_where_it_measures_slower(monkeypatch):
    monkeypatch.setattr(packed, "MIN_GAIN", 0.0)  # nothing can be that fast
    model = tiny_model("bamba", dtype=torch.float32)
    assert packed.packed_linears(model, _weights_version(model)) == {}


def test_compiled_passes_call_the_packed_operator_and_equal_sequential_decoding(forced):
    """A compiled TreeModel traces its packed layers as stree::packed_linear calls (the packed weight stays out of
    the graph), one graph per compilation (the choice by row count is made when the operator runs, not traced:
    traced, it would guard on the row count and recompile for each new one), and its passes still equal HF's
    sequential decode of each path."""
    from test_tree_model import assert_node_logits_match_sequential, random_tree
    targets, graphs = [], []

    def backend(graph, example_inputs):
        graphs.append(graph)
        targets.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward
    model = tiny_model("bamba", dtype=torch.float32, seed=5)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(6))
    tm = TreeModel(model, nodes=8).compile(backend=backend)
    tm.prefill(prompt)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    op = torch.ops.stree.packed_linear
    # one compilation: the node count is dynamic from the first (models.compile.PASS_SIZES), so no size recompiles
    for size, compilations in ((7, 1), (5, 1), (3, 1), (8, 1)):
        tokens, parents = random_tree(size, seed=size)
        logits = tm.tree_forward([tokens], [parents])[0]
        assert len(graphs) == compilations
        assert sum(t in (op, op.default) for t in targets) == linears * compilations
        assert_node_logits_match_sequential(logits, model, prompt, tokens, parents, 1e-4)
        tm.discard()
    assert not any(t in (F.linear, torch._C._nn.linear) for t in targets)


def test_packed_operator_falls_back_to_the_layers_weight_once_unpacked(forced):
    """A graph traced against a packed layer keeps giving its product after the packed copy is freed."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(24, 40)
    model = torch.nn.Sequential(layer)
    packed.packed_linears(model, _weights_version(model))
    key = packed._KEYS[layer]
    x = torch.randn(3, 24)
    want = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(torch.ops.stree.packed_linear(x, layer.bias, key, 40), want, rtol=1e-5, atol=1e-5)
    packed.drop_packed_linears(model)
    assert key not in packed._PACKED
    torch.testing.assert_close(torch.ops.stree.packed_linear(x, layer.bias, key, 40), want, rtol=1e-5, atol=1e-5)


def test_each_row_count_takes_the_product_measured_at_the_nearest_row_count(monkeypatch):
    """A plan that packs only for MEASURED_ROWS[1] rows; the packed copy holds twice the weight, so each output
    shows which product ran."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 24)
    uses = tuple(i == 1 for i in range(len(packed.MEASURED_ROWS)))
    doubled = torch.ops.mkldnn._reorder_linear_weight(2 * layer.weight.detach(), packed.PACK_ROWS)
    monkeypatch.setattr(packed, "_plan", lambda weight, bias: (doubled, uses))
    model = torch.nn.Sequential(layer)
    forward = packed.packed_linears(model, _weights_version(model))[layer]
    assert [packed._band(r) for r in (1, 2, 3, 4, 7, 8, 9, 16, 17, 64)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
    for rows in (1, 2, 3, 4, 8, 9, 16, 17):
        x = torch.randn(rows, 32)
        plain = F.linear(x, layer.weight, layer.bias)
        expected = plain + x @ layer.weight.t() if packed._band(rows) == 1 else plain
        torch.testing.assert_close(forward(x), expected, rtol=1e-5, atol=1e-5)
