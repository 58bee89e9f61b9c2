import argparse
import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from stree.cli import _tree, main
from stree.draft import BeamTree, DynamicTree, StaticTree
from stree.models import tiny_model


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
    with pytest.raises(Exception):
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
    assert out.split()[:3] == ["w5", "w6", "w7"] and len(out.split()) == 9
    assert "tokens/s" in err and "tau" in err
    main(["generate", *pair_args(pair_dir), "--prompt", "w5", "--max-new-tokens", "4", "--temperature", "1.0",
          "--top-p", "0.9", "--tree", "dynamic:6"])
    assert len(capsys.readouterr().out.split()) == 5


def test_bench_table(pair_dir, capsys, tmp_path):
    main(["bench", *pair_args(pair_dir), "--prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
          "--json", str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert "HF generate" in out and "stree autoregressive" in out and "chain" in out
    tables = json.load(open(tmp_path / "b.json"))
    assert [t["temperature"] for t in tables] == [0.0, 1.0]
    assert all(t["device"].startswith("cpu (") and "torch threads" in t["device"] for t in tables)
    methods = [r["method"] for r in tables[0]["rows"]]
    assert methods == ["HF generate", "stree autoregressive", "chain-4", "dynamic-16", "adaptive"]
    assert all(r["agreement"]["all_equal"] for r in tables[0]["rows"])  # float32 greedy: HF's output exactly
    assert all(r["speedup_vs_hf"][0] > 0 and r["tau"] >= 1 for t in tables for r in t["rows"])


def test_distill_command(pair_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{(i * 7) % 64}" for i in range(3000)))
    student = json.dumps(dict(model_type="mamba2", hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16,
                              state_size=8, n_groups=1))
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
