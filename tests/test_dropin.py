import copy

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import GenerationConfig, PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.streamers import BaseStreamer

import stree
import stree.dropin  # noqa: F401 (a submodule the tests patch: loaded here, not by whichever test runs first)
from stree.models import tiny_model


@pytest.fixture
def pair():
    target = tiny_model("bamba", dtype=torch.float64, seed=5)
    target.generation_config.eos_token_id = None
    draft = tiny_model("bamba", dtype=torch.float64, seed=5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return target, draft


PROMPT = torch.tensor([[4, 8, 15, 16, 23, 42]])


def hf(model, **kwargs):
    with torch.no_grad():
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), **kwargs)


def test_drop_in_greedy_equals_hf_and_falls_back_without_draft(pair):
    target, draft = pair
    want = hf(target, do_sample=False, max_new_tokens=50)
    stree.enable(target)
    assert torch.equal(target.generate(PROMPT, draft_model=draft, max_new_tokens=50), want)
    assert torch.equal(target.generate(input_ids=PROMPT, draft_model=draft, max_new_tokens=50, tree=(1, 1)), want)
    assert torch.equal(hf(target, do_sample=False, max_new_tokens=50), want)  # no draft: HF's own path
    # max_length instead of max_new_tokens, and neither (HF's default: 20 new tokens), each against HF's own call
    assert torch.equal(target.generate(PROMPT, draft_model=draft, max_length=30), hf(target, max_length=30))
    assert torch.equal(target.generate(PROMPT, draft_model=draft), hf(target))
    stree.disable(target)
    assert "generate" not in vars(target)


def test_enable_compile_reaches_generate(pair, monkeypatch):
    """enable(compile=...) is what stree.generate gets as compile= (whose compiled passes test_generate checks
    against HF); a call's stree_compile= overrides it."""
    target, draft = pair
    seen = []
    monkeypatch.setattr(stree.dropin, "generate", lambda *args, compile, **kwargs: seen.append(compile))
    stree.enable(target, compile={"backend": "eager"})
    target.generate(PROMPT, draft_model=draft, max_new_tokens=6)
    target.generate(PROMPT, draft_model=draft, max_new_tokens=6, stree_compile=False)
    stree.enable(target)
    target.generate(PROMPT, draft_model=draft, max_new_tokens=6)
    target.generate(PROMPT, draft_model=draft, max_new_tokens=6, stree_compile=True)
    assert seen == [{"backend": "eager"}, False, False, True]


def test_sampling_with_top_k_1_is_greedy(pair):
    target, draft = pair
    want = hf(target, do_sample=False, max_new_tokens=30)
    stree.enable(target)
    got = target.generate(PROMPT, draft_model=draft, do_sample=True, top_k=1, temperature=0.7, max_new_tokens=30)
    assert torch.equal(got, want)


def test_eos_lists_and_min_new_tokens(pair):
    target, draft = pair
    reference = hf(target, do_sample=False, max_new_tokens=40)[0, 6:].tolist()
    eos = [reference[3], 63]  # appears early; min_new_tokens pushes the stop later
    for kwargs in (dict(eos_token_id=eos), dict(eos_token_id=eos, min_new_tokens=12), dict(eos_token_id=eos, min_length=20)):
        want = hf(target, do_sample=False, max_new_tokens=40, **kwargs)
        stree.enable(target)
        assert torch.equal(target.generate(PROMPT, draft_model=draft, max_new_tokens=40, **kwargs), want), kwargs
        stree.disable(target)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_and_stopping_criteria(pair, capsys):
    target, draft = pair
    stree.enable(target)
    streamer = Collect()
    out = target.generate(PROMPT, draft_model=draft, max_new_tokens=25, streamer=streamer)
    assert streamer.chunks[0] == PROMPT[0].tolist() and streamer.ended
    assert sum(streamer.chunks[1:], []) == out[0, 6:].tolist()

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] >= 13])

    stree.disable(target)
    want = hf(target, do_sample=False, max_new_tokens=25, stopping_criteria=StoppingCriteriaList([StopAfter()]))
    stree.enable(target)
    got = target.generate(PROMPT, draft_model=draft, max_new_tokens=25,
                          stopping_criteria=StoppingCriteriaList([StopAfter()]))
    assert torch.equal(got, want) and got.shape[1] == 13

    vocab = {f"w{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0")))
    target.generate(PROMPT, draft_model=draft, max_new_tokens=5, streamer=TextStreamer(tokenizer))
    printed = capsys.readouterr().out
    assert printed.split()[:6] == [f"w{i}" for i in PROMPT[0].tolist()] and len(printed.split()) == 11


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(repetition_penalty=1.3), NotImplementedError, "repetition_penalty"),
    (dict(num_beams=2), NotImplementedError, "num_beams"),
    (dict(return_dict_in_generate=True), NotImplementedError, "return_dict_in_generate"),
    (dict(no_repeat_ngram_size=2), NotImplementedError, "no_repeat_ngram_size"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]])), ValueError, "left padding"),
    (dict(not_an_option=3), TypeError, "not_an_option"),
])
def test_unsupported_options_raise(pair, kwargs, error, message):
    target, draft = pair
    stree.enable(target)
    with pytest.raises(error, match=message):
        target.generate(PROMPT, draft_model=draft, max_new_tokens=5, **kwargs)



