"""GPU readiness in one script (issue 11): the ahead-of-time compile check for machines without a GPU, and one
command that measures everything the first few minutes a GPU is lent.

    python benchmarks/gpu.py --compile-only          # any machine: every Triton kernel launch compiled for sm_80
                                                     # and sm_90; registers, spills, shared memory, fits or not
    python benchmarks/gpu.py --out DIR               # a CUDA machine: the steps below, at most 8 min on one H200
    python benchmarks/gpu.py --out DIR --dry-run     # the same steps on CPU at tiny sizes, Triton interpreted
    (a GPU machine without internet: benchmarks/gpu_wheels.sh and docs/gpu.md say what to carry there)

Each step runs as a subprocess under its own time budget (BUDGETS, RUNS; TOTAL_BUDGET bounds their sum), plus what
the steps before it left unspent of theirs (so the compiled steps last get the time the quick ones did not need, and
the whole run still ends within TOTAL_BUDGET), and writes its JSON into DIR as soon as it finishes, so a step that
fails or overruns loses nothing written before it;
DIR/summary.md and DIR/summary.json (the steps, and one record per measured case: tokens/s of HF generate, stree's
autoregressive loop and the tree, tau, host syncs per round) are rewritten after every step.
  1 equivalence  pytest on every kernel's tests on CUDA (tests/conftest.py picks the device); the TreeModel's
                 tree pass and stree.generate on tiny CUDA models of seven families against HF's own decoding;
                 then the Mamba2 kernels at the real layer shapes of aot.MODEL_SHAPES: Triton vs the PyTorch
                 reference vs the naive loops of tests/loops.py, in fp32, bf16 and fp16  -> step1-equivalence.json
  2 kernels      benchmarks/scan_kernels/tree_kernels.py: a T-node tree scan vs one decode step, T steps, unrolled
                 paths, HF's chunked scan and mamba_ssm's chunk scan over T tokens, T in 1, 16, 64; a Gated
                 DeltaNet layer over T nodes vs fla's chunk kernel (anchors when carried)  -> step2-kernels.json
  3 generate     benchmarks/decoding/generate.py: the bundled pair inflated to 8.9B / 364M parameters, bf16, eager,
                 T=0 and 1, against HF generate and stree's autoregressive loop, trees drafted by the draft and by
                 the inflated bundled head                                     -> step3-generate-8b-pair.json
  4 batch        benchmarks/decoding/batch.py: the same pair at B = 1 and 16   -> step4-batch-8b-pair.json
  5 compiled     generate.py as in 3 with torch.compile'd passes (CUDA graphs)
                                                                        -> step5-generate-8b-pair-compiled.json
  6 compiled     batch.py as in 4 at B = 16 with compiled passes         -> step6-batch-8b-pair-compiled.json
Steps 2 on run their scripts as modules from the repository root (python -m benchmarks...), as
benchmarks/README.md says to. The compile check writes benchmarks/results/<machine kind>/gpu-compile.json.
"""
import argparse
import functools
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if "--dry-run" in sys.argv:  # the interpreter must be chosen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ---- Steps 3 on: the decoding benchmarks' command lines, written here only, run in this order after steps 1 and 2.
# name: (module, arguments on a GPU, arguments for --dry-run or None (not run dry), budget in seconds (GPU, dry)).
# The pair is the bundled one inflated to 8.9B / 364M parameters (benchmarks/decoding/pairs.py: same trees, a real
# model's cost); its trees come twice, drafted by the draft and by the bundled head inflated with the target.
PAIR_8B = ["--target", "demo-target", "--draft", "demo-draft", "--large", "8b", "--large-draft", "--large-only",
           "--dtypes", "bfloat16", "--temperatures", "0", "1", "--prompts", "1", "--large-new-tokens", "48"]
DRY_PAIR = ["--target", "mamba2-draft", "--draft", "mamba2-draft", "--dtypes", "float32", "--temperatures", "0",
            "--prompts", "1", "--prompt-len", "8", "--max-new-tokens", "4", "--repeats", "1"]
