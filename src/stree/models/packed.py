"""Linear layers on prepacked oneDNN weights, for a TreeModel's passes on a CPU.

torch's nn.Linear on a CPU calls MKL (float32) or oneDNN (bf16) with the weight as it is stored. On some CPUs that
is far from the machine's speed for the few rows of a tree pass: on an AMD EPYC (Zen 5, AVX-512), MKL's float32
product of 17 rows by a (8192, 2048) weight costs 4x its one-row product, and a bf16 one-row product reads the
weight at 10 GB/s. The same weight reordered once into oneDNN's blocked layout (torch.ops.mkldnn, the layout
inductor uses when it freezes a model) takes 17 rows in about 1.3x the time of one, and one row in half the time.
Which is faster depends on the CPU, the shape and the number of rows, so it is measured once per weight shape and
dtype, at each of MEASURED_ROWS rows, and each call takes the faster for the measured row count nearest its own
(on an AVX2 EPYC, a (1096, 256) packed weight took 0.87x the plain product's time at 4 rows but 0.93x at 16).

A compiled pass (torch.compile) calls the packed product through the operator `stree::packed_linear`, which takes a
key instead of the weight: the packed weight stays out of the graph (inductor cannot hold a oneDNN-layout tensor
as a constant), and a graph keeps working when the weights are packed again (same key) or not at all (the operator
then runs F.linear on the layer's own weight).

The packed weights are a second copy of the weights they pack. They are kept per model, weakly (one set per weights
version, see packed_linears) and made only when they fit in a quarter of the memory the system has available.
Set STREE_PACK_LINEARS=0 to turn them off (it is read when a model's set is made: before its first pass, after
its weights change, or after drop_packed_linears(model), which frees them).
"""
import itertools
import math
import os
import time
import weakref

import torch
import torch.nn.functional as F

PACK_ROWS = 16       # the rows a weight is packed for (a tree pass's size)
MEASURED_ROWS = (1, 4, 16)  # a decode step, a draft level, a tree pass
_BOUNDS = [math.sqrt(a * b) for a, b in zip(MEASURED_ROWS, MEASURED_ROWS[1:])]  # geometric midpoints
PACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_GAIN = 0.9       # a packed product is used only where it measured at most this fraction of the plain one
MEMORY_SHARE = 0.25  # packed copies may take at most this share of the available memory
_KEPT = weakref.WeakKeyDictionary()  # model -> (weights version, {nn.Linear: packed forward})

# The operator a compiled pass calls: key -> the layer (while it lives) and its packed weight (while packed).
_LAYERS = weakref.WeakValueDictionary()
_PACKED = weakref.WeakValueDictionary()
_KEYS = weakref.WeakKeyDictionary()  # layer -> its key (stable across repacking)
_next_key = itertools.count()
_LIB = torch.library.Library("stree", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor? bias, int key, int out_features) -> Tensor")


class _Packed:
    """A packed weight and where to use it (_plan's uses), held by its model's set (packed_linears); _PACKED sees it
    only while that set lives."""
    __slots__ = ("weight", "uses", "__weakref__")

    def __init__(self, weight, uses):
        self.weight, self.uses = weight, uses


def _product(x, packed, weight, bias):
    """x @ weight.T + bias on the packed copy where it measured faster at the row count nearest x's, else F.linear.
    (Decided when it runs, also in a compiled pass, whose graph calls it through stree::packed_linear: a row count
    compared in the graph would be a guard, and a band crossed a recompilation.)"""
    rows = x.numel() // x.shape[-1]
    if packed is None or not rows or not packed.uses[_band(rows)]:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.weight, bias, "none", [], "")


def _packed_linear(x, bias, key, out_features):
    return _product(x, _PACKED.get(key), _LAYERS[key].weight, bias)  # None: packing was dropped after tracing


def _packed_linear_shape(x, bias, key, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


_LIB.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("stree::packed_linear", _packed_linear_shape, lib=_LIB)


def _available_bytes():
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages, else None (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _seconds(f, x, repeats=3):
    """Best of `repeats` timings of f(x), each over enough calls to last about a millisecond."""
    f(x)
    start = time.perf_counter()
    f(x)
    calls = max(1, int(1e-3 / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            f(x)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _band(rows):
    """The index in MEASURED_ROWS of the row count nearest `rows` (geometrically; ties to the larger)."""
    return sum(rows >= bound for bound in _BOUNDS)


def _plan(weight, bias):
    """(weight packed, (use it at MEASURED_ROWS[i] rows, for each i)), or None where packing is slower or fails."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)

        def on_packed(x):
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        uses = []
        for rows in MEASURED_ROWS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            uses.append(_seconds(on_packed, x) <= MIN_GAIN * _seconds(lambda v: F.linear(v, weight, bias), x))
    except (RuntimeError, AttributeError):  # no oneDNN, or none for this dtype
        return None
    return (packed, tuple(uses)) if any(uses) else None


def _forward(module, packed, uses):
    """module's forward on the packed weight where it measured faster at the row count nearest the input's
    (compiled: through the stree::packed_linear operator)."""
    weight, bias = module.weight, module.bias
    key = _KEYS.get(module)
    if key is None:
        key = _KEYS[module] = next(_next_key)
    _LAYERS[key] = module
    holder = _PACKED[key] = _Packed(packed, uses)

    def forward(x):
        if x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        if torch.compiler.is_compiling():
            return torch.ops.stree.packed_linear(x, bias, key, weight.shape[0])
        return _product(x, holder, weight, bias)
    return forward


@torch.no_grad()
def packed_linears(model, version, head=None):
    """{nn.Linear module: forward on its packed weight} for the CPU layers of `model` (and `head`, an LM head kept
    outside it): plain nn.Linear only (subclasses, e.g. quantized ones, keep their forward), empty when packing does
    not pay or does not fit. `version` identifies the weights (hf_forward.weights_version): the set is kept for
    `model` (weakly: it dies with the model) and remade when the version changes. The first call measures and
    packs: about a second for a 1B model."""
    kept = _KEPT.get(model)
    if kept is not None and kept[0] == version:
        return kept[1]
    _KEPT.pop(model, None)  # the old copies go before new ones are made
    modules = list(model.modules()) + ([] if head is None else list(head.modules()))
    linears = list({m: None for m in modules if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
                    and m.weight.dtype in PACK_DTYPES})
    available = _available_bytes()
    if (os.environ.get("STREE_PACK_LINEARS", "1") == "0" or not linears or not torch.backends.mkldnn.is_available()
            or available is not None and sum(m.weight.nbytes for m in linears) > MEMORY_SHARE * available):
        forwards = {}
    else:
        plans, forwards = {}, {}  # one measurement per shape, dtype and bias presence
        for m in linears:
            key = (tuple(m.weight.shape), m.weight.dtype, m.bias is None)
            if key in plans:
                plan = plans[key] and (torch.ops.mkldnn._reorder_linear_weight(m.weight, PACK_ROWS), *plans[key][1:])
            else:
                plan = plans[key] = _plan(m.weight, m.bias)
            if plan:
                forwards[m] = _forward(m, *plan)
    _KEPT[model] = (version, forwards)
    return forwards


def kept_linears(model):
    """The packed forwards kept for `model`, or for its base model (what a TreeModel packs), or None."""
    kept = _KEPT.get(model) or _KEPT.get(getattr(model, "base_model", None) or model)
    return None if kept is None else kept[1]


def drop_packed_linears(model):
    """Free the packed weights kept for `model` and its base model (the next TreeModel pass on it packs again)."""
    for key in (model, getattr(model, "base_model", None)):
        if key is not None:
            _KEPT.pop(key, None)
