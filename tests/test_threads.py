"""stree beside other users of the same model object: HF's own forward and generate, other threads' stree calls.
The oracles are HF's own greedy search and each call run alone."""
import threading

import pytest
import torch

import stree
from stree.models import TreeModel, tiny_model
from stree.models.claim import Claim
from test_generate import hf_greedy, noisy_copy, prompts, without_eos

FAMILIES = ["bamba", "mamba2", "qwen3_next"]  # attention + Mamba2, attention-free, attention + Gated DeltaNet
TREE = (2, 2, 1)  # a fixed shape: compiled calls compile once


class Stop(Exception):
    pass


class RaisingStreamer:
    """A streamer that raises `error` at the first round's tokens (after the prompt)."""

    def __init__(self, error):
        self.error = error

    def put(self, value):
        if value.dim() == 1:
            raise self.error

    def end(self):
        pass


def pair(family):
    target = without_eos(tiny_model(family))
    return target, noisy_copy(target, scale=0.01, seed=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_forward_inside_a_tree_pass_is_hfs(family):
    """HF's forward of the model, run while a tree pass is in flight (from a forward hook that the pass fires), gives
    what it gives alone: the pass changes nothing another caller of the same modules sees."""
    target, draft = pair(family)
    probe = prompts([9], seed=3)[0]
    with torch.no_grad():
        want = target(probe).logits
    seen, inside = [], threading.local()

    def hook(module, args, output):
        if not getattr(inside, "busy", False):
            inside.busy = True
            try:
                with torch.no_grad():
                    seen.append(target(probe).logits)
            finally:
                inside.busy = False
    handle = target.get_output_embeddings().register_forward_hook(hook)
    try:
        stree.generate(target, prompts([5])[0], draft_model=draft, max_new_tokens=12, tree=TREE)
    finally:
        handle.remove()
    assert len(seen) > 2  # prefill and several tree passes fired it
    for logits in seen:
        torch.testing.assert_close(logits, want, rtol=0, atol=0)


def run_threads(workers):
    """Run each callable in its own thread; re-raise the first exception any raised."""
    errors = []

    def guarded(work):
        try:
            work()
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("family", ["bamba", "mamba2"])
def test_hf_generate_and_stree_calls_in_threads_are_exact(family):
    """One model object shared by threads: HF's greedy generate in one, eager stree calls in two others and
    compiled ones in two more (their compilation done first: see docs/limits.md on compiling beside other threads); every output
    equals HF's greedy search."""
    target, draft = pair(family)
    cases = prompts([3, 8, 13], seed=5)
    want = [hf_greedy(target, p, 16) for p in cases]
    compiled = {"backend": "eager"}
    for p in cases:  # warm up the compiled passes
        stree.generate(target, p, draft_model=draft, max_new_tokens=16, tree=TREE, compile=compiled)
    got = {}

    def hf():
        for r in range(2):
            for i, p in enumerate(cases):
                got["hf", r, i] = hf_greedy(target, p, 16)

    def tree(name, compile, shape=TREE):
        def work():
            for r in range(2):
                for i, p in enumerate(cases):
                    got[name, r, i] = stree.generate(target, p, draft_model=draft, max_new_tokens=16, tree=shape,
                                                     compile=compile)
        return work
    # eager-b: the adaptive default, whose measured costs every call on the model shares
    run_threads([hf, tree("eager-a", False), tree("eager-b", False, stree.DynamicTree(adaptive=True)),
                 tree("compiled-a", compiled), tree("compiled-b", compiled)])  # compiled: one TreeModel, in turns
    assert len(got) == 5 * 2 * len(cases)
    for (name, r, i), output in got.items():
        assert torch.equal(output, want[i]), (name, r, i)


def test_hf_and_stree_alternate_on_one_model():
    """HF's greedy and sampled generate and stree's greedy and sampled generate, in turn, repeatedly: each gives what
    it gave first (seeded), so neither changes what the other computes."""
    target, draft = pair("bamba")
    p = prompts([7], seed=2)[0]

    def hf_sampled():
        torch.manual_seed(0)
        return target.generate(p, attention_mask=torch.ones_like(p), do_sample=True, top_k=0, max_new_tokens=12)

    def stree_sampled():
        return stree.generate(target, p, draft_model=draft, max_new_tokens=12, tree=TREE, temperature=1.0,
                              generator=torch.Generator().manual_seed(0))
    want = hf_greedy(target, p, 12), hf_sampled(), stree_sampled()
    for _ in range(3):
        assert torch.equal(stree.generate(target, p, draft_model=draft, max_new_tokens=12, tree=TREE), want[0])
        assert torch.equal(hf_greedy(target, p, 12), want[0])
        assert torch.equal(stree_sampled(), want[2])
        assert torch.equal(hf_sampled(), want[1])


def test_a_claimed_tree_model_waits_for_other_threads_and_refuses_its_own():
    """Claim: another thread's claim on a held TreeModel waits until it is released; the holding thread's own
    second claim raises instead of waiting forever."""
    first, second = TreeModel(tiny_model("mamba2")), TreeModel(tiny_model("mamba2"))
    held = Claim([first, None])
    with pytest.raises(RuntimeError, match="still holds"):
        Claim([second, first])
    assert second._holder is None  # nothing taken by the refused claim
    order = []

    def other():
        claim = Claim([second, first])  # waits for `first`
        order.append("other claimed")
        claim.release()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=0.3)
    assert thread.is_alive() and not order  # still waiting
    order.append("released")
    held.release()
    thread.join(timeout=10)
    assert order == ["released", "other claimed"]
    held.release()  # idempotent