RUNS = {
    # eager: HF generate (mamba_ssm's kernels when carried), stree's loop, the default tree and a fixed one
    "generate:8b-pair": ("benchmarks.decoding.generate",
                         PAIR_8B + ["--repeats", "2", "--trees", "adaptive", "dynamic-16", "--overhead-sizes", "1", "16"],
                         DRY_PAIR + ["--trees", "chain-4"], (80, 150)),
    "batch:8b-pair": ("benchmarks.decoding.batch",
                      ["--large", "8b", "--large-draft", "--dtype", "bfloat16", "--batches", "1", "16", "--repeats", "1",
                       "--new-tokens", "24"],
                      ["--batches", "2", "--new-tokens", "3", "--repeats", "1", "--prompt-lens", "4", "8"], (45, 90)),
    # compiled last: their warm-up is the least predictable, and whatever they finish is saved table by table
    "generate:8b-pair-compiled": ("benchmarks.decoding.generate",
                                  PAIR_8B + ["--repeats", "1", "--trees", "adaptive", "--compile", "--no-overhead"],
                                  None, (190, 0)),
    # batches with compiled passes (CUDA graphs; each batch size met compiles once): B = 16 alone
    "batch:8b-pair-compiled": ("benchmarks.decoding.batch",
                               ["--large", "8b", "--large-draft", "--dtype", "bfloat16", "--batches", "16",
                                "--repeats", "1", "--new-tokens", "24", "--compile"], None, (50, 0)),
}
TOTAL_BUDGET = 480  # seconds on one H200, steps 1 and 2 included: a rerun fits in a 15-minute device lease
# ---- Steps 1 and 2: budgets in seconds (on one H200, in --dry-run) and tree_kernels.py's arguments. ----------
BUDGETS = {"equivalence": (75, 120), "kernels": (40, 120)}  # dry-run budgets: a safety net on a loaded CPU
KERNELS_ARGS = (["--shapes", "mamba2-2.7b", "nemotron-h-8b", "--sizes", "1", "16", "64", "--dtype", "bfloat16",
                 "--min-time", "0.2", "--gated-delta"],
                ["--shapes", "tiny", "--sizes", "4", "--dtype", "float32", "--backend", "triton", "--min-time", "0",
                 "--min-reps", "1", "--gated-delta", "tiny"])
EQUIVALENCE_SIZES = ((16, 64), (5,))                   # trees checked at every real shape (GPU, dry run)
PYTEST_BUDGET = (45, 90)                               # seconds of step 1's budget pytest may take
PYTEST_ARGS = (["tests/test_tree_scan.py", "tests/test_tree_conv.py", "tests/test_tree_selective_scan.py",
                "tests/test_tree_gated_delta.py", "tests/test_tree_kda.py"],  # every kernel's tests, natively on CUDA
               ["tests/test_tree_scan.py", "tests/test_tree_conv.py", "-k", "chain_equals_hf"])  # a few, interpreted
TINY_SHAPE = dict(nheads=4, headdim=16, dstate=16, ngroups=2, conv_width=4, conv_dim=96)
TOLERANCE = {"float32": 2e-4, "bfloat16": 6e-2, "float16": 2e-2}  # max |error| / max |reference|, as the tests


def run_bounded(command, seconds, log, env, group=True):
    """Run `command` in ROOT with its output in the file `log` and stop it after `seconds`: with every process it
    started when `group` (it gets its own process group), else itself only (it stays in ours, so that stopping us
    stops it). Returns the exit code, or None when it was stopped."""
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=group)
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
            return None


