import pytest
import torch
from transformers import DynamicCache

from loops import path_to
from stree import random_parents
from stree.models import TINY_CONFIGS, TreeModel, tiny_model
from stree.models.rows import layer_states

FAMILIES = sorted(TINY_CONFIGS)
# HF's Mamba1 decode step and its gated delta rule compute in fp32 even in float64 models (stree computes in float64):
# those families are compared with HF at fp32 tolerance; tree passes are compared with each other at 1e-7 throughout.
FP32_IN_HF = {"mamba", "falcon_mamba", "jamba", "zamba", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid",
              "kimi_linear"}


def hf_tol(family):
    return 2e-5 if family in FP32_IN_HF else 1e-6


def decode_sequentially(model, prompt, continuation):
    """HF's own path: a chunked prefill of the prompt, then one cached single-token forward per token.

    Returns (logits after the last token (vocab,), the cache)."""
    cache = DynamicCache(config=model.config)
    P = prompt.shape[1]
    with torch.no_grad():
        logits = model(prompt, cache=cache, use_cache=True, position_ids=torch.arange(P)[None]).logits[0, -1]
        for k, token in enumerate(continuation):
            logits = model(torch.tensor([[token]]), cache=cache, use_cache=True,
                           position_ids=torch.tensor([[P + k]])).logits[0, -1]
    return logits, cache


def random_tree(T, seed, vocab=64):
    g = torch.Generator().manual_seed(seed)
    parents = random_parents(T, g, max_children=3)
    return torch.randint(0, vocab, (T,), generator=g).tolist(), parents


def assert_node_logits_match_sequential(logits, model, prompt, tokens, parents, tol, committed=()):
    """logits (T, vocab) of a tree's nodes equal HF's sequential decode of prompt + committed + path(node), within
    tol."""
    for i in range(len(tokens)):
        want, _ = decode_sequentially(model, prompt, list(committed) + [tokens[k] for k in path_to(parents, i)])
        torch.testing.assert_close(logits[i].double(), want.double(), rtol=tol, atol=tol)


def assert_tree_logits_match_sequential(model, prompt_len, T, seed, tol):
    """Tree-pass logits of every node equal HF's sequential decode of prompt + path(node), within tol."""
    prompt = torch.randint(0, 64, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    tokens, parents = random_tree(T, seed=seed + 1)
    logits = one_pass_logits(model, prompt, tokens, parents)
    assert logits.shape == (T, model.config.vocab_size)
    assert_node_logits_match_sequential(logits, model, prompt, tokens, parents, tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_equal_sequential_decode_of_each_path(family):
    assert_tree_logits_match_sequential(tiny_model(family, dtype=torch.float64), prompt_len=9, T=12, seed=1,
                                        tol=hf_tol(family))


def hf_tensors(cache):
    """Every cached tensor of every layer of an HF DynamicCache, by name (read through stree's one cache walker)."""
    return {f"{i}.{name}": t for i, states in layer_states(cache).items() for name, t in states.items()}


def state_tensors(state):
    """The same names for a stree StateCache (attention buffers cut to the committed length)."""
    out = {}
    for i in state.keys:
        out[f"{i}.keys"], out[f"{i}.values"] = (t[:, :, :state.length] for t in (state.keys[i], state.values[i]))
    for i in state.conv:
        out[f"{i}.conv_states"] = state.conv[i]
        if state.recurrent[i] is not None:
            out[f"{i}.recurrent_states"] = state.recurrent[i]
    return out


def assert_cache_is_after(tm, model, prompt, path, tol=1e-6):
    """tm's state equals HF's after sequentially decoding prompt + path (token ids), tensor by tensor."""
    _, ref_cache = decode_sequentially(model, prompt, path)
    got, want = state_tensors(tm.cache), hf_tensors(ref_cache)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name].to(got[name].dtype), rtol=tol, atol=tol, msg=name)


