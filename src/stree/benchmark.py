"""Same-run speed comparisons of tree decoding against HF's own generate and stree's own autoregressive loop.

Used by `stree bench` and benchmarks/decoding/generate.py. Every method decodes the same prompts; the methods of one repeat
run back to back, so a ratio compares runs that saw the same machine load, and repeats give its range.
"""
import contextlib
import copy
import cProfile
import os
import pstats
import statistics
import time
import warnings

import torch

from .adaptive import kept_costs
from .decoding import generate


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, prompt, max_new_tokens, temperature, generator=None):
    """HF's own decoding (greedy, or sampling at `temperature` with no top-k / top-p)."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
        do_sample=False)
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                              **sampling)


def identical_prefix(a, b, start):
    """Tokens from `start` on that a (1, n) and b (1, m) share before they first differ."""
    a, b = a[0, start:], b[0, start:]
    n = min(a.shape[0], b.shape[0])
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0]) if len(differs) else n


def compare(target, draft, prompts, trees, *, max_new_tokens, temperature=0.0, repeats=3, compile=False, seed=0,
            profile=0):
    """Decode every prompt with HF's generate, stree's autoregressive loop and each tree in `trees` ({name: spec,
    or a dict of stree.generate's keyword arguments with the spec as `tree`, and a draft other than `draft` as
    `draft_model`, e.g. a DraftHead}), `repeats` times. Returns one row
    per method:

        method, tokens_per_s (median), speedup_vs_hf / speedup_vs_ar ([min, median, max] over repeats),
        tau, draft_passes (per round), breakdown (ms per round: draft / verify / commit / other, transfers),
        syncs_per_round (CUDA: synchronizing calls per round, counted by torch's sync debug mode in one more untimed
        run; None elsewhere), agreement (greedy: mean number of leading tokens equal to HF's output, and whether all
        are equal).
    With compile=True, a first untimed call per method pays the compilation; its time is `warmup_s`. profile=N:
    after the timed runs, one more untimed run of each stree method under cProfile, whose N functions with the most
    own time (host time: Python, and the launches or device waits inside them) go to the row's `profile`. Sampling
    draws from the global RNG, seeded before each run, as when a user passes no generator (so the default tree
    sizes itself from measured costs; with a generator it keeps its fixed shape).
    """
    device = prompts[0].device
    n_tokens = len(prompts) * max_new_tokens
    methods = {"HF generate": None, "stree autoregressive": "ar", **trees}
    times = {name: [] for name in methods}
    results = {name: None for name in methods}
    warmup = {}

    def run(name):
        spec, outs = methods[name], []
        more = dict(spec) if isinstance(spec, dict) else {}
        spec, method_draft = more.pop("tree", spec), more.pop("draft_model", draft)
        torch.manual_seed(seed)
        _sync(device)
        start = time.perf_counter()
        for prompt in prompts:
            if spec is None:
                outs.append((hf_generate(target, prompt, max_new_tokens, temperature), None))
            else:
                kwargs = dict(tree=spec, **more) if spec != "ar" else {}
                outs.append(generate(target, prompt, draft_model=None if spec == "ar" else method_draft,
                                     max_new_tokens=max_new_tokens, temperature=temperature,
                                     return_stats=True, compile=compile, **kwargs))
        _sync(device)
        return time.perf_counter() - start, outs

    for name in methods:  # warm-up (and compilation) outside the timed runs
        start = time.perf_counter()
        run(name)
        warmup[name] = time.perf_counter() - start
    for _ in range(repeats):
        for name in methods:
            elapsed, outs = run(name)
            times[name].append(elapsed)
            results[name] = outs
    stree_methods = [name for name in methods if name != "HF generate"]
    with _costs_kept(target):  # neither cProfile's slowed runs nor the counting runs may teach adaptive trees
        profiles = {name: _profiled(lambda: run(name), profile) for name in stree_methods} if profile else {}
        syncs = {name: _syncs_per_round(lambda: run(name)) for name in stree_methods} if device.type == "cuda" else {}
    rows, reference = [], [out for out, _ in results["HF generate"]]
    for name in methods:
        stats = [s for _, s in results[name] if s is not None]
        vs_hf = sorted(h / t for h, t in zip(times["HF generate"], times[name]))
        vs_ar = sorted(a / t for a, t in zip(times["stree autoregressive"], times[name]))
        row = dict(method=name, tokens_per_s=n_tokens / statistics.median(times[name]),
                   speedup_vs_hf=[vs_hf[0], statistics.median(vs_hf), vs_hf[-1]],
                   speedup_vs_ar=[vs_ar[0], statistics.median(vs_ar), vs_ar[-1]],
                   tau=_mean([p for s in stats for p in s.tokens_per_pass]) if stats else 1.0,
                   draft_passes=sum(s.draft_passes for s in stats) / max(sum(s.rounds for s in stats), 1),
                   breakdown=_mean_breakdown(stats), syncs_per_round=syncs.get(name),
                   warmup_s=warmup[name] if compile else None)
        if name in profiles:
            row["profile"] = profiles[name]
        if temperature == 0:
            prompt_len = prompts[0].shape[1]
            same = [identical_prefix(out, ref, prompt_len) for (out, _), ref in zip(results[name], reference)]
            row["agreement"] = dict(mean_identical_prefix=_mean(same), of=max_new_tokens,
                                    all_equal=all(s == max_new_tokens for s in same))
        rows.append(row)
    return rows


@contextlib.contextmanager
def _costs_kept(target):
    """The costs adaptive trees keep on `target` restored after the block, whatever it measured."""
    kept = kept_costs(target)
    learnt = copy.deepcopy(kept)
    try:
        yield
    finally:
        kept.clear()
        kept.update(learnt)


def _syncs_per_round(run):
    """Synchronizing CUDA calls (a device-to-host copy, .item(), a blocking wait) per round of run() (compare's
    run of one stree method), counted by torch's sync debug mode: the host waits a round makes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.cuda.set_sync_debug_mode("warn")
            _, outs = run()
        except Exception as e:  # noqa: BLE001 - a count is a diagnostic; the timed figures stand without it
            print(f"syncs not counted: {type(e).__name__}: {e}")
            return None
        finally:
            torch.cuda.set_sync_debug_mode("default")
    rounds = max(sum(s.rounds for _, s in outs if s is not None), 1)
    return sum("synchroniz" in str(w.message) for w in caught) / rounds