@functools.cache
def load_file(name, path):
    """The module in the file `path` (relative to ROOT), loaded by path: this script runs as
    `python benchmarks/gpu.py`, where neither the package `benchmarks` nor the tests' helpers are importable."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def common():
    return load_file("benchmarks.common", os.path.join("benchmarks", "common.py"))


def loops():
    return load_file("loops", os.path.join("tests", "loops.py"))


def write_json(path, data):
    common().write_json(path, data)


def versions():
    import torch
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    machine = common().machine_info("cuda" if torch.cuda.is_available() else "cpu")
    return dict(device=device, machine=machine["machine"], cpu_flags=" ".join(machine["cpu_flags"]),
                torch=torch.__version__, triton=triton_version, transformers=transformers.__version__)


# ---- --compile-only ----------------------------------------------------------------------------------------------

def compile_only(args):
    from stree.triton_kernels import aot
    machine = common().machine_info("cpu")
    print(common().device_line(machine))
    cases = aot.launches(args.models, args.sizes, [aot.DTYPES[d] for d in args.dtypes])
    start = time.perf_counter()
    results = aot.check(cases, args.archs, jobs=args.jobs)
    print(f"{'kernel':<24} {'sm':>3} {'dtype':<8} {'flags':<22} {'blocks':<16} {'warps':>5} {'regs':>4} "
          f"{'spill B':>7} {'smem KB':>7}  fits")
    for r in results:
        flags = ",".join(k.removeprefix("HAS_") for k, v in r.constexprs.items() if v is True) or "-"
        blocks = "x".join(str(v) for k, v in r.constexprs.items() if k.startswith("BLOCK_"))
        fits = "yes" if r.fits else "NO: " + (r.error or "; ".join(r.problems))
        print(f"{r.kernel:<24} {r.arch:>3} {r.dtype:<8} {flags:<22} {blocks:<16} {r.num_warps:>5} {r.regs:>4} "
              f"{r.spill_bytes:>7} {r.smem / 1024:>7.1f}  {fits}")
    bad = [r for r in results if not r.fits]
    print(f"\n{len(results)} distinct compilations ({len(cases)} launches: {len(args.models)} models x T in "
          f"{args.sizes} x {args.dtypes}, archs {args.archs}) in {time.perf_counter() - start:.0f} s; "
          f"{len(bad)} failed or did not fit")
    out = args.out or common().results_path(machine, "gpu-compile.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json(out, dict(versions(), archs=aot.ARCHS, models={m: aot.MODEL_SHAPES[m] for m in args.models},
                         sizes=args.sizes, dtypes=args.dtypes, ok=not bad,
                         results=[dict(vars(r), fits=r.fits) for r in results]))
    print(f"wrote {out}")
    return 1 if bad else 0


# ---- step 1: equivalence -----------------------------------------------------------------------------------------

def pytest_counts(junit):
    """passed / failed / errors / skipped and the failing test ids of a pytest --junitxml file."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
    return dict(passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                failed=counts["failures"], errors=counts["errors"], skipped=counts["skipped"], failing=failing)


def real_shape_inputs(shape, T, batch=2):
    """Random inputs of one layer shape and tree size whose tensors hold values exact in fp32, bf16 and fp16 alike
    (bf16-rounded, tiny magnitudes zeroed), so one fp64 loop reference serves all three dtypes."""
    import torch
    random_rows = loops().random_rows
    H, P, N, G, W, C = (shape[k] for k in ("nheads", "headdim", "dstate", "ngroups", "conv_width", "conv_dim"))
    g = torch.Generator().manual_seed(T)

    def exact(*size, scale=1.0):
        t = (torch.randn(*size, generator=g) * scale).bfloat16().float()
        return t.masked_fill(t.abs() < 2**-10, 0.0)

    rows = random_rows("random", T, batch, seed=T)
    return dict(x=exact(batch, T, H, P), dt=exact(batch, T, H, scale=0.5), A=-torch.rand(H, generator=g).add(0.5),
                B=exact(batch, T, G, N), C=exact(batch, T, G, N), D=torch.randn(H, generator=g),
                dt_bias=exact(H, scale=0.5), h0=torch.randn(batch, H, P, N, generator=g), xbc=exact(batch, T, C),
                weight=exact(C, W), bias=exact(C), conv_state=exact(batch, C, W),
                nodes=torch.tensor([T - 1, int(torch.randint(0, T, (1,), generator=g))]),
                parents=torch.tensor(rows)), rows


