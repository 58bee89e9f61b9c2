import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import stree
from stree.cli import _tree, main
from stree.demo import held_out_prompts
from stree.draft import BeamTree, DynamicTree, StaticTree
from stree.models import tiny_model
from test_distill import hf_greedy, oracle_tau

STUDENT = json.dumps(dict(model_type="mamba2", hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16,
                          state_size=8, n_groups=1))


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    """A tiny target / draft / word-level tokenizer saved like real checkpoints."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_model("bamba", seed=1)
    target.generation_config.eos_token_id = None
    target.save_pretrained(root / "target")
    tiny_model("mamba2", seed=2).save_pretrained(root / "draft")
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w2").save_pretrained(root / "tokenizer")
    return root


def pair_args(root):
    return ["--target", str(root / "target"), "--draft", str(root / "draft"), "--tokenizer", str(root / "tokenizer")]


def test_tree_option():
    assert _tree("3,2,2,1") == StaticTree((3, 2, 2, 1))
    assert _tree("dynamic:10") == DynamicTree(budget=10, adaptive=True)
    assert _tree("fixed:10") == DynamicTree(budget=10)
    assert _tree("beam:2:3") == BeamTree(beams=2, steps=3)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown tree name 'three'"):
        _tree("three")


def test_tree_option_takes_the_tree_names(capsys):
    """--tree takes stree.shapes' names; the old spellings still work and print the new name."""
    assert _tree("adaptive") == DynamicTree(adaptive=True)
    assert _tree("dynamic-16") == DynamicTree(16) and _tree("chain-4") == StaticTree((1, 1, 1, 1))
    assert _tree("beam-2x3") == BeamTree(beams=2, steps=3)
    assert capsys.readouterr().err == ""
    assert _tree("fixed:10") == DynamicTree(budget=10)
    assert "use --tree dynamic-10" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match="tree names"):
        _tree("dynamic-sixteen")