def one_pass_logits(model, prompt, tokens, parents):
    """Logits (T, vocab) of every node from one tree_forward() of the whole tree."""
    tm = TreeModel(model)
    tm.prefill(prompt)
    return tm.tree_forward(torch.tensor([tokens]), torch.tensor([parents]))[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("accepted", [0, 5, 11, -1])
def test_commit_equals_feeding_the_path(family, accepted):
    model = tiny_model(family, dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    tokens, parents = random_tree(12, seed=4)
    tm = TreeModel(model)
    tm.prefill(prompt)
    tm.tree_forward(torch.tensor([tokens]), torch.tensor([parents]))
    tm.commit(torch.tensor([accepted]))
    path = [tokens[k] for k in path_to(parents, accepted)] if accepted >= 0 else []
    assert tm.length == 7 + len(path)
    assert_cache_is_after(tm, model, prompt, path, hf_tol(family))
    # The committed cache keeps working: two more trees on top still equal sequential decoding.
    tm.tree_forward(torch.tensor([[5, 6]]), torch.tensor([[-1, 0]]))
    tm.commit(torch.tensor([1]))
    got_logits = tm.tree_forward(torch.tensor([[7]]), torch.tensor([[-1]]))[0, 0]
    want_logits, _ = decode_sequentially(model, prompt, path + [5, 6, 7])
    torch.testing.assert_close(got_logits.double(), want_logits.double(), rtol=hf_tol(family), atol=hf_tol(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_extending_a_tree_equals_one_pass_over_the_grown_tree(family):
    """Three extend() calls with random split points: the new nodes' logits equal one tree_forward() over the
    whole tree, logits_for picks rows, and the commit of a node added last equals sequential decoding."""
    model = tiny_model(family, dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    tokens, parents = random_tree(13, seed=6)
    want = one_pass_logits(model, prompt, tokens, parents)
    grown = TreeModel(model)
    grown.prefill(prompt)
    got, pieces = [], [(0, 1), (1, 5), (5, 6), (6, 13)]
    for n, (a, b) in enumerate(pieces):
        grow = grown.extend if n else grown.tree_forward
        got.append(grow(torch.tensor([tokens[a:b]]), torch.tensor([parents[a:b]]))[0])
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-7, atol=1e-7)
    grown.discard()
    grown.tree_forward(torch.tensor([tokens[:9]]), torch.tensor([parents[:9]]))
    rows = grown.extend(torch.tensor([tokens[9:]]), torch.tensor([parents[9:]]), logits_for=[3, 0])[0]
    torch.testing.assert_close(rows, want[[12, 9]], rtol=1e-7, atol=1e-7)
    grown.commit(torch.tensor([12]))
    assert_cache_is_after(grown, model, prompt, [tokens[k] for k in path_to(parents, 12)], hf_tol(family))


@pytest.mark.parametrize("family, batch, one_call", [(f, 1, False) for f in FAMILIES] + [
    ("bamba", 2, False), ("qwen3_next", 3, False), ("bamba", 2, True), ("mamba", 1, True), ("qwen3_next", 1, True),
    ("lfm2", 1, True)])
def test_levels_grown_on_the_device_equal_sequential_decoding(family, batch, one_call):
    """A trunk pass, then levels of nodes chosen on the device (extend_on_device: tokens and parents from choose(),
    the host tree told only at settle()), one call per level or all in one call (`more`), every row its own tree:
    every new node's logits equal HF's sequential decoding of its path, and after settle() the commit of a node of
    the last level leaves each row's state HF's (then a host-built tree on top still agrees)."""
    model = tiny_model(family, dtype=torch.float64)
    g = torch.Generator().manual_seed(31)
    prompts = torch.randint(0, 64, (batch, 6), generator=g)
    tokens, parents = [[4, 9]] * batch, [[-1, 0]] * batch
    tm = TreeModel(model, nodes=4)
    tm.prefill(prompts)
    tm.tree_forward(tokens, parents, logits_for=[1], slots=12)
    last, grown, levels = [1], [[] for _ in range(batch)], []
    for depth, size in enumerate((3, 1, 4, 2), 2):  # level: (size, depth, tokens, parents, the new nodes' ids)
        level_parents = [[last[int(i)] for i in torch.randint(0, len(last), (size,), generator=g)] for _ in grown]
        new = list(range(2 + sum(level[0] for level in levels), 2 + sum(level[0] for level in levels) + size))
        levels.append((size, depth, torch.randint(0, 64, (batch, size), generator=g).tolist(), level_parents, new))
        last = new
    ids = []
    choices = [lambda new_ids, level=level: (ids.append(new_ids.tolist()), (torch.tensor(level[2]),
                                                                         torch.tensor(level[3]), "carried"))[1]
               for level in levels]
    then = lambda logits, carry: (carry, logits)  # noqa: E731
    if one_call:
        (size, depth, *_), *rest = levels
        outs = tm.extend_on_device(size, depth, choices[0], then=then, more=[
            (level[0], level[1], choose, then, lambda out: ()) for level, choose in zip(rest, choices[1:])])
    else:
        outs = [tm.extend_on_device(level[0], level[1], choose, then=then) for level, choose in zip(levels, choices)]
    tol = dict(rtol=hf_tol(family), atol=hf_tol(family))
    assert ids == [level[4] for level in levels]
    for (size, depth, level_tokens, level_parents, new), (carry, logits) in zip(levels, outs):
        assert carry == "carried" and logits.shape == (batch, size, 64)
        for b in range(batch):
            tokens[b], parents[b] = tokens[b] + level_tokens[b], parents[b] + level_parents[b]
            grown[b] += level_parents[b]
            for row, node in enumerate(new):
                want, _ = decode_sequentially(model, prompts[b:b + 1], [tokens[b][k] for k in path_to(parents[b], node)])
                torch.testing.assert_close(logits[b, row], want.to(logits.dtype), **tol)
    with pytest.raises(RuntimeError, match="settle"):
        tm.commit([last[0]] * batch)
    with pytest.raises(ValueError, match="10 nodes"):
        tm.settle([row[:-1] for row in grown])
    tm.settle(grown)
    accepted = [last[b % len(last)] for b in range(batch)]
    tm.commit(accepted)
    fed = [[tokens[b][k] for k in path_to(parents[b], accepted[b])] for b in range(batch)]
    logits = tm.tree_forward([[7, 8]] * batch, [[-1, -1]] * batch)
    for b in range(batch):
        _, ref_cache = decode_sequentially(model, prompts[b:b + 1], fed[b])
        got, want = state_tensors(tm.cache), hf_tensors(ref_cache)
        for name in want:
            torch.testing.assert_close(got[name][b:b + 1], want[name].to(got[name].dtype), **tol, msg=name)
        for row, token in enumerate((7, 8)):
            want, _ = decode_sequentially(model, prompts[b:b + 1], fed[b] + [token])
            torch.testing.assert_close(logits[b, row], want.to(logits.dtype), **tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_commits_applied_by_the_next_pass_equal_sequential_decoding(family, monkeypatch):
    """A commit's device part runs with the next pass. Commits never read in between, then a tree that makes every
    buffer grow (more node slots than before, attention positions past the reserve), still give HF's sequential
    decoding's logits, and the state read at the end equals HF's."""
    from stree.models import tree_model
    monkeypatch.setattr(tree_model, "DEFAULT_RESERVE", 4)
    model = tiny_model(family, dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(11))
    tm = TreeModel(model, nodes=2)
    tm.prefill(prompt)
    fed = []
    for tokens, parents, accepted in (([3, 4], [-1, 0], 1), ([5, 6, 7], [-1, -1, 1], 2)):
        tm.tree_forward([tokens], [parents])
        tm.commit([accepted])
        fed += [tokens[k] for k in path_to(parents, accepted)]
    tokens, parents = random_tree(12, seed=12)
    logits = tm.tree_forward([tokens], [parents])[0]
    for i in range(12):
        want, _ = decode_sequentially(model, prompt, fed + [tokens[k] for k in path_to(parents, i)])
        torch.testing.assert_close(logits[i].double(), want.double(), rtol=hf_tol(family), atol=hf_tol(family))
    tm.commit([11])
    fed += [tokens[k] for k in path_to(parents, 11)]
    assert tm.length == 5 + len(fed)
    assert_cache_is_after(tm, model, prompt, fed, hf_tol(family))


def test_compiled_tree_model_runs_a_first_one_node_pass_on_its_dynamic_graph():
    """Once the node count is dynamic, a first 1-node pass or 1-row LM head (which dynamo would specialise and
    compile anew mid-generation) runs padded on the dynamic graph: no new graph, the same logits as eager passes."""
    import torch._dynamo
    model = tiny_model("bamba", dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(13))
    eager, compiled = TreeModel(model, nodes=8), TreeModel(model, nodes=8).compile(backend="aot_eager")
    counts = torch._dynamo.utils.counters
    trees = [([1, 2, 3], [-1, 0, 0], None), ([4, 5, 6, 7, 8], [-1, 0, 1, 1, 0], [2, 4]), ([9], [-1], None),
             ([10, 11], [-1, 0], [1])]
    for n, tm in enumerate((eager, compiled)):
        tm.prefill(prompt)
        got = []
        for k, (tokens, parents, rows) in enumerate(trees):
            if n == 1 and k == 2:
                graphs = counts["stats"]["unique_graphs"]
            got.append(tm.tree_forward([tokens], [parents], logits_for=rows)[0])
            tm.commit([0])
        if n == 0:
            want = got
    assert counts["stats"]["unique_graphs"] == graphs
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_what_stree_keeps_for_a_model_goes_with_it():
    """The compiled TreeModels, measured costs and packed weights stree keeps per model are held weakly: nothing
    is written into the model, and a model the user drops is freed (a kept TreeModel must not refer back to it)."""
    import gc
    import weakref
    from stree.adaptive import kept_costs
    from stree.decoding import tree_model
    from stree.models.packed import packed_linears
    model = tiny_model("mamba2", dtype=torch.float32)
    before = set(model.__dict__)
    tm = tree_model(model, dict(backend="aot_eager"), nodes=4, pass_width=4)
    assert tree_model(model, dict(backend="aot_eager"), nodes=4, pass_width=4) is tm
    kept_costs(model)
    packed_linears(model, 0)
    assert set(model.__dict__) == before
    gone = weakref.ref(model)
    del model, tm
    gc.collect()
    assert gone() is None


def test_compile_arguments_give_cuda_graphs_beside_the_guard_filter():
    """TreeModel.compile's torch.compile arguments: on CUDA the inductor backend gets CUDA graphs (mode
    "reduce-overhead" as inductor options, since torch.compile refuses a mode beside options, and the options always
    carry the guard filter); a user's mode and options are kept; a mode for another backend is refused."""
    from stree.models.compile import compile_options as _compile_options
    from stree.models.compile import skip_module_guards_of_own_frames as _skip_module_guards_of_own_frames
    cuda = _compile_options({"dynamic": None}, cuda=True)
    assert "mode" not in cuda and cuda["options"]["triton.cudagraphs"] is True
    assert cuda["options"]["guard_filter_fn"] is _skip_module_guards_of_own_frames
    torch.compile(lambda x: x + 1, **cuda)  # accepted: construction checks the arguments, as the next line shows
    with pytest.raises(RuntimeError, match="not_an_option"):
        torch.compile(lambda x: x + 1, options={"not_an_option": True})
    assert "triton.cudagraphs" not in _compile_options({}, cuda=False)["options"]
    tuned = _compile_options({"mode": "max-autotune-no-cudagraphs", "options": {"cpp_wrapper": True}}, cuda=True)
    assert tuned["options"]["max_autotune"] and tuned["options"]["cpp_wrapper"]
    assert "triton.cudagraphs" not in tuned["options"]
    assert _compile_options({"backend": "aot_eager"}, cuda=True)["options"] == {
        "guard_filter_fn": _skip_module_guards_of_own_frames}
    with pytest.raises(ValueError, match="inductor"):
        _compile_options({"backend": "eager", "mode": "reduce-overhead"}, cuda=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_a_pass_writes_in_place_is_marked_static(family):
    """CUDA graphs replay a compiled pass only if each tensor it writes in place and that outlives it keeps its
    address and is marked so for torch.compile; inductor skips the graphs otherwise ("mutated inputs", seen on an
    H200 for the views a Mamba2 adapter keeps). Checked on eager passes (a tree pass whose commit runs in it, an
    extension, a level grown on the device): the tensors written in place that no op of the pass made are all
    marked."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made, self.written = set(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    self.written.append(value)
            out = func(*args, **kwargs)
            inputs = {id(a) for a in [*args, *kwargs.values()]}  # an in-place op returns what it wrote
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and id(t) not in inputs:
                    self.made.add(id(t))
            return out

    model = tiny_model(family)
    tokens, parents = random_tree(6, seed=3)
    tm = TreeModel(model, nodes=4)
    tm._static_buffers = True  # what compile() sets on CUDA
    tm.prefill(torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2)))
    for slots in (4, 8):  # the second tree grows the buffers to 8 slots: the new ones must be marked too
        tm.tree_forward(torch.tensor([tokens[:3]]), torch.tensor([parents[:3]]), slots=slots)
        tm.commit([0])
    level = (torch.tensor([tokens[:2]]), torch.tensor([[0, 0]]), None)  # two children of node 0 (depth 1)
    with Writes() as writes:
        tm.tree_forward(torch.tensor([tokens[:3]]), torch.tensor([parents[:3]]), slots=8)
        tm.extend(torch.tensor([tokens[3:]]), torch.tensor([parents[3:]]))
        tm.extend_on_device(2, 2, lambda ids: level)
    # what outlives the pass: a tensor written in place that no op of the pass made, or the base of a view the pass
    # made and wrote through
    kept = [t if id(t) not in writes.made else t._base for t in writes.written
            if id(t) not in writes.made or (t._base is not None and id(t._base) not in writes.made)]
    assert kept, "no kept buffer was written: the check saw nothing"
    unmarked = [tuple(t.shape) for t in kept if getattr(t, "_dynamo_static_input_type", None) is None]
    assert not unmarked, f"written in place without a static address: {unmarked}"


def static_input_backend(graphs):
    """A torch.compile backend that appends, for every graph it is given, (how many graph inputs it writes in place,
    the shapes of those torch.compile does not hold static): the test inductor applies before it replays a graph
    with CUDA graphs ("skipping cudagraphs due to mutated inputs" otherwise). The graphs run eagerly."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext

    def forward(gm, example_inputs):
        static = set(TracingContext.get().fw_metadata.static_input_indices)
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        written = {inputs.index(n.args[0]) for n in gm.graph.nodes if n.op == "call_function"
                   and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"}
        graphs.append((len(written), [tuple(example_inputs[i].shape) for i in sorted(written - static)]))
        return gm
    return aot_autograd(fw_compiler=forward, keep_inference_input_mutations=True)


@pytest.mark.parametrize("family", ["bamba", "lfm2", "mamba2"])
def test_a_compiled_pass_writes_no_input_that_is_not_static(family):
    """CUDA graphs replay a compiled pass only if every graph input it writes in place is static (keeps its address
    and is known to torch.compile as such); inductor skips the graphs otherwise. Seen on an H200: a view of a
    marked buffer is a graph input of its own, and inputs that alias a written one are merged into a new base that
    is not static. Checked with torch.compile's own bookkeeping on the graphs of a first tree pass, an extension,
    a pass whose commit runs in it, and two levels grown on the device in one call; families: attention with Mamba2 and with
    short-conv layers, and an attention-free model (its modules are called directly). The other mixer kinds slice
    their buffers inside the pass; Jamba and Qwen3-Next passed here too but compile for over a minute each (graph
    breaks). That every buffer a pass writes is marked is checked for every family by the test above."""
    model = tiny_model(family)
    tokens, parents = random_tree(6, seed=3)
    graphs = []
    tm = TreeModel(model, nodes=8).compile(backend=static_input_backend(graphs))
    tm._static_buffers = True  # what compile() sets on CUDA
    tm.prefill(torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2)))
    tm.tree_forward(torch.tensor([tokens[:3]]), torch.tensor([parents[:3]]))
    tm.extend(torch.tensor([tokens[3:]]), torch.tensor([parents[3:]]))  # what drafting on the host runs
    tm.commit([4])
    tm.tree_forward(torch.tensor([tokens[:3]]), torch.tensor([parents[:3]]))
    level = lambda parents: lambda ids: (torch.tensor([tokens[:2]]), torch.tensor([parents]), None)  # noqa: E731
    tm.extend_on_device(2, 2, level([0, 0]), more=[(2, 3, level([3, 4]), None, lambda logits: ())])  # two levels
    assert len(graphs) >= 3, f"{len(graphs)} graphs compiled: the check missed a pass"
    assert sum(written for written, _ in graphs) > 0, "no graph input was written in place: the check saw nothing"
    assert not any(unstatic for _, unstatic in graphs), f"graph inputs written in place but not static: {graphs}"


def test_a_failed_pass_leaves_the_tree_as_it_was(monkeypatch):
    """A forward that fails after the attention layer appended K/V (bamba: mamba, attention, mamba) is rolled back:
    extending again gives the one-pass logits and the commit still equals sequential decoding."""
    from stree.models.mamba2 import Mamba2Layers
    model = tiny_model("bamba", dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    tokens, parents = random_tree(8, seed=8)
    want = one_pass_logits(model, prompt, tokens, parents)
    tm = TreeModel(model)
    tm.prefill(prompt)
    tm.tree_forward(torch.tensor([tokens[:3]]), torch.tensor([parents[:3]]))
    calls, original = [], Mamba2Layers.forward

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:  # the second mamba layer, after the attention layer wrote the new K/V
            raise RuntimeError("boom")
        return original(*args)

    monkeypatch.setattr(Mamba2Layers, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        tm.extend(torch.tensor([tokens[3:]]), torch.tensor([parents[3:]]))
    monkeypatch.setattr(Mamba2Layers, "forward", original)
    got = tm.extend(torch.tensor([tokens[3:]]), torch.tensor([parents[3:]]))[0]
    torch.testing.assert_close(got, want[3:], rtol=1e-7, atol=1e-7)
    tm.commit(torch.tensor([7]))
    assert_cache_is_after(tm, model, prompt, [tokens[k] for k in path_to(parents, 7)])


@pytest.mark.parametrize("family", ["bamba", "jamba"])  # Mamba1 keeps the committed state in an extra slot
@pytest.mark.parametrize("accepted", [1, -1])
def test_a_failed_pass_that_grew_the_tree_still_commits(monkeypatch, family, accepted):
    """An extend() that grows the node slots and then fails leaves a tree with more slots than its last good pass
    saw: committing one of its nodes, or none, still gives HF's sequential decoding (logits and state)."""
    model = tiny_model(family, dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    tm = TreeModel(model, nodes=4)
    tm.prefill(prompt)
    tm.tree_forward([[3, 4]], [[-1, 0]])

    def failing(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(next(iter(tm.kinds.values())), "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        tm.extend([[5] * 10], [[1] + list(range(2, 11))])  # 12 nodes: more than the 4 slots
    monkeypatch.undo()
    tm.commit([accepted])
    sequence = [3, 4][:accepted + 1] + [9]
    got = tm.tree_forward([[9]], [[-1]])[0, 0]
    tol = hf_tol(family)
    torch.testing.assert_close(got, decode_sequentially(model, prompt, sequence)[0], rtol=tol, atol=tol)
    tm.commit([0])
    assert_cache_is_after(tm, model, prompt, sequence, tol)


@pytest.mark.parametrize("family", ["bamba", "mamba"])  # Mamba2 / Mamba1 adapters derive A from A_log
def test_a_prefill_after_weights_changed_in_place_uses_the_new_weights(family):
    """A TreeModel reused across prefills (compiled ones are kept on the model) follows weights changed in place in
    between, as by an optimizer step or load_state_dict: its passes equal HF's sequential decoding of the new model."""
    model = tiny_model(family, dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    tm = TreeModel(model)
    tm.prefill(prompt)
    tm.tree_forward([[3, 4]], [[-1, 0]])
    tm.commit([1])
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    tokens, parents = random_tree(6, seed=5)
    tm.prefill(prompt)
    assert_node_logits_match_sequential(tm.tree_forward([tokens], [parents])[0], model, prompt, tokens, parents,
                                        hf_tol(family))


def test_a_failed_pass_after_a_commit_asks_for_a_new_prefill(monkeypatch):
    """A pass that fails while it carries the previous commit's device part leaves the state unknown: the model
    says so (prefill again) instead of decoding on from a state that may or may not include the commit."""
    from stree.models.mamba2 import Mamba2Layers
    model = tiny_model("bamba", dtype=torch.float64)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(9))
    tm = TreeModel(model)
    tm.prefill(prompt)
    tm.tree_forward([[3, 4]], [[-1, 0]])
    tm.commit([1])

    def failing(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(Mamba2Layers, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        tm.tree_forward([[5]], [[-1]])
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="prefill"):
        tm.tree_forward([[5]], [[-1]])
    tm.prefill(prompt)
    torch.testing.assert_close(tm.tree_forward([[5]], [[-1]])[0, 0], decode_sequentially(model, prompt, [5])[0])


def test_unsupported_model_lists_supported():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="mamba2, bamba"):
        TreeModel(model)


@pytest.mark.parametrize("family", ["bamba", "falcon_h1"])
def test_bfloat16_tree_pass_tracks_sequential_decode(family):
    """Low precision runs end to end; it agrees with HF's bf16 decode to bf16 accuracy, not bit for bit."""
    assert_tree_logits_match_sequential(tiny_model(family, dtype=torch.bfloat16), prompt_len=6, T=8, seed=0,
                                        tol=0.05)


def test_tree_model_usage_errors():
    tm = TreeModel(tiny_model("mamba2"))
    with pytest.raises(RuntimeError, match="prefill"):
        tm.tree_forward(torch.tensor([[1]]), torch.tensor([[-1]]))
    tm.prefill(torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match="no tree to extend"):
        tm.extend(torch.tensor([[1]]), torch.tensor([[-1]]))
    with pytest.raises(RuntimeError, match="tree_forward"):
        tm.commit(torch.tensor([0]))
    tm.tree_forward(torch.tensor([[1, 2]]), torch.tensor([[-1, 0]]))
    with pytest.raises(RuntimeError, match="not committed"):
        tm.tree_forward(torch.tensor([[1]]), torch.tensor([[-1]]))
    with pytest.raises(ValueError, match="logits_for"):
        tm.extend(torch.tensor([[3]]), torch.tensor([[1]]), logits_for=[1])
    with pytest.raises(ValueError, match="topological"):  # new node 2 may not point at itself
        tm.extend(torch.tensor([[3]]), torch.tensor([[2]]))
    with pytest.raises(ValueError, match="node ids"):
        tm.commit(torch.tensor([2]))
    tm.discard()
    assert tm.length == 2


def assert_rows_match_sequential(model, logits, prompts, committed, trees, tol):
    """Row b's node logits equal HF's sequential decoding of prompts[b] + committed[b] + the node's path."""
    for b, (tokens, parents) in enumerate(trees):
        assert_node_logits_match_sequential(logits[b], model, prompts[b][None], tokens, parents, tol, committed[b])


def commit_random_paths(tm, trees, committed, g):
    """Commit a random node per row (paths of different lengths; -1 now and then) and record what each row took."""
    nodes = [int(torch.randint(-1, len(tokens), (), generator=g)) for tokens, _ in trees]
    tm.commit(nodes)
    for b, ((tokens, parents), node) in enumerate(zip(trees, nodes)):
        committed[b] += [tokens[k] for k in path_to(parents, node)] if node >= 0 else []


# rows kept reordered (a new state), every family; in order (moved within the buffers), one family per state layout
@pytest.mark.parametrize("family, kept", [(f, [2, 0]) for f in FAMILIES] + [
    (f, [0, 2]) for f in ("bamba", "jamba", "mamba", "qwen3_next", "lfm2")])
def test_ragged_rows_equal_each_row_decoded_alone(family, kept):
    """Rows with prompts of different lengths (add_rows) run trees in one pass and commit paths of different
    lengths; every node's logits equal HF's sequential decoding of that row alone, also after rows leave
    (keep_rows) and a new row joins (add_rows on a running batch)."""
    model = tiny_model(family, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (5, 3, 5)]  # equal lengths prefill together
    tm = TreeModel(model)
    # HF's fp32 steps inside float64 models drift further over the longer sequences here than in one tree's test
    first, tol = tm.add_rows(prompts, max_length=40), 1e-4 if family in FP32_IN_HF else 1e-6
    for b, prompt in enumerate(prompts):
        torch.testing.assert_close(first[b], decode_sequentially(model, prompt[None], [])[0].double(), rtol=tol,
                                   atol=tol)
    committed = [[] for _ in prompts]
    for round_ in range(3):
        if round_ == 2:  # row 1 leaves, a new prompt joins
            tm.keep_rows(kept)
            prompts, committed = [prompts[k] for k in kept], [committed[k] for k in kept]
            prompts.append(torch.randint(0, 64, (4,), generator=g))
            committed.append([])
            tm.add_rows(prompts[-1:], max_length=40)
        trees = [random_tree(5, seed=100 * round_ + b) for b in range(len(prompts))]
        logits = tm.tree_forward([t for t, _ in trees], [p for _, p in trees])
        assert_rows_match_sequential(model, logits, prompts, committed, trees, tol)
        commit_random_paths(tm, trees, committed, g)
    assert tm.cache.lengths.tolist() == [len(p) + len(c) for p, c in zip(prompts, committed)]


def buffer_addresses(tm):
    """(address, shape) of every state tensor and mixer node buffer of a TreeModel."""
    adapters = {id(a): a for a, _ in tm._layers.values()}.values()
    tensors = tm.cache.tensors() + [t for a in adapters for t in vars(a).values() if isinstance(t, torch.Tensor)]
    return [(t.data_ptr(), tuple(t.shape)) for t in tensors]


@pytest.mark.parametrize("family", ["bamba", "jamba", "mamba", "qwen3_next", "lfm2"])
def test_spare_rows_change_no_row_and_stay_empty(family):
    """pad_rows (a compiled Batch on CUDA keeps its batch at powers of two): spare rows after the rows decoding run
    trees of their own in every pass; the rows' logits still equal HF's sequential decoding of each row alone, and
    spare rows committed with -1 keep zero states and no token, also after rows leave and the batch is padded
    again. A row leaving, another joining and the batch padded back to its size keep every state and node buffer
    where it was (the commit riding in the pass, as with CUDA graphs, which replay over buffers at fixed
    addresses)."""
    model = tiny_model(family, dtype=torch.float64)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (4, 6, 3)]
    tm = TreeModel(model)
    tm._static_buffers = True  # as on CUDA: rows move within the buffers, the commit runs in the next pass
    tm.add_rows(prompts, max_length=40)
    tm.pad_rows(1)
    committed, tol = [[] for _ in prompts], 1e-4 if family in FP32_IN_HF else 1e-6
    for round_ in range(3):
        if round_ == 2:  # row 0 leaves (two rows, two spare ones), then a prompt joins (three rows, one spare)
            buffers = buffer_addresses(tm)
            tm.keep_rows([1, 2])
            tm.pad_rows(2)
            tm.keep_rows([0, 1])
            prompts, committed = prompts[1:] + [torch.randint(0, 64, (5,), generator=g)], committed[1:] + [[]]
            tm.add_rows(prompts[-1:], max_length=40)
            tm.pad_rows(1)
        trees = [random_tree(5, seed=10 * round_ + b) for b in range(tm.cache.batch)]
        logits = tm.tree_forward([t for t, _ in trees], [p for _, p in trees])
        if round_ == 2:
            assert buffer_addresses(tm) == buffers
        assert_rows_match_sequential(model, logits, prompts, committed, trees[:len(prompts)], tol)
        live = trees[:len(prompts)]
        nodes = [int(torch.randint(-1, 5, (), generator=g)) for _ in live]
        tm.commit(nodes + [-1] * (len(trees) - len(live)))
        for b, ((tokens, parents), node) in enumerate(zip(live, nodes)):
            committed[b] += [tokens[k] for k in path_to(parents, node)] if node >= 0 else []
        spare = slice(len(prompts), None)
        assert tm.cache.lengths[spare].tolist() == [0] * (tm.cache.batch - len(prompts))
        for group in tm.cache.groups:
            assert not group.conv[spare].any() and (group.recurrent is None or not group.recurrent[spare].any())
    assert tm.cache.lengths[:len(prompts)].tolist() == [len(p) + len(c) for p, c in zip(prompts, committed)]


@pytest.mark.parametrize("family", ["bamba", "jamba", "mamba", "qwen3_next"])
@pytest.mark.parametrize("kept", [[0, 1, 2, 3], [1, 2, 3], [0, 2], [3], [0, 1, 2]])
def test_rows_left_in_place_equal_a_selected_copy(family, kept):
    """keep_rows with rows in order compacts the state in its own buffers (a CPU's fresh tensors cost page faults):
    every state tensor and length equals index_select's copy of those rows (StateCache.select), and no buffer is
    new; a row that joins then goes into the room left."""
    tm = TreeModel(tiny_model(family, dtype=torch.float64))
    g = torch.Generator().manual_seed(len(kept))
    tm.add_rows([torch.randint(0, 64, (n,), generator=g) for n in (4, 2, 6, 3)], max_length=30)
    trees = [random_tree(4, seed=b) for b in range(4)]
    tm.tree_forward([t for t, _ in trees], [p for _, p in trees])
    tm.commit([1, 3, 0, 2])
    want = tm.cache.select(torch.tensor(kept))
    buffers = {t.data_ptr() for t in tm.cache.tensors()}
    tm.keep_rows(kept)
    got = tm.cache
    assert got.lengths.tolist() == want.lengths.tolist()
    for a, b in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(a, b)
    assert {t.data_ptr() for t in got.tensors()} <= buffers
    if len(kept) < 4:  # a row joins into the room left: the same buffers again (its state: the ragged rows' test)
        tm.add_rows([torch.randint(0, 64, (3,), generator=g)], max_length=30)
        assert {t.data_ptr() for t in tm.cache.tensors()} <= buffers
        assert tm.cache.lengths.tolist() == want.lengths.tolist() + [3]


@pytest.mark.parametrize("family", ["bamba", "mamba2", "falcon_h1"])
def test_batch_rows_are_independent_trees(family):
    """Two rows with different prompts and different trees: every node's logits equal HF's sequential decoding of
    that row's prompt + path, and committing equal-length paths on both rows leaves each row's state equal to
    sequential decoding of its own path (then one more tree on top still agrees)."""
    model = tiny_model(family, dtype=torch.float64)
    g = torch.Generator().manual_seed(21)
    prompts = torch.randint(0, 64, (2, 6), generator=g)
    trees = [random_tree(9, seed=22), random_tree(9, seed=23)]
    tm = TreeModel(model)
    tm.prefill(prompts)
    logits = tm.tree_forward([t for t, _ in trees], [p for _, p in trees])
    for b, (tokens, parents) in enumerate(trees):
        for i in range(9):
            want, _ = decode_sequentially(model, prompts[b:b + 1], [tokens[k] for k in path_to(parents, i)])
            torch.testing.assert_close(logits[b, i].double(), want.double(), rtol=1e-6, atol=1e-6)
    depth = [[len(path_to(p, i)) for i in range(9)] for _, p in trees]
    nodes = next((a, c) for a in range(9) for c in range(9) if depth[0][a] == depth[1][c] >= 2)
    tm.commit(list(nodes))
    for b, (tokens, parents) in enumerate(trees):
        path = [tokens[k] for k in path_to(parents, nodes[b])]
        _, ref_cache = decode_sequentially(model, prompts[b:b + 1], path)
        got, want = state_tensors(tm.cache), hf_tensors(ref_cache)
        for name in want:
            torch.testing.assert_close(got[name][b:b + 1], want[name].to(got[name].dtype), rtol=1e-6, atol=1e-6,
                                       msg=name)
    more = tm.tree_forward([[3], [4]], [[-1], [-1]])
    for b, (tokens, parents) in enumerate(trees):
        want, _ = decode_sequentially(model, prompts[b:b + 1], [tokens[k] for k in path_to(parents, nodes[b])]
                                      + [3 + b])
        torch.testing.assert_close(more[b, 0].double(), want.double(), rtol=1e-6, atol=1e-6)


def test_an_older_transformers_is_refused_with_the_version_needed():
    """Before transformers 5.24 a model ignored a cache passed as cache= (a confusing failure later): importing the
    model code under an older version raises ImportError naming the version needed. (A subprocess: the check runs
    at import.)"""
    import subprocess
    import sys
    code = "import transformers; transformers.__version__ = '5.17.0'; import stree.models"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "stree needs transformers>=5.24, found 5.17.0" in result.stderr


@pytest.mark.parametrize("call, error, message", [
    (lambda tm: tm.prefill(torch.tensor([[1, 64]])), ValueError, r"input_ids holds token id 64, .* vocabulary of 64"),
    (lambda tm: tm.prefill(torch.tensor([[-1, 2]])), ValueError, r"input_ids holds token id -1"),
    (lambda tm: tm.prefill(torch.tensor([[1.0, 2.0]])), ValueError, r"integer tensor of shape \(batch"),
    (lambda tm: tm.prefill(torch.tensor([1, 2])), ValueError, r"integer tensor of shape \(batch"),
    (lambda tm: tm.tree_forward([[1]], [[-1]]), RuntimeError, r"call prefill\(\) before"),
    (lambda tm: (tm.prefill(torch.tensor([[1, 2]])), tm.tree_forward([[3, 64]], [[-1, 0]])), ValueError,
     r"tokens holds token id 64, .* vocabulary of 64"),
    (lambda tm: (tm.prefill(torch.tensor([[1, 2]])), tm.tree_forward([[3]], [[-1]]), tm.extend([[-5]], [[0]])),
     ValueError, r"tokens holds token id -5"),
    (lambda tm: (tm.prefill(torch.tensor([[1, 2]])), tm.tree_forward([[3, 4]], [[-1, 1]])), ValueError,
     r"parents must be -1 or an earlier node"),
    (lambda tm: (tm.prefill(torch.tensor([[1, 2]])), tm.tree_forward([[3, 4]], [[-1, 0]]), tm.commit([5])),
     ValueError, r"nodes must hold 1 node ids"),
])
def test_bad_inputs_get_clear_errors(call, error, message):
    """TreeModel's own entry points check what they are given before any forward: ids outside the vocabulary name
    the id and the vocabulary's size (HF's embedding would raise an IndexError naming neither)."""
    tm = TreeModel(tiny_model("bamba"))
    with pytest.raises(error, match=message):
        call(tm)