def loop_references(inputs, rows):
    """Each kernel's expected output from the naive fp64 loops of tests/loops.py."""
    import torch
    conv_loop, conv_windows_loop, scan_loop = loops().conv_loop, loops().conv_windows_loop, loops().scan_loop
    i = inputs
    y, states = scan_loop(i["x"], i["dt"], i["A"], i["B"], i["C"], rows, D=i["D"], dt_bias=i["dt_bias"],
                          dt_softplus=True, initial_states=i["h0"])
    width = i["weight"].shape[1]
    return dict(tree_scan=y, tree_states=states[torch.arange(len(rows)), i["nodes"]],
                tree_conv1d=conv_loop(i["xbc"], i["weight"], i["bias"], rows, i["conv_state"]),
                tree_conv_state=conv_windows_loop(i["xbc"], rows, i["conv_state"], width,
                                                  [[n] for n in i["nodes"].tolist()])[:, 0].transpose(1, 2))


def run_kernels(inputs, dtype, device, backend):
    """The four kernels on `inputs` cast to dtype (model parameters A, D, dt_bias and the fp32 state stay fp32)."""
    from stree.triton_kernels import tree_conv1d, tree_conv_state, tree_scan, tree_states
    keep = ("A", "D", "dt_bias", "h0", "nodes", "parents")
    i = {k: v.to(device) if k in keep else v.to(device, dtype) for k, v in inputs.items()}
    ssm = dict(dt_bias=i["dt_bias"], dt_softplus=True, initial_states=i["h0"], backend=backend)
    return dict(tree_scan=tree_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["parents"], D=i["D"], **ssm),
                tree_states=tree_states(i["x"], i["dt"], i["A"], i["B"], i["parents"], i["nodes"], **ssm),
                tree_conv1d=tree_conv1d(i["xbc"], i["weight"], i["bias"], i["parents"], i["conv_state"],
                                        backend=backend),
                tree_conv_state=tree_conv_state(i["xbc"], i["parents"], i["nodes"], i["conv_state"], backend=backend))


def relative_error(actual, expected):
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).abs().max() / (expected.abs().max() + 1e-6)).item()


def check_real_shape(name, shape, T, device, dtypes):
    """Each kernel at one layer shape and tree size, in each dtype: Triton and the PyTorch reference against the
    naive loops, and Triton against the PyTorch reference. Rows of model, T, dtype, kernel, backend, against, error."""
    inputs, rows = real_shape_inputs(shape, T)
    want = loop_references(inputs, rows)
    out = []
    for dtype in dtypes:
        name_of = str(dtype).removeprefix("torch.")
        got = {b: run_kernels(inputs, dtype, device, b) for b in ("torch", "triton")}
        for kernel, expected in want.items():
            pairs = [("torch", "loops", relative_error(got["torch"][kernel], expected)),
                     ("triton", "loops", relative_error(got["triton"][kernel], expected)),
                     ("triton", "torch", relative_error(got["triton"][kernel], got["torch"][kernel]))]
            out += [dict(model=name, T=T, dtype=name_of, kernel=kernel, backend=b, against=a, error=e,
                         ok=e <= TOLERANCE[name_of]) for b, a, e in pairs]
    return out


MODEL_FAMILIES = (("bamba", "nemotron_h", "falcon_h1", "zamba2", "jamba", "qwen3_next", "lfm2"), ("bamba",))