def _profiled(run, top):
    """Run `run` (compare's run of one method) under cProfile: its `top` functions by own time, per round."""
    profiler = cProfile.Profile()
    profiler.enable()
    _, outs = run()
    profiler.disable()
    rounds = max(sum(s.rounds for _, s in outs if s is not None), 1)
    entries = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]
    return [dict(function=f"{os.path.basename(file)}:{line}({name})", calls_per_round=calls / rounds,
                 own_ms_per_round=1e3 * own / rounds, cumulative_ms_per_round=1e3 * cumulative / rounds)
            for (file, line, name), (_, calls, own, cumulative, _) in entries]


def format_profile(rows):
    """compare()'s profiles as text: per method, its functions by own time, ms and calls per round."""
    lines = []
    for r in rows:
        if r.get("profile"):
            lines.append(f"{r['method']}: functions by own time (per round: own ms, cumulative ms, calls)")
            lines += [f"  {p['own_ms_per_round']:8.3f} {p['cumulative_ms_per_round']:8.3f} {p['calls_per_round']:7.1f}  "
                      f"{p['function']}" for p in r["profile"]]
    return "\n".join(lines)


def _mean(values):
    return sum(values) / len(values) if values else 0.0


def _mean_breakdown(stats):
    parts = [s.breakdown() for s in stats if s.rounds]
    return {k: _mean([p[k] for p in parts]) for k in parts[0]} if parts else {}


def format_rows(rows):
    """A fixed-width table of compare()'s rows."""
    lines = [f"{'method':>38} {'tok/s':>8} {'vs HF (min-max)':>17} {'vs stree AR':>17} {'tau':>5} {'drafts':>6} "
             f"{'draft/verify/commit/other ms':>29} {'copies':>6} {'syncs':>6} {'agree':>8}"]
    for r in rows:
        b = r["breakdown"]
        parts = "/".join(f"{b[k]:.1f}" for k in ("draft_ms", "verify_ms", "commit_ms", "other_ms")) if b else "-"
        copies = f"{b['transfers']:.2f}" if b else "-"  # device-to-host copies per round
        syncs = "-" if r.get("syncs_per_round") is None else f"{r['syncs_per_round']:.2f}"  # CUDA only
        agree = r.get("agreement")
        agree = "-" if agree is None else f"{agree['mean_identical_prefix']:.0f}/{agree['of']}"
        lines.append(f"{r['method']:>38} {r['tokens_per_s']:>8.1f} "
                     f"{_span(r['speedup_vs_hf']):>17} {_span(r['speedup_vs_ar']):>17} {r['tau']:>5.2f} "
                     f"{r['draft_passes']:>6.2f} {parts:>29} {copies:>6} {syncs:>6} {agree:>8}")
    return "\n".join(lines)


def _span(values):
    low, mid, high = values
    return f"{mid:.2f} ({low:.2f}-{high:.2f})"