def test_generation_releases_its_models_when_done_or_raising(monkeypatch):
    """A Generation holds its TreeModels until it ends, raises, or is closed: then the same thread may start the
    next call on the same compiled models."""
    target, draft = pair("mamba2")
    p = prompts([4])[0]
    compiled = {"backend": "eager"}
    generation = stree.decoding.Generation(target, p, draft_model=draft, max_new_tokens=8, tree=TREE,
                                           compile=compiled)
    with pytest.raises(RuntimeError, match="still holds"):
        stree.generate(target, p, draft_model=draft, max_new_tokens=8, tree=TREE, compile=compiled)
    while not generation.done:
        generation.round()
    want = generation.output()
    assert torch.equal(stree.generate(target, p, draft_model=draft, max_new_tokens=8, tree=TREE, compile=compiled),
                       want)
    with pytest.raises(Stop):
        stree.generate(target, p, draft_model=draft, max_new_tokens=8, tree=TREE, compile=compiled,
                       streamer=RaisingStreamer(Stop))
    assert torch.equal(stree.generate(target, p, draft_model=draft, max_new_tokens=8, tree=TREE, compile=compiled),
                       want)


def test_forwards_set_on_instances_are_refused():
    """A forward set on a module instance (accelerate's offloading hooks) would run the original modules, not the
    TreeModel's copy: refused, naming the module."""
    target = tiny_model("bamba")
    layer = target.model.layers[1]
    layer.forward = layer.forward
    with pytest.raises(ValueError, match="'model.layers.1' has a forward set on the instance"):
        TreeModel(target)


@pytest.mark.parametrize("compile", [False, {"backend": "eager"}])
def test_the_model_changed_between_calls_stays_exact(compile):
    """What a user does to the model between stree calls reaches stree's private copy of its modules: a call that
    raised mid-generation, new weights loaded (load_state_dict), the dtype changed (.to): each next call equals
    HF's greedy search of the model as it now is."""
    target, draft = pair("bamba")
    p = prompts([6], seed=4)[0]

    def check():
        got = stree.generate(target, p, draft_model=draft, max_new_tokens=12, tree=TREE, compile=compile)
        assert torch.equal(got, hf_greedy(target, p, 12))
    with pytest.raises(KeyboardInterrupt):
        stree.generate(target, p, draft_model=draft, max_new_tokens=12, tree=TREE, compile=compile,
                       streamer=RaisingStreamer(KeyboardInterrupt))
    check()
    target.load_state_dict(without_eos(tiny_model("bamba", seed=7)).state_dict())
    check()
    target.to(torch.float64)
    draft.to(torch.float64)
    check()
