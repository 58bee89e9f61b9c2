"""benchmarks/gpu.py: the dry run of every step (CPU, tiny sizes, Triton interpreted) writes the JSON files a GPU
run writes, and the driver keeps what earlier steps wrote when a later one fails or overruns its budget."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_gpu():
    spec = importlib.util.spec_from_file_location("gpu_script", os.path.join(ROOT, "benchmarks", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_every_step(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and [s["step"] for s in summary["steps"]] == \
        ["equivalence", "kernels", "generate:8b-pair", "batch:8b-pair"]
    assert all(s["status"] == "ok" and s["json"] for s in summary["steps"]), summary["steps"]
    equivalence = json.loads((out / "step1-equivalence.json").read_text())
    assert equivalence["ok"] and equivalence["pytest"]["passed"] > 0 and equivalence["pytest"]["failed"] == 0
    kernels = {r["kernel"] for r in equivalence["shapes"]}
    assert kernels == {"tree_scan", "tree_states", "tree_conv1d", "tree_conv_state"}
    assert {r["dtype"] for r in equivalence["shapes"]} == {"float32", "bfloat16", "float16"}
    assert {(r["backend"], r["against"]) for r in equivalence["shapes"]} == \
        {("torch", "loops"), ("triton", "loops"), ("triton", "torch")}
    step2 = json.loads((out / "step2-kernels.json").read_text())
    assert step2["backend"] == "triton" and all("hf_chunk" in r["times_ms"] for r in step2["results"])
    assert [r["T"] for r in step2["gated_delta"]] == [4]
    generate = json.loads((out / "step3-generate-8b-pair.json").read_text())
    assert generate["overhead"] and generate["tables"]
    assert [r["batch"] for r in json.loads((out / "step4-batch-8b-pair.json").read_text())["rows"]] == [2]
    assert "| equivalence | ok |" in (out / "summary.md").read_text()
    # one record per tree method of each table and per batch size, in the issue's schema, from the steps' JSON
    cases = summary["cases"]
    assert [c["case"] for c in cases] == ["mamba2-draft: chain-4", "batch of 2: adaptive"]
    table = generate["tables"][0]
    tok_s = {r["method"]: r["tokens_per_s"] for r in table["rows"]}
    assert cases[0]["tok_s"] == {"hf": tok_s["HF generate"], "stree_ar": tok_s["stree autoregressive"],
                                 "tree": tok_s["chain-4"]}
    assert cases[0]["target_params"] == table["params"] > 0 and cases[0]["syncs_per_round"] is None  # CPU
    assert {"device", "dtype", "temperature", "compiled", "draft_params", "tau"} <= set(cases[1])


def test_the_gpu_steps_fit_the_total_budget(tmp_path):
    """Every step's budget together stays inside TOTAL_BUDGET (8 minutes: a rerun fits one device lease), the
    compiled steps (whose warm-up is the least predictable) last, and the driver refuses a plan that does not fit."""
    gpu = load_gpu()
    steps = gpu.plan(str(tmp_path), dry=False)
    assert sum(budget for _, _, budget, _ in steps) <= gpu.TOTAL_BUDGET <= 480
    assert [name for name, *_ in steps][-2:] == ["generate:8b-pair-compiled", "batch:8b-pair-compiled"]


def test_a_failing_or_overrunning_step_loses_nothing_and_later_steps_get_the_unspent_time(tmp_path, monkeypatch):
    """A step may run past its own budget into what the steps before it left unspent, never past that: the run as a
    whole ends within the sum of the budgets. The slow step needs 2 s on a 1 s budget (the first left it ~4 s);
    the overrunning one sleeps 60 s and is stopped once the time left is spent."""
    gpu = load_gpu()
    write = "import json, sys; json.dump({'rows': []}, open(sys.argv[1], 'w'))"
    paths = [str(tmp_path / f"{i}.json") for i in range(5)]
    steps = [("first", [sys.executable, "-c", write, paths[0]], 4, paths[0]),
             ("fails", [sys.executable, "-c", "raise SystemExit(3)"], 1, paths[1]),
             ("slow", [sys.executable, "-c", "import time; time.sleep(2); " + write, paths[2]], 1, paths[2]),
             ("overruns", [sys.executable, "-c", "import time; time.sleep(60)"], 1, paths[3]),
             ("last", [sys.executable, "-c", write, paths[4]], 60, paths[4])]
    monkeypatch.setattr(gpu, "plan", lambda out, dry: steps)
    assert gpu.run_all(str(tmp_path), dry=True) == 1
    rows = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [r["status"] for r in rows[:3]] + [rows[4]["status"]] == ["ok", "failed (exit 3)", "ok", "ok"]
    assert rows[3]["status"].startswith("stopped after")
    assert abs(rows[3]["allowed"] - (4 + 1 + 1 + 1 - sum(r["seconds"] for r in rows[:3]))) < 0.1
    assert sum(r["seconds"] for r in rows[:4]) <= 4 + 1 + 1 + 1 + 0.5  # the budgets, and the kill's latency
    assert [bool(r["json"]) for r in rows] == [True, False, True, False, True]
    assert os.path.exists(paths[0]) and os.path.exists(paths[4])