def check_models(device, families):
    """The TreeModel's one-pass tree logits against HF's own sequential decoding of each node's path, and
    stree.generate's greedy output against HF's generate, for tiny float32 models of each family on `device`
    (TF32 off: exact float32 matmuls). Rows of family, check, error / equal."""
    import torch
    import stree
    from stree import random_parents
    from stree.models import TreeModel, tiny_model
    from transformers import DynamicCache
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows = []
    for family in families:
        model = tiny_model(family, dtype=torch.float32, seed=1).to(device)
        g = torch.Generator().manual_seed(2)
        prompt = torch.randint(0, 64, (1, 9), generator=g).to(device)
        parents = random_parents(10, g, max_children=3)
        tokens = torch.randint(0, 64, (10,), generator=g).tolist()
        tm = TreeModel(model)
        tm.prefill(prompt)
        logits = tm.tree_forward([tokens], [parents])[0].float()
        worst = 0.0
        with torch.no_grad():
            for i in range(10):
                path, node = [], i
                while node >= 0:
                    path.insert(0, tokens[node])
                    node = parents[node]
                cache = DynamicCache(config=model.config)
                ids = torch.cat([prompt, torch.tensor([path], device=device)], dim=1)
                want = model(ids, cache=cache, use_cache=True,
                             position_ids=torch.arange(ids.shape[1], device=device)[None]).logits[0, -1].float()
                worst = max(worst, float((logits[i] - want).abs().max() / want.abs().max()))
        rows.append(dict(family=family, check="tree logits vs HF", error=worst, ok=worst < 1e-3))
        model.generation_config.eos_token_id = None
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48, do_sample=False)
        got = stree.generate(model, prompt, draft_model=model, max_new_tokens=48, tree=stree.DynamicTree(8, 4, 2, 2))
        rows.append(dict(family=family, check="greedy generate vs HF", equal=bool(torch.equal(got, want)),
                         ok=bool(torch.equal(got, want))))
        print(f"{family}: {rows[-2]['error']:.2e} relative logits error, greedy equal {rows[-1]['equal']}", flush=True)
    return rows


def step_equivalence(out, dry):
    import torch
    from stree.triton_kernels import aot
    path = os.path.join(out, "step1-equivalence.json")
    result = dict(versions())
    junit = os.path.join(out, "step1-pytest.xml")
    start = time.perf_counter()
    write_json(path, result)
    if importlib.util.find_spec("pytest") is None:
        result["pytest"] = dict(exit_code=None, error="pytest is not installed: bring its wheels (pip download pytest)")
    else:
        log = os.path.join(out, "step1-pytest.log")
        code = run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                            *PYTEST_ARGS[dry]], PYTEST_BUDGET[dry], log, os.environ, group=False)
        with open(log) as f:
            tail = f.read()[-2000:]
        result["pytest"] = dict(pytest_counts(junit) if os.path.exists(junit) else {}, exit_code=code,
                                seconds=time.perf_counter() - start, tail=tail)
    write_json(path, result)  # written now: the checks below may run out of time
    device = "cpu" if dry else "cuda"
    result["models"] = check_models(device, MODEL_FAMILIES[dry])
    write_json(path, result)
    shapes = {"tiny": TINY_SHAPE} if dry else {k: v for k, v in aot.MODEL_SHAPES.items() if "dstate" in v}
    rows = []
    for name, shape in shapes.items():
        for T in EQUIVALENCE_SIZES[dry]:
            rows += check_real_shape(name, shape, T, device, (torch.float32, torch.bfloat16, torch.float16))
        result["shapes"] = rows
        write_json(path, result)
        print(f"{name}: {sum(r['ok'] for r in rows)}/{len(rows)} within tolerance so far", flush=True)
    result["ok"] = (result["pytest"]["exit_code"] == 0 and bool(rows) and all(r["ok"] for r in rows)
                    and all(r["ok"] for r in result["models"]))
    write_json(path, result)
    return 0 if result["ok"] else 1


# ---- the driver --------------------------------------------------------------------------------------------------

def plan(out, dry):
    """(step name, command, budget s, JSON path) of every step."""
    me = [sys.executable, os.path.abspath(__file__), "--out", out] + (["--dry-run"] if dry else [])
    steps = [("equivalence", me + ["--step", "equivalence"], BUDGETS["equivalence"][dry],
              os.path.join(out, "step1-equivalence.json"))]
    kernels_json = os.path.join(out, "step2-kernels.json")
    steps.append(("kernels", [sys.executable, "-m", "benchmarks.scan_kernels.tree_kernels", *KERNELS_ARGS[dry],
                              "--out", kernels_json], BUDGETS["kernels"][dry], kernels_json))
    for number, (name, (module, gpu_args, dry_args, budgets)) in enumerate(RUNS.items(), start=3):
        arguments = dry_args if dry else gpu_args
        if arguments is None:
            continue
        path = os.path.join(out, f"step{number}-{name.replace(':', '-')}.json")
        steps.append((name, [sys.executable, "-m", module, *arguments, "--out", path], budgets[dry], path))
    return steps