def test_generate_streams_text_and_reports_tau(pair_dir, capsys):
    main(["generate", *pair_args(pair_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32)
    expected = hf_greedy(target, torch.tensor([[5, 6, 7]]), 6)[0]  # greedy: HF's own greedy search of the target
    assert out.split() == [f"w{t}" for t in expected.tolist()]
    assert "tokens/s" in err and "tau" in err
    main(["generate", *pair_args(pair_dir), "--prompt", "w5", "--max-new-tokens", "4", "--temperature", "1.0",
          "--top-p", "0.9", "--tree", "dynamic:6"])
    assert len(capsys.readouterr().out.split()) == 5


def test_bench_table(pair_dir, capsys, tmp_path):
    """The target as its own draft: every drafted token agrees, so tau is known and above 1 for fixed trees."""
    argv = pair_args(pair_dir)
    argv[argv.index("--draft") + 1] = str(pair_dir / "target")
    main(["bench", *argv, "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--json",
          str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert "HF generate" in out and "stree autoregressive" in out and "chain" in out
    tables = json.load(open(tmp_path / "b.json"))
    assert [t["temperature"] for t in tables] == [0.0, 1.0]
    assert all(t["device"].startswith("cpu (") and "torch threads" in t["device"] for t in tables)
    methods = [r["method"] for r in tables[0]["rows"]]
    assert methods == ["HF generate", "stree autoregressive", "chain-4", "dynamic-16", "adaptive"]
    assert all(r["agreement"]["all_equal"] for r in tables[0]["rows"])  # float32 greedy: HF's output exactly
    assert all(r["speedup_vs_hf"][0] > 0 for t in tables for r in t["rows"])
    # tau: 1 token per pass for stree's own loop; above 1 for fixed trees of an agreeing draft, at most depth + 1
    # (dynamic trees: depth 6); an adaptive tree may take plain steps instead when drafting does not pay
    for table in tables:
        rows = {r["method"]: r for r in table["rows"]}
        assert rows["stree autoregressive"]["tau"] == 1.0
        assert 1 < rows["chain-4"]["tau"] <= 5 and 1 < rows["dynamic-16"]["tau"] <= 7, table["temperature"]
        assert 1 <= rows["adaptive"]["tau"] <= 7, table["temperature"]
    # greedy chain-4: the count of accepted drafts made without stree, on the same held-out prompts
    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32)
    prompts = torch.cat(held_out_prompts(AutoTokenizer.from_pretrained(pair_dir / "tokenizer"), 2, 32))
    chain = next(r for r in tables[0]["rows"] if r["method"] == "chain-4")
    assert chain["tau"] == pytest.approx(oracle_tau(target, target, prompts, 8, (1, 1, 1, 1)), abs=1e-12)


def test_distill_command(pair_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{(i * 7) % 64}" for i in range(3000)))
    student = STUDENT
    main(["distill", "--target", str(pair_dir / "target"), "--tokenizer", str(pair_dir / "tokenizer"),
          "--student-config", student, "--data", str(corpus), "--output", str(tmp_path / "out"), "--steps", "4",
          "--batch-size", "2", "--seq-len", "24", "--continuations", "4", "--loss", "forward_kl=0.9,cross_entropy=0.1",
          "--save-every", "2"])
    assert os.path.exists(tmp_path / "out" / "final" / "model.safetensors")
    last = json.loads(capsys.readouterr().out)  # the last logged step
    assert last["step"] == 4 and {"forward_kl", "cross_entropy"} <= set(last)
    main(["distill", "--target", str(pair_dir / "target"), "--tokenizer", str(pair_dir / "tokenizer"),
          "--student-config", student, "--data", str(corpus), "--output", str(tmp_path / "out2"), "--steps", "4",
          "--batch-size", "2", "--seq-len", "24", "--resume", str(tmp_path / "out" / "checkpoint-2")])
    assert os.path.exists(tmp_path / "out2" / "final" / "model.safetensors")


def test_distill_command_trains_a_head(pair_dir, tmp_path, capsys):
    """--head-layers trains an EAGLE-style head (stree.distill.heads) with the same checkpoints and resume; the head
    loads back and drafts for the target."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{(i * 7) % 64}" for i in range(3000)))
    common = ["distill", "--target", str(pair_dir / "target"), "--tokenizer", str(pair_dir / "tokenizer"),
              "--head-layers", "1", "--unroll", "2", "--data", str(corpus), "--steps", "4", "--batch-size", "2",
              "--seq-len", "24"]
    main(common + ["--output", str(tmp_path / "out"), "--save-every", "2"])
    last = json.loads(capsys.readouterr().out)
    assert last["step"] == 4 and {"kl_0", "kl_1", "feature_0", "feature_1"} <= set(last)
    main(common + ["--output", str(tmp_path / "out2"), "--resume", str(tmp_path / "out" / "checkpoint-2")])
    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32)
    head = stree.DraftHead.from_pretrained(tmp_path / "out2" / "final", target=target)
    ids = torch.tensor([[3, 5, 7, 11]])
    out = stree.generate(target, ids, draft_model=head, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out, target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=8, eos_token_id=None))


@pytest.mark.parametrize("extra, message", [([], "--student-config .* or --head-layers"),
                                            (["--student-config", '{"model_type": "mamba2"}', "--head-layers", "1"],
                                             "not both")])
def test_distill_needs_a_student_or_a_head(pair_dir, tmp_path, capsys, extra, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3")
    with pytest.raises(SystemExit):
        main(["distill", "--target", str(pair_dir / "target"), "--data", str(corpus), "--output",
              str(tmp_path / "out")] + extra)
    assert re.search(message, capsys.readouterr().err)


def test_console_script_is_installed():
    """pip installs the `stree` command beside the interpreter that runs the tests."""
    exe = os.path.join(os.path.dirname(sys.executable), "stree")
    assert os.path.exists(exe)
    assert "generate" in subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout


def test_compare_profiles_each_stree_method():
    """compare(profile=N): one more run of each stree method under cProfile, its N functions with the most own time
    per round, most first; HF's generate is not profiled."""
    import torch
    from stree.benchmark import compare, format_profile
    target, draft = tiny_model("bamba", seed=1), tiny_model("mamba2", seed=2)
    target.generation_config.eos_token_id = None
    rows = compare(target, draft, [torch.tensor([[5, 6, 7]])], {"chain": StaticTree((1, 1))}, max_new_tokens=6,
                   repeats=1, profile=5)
    assert [r["method"] for r in rows if "profile" in r] == ["stree autoregressive", "chain"]
    for r in rows[1:]:
        own = [p["own_ms_per_round"] for p in r["profile"]]
        assert len(own) == 5 and own == sorted(own, reverse=True) and own[0] > 0
        assert all(p["cumulative_ms_per_round"] >= p["own_ms_per_round"] and p["calls_per_round"] > 0
                   for p in r["profile"])
    assert format_profile(rows).count("functions by own time") == 2


def test_syncs_per_round_counts_the_sync_warnings_of_one_run(monkeypatch):
    """_syncs_per_round turns torch's sync debug mode on around one run and counts its warnings per round (a CUDA
    feature: here a stand-in for the mode and a run that warns as CUDA would, 3 times over 2 rounds); other
    warnings are not counted, and the mode is set back to default even when the run raises."""
    import warnings

    import torch
    from stree import benchmark
    from stree.stats import GenerationStats
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def run():
        for message in ("called a synchronizing CUDA operation",) * 3 + ("something else",):
            warnings.warn(message)
        return 0.0, [(None, GenerationStats(tokens_per_pass=[2, 1])), (None, None)]

    assert benchmark._syncs_per_round(run) == 1.5 and modes == ["warn", "default"]

    def broken():
        raise RuntimeError("no CUDA")

    assert benchmark._syncs_per_round(broken) is None and modes[-1] == "default"


def cli_error(capsys, argv):
    """The message `stree` prints on stderr when it refuses argv (argparse's exit status 2), before any loading."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--target", "T"], "give both --target and --draft, or neither"),
    (["--draft", "D"], "give both --target and --draft, or neither"),
    (["--tokenizer", "K"], "--tokenizer goes with --target and --draft"),
    (["--tree", "three"], "argument --tree: unknown tree name 'three'"),
    (["--tree", "fixed:x"], "argument --tree: invalid _tree value: 'fixed:x'"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be an integer >= 1, got '-1'"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got '0'"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got 'nan'"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got '-1'"),
    (["--top-k", "0"], "argument --top-k: must be an integer >= 1, got '0'"),
    (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1], got '1.5'"),
])
def test_generate_refuses_bad_arguments(pair_dir, capsys, argv, message):
    argv = [a.replace("T", str(pair_dir / "target")).replace("D", str(pair_dir / "draft"))
            .replace("K", str(pair_dir / "tokenizer")) if len(a) == 1 else a for a in argv]
    assert message in cli_error(capsys, ["generate", *argv])


def test_generate_and_bench_refuse_missing_folders_and_an_empty_prompt(pair_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    # absolute, and relative under a folder that exists here (else namespace/name is taken for a Hub id)
    for missing in (str(tmp_path / "nowhere"), "runs/draft"):
        for option in ("--target", "--draft", "--tokenizer"):
            argv = pair_args(pair_dir)
            argv[argv.index(option) + 1] = missing
            for command in ("generate", "bench"):
                assert f"{option}: no such folder: {missing}" in cli_error(capsys, [command, *argv])
    for argv, message in [(["--prompts", "0"], "argument --prompts: must be an integer >= 1, got '0'"),
                          (["--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
                          (["--prompt-len", "0"], "argument --prompt-len: must be an integer >= 1, got '0'"),
                          (["--temperatures", "0", "nan"], "argument --temperatures: must be a finite number >= 0, "
                                                           "got 'nan'")]:
        assert message in cli_error(capsys, ["bench", *pair_args(pair_dir), *argv])
    with pytest.raises(SystemExit, match="--prompt '' is no tokens at all"):
        main(["generate", *pair_args(pair_dir), "--prompt", ""])


@pytest.mark.parametrize("config, message", [
    ('{"model_type": "mamba2",', "--student-config: the JSON literal is not valid JSON (Expecting property name"),
    ('[1, 2]', "--student-config: the JSON literal must hold a JSON object, got list"),
    ('3', "--student-config: no such file, and not a JSON object: '3'"),
    ('{"hidden_size": 32}', '--student-config: a student config dict needs a "model_type"'),
    ('{"model_type": "mambo"}', "--student-config: unknown model_type 'mambo'"),
    (STUDENT[:-1] + ', "hidden_sise": 32}', "--student-config: unknown keys ['hidden_sise'] for model_type 'mamba2'"),
])
def test_distill_refuses_a_bad_student_config(pair_dir, tmp_path, capsys, config, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3")
    argv = ["distill", "--target", str(pair_dir / "target"), "--student-config", config, "--data", str(corpus),
            "--output", str(tmp_path / "out")]
    assert message in cli_error(capsys, argv)
    (tmp_path / "student.json").write_text(config)  # the same JSON in a file: named by its path
    argv[argv.index(config)] = str(tmp_path / "student.json")
    if config != "3":
        assert message.replace("the JSON literal", str(tmp_path / "student.json")) in cli_error(capsys, argv)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got '0'"),
    (["--grad-accum", "0"], "argument --grad-accum: must be an integer >= 1, got '0'"),
    (["--seq-len", "0"], "argument --seq-len: must be an integer >= 1, got '0'"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got '-1'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--temperature", "0"], "argument --temperature: must be a finite number > 0, got '0'"),
    (["--teacher-top-k", "-1"], "argument --teacher-top-k: must be an integer >= 0, got '-1'"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got '-1'"),
    (["--eval-every", "-1"], "argument --eval-every: must be an integer >= 0, got '-1'"),
    (["--continuation-temperature", "nan"], "argument --continuation-temperature: must be a finite number >= 0"),
    (["--loss", "forward_kl"], "argument --loss: 'forward_kl' is not name=weight"),
    (["--loss", "forward_kl=x"], "argument --loss: 'forward_kl=x' is not name=weight"),
    (["--loss", "l2=1"], "argument --loss: unknown losses ['l2']"),
    (["--loss", "forward_kl=nan"], "argument --loss: the weight of forward_kl must be a finite number >= 0.0"),
    (["--device", "bogus"], "argument --device: not a torch device: 'bogus'"),
    (["--continuations", "4", "--seq-len", "2"], "--continuations needs --seq-len >= 3"),
    (["--resume", "MISSING"], "--resume: no such folder: MISSING"),
    (["--data", "MISSING"], "--data: no such file or folder: MISSING"),
    (["--target", "MISSING"], "--target: no such folder: MISSING"),
])
def test_distill_refuses_bad_arguments(pair_dir, tmp_path, capsys, argv, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3")
    missing = str(tmp_path / "nowhere")
    argv = [missing if a == "MISSING" else a for a in argv]
    base = ["distill", "--target", str(pair_dir / "target"), "--student-config", STUDENT, "--data", str(corpus),
            "--output", str(tmp_path / "out")]
    assert message.replace("MISSING", missing) in cli_error(capsys, base + argv)
