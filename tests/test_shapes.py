"""Tree names: one vocabulary for the API, the `stree` command, the benchmarks and the docs."""
import pytest

from stree import BeamTree, DynamicTree, StaticTree
from stree.shapes import parse_tree, tree_name


@pytest.mark.parametrize("spec, name", [
    (DynamicTree(adaptive=True), "adaptive"),
    (DynamicTree(24, adaptive=True), "adaptive-24"),
    (DynamicTree(16, depth=4, adaptive=True), "adaptive-d4"),
    (DynamicTree(16), "dynamic-16"),
    (DynamicTree(8, depth=4), "dynamic-8-d4"),
    (DynamicTree(6, depth=3, top_k=2, frontier=1, coverage=0.5), "dynamic-6-d3-k2-f1-c0.5"),
    (StaticTree((3, 2, 2, 1)), "static-3,2,2,1"),
    (StaticTree((1, 1, 1, 1)), "chain-4"),
    (StaticTree((1,)), "chain-1"),
    (BeamTree(4, 4), "beam-4x4"),
    (BeamTree(2, 6), "beam-2x6"),
])
def test_names_round_trip(spec, name):
    assert tree_name(spec) == name
    assert parse_tree(name) == spec


def test_names_from_tuples_and_bare_branchings():
    assert tree_name((2, 2)) == "static-2,2"
    assert parse_tree("3,2,2,1") == StaticTree((3, 2, 2, 1))
    assert parse_tree(" chain-2 ") == StaticTree((1, 1))


@pytest.mark.parametrize("name", ["", "dynamic", "dynamic-x", "adaptive-16-z3", "beam-4", "chain-0", "static-3,0",
                                  "tree", "dynamic-16-c2"])
def test_bad_names_say_what_is_accepted(name):
    with pytest.raises(ValueError, match="tree name"):
        parse_tree(name)