def headline(name, path):
    """One line of the most telling numbers of a step's JSON (best effort: formats of other scripts change)."""
    try:
        with open(path) as f:
            data = json.load(f)
        if name == "equivalence":
            p, shapes = data.get("pytest", {}), data.get("shapes", [])
            worst = max(shapes, key=lambda r: r["error"] / TOLERANCE[r["dtype"]], default=None)
            models = data.get("models", [])
            text = (f"pytest {p.get('passed')} passed, {p.get('failed')} failed, {p.get('errors')} errors; models "
                    f"{sum(r['ok'] for r in models)}/{len(models)} checks equal HF; real "
                    f"shapes {sum(r['ok'] for r in shapes)}/{len(shapes)} within tolerance")
            return text + (f" (worst {worst['kernel']} {worst['backend']} vs {worst['against']}, {worst['model']} "
                           f"T={worst['T']} {worst['dtype']}: {worst['error']:.1e})" if worst else "")
        if name == "kernels":
            return "; ".join(f"{r['shape']} T={r['T']}: tree/step1 {r['ratios']['tree_over_step1']:.2f}, "
                             f"tree/hf_chunk {r['ratios']['tree_over_hf_chunk']:.2f}"
                             for r in data["results"] if r["T"] in (4, 16))
        if name == "batch":
            return "; ".join(f"B={r['batch']}: tree {statistics.median(r['tree_vs_ar']):.2f}x stree AR, "
                             f"AR {statistics.median(r['ar_vs_hf']):.2f}x HF" for r in data["rows"])
        parts = ["partial"] if data.get("complete") is False else []
        parts += [f"{o['target']} {o['dtype']}: 16-node pass " + ", ".join(
            f"{t['ratio']:.2f}x HF's step" for t in o["trees"] if t["nodes"] == 16) for o in data.get("overhead", [])]
        for table in data.get("tables", []):
            best = max(table["rows"], key=lambda r: r["speedup_vs_hf"][1])
            parts.append(f"{table['target']} {table['dtype']} T={table['temperature']}: best {best['method']} "
                         f"{best['speedup_vs_hf'][1]:.2f}x HF generate (tau {best['tau']:.2f})")
        return "; ".join(parts)
    except Exception as e:  # noqa: BLE001 - a headline is a convenience; the JSON is the record
        return f"(no headline: {type(e).__name__}: {e})"


def case_records(path):
    """summary.json's records from one step's JSON: one per tree method of each table of generate.py and per batch
    size of batch.py, {case, device, dtype, temperature, compiled, target_params, draft_params (a head's own for its
    rows), tok_s: {hf, stree_ar, tree}, tau, syncs_per_round (CUDA; None for batches), tree_vs_stree_ar (median)}."""
    with open(path) as f:
        data = json.load(f)
    common = dict(device=data.get("device_name"), compiled=bool(data.get("compile", data.get("compiled", False))))
    records = []
    for table in data.get("tables", []):  # generate.py
        rows = {r["method"]: r for r in table["rows"]}
        hf, ar = rows.pop("HF generate", None), rows.pop("stree autoregressive", None)
        for method, row in rows.items():
            draft_params = table.get("head_params") if method.startswith("head ") else table["draft_params"]
            records.append(dict(case=f"{table['target']}: {method}", **common, dtype=table["dtype"],
                                temperature=table["temperature"], target_params=table["params"],
                                draft_params=draft_params,
                                tok_s=dict(hf=hf and hf["tokens_per_s"], stree_ar=ar and ar["tokens_per_s"],
                                           tree=row["tokens_per_s"]),
                                tau=row["tau"], syncs_per_round=row.get("syncs_per_round"),
                                tree_vs_stree_ar=row["speedup_vs_ar"][1]))
    for row in data.get("rows", []):  # batch.py: greedy
        compiled = " compiled" if data.get("compiled") else ""
        records.append(dict(case=f"batch of {row['batch']}{compiled}: {data['tree']}", **common, dtype=data["dtype"],
                            temperature=0.0, target_params=data.get("target_params"),
                            draft_params=data.get("draft_params"), tok_s=row["tok_s"], tau=row["tau"],
                            syncs_per_round=None, tree_vs_stree_ar=statistics.median(row["tree_vs_ar"])))
    return records


