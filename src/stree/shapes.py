"""Draft tree shapes (the `tree=` argument of stree.generate) and their names.

    StaticTree((3, 2, 2, 1))   fixed children per depth (a plain tuple of ints means this)   "static-3,2,2,1"
    StaticTree((1, 1, 1, 1))   a chain: vanilla speculative decoding                           "chain-4"
    DynamicTree(16)            EAGLE-2 style: expand the most probable paths, keep 16 nodes    "dynamic-16"
    DynamicTree(adaptive=True) the default: a dynamic tree sized every round by measured costs "adaptive"
    BeamTree(4, 4)             the draft's beam search, beams merged into one tree (greedy)    "beam-4x4"

The names are the one vocabulary of the API (tree_name / parse_tree), the `stree` command's --tree, the benchmarks'
tables and the docs. A dynamic tree's non-default depth, top_k, frontier and coverage follow its budget:
"dynamic-8-d4" is DynamicTree(8, depth=4); "adaptive-24" is DynamicTree(24, adaptive=True).
"""
import re
from dataclasses import dataclass, fields

from .tree import static_parents


@dataclass(frozen=True)
class StaticTree:
    """branching[d] children for every node at depth d (the root's children first)."""
    branching: tuple

    def __post_init__(self):
        static_parents(self.branching)  # raises ValueError on a bad spec
        object.__setattr__(self, "branching", tuple(self.branching))


@dataclass(frozen=True)
class DynamicTree:
    """budget: draft nodes per tree (root excluded); depth: levels (at most); top_k: children per expanded node;
    frontier: nodes expanded per level, the most probable paths first.

    adaptive: decide each round's depth and size from measured costs (stree.adaptive.RoundCosts) instead of always
    drafting `depth` levels: another level is drafted only while its expected extra tokens per extra second beat
    the round's current expected tokens per second.

    coverage (sampling only): an expanded node gets as many children, at most top_k, as its draft distribution's
    most probable tokens need to reach this share of its mass (a confident node one child, so the budget goes to
    depth); decided from the node's distribution before its children are drawn, which keeps verification
    lossless. 1.0: always top_k."""
    budget: int = 16
    depth: int = 6
    top_k: int = 3
    frontier: int = 3
    adaptive: bool = False
    coverage: float = 0.8

    def __post_init__(self):
        _check_positive(self, ("budget", "depth", "top_k", "frontier"))
        if not 0.0 < self.coverage <= 1.0:
            raise ValueError(f"DynamicTree.coverage must be in (0, 1], got {self.coverage}")
        if self.budget < self.top_k:
            raise ValueError(f"DynamicTree.budget ({self.budget}) must be at least top_k ({self.top_k}): the root's "
                             "children alone take top_k nodes")


@dataclass(frozen=True)
class BeamTree:
    """The draft's beam search with `beams` beams over `steps` tokens; at most beams * steps nodes. Greedy only."""
    beams: int = 4
    steps: int = 4

    def __post_init__(self):
        _check_positive(self, ("beams", "steps"))


def _check_positive(spec, names):
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(spec).__name__}.{name} must be a positive int, got {value!r}")


def tree_spec(tree):
    """A StaticTree / DynamicTree / BeamTree from generate()'s `tree` argument (a branching tuple allowed; a name
    goes through parse_tree first)."""
    if isinstance(tree, (StaticTree, DynamicTree, BeamTree)):
        return tree
    if isinstance(tree, (str, bytes)) or not hasattr(tree, "__iter__"):
        raise ValueError(f"tree must be a sequence of positive ints (a static branching spec), a DynamicTree or a "
                         f"BeamTree, got {tree!r}")
    return StaticTree(tuple(tree))


# A dynamic tree's optional fields in its name, by prefix, in this order.
_DYNAMIC_FIELDS = (("d", "depth", int), ("k", "top_k", int), ("f", "frontier", int), ("c", "coverage", float))


