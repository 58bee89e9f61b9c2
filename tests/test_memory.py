"""stree.memory's formulas against the tensors a TreeModel actually allocates at tiny shapes."""
import pytest
import torch

from stree.memory import kv_bytes, layer_counts, memory_table, per_node_bytes, round_bytes, state_bytes
from stree.models import TreeModel, tiny_model


def allocated_per_node(tm, batch):
    """Bytes per node slot and batch row of every per-node buffer the mixer adapters hold (tensors shaped
    (layers, batch, capacity, ...))."""
    total = 0
    for adapter in {id(a): a for a, _ in tm._layers.values()}.values():
        for t in vars(adapter).values():
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[1:3] == (batch, adapter.capacity):
                total += t.nbytes // (batch * adapter.capacity)
    return total


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1", "qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_formulas_equal_what_a_tree_model_allocates(family, dtype):
    model = tiny_model(family, dtype=dtype)
    tm = TreeModel(model, nodes=5)
    tm.add_rows([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    tm.tree_forward([[1, 2, 3, 4, 5]] * 2, [[-1, 0, 0, 1, 3]] * 2)
    counts, size = layer_counts(model.config), torch.empty((), dtype=dtype).element_size()
    assert per_node_bytes(counts, size) == allocated_per_node(tm, 2) > 0
    assert state_bytes(counts, size) == tm.cache.nbytes(positions=0) > 0
    node_kv = sum(t[0, :, :1].nbytes for store in (tm.cache.keys, tm.cache.values) for t in store.values())
    assert kv_bytes(counts, size) == node_kv > 0
    rounds = round_bytes(model.config, batch=2, nodes=5, depth=3, dtype=dtype)
    assert rounds["stree"] == 2 * 5 * (allocated_per_node(tm, 2) + node_kv)
    assert rounds["per_node_snapshot"] == 2 * 5 * (tm.cache.nbytes(positions=0) + node_kv)


def test_the_table_covers_three_hybrids_at_three_batch_sizes():
    table = memory_table()
    assert table.count("\n") == 1 + 9 and "Qwen3.5-9B-like" in table and "| 64 |" in table
    with pytest.raises(ValueError, match="no memory formula"):
        layer_counts(tiny_model("mamba2").config)