def write_summary(out, rows, dry):
    lines = [f"# GPU run{' (dry run: CPU, tiny sizes, Triton interpreted)' if dry else ''}", "",
             ", ".join(f"{k} {v}" for k, v in versions().items()), "",
             "| step | status | seconds | budget (allowed) | JSON | headline |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['budget']} ({r['allowed']:.0f}) | "
              f"{os.path.basename(r['json']) if r['json'] else '-'} | {r['headline']} |" for r in rows]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    cases = [record for r in rows if r["json"] and r["step"] not in ("equivalence", "kernels")
             for record in _readable(case_records, r["json"])]
    write_json(os.path.join(out, "summary.json"), dict(versions(), dry_run=dry, steps=rows, cases=cases))


def _readable(read, path):
    """read(path), or nothing when the file is not what `read` expects (a step stopped while writing it)."""
    try:
        return read(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"   no cases from {os.path.basename(path)}: {type(e).__name__}: {e}")
        return []


def run_all(out, dry):
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if dry else {}))
    rows, steps = [], plan(out, dry)
    if not dry and sum(budget for _, _, budget, _ in steps) > TOTAL_BUDGET:
        sys.exit(f"the steps' budgets add up to more than TOTAL_BUDGET ({TOTAL_BUDGET} s)")
    unspent = 0.0  # what the steps before left of their budgets: the next step may use it (compiling needs most)
    for name, command, budget, path in steps:
        allowed = budget + unspent
        print(f"== {name} (budget {budget} s, {allowed:.0f} s with what the steps before left)", flush=True)
        start = time.perf_counter()
        code = run_bounded(command, allowed, os.path.join(out, f"{name.replace(':', '-')}.log"), env)
        seconds = time.perf_counter() - start
        unspent = max(allowed - seconds, 0.0)
        status = (f"stopped after {allowed:.0f} s (budget {budget} s)" if code is None else
                  "ok" if code == 0 else f"failed (exit {code})")
        found = path if os.path.exists(path) else None
        rows.append(dict(step=name, status=status, seconds=seconds, budget=budget, allowed=round(allowed, 1),
                         json=found, headline=headline(name.split(":")[0], found) if found else "no JSON"))
        print(f"   {status}, {rows[-1]['seconds']:.0f} s: {rows[-1]['headline']}", flush=True)
        write_summary(out, rows, dry)
    print(f"wrote {os.path.join(out, 'summary.md')}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true", help="the ahead-of-time compile check (no GPU)")
    parser.add_argument("--dry-run", action="store_true", help="every step on CPU, tiny sizes, Triton interpreted")
    parser.add_argument("--out", default=None, help="the steps' folder (required unless --compile-only), or the "
                        "compile check's JSON (default benchmarks/results/<machine kind>/gpu-compile.json)")
    parser.add_argument("--step", choices=["equivalence"], help=argparse.SUPPRESS)  # how the driver runs step 1
    from stree.triton_kernels.aot import ARCHS, DTYPES, MODEL_SHAPES, TREE_SIZES
    group = parser.add_argument_group("--compile-only")
    group.add_argument("--models", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    group.add_argument("--sizes", nargs="+", type=int, default=list(TREE_SIZES))
    group.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    group.add_argument("--archs", nargs="+", type=int, default=list(ARCHS), choices=list(ARCHS))
    group.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compiler processes")
    args = parser.parse_args()
    if args.compile_only:
        sys.exit(compile_only(args))
    if args.out is None:
        parser.error("--out DIR is required (or use --compile-only)")
    if args.step:
        sys.exit(step_equivalence(args.out, args.dry_run))
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run (CPU, tiny sizes) or --compile-only")
    sys.exit(run_all(args.out, args.dry_run))


if __name__ == "__main__":
    main()
