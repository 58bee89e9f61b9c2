"""What compiling a TreeModel's passes takes: torch.compile's options for them, a code object of the pass's own per
TreeModel, a recompilation limit raised around its calls only, the buffers marked static for CUDA graphs, and the
compiled TreeModels kept per model so that compilation is paid once per model and tree shape.
"""
import itertools
import types
import weakref

import torch
from torch.utils._pytree import tree_leaves

# Sequential mixer kinds unroll their levels into the graph (one graph per tree depth met), which can pass dynamo's
# default limit of 8 graphs per function.
RECOMPILE_LIMIT = 64

_copies = itertools.count()
_COMPILED = weakref.WeakKeyDictionary()  # model -> {key: compiled TreeModel} (a TreeModel holds no reference to it)


def skip_module_guards_of_own_frames(entries):
    """torch.compile's guard_filter_fn: drop the guards on module attributes in a TreeModel's own frames (the pass,
    whose `self` is the TreeModel), keep every guard elsewhere. Checking every module attribute on every call costs
    more than a small model's pass (1.8 ms of a 15 ms pass measured), and a pass reaches one model's modules, whose
    attributes decoding never replaces. Where the model's forward breaks the graph (e.g. HF's MoE blocks, on
    `nonzero`), dynamo traces the layers' own methods as frames of their own, one code object for every layer:
    there only the module guards tell the layers apart (dropping them replayed one layer's graph for all of them)."""
    from .tree_model import TreeModel
    own = any(e.name == "self" and e.has_value and isinstance(e.value, TreeModel) for e in entries)
    return [not (own and e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


def compile_options(options, cuda):
    """torch.compile's keyword arguments for a pass from TreeModel.compile's: inductor's options (`options`) get the
    guard filter above, and on CUDA the inductor backend runs with mode="reduce-overhead" (CUDA graphs) unless a
    mode is given. torch.compile takes a mode or options, not both, so a mode is turned into its options."""
    options = dict(options)
    extra = dict(options.pop("options", None) or {})
    extra.setdefault("guard_filter_fn", skip_module_guards_of_own_frames)
    inductor = options.get("backend", "inductor") == "inductor"
    mode = options.pop("mode", "reduce-overhead" if cuda and inductor else None)
    if mode is not None:
        if not inductor:
            raise ValueError(f"mode={mode!r} is an inductor setting; backend {options['backend']!r} takes none")
        from torch._inductor import list_mode_options
        extra = {**list_mode_options(mode, options.get("dynamic")), **extra}
    return {**options, "options": extra}


def own_copy(method):
    """The bound method with a code object of its own, under a name of its own. Dynamo keeps its graphs and guards
    per code object, and what it has learnt about which sizes vary per (file, line, name) of the code: with one
    function shared by every TreeModel, one model's other slot count or node count made another model's first
    compilation dynamic (measured: the autoregressive loop's compiled commit 0.6 -> 7.6 ms once a tree model had
    compiled first), and every call walked the other models' guards."""
    f = method.__func__
    n = next(_copies)
    name = f"{f.__name__}_{n}"
    code = f.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        code = code.replace(co_qualname=f"{f.__qualname__}_{n}")
    copy = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
    return types.MethodType(copy, method.__self__)


# A pass's sizes that vary from pass to pass when passes are not padded to a fixed width (TreeModel.compile): its
# one input tensor, the node and LM-head row counts of its layout, and a draft head's features and their row mask.
PASS_SIZES = "L['flat'],L['layout'].width,L['layout'].head_rows,L['features'][0],L['features'][1]"


def with_recompile_limit(compiled, dynamic_sources=""):
    """`compiled` called with dynamo's recompilation limit at least RECOMPILE_LIMIT, and with `dynamic_sources`
    (torch.compiler.config's: sizes compiled as dynamic from the first compilation, instead of specialised once and
    recompiled when they first change), both restored after the call (dynamo applies them when a call compiles; a
    context manager of dynamo's config costs ~50 us a call, this ~10)."""
    config, compiler = torch._dynamo.config, torch.compiler.config

    def call(*args):
        limit, sources = config.recompile_limit, compiler.dynamic_sources
        config.recompile_limit, compiler.dynamic_sources = max(limit, RECOMPILE_LIMIT), dynamic_sources
        try:
            return compiled(*args)
        finally:
            config.recompile_limit, compiler.dynamic_sources = limit, sources
    return call


def mark_static(buffers):
    """Tell torch.compile that every tensor among `buffers` (any nesting of lists, dicts and tensors) keeps its
    address, so that CUDA graphs may write them in place."""
    for t in tree_leaves(buffers):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t)


def compiled_tree_model(model, nodes, pass_width, pad_single, options, returns_hidden=False):
    """The compiled TreeModel kept for `model` (a HeadTreeModel for a draft head) and these shapes and torch.compile
    options (made on first use)."""
    from .head_model import HeadTreeModel
    from .tree_model import TreeModel
    kept = _COMPILED.setdefault(model, {})
    # The mode is in the key: a pass traces it as a constant (module attributes are not guarded in the pass's frame).
    key = (nodes, pass_width, pad_single, repr(sorted(options.items())), model.training,  # repr: values may be dicts
           returns_hidden)
    if key not in kept:
        if hasattr(model, "fusion"):  # a draft head (stree.heads.DraftHead)
            made = HeadTreeModel(model, nodes=nodes, pass_width=pass_width)
        else:
            made = TreeModel(model, nodes=nodes, pass_width=pass_width, returns_hidden=returns_hidden)
        kept[key] = made.compile(pad_single=pad_single, **options)
    return kept[key]
