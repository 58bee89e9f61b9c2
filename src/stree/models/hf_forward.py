"""How a tree pass runs through an HF model: on a private copy of its modules, forwards swapped in for the pass, the
tree's attention mask, the direct forward of attention-free models, and the weights' version."""
import contextlib
import itertools
import weakref

import torch


def private_modules(model):
    """(copy, {module: its copy}, weakly keyed): model's module tree rebuilt from new module objects that share the
    originals' parameters and buffers (the very dicts that hold them, so `.to()`, `load_state_dict` and optimizer
    steps reach both) and their hooks. A TreeModel swaps forwards on its copy only: HF's generate, other threads and other
    TreeModels running the same model never see a tree pass's forwards. A module used at several places stays one
    module in the copy. Refuses modules whose forward was replaced on the instance (e.g. accelerate's offloading
    hooks), which would run the original modules instead of the copy's."""
    copies, of = {}, weakref.WeakKeyDictionary()

    def copy(module, name):
        if id(module) in copies:
            return copies[id(module)]
        if "forward" in vars(module):
            raise ValueError(f"module {name or type(module).__name__!r} has a forward set on the instance (a hook such "
                             "as accelerate's offloading or device-map dispatch); stree's tree passes need the "
                             "model's modules as their classes define them: load it on one device without offloading")
        new = copies[id(module)] = of[module] = object.__new__(type(module))
        new.__dict__.update(vars(module), _compiled_call_impl=None)  # model.compile() compiled the original's call
        new.__dict__["_modules"] = {key: None if child is None else copy(child, f"{name}.{key}".lstrip("."))
                                    for key, child in module._modules.items()}
        return new
    return copy(model, ""), of


@contextlib.contextmanager
def swapped(forwards):
    """Modules' forwards replaced by the given ones ({module: forward}) for the duration of the block. (Written to
    the instances' __dict__ directly: nn.Module's __setattr__ / __delattr__ would look for a parameter, buffer or
    submodule of that name first, which costs more than a small model's pass can spare, for the same effect.)"""
    for module, forward in forwards.items():
        module.__dict__["forward"] = forward
    try:
        yield
    finally:
        for module in forwards:
            del module.__dict__["forward"]


def capturing_forwards(base, layers, outputs):
    """{decoder layer: a forward that also stores its output hidden states (batch, n, hidden) in outputs[i]} for the
    base model's layers i in `layers`, to be swapped() in: the intermediate features of EAGLE-3-style heads. A layer
    index must be in range (ValueError)."""
    if not layers:
        return {}
    blocks = base.layers
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(blocks):
            raise ValueError(f"feature layer {i!r} is not a layer index of a {len(blocks)}-layer model")

    def capture(i, block):
        def forward(*args, **kwargs):
            out = type(block).forward(block, *args, **kwargs)
            outputs[i] = out[0] if isinstance(out, tuple) else out
            return out
        return forward
    return {blocks[i]: capture(i, blocks[i]) for i in layers}


def tree_attention_mask(lengths, length, rows, tree_mask, capacity, dtype):
    """The additive 4D mask (batch, 1, R, capacity) of a pass over node slots `rows` (R,): on row b, position p is
    visible to node r if p < lengths[b] (committed on that row) or p = length + k with k an ancestor of r
    (tree_mask (batch, slots, slots) bool, the tree's ancestor mask; node slots sit after the frontier `length` =
    max(lengths))."""
    device = rows.device
    batch, width, slots = lengths.shape[0], rows.shape[0], tree_mask.shape[1]
    positions = torch.arange(capacity, device=device)
    allowed = (positions < lengths[:, None, None]).expand(batch, width, -1).clone()
    tree_cols = (length + torch.arange(slots, device=device)).expand(batch, width, -1)
    allowed.scatter_(2, tree_cols, tree_mask.index_select(1, rows))
    return torch.zeros(batch, 1, width, capacity, dtype=dtype, device=device).masked_fill_(
        ~allowed[:, None], torch.finfo(dtype).min)


def blocks_forward(base, tokens):
    """An attention-free base model's forward over tokens (batch, R), its modules called directly: embeddings,
    each block (its norm, the swapped-in tree mixer, the residual), the final norm. That is all HF's forward
    does for these families when nothing is padded; its wrappers (output capture, config defaults, the
    padding mask) cost a one-layer draft's pass ~0.2-0.3 ms on a CPU."""
    hidden = base.embeddings(tokens)
    for block in base.layers:
        hidden = block(hidden)
    return base.norm_f(hidden)


def weights_version(*modules):
    """Where every parameter of `modules` lives and how often it was modified in place (an optimizer step,
    load_state_dict): the mixer adapters are rebuilt when this changes. (Writes through `.data` are not counted.)"""
    return tuple((p.data_ptr(), p._version) for p in itertools.chain.from_iterable(m.parameters() for m in modules))