def tree_name(spec):
    """The name of a tree spec (see the module docstring); parse_tree(tree_name(spec)) == spec."""
    spec = tree_spec(spec)  # a branching tuple too
    if isinstance(spec, BeamTree):
        return f"beam-{spec.beams}x{spec.steps}"
    if isinstance(spec, StaticTree):
        if set(spec.branching) == {1}:
            return f"chain-{len(spec.branching)}"
        return "static-" + ",".join(map(str, spec.branching))
    defaults = {f.name: f.default for f in fields(DynamicTree)}
    parts = ["adaptive" if spec.adaptive else "dynamic"]
    if not spec.adaptive or spec.budget != defaults["budget"]:
        parts.append(str(spec.budget))
    parts += [f"{prefix}{getattr(spec, name)}" for prefix, name, _ in _DYNAMIC_FIELDS
              if getattr(spec, name) != defaults[name]]
    return "-".join(parts)


def parse_tree(name):
    """The spec a tree name stands for: "adaptive[-budget]", "dynamic-<budget>[-d<depth>][-k<top_k>][-f<frontier>]
    [-c<coverage>]" (the same suffixes after an adaptive budget), "static-3,2,2,1" or "3,2,2,1", "chain-<n>",
    "beam-<beams>x<steps>". Raises ValueError naming the forms for anything else."""
    text = name.strip()
    try:
        if re.fullmatch(r"[0-9, ]+", text):
            return StaticTree(tuple(int(x) for x in text.split(",")))
        kind, _, rest = text.partition("-")
        if kind == "static":
            return StaticTree(tuple(int(x) for x in rest.split(",")))
        if kind == "chain":
            return StaticTree((1,) * int(rest))
        if kind == "beam":
            beams, steps = rest.split("x")
            return BeamTree(int(beams), int(steps))
        if kind in ("dynamic", "adaptive"):
            return _parse_dynamic(kind == "adaptive", rest)
    except ValueError as error:
        raise ValueError(f"bad tree name {name!r} ({error}); {_FORMS}") from None
    raise ValueError(f"unknown tree name {name!r}; {_FORMS}")


_FORMS = ("tree names: adaptive, adaptive-24, dynamic-16, dynamic-8-d4-k2, static-3,2,2,1 (or 3,2,2,1), chain-4, "
          "beam-4x4")


def _parse_dynamic(adaptive, rest):
    parts = rest.split("-") if rest else []
    if not adaptive and (not parts or not parts[0].isdigit()):
        raise ValueError("a dynamic tree's name gives its budget, e.g. dynamic-16")
    kwargs = {"adaptive": adaptive}
    if parts and parts[0].isdigit():
        kwargs["budget"] = int(parts.pop(0))
    by_prefix = {prefix: (name, kind) for prefix, name, kind in _DYNAMIC_FIELDS}
    for part in parts:
        if part[:1] not in by_prefix:
            raise ValueError(f"unknown part {part!r}")
        field_name, kind = by_prefix[part[:1]]
        kwargs[field_name] = kind(part[1:])
    return DynamicTree(**kwargs)


def tree_shapes(spec, paced=False):
    """Upper bounds of what one round builds with `spec`, for fixed-shape passes:
    (target tree nodes, draft node slots, new draft nodes per pass). The draft is fed only the nodes it expands:
    its first pass the trunk, ending at the root, then each pass one level's expanded nodes. Every node of an
    accepted path but the last has a child on it, so it was expanded: at most one accepted node is not in the
    draft's cache, and the next trunk holds at most 2 tokens (that node and the bonus token).
    paced (adaptive rounds that may be plain steps, at most new-nodes-per-pass - 2 in a row): the trunk may hold
    as many as a pass's new nodes, which is then frontier * top_k."""
    if isinstance(spec, StaticTree):
        levels, width = [], 1
        for b in spec.branching:
            width *= b
            levels.append(width)
        grown, expanded = sum(levels), levels[:-1]
    elif isinstance(spec, DynamicTree):
        grown, expanded = spec.depth * spec.frontier * spec.top_k, [spec.frontier] * (spec.depth - 1)
    else:
        grown, expanded = spec.beams * spec.steps, [spec.beams] * (spec.steps - 1)
    target_nodes = 1 + (min(grown, spec.budget) if isinstance(spec, DynamicTree) else grown)
    per_pass = max([2] + expanded)
    if paced and isinstance(spec, DynamicTree):
        per_pass = max(per_pass, spec.frontier * spec.top_k)
    return target_nodes, (per_pass if paced else 2) + sum(expanded) + per_pass, per_pass