@pytest.mark.parametrize("prompt, kwargs, message", [
    (torch.tensor([[4, 8, 500]]), {}, "token id 500, outside the model's vocabulary"),
    (torch.tensor([[-1, 8, 15]]), {}, "token id -1, outside"),
    (PROMPT, dict(do_sample=True, temperature=float("nan")), "finite"),
])
def test_bad_ids_and_temperatures_get_clear_errors(pair, prompt, kwargs, message):
    """Checked before any forward: HF's embedding would raise an IndexError, sampling a RuntimeError on NaN."""
    target, draft = pair
    stree.enable(target)
    with pytest.raises(ValueError, match=message):
        target.generate(prompt, draft_model=draft, max_new_tokens=5, **kwargs)

@pytest.mark.parametrize("passed, kwargs", [
    (None, dict(max_new_tokens=7)),
    (dict(max_new_tokens=7), {}),
    (dict(max_new_tokens=7, do_sample=False), {}),
    (dict(max_new_tokens=7), dict(temperature=0.3)),
    (dict(max_length=12, top_k=5), dict(min_new_tokens=2)),
])
def test_the_merged_generation_config_is_hfs(pair, passed, kwargs):
    """The drop-in path decodes with the GenerationConfig HF's generate builds (HF's own merge as the oracle): a
    passed config's unset fields come from the model's (here a sampling checkpoint's settings), then from HF's
    defaults, and keyword arguments override them."""
    from stree.dropin import _effective_config
    target, _ = pair
    target.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9, min_new_tokens=3)
    passed = None if passed is None else GenerationConfig(**passed)
    want, _ = target._prepare_generation_config(copy.deepcopy(passed), **kwargs)
    got = _effective_config(target, passed, dict(kwargs))
    for name in ("do_sample", "temperature", "top_k", "top_p", "min_new_tokens", "min_length", "max_new_tokens",
                 "max_length", "eos_token_id"):
        assert getattr(got, name) == getattr(want, name), name


def test_options_of_the_model_and_lengths_are_checked_as_hf_does(pair):
    """A passed config does not hide the model's own unsupported settings, and a prompt that already fills max_length
    (or max_new_tokens=0) is refused, as HF refuses it, instead of returning the prompt."""
    target, draft = pair
    target.generation_config.repetition_penalty = 1.2
    stree.enable(target)
    with pytest.raises(NotImplementedError, match="repetition_penalty"):
        target.generate(PROMPT, draft_model=draft, generation_config=GenerationConfig(max_new_tokens=5))
    target.generation_config.repetition_penalty = None
    long_prompt = torch.arange(24)[None] % 64
    mask = torch.ones_like(long_prompt)
    for kwargs in (dict(max_length=10), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            target.generate(long_prompt, attention_mask=mask, **kwargs)  # no draft: HF's own
        with pytest.raises(ValueError, match="max_length|max_new_tokens"):
            target.generate(long_prompt, draft_model=draft, **kwargs)
    # no length given: 20 new tokens, however long the prompt
    assert torch.equal(target.generate(long_prompt, draft_model=draft), target.generate(long_prompt, attention_mask=mask))


def test_enable_refuses_unsupported_models():
    from transformers import GPT2Config, GPT2LMHeadModel
    with pytest.raises(ValueError, match="supported"):
        stree.enable(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))
