"""benchmarks/: no file or folder shadows an installed package, no script edits sys.path, every script runs as a
module from the repository root, machine kinds and default result names match the committed results folders."""
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
GROUPS = ("scan_kernels", "decoding", "tree_search")
SCRIPTS = ["benchmarks.scan_kernels.tree_kernels", "benchmarks.scan_kernels.selective_scan_methods",
           "benchmarks.scan_kernels.recurrent_trees", "benchmarks.decoding.generate", "benchmarks.decoding.draft_share",
           "benchmarks.decoding.tree_policy", "benchmarks.decoding.soak", "benchmarks.decoding.batch",
           "benchmarks.tree_search.arithmetic_search"]


@pytest.fixture
def benchmarks_package(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)  # as `python -m` from the repository root has it
    return importlib.import_module("benchmarks")


def importable_names(folder):
    """The top-level names Python could import from `folder` if it were first on sys.path (as the folder of a script
    run by path is): its modules and its folders, packages or not."""
    names = set()
    for entry in os.listdir(folder):
        stem, ext = os.path.splitext(entry)
        if os.path.isdir(os.path.join(folder, entry)) and entry.isidentifier():
            names.add(entry)
        elif ext in (".py", ".pyc", ".so") and stem.isidentifier():
            names.add(stem)
    return names - {"__init__", "__pycache__"}


@pytest.mark.parametrize("folder", ["", *GROUPS])
def test_no_name_in_benchmarks_shadows_an_installed_or_standard_module(folder):
    path = os.path.join(BENCHMARKS, folder)
    names = importable_names(path)
    assert names, path
    assert "kernels" not in names and "search" not in names
    for name in names:
        assert name not in sys.stdlib_module_names, name
        assert importlib.util.find_spec(name) is None, f"{name} in {path} would shadow an importable module"


def test_no_benchmark_edits_sys_path():
    edit = re.compile(r"sys\.path\s*(=|\+=|\.insert|\.append|\.extend|\[)")
    for folder, _, files in os.walk(BENCHMARKS):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    assert not edit.search(f.read()), os.path.join(folder, name)


@pytest.mark.parametrize("module", SCRIPTS)
def test_every_script_runs_as_a_module_from_the_root(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


def test_machine_kinds(benchmarks_package):
    common = importlib.import_module("benchmarks.common")
    assert common.gpu_kind("NVIDIA H200") == "gpu-h200"
    assert common.gpu_kind("NVIDIA H100 80GB HBM3") == "gpu-h100"
    assert common.gpu_kind("NVIDIA A100-SXM4-80GB") == "gpu-a100"
    assert common.gpu_kind("NVIDIA GeForce RTX 4090") == "gpu-geforce-rtx-4090"
    avx2, avx512 = {"fma", "avx2"}, {"fma", "avx2", "avx512f", "avx512_bf16"}
    assert common.cpu_kind("AMD EPYC 7B13", "AuthenticAMD", avx2) == "cpu-epyc-avx2"
    assert common.cpu_kind("AMD EPYC 9B45", "AuthenticAMD", avx512) == "cpu-epyc-avx512"
    assert common.cpu_kind("Intel(R) Xeon(R) Processor", "GenuineIntel", avx512 | {"amx_tile"}) == "cpu-xeon-amx"
    assert common.cpu_kind("AMD Ryzen 9 7950X 16-Core Processor", "AuthenticAMD", avx512) == "cpu-ryzen-avx512"
    assert common.cpu_kind("", "GenuineIntel", avx2) == "cpu-intel-avx2"
    here = common.machine_info("cpu")
    assert here["machine"] == common.cpu_kind(*common.cpu_description())
    assert set(here["cpu_flags"]) <= set(common.FLAGS)
    assert common.results_path(here, "x.json") == os.path.join(BENCHMARKS, "results", here["machine"], "x.json")


def test_results_are_filed_by_machine_kind():
    kinds = os.listdir(os.path.join(BENCHMARKS, "results"))
    assert set(kinds) == {"cpu-epyc-avx2", "cpu-epyc-avx512", "cpu-xeon-amx", "gpu-h200"}
    for kind in kinds:
        for name in os.listdir(os.path.join(BENCHMARKS, "results", kind)):
            assert not re.search(r"[0-9a-f]{7}", name), f"{kind}/{name} is named by a commit"


def test_default_result_names_match_the_committed_files(benchmarks_package):
    generate = importlib.import_module("benchmarks.decoding.generate")
    search = importlib.import_module("benchmarks.tree_search.arithmetic_search")
    results = os.path.join(BENCHMARKS, "results")
    for kind, argv in [("cpu-xeon-amx", ["--large", "--dtypes", "bfloat16", "--temperatures", "1"]),
                       ("cpu-epyc-avx2", ["--large", "--dtypes", "float32", "bfloat16"]),
                       ("cpu-epyc-avx2", ["--temperatures", "0", "--both-drafting", "--compile"]),
                       ("cpu-epyc-avx2", ["--overhead-only", "--target", "jamba-like-4layers", "--dtypes", "bfloat16"])]:
        name = generate.default_name(generate.parse_args(argv))
        assert os.path.exists(os.path.join(results, kind, name)), (kind, name)
    for kind, argv in [("cpu-epyc-avx512", ["--setting", "hard"]),
                       ("cpu-epyc-avx2", ["--setting", "hard", "--together", "1", "2"])]:
        name = search.default_name(search.parse_args(argv))
        assert os.path.exists(os.path.join(results, kind, name)), (kind, name)
