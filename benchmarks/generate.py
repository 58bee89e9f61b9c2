"""End-to-end decoding: HF autoregressive greedy vs vanilla speculative (chain) vs static trees, same prompts.

Reports tokens/s, tau (tokens per target pass) and speedup over autoregressive for each method, checks that every
method's output equals the autoregressive one, and times the target's one-pass tree forward against its own
single-token decode step for trees of 1 to 32 nodes (STree's tree-overhead figure, as a curve). Table on stdout,
JSON in benchmarks/results/.

    python benchmarks/generate.py                                  # built-in random pair (tau is meaningless)
    python benchmarks/generate.py --target demo-target --draft demo-draft   # the bundled trained pair
    python benchmarks/generate.py --target PATH --draft PATH       # any local HF checkpoints
    python benchmarks/generate.py --overhead-only --target mamba2-2.7b-4layers

Temperatures 0 and 1 by default (--temperatures); beam trees run at temperature 0 only (they are not lossless when
sampling). A PNG of speedup and tau against tree size is written when matplotlib is installed (pip install
-e ".[bench]").
"""
import argparse
import json
import os
import platform
import sys
import time

# Python puts this script's folder first on sys.path; there benchmarks/kernels.py would shadow the `kernels`
# package that transformers probes for when it is imported. Drop the folder first.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

import stree  # noqa: E402
from stree import BeamTree, DynamicTree, StaticTree, random_parents  # noqa: E402
from stree.demo import demo_pair, held_out_prompts  # noqa: E402
from stree.models import TreeModel, tiny_model  # noqa: E402

# Built-in random models: (family, config overrides on stree.models.TINY_CONFIGS).
PRESETS = {
    "bamba-small": ("bamba", dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                  attn_layer_indices=[3, 7], num_attention_heads=8, num_key_value_heads=4,
                                  mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64)),
    "mamba2-draft": ("mamba2", dict(vocab_size=4096, hidden_size=128, num_hidden_layers=2, num_heads=4, head_dim=64,
                                    state_size=64, n_groups=1)),
    "mamba2-2.7b-4layers": ("mamba2", dict(vocab_size=50288, hidden_size=2560, num_hidden_layers=4, num_heads=80,
                                           head_dim=64, state_size=128, n_groups=1)),
}
TREES = {
    "chain-4": StaticTree((1, 1, 1, 1)),
    "static-2211": StaticTree((2, 2, 1, 1)),
    "static-3221": StaticTree((3, 2, 2, 1)),
    "static-4321": StaticTree((4, 3, 2, 1)),
    "dynamic-4": DynamicTree(budget=4, depth=4, top_k=2, frontier=1),
    "dynamic-8": DynamicTree(budget=8, depth=5, top_k=2, frontier=2),
    "dynamic-12": DynamicTree(budget=12, depth=5, top_k=3, frontier=2),
    "dynamic-16": DynamicTree(budget=16, depth=6, top_k=3, frontier=3),
    "dynamic-32": DynamicTree(budget=32, depth=7, top_k=4, frontier=4),
    "beam-2x4": BeamTree(beams=2, steps=4),
    "beam-4x4": BeamTree(beams=4, steps=4),
}


def load(name, dtype, device):
    if name in ("demo-target", "demo-draft"):  # the bundled trained pair
        return demo_pair(dtype=dtype, device=device)[0 if name == "demo-target" else 1]
    if name in PRESETS:
        family, overrides = PRESETS[name]
        return tiny_model(family, dtype=dtype, **overrides).to(device)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def tree_overhead(model, device, sizes=(1, 4, 8, 16, 32), prompt_len=64, reps=20):
    """Median time of one tree pass of each size in `sizes` over one HF single-token decode step, on the same cached
    prefix (random trees with at most 4 children per node). Returns {"decode_step_ms": ..., "trees": [{"nodes",
    "ms", "ratio"}]}: the curve that decides how large a tree pays off on this device."""
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    tm = TreeModel(model)
    tm.prefill(prompt)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True, position_ids=torch.arange(prompt_len, device=device)[None])
    step_token = prompt[:, :1]
    position = torch.tensor([[prompt_len]], device=device)
    step_times = []
    for _ in range(reps):
        with torch.no_grad():
            _, t = timed(lambda: model(step_token, cache=cache, use_cache=True, position_ids=position), device)
        for layer in cache.layers:  # drop the fed token from attention caches: every step sees the same prefix
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., :prompt_len, :], layer.values[..., :prompt_len, :]
        step_times.append(t)
    step_ms = 1e3 * sorted(step_times)[reps // 2]
    trees = []
    for T in sizes:
        g = torch.Generator().manual_seed(T)
        parents = torch.tensor([random_parents(T, g, max_children=4)], device=device)
        tokens = torch.randint(0, model.config.vocab_size, (1, T), generator=g).to(device)
        times = []
        for _ in range(reps):
            _, t = timed(lambda: tm.tree_forward(tokens, parents), device)
            tm.discard()
            times.append(t)
        ms = 1e3 * sorted(times)[reps // 2]
        trees.append(dict(nodes=T, ms=ms, ratio=ms / step_ms))
    return dict(decode_step_ms=step_ms, trees=trees)


def run_methods(target, draft, prompts, args, temperature, device):
    """One row per method at one temperature: tokens/s, tau, mean tree size, speedup over autoregressive."""
    n_tokens = len(prompts) * args.max_new_tokens
    sampling = dict(do_sample=True, temperature=temperature, top_k=None) if temperature > 0 else dict(do_sample=False)
    reference, ar_time = [], 0.0
    with torch.no_grad():
        for prompt in prompts:
            out, t = timed(lambda: target.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                   max_new_tokens=args.max_new_tokens, **sampling), device)
            reference.append(out)
            ar_time += t
    ar_speed = n_tokens / ar_time
    rows = [dict(temperature=temperature, method="autoregressive", mean_nodes=1.0, tokens_per_s=ar_speed, tau=1.0,
                 speedup=1.0, exact=True)]
    for name in args.trees:
        spec = TREES[name]
        if temperature > 0 and isinstance(spec, BeamTree):
            continue
        total, passes, sizes, exact = 0.0, [], [], True
        for prompt, want in zip(prompts, reference):
            (out, stats), t = timed(lambda: stree.generate(
                target, prompt, draft_model=draft, max_new_tokens=args.max_new_tokens, temperature=temperature,
                tree=spec, return_stats=True), device)
            total += t
            passes += stats.tokens_per_pass
            sizes += stats.tree_sizes
            exact &= torch.equal(out, want)
        rows.append(dict(temperature=temperature, method=name, mean_nodes=sum(sizes) / len(sizes),
                         tokens_per_s=n_tokens / total, tau=sum(passes) / len(passes),
                         speedup=n_tokens / total / ar_speed, exact=exact if temperature == 0 else "n/a"))
    return rows


def plot(rows, args):
    """Speedup and tau against mean tree size, one marker per method, one colour per temperature."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for temperature in sorted({r["temperature"] for r in rows}):
        mine = [r for r in rows if r["temperature"] == temperature]
        for ax, key in zip(axes, ("speedup", "tau")):
            ax.scatter([r["mean_nodes"] for r in mine], [r[key] for r in mine], label=f"T={temperature}")
            for r in mine:
                ax.annotate(r["method"], (r["mean_nodes"], r[key]), fontsize=7)
    for ax, key in zip(axes, ("speedup over autoregressive", "tau (tokens per target pass)")):
        ax.set_xlabel("nodes per verified tree")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"target {args.target}, draft {args.draft}")
    fig.tight_layout()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"generate-{args.target.replace('/', '_')}.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="bamba-small",
                        help=f"a local checkpoint, demo-target, or one of {list(PRESETS)}")
    parser.add_argument("--draft", default="mamba2-draft", help="a local checkpoint, demo-draft, or a preset name")
    parser.add_argument("--trees", nargs="+", default=list(TREES), choices=list(TREES))
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--overhead-only", action="store_true", help="only the tree-forward overhead of --target")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {device.type} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"dtype {dtype}")
    target = load(args.target, dtype, device)
    n_target = sum(p.numel() for p in target.parameters())
    print(f"target: {args.target} ({target.config.model_type}, {n_target / 1e6:.1f}M params)")
    result = dict(device=device.type, device_name=name, dtype=args.dtype, target=args.target,
                  target_params=n_target)
    overhead = tree_overhead(target, device)
    print(f"HF single-token decode step: {overhead['decode_step_ms']:.2f} ms. One tree pass over it "
          "(STree: 2.04x at 16 nodes on a 2.7B model, GPU):")
    print(f"{'nodes':>6} {'ms':>8} {'x step':>7}")
    for row in overhead["trees"]:
        print(f"{row['nodes']:>6} {row['ms']:>8.2f} {row['ratio']:>7.2f}")
    result["tree_overhead"] = overhead
    if not args.overhead_only:
        draft = load(args.draft, dtype, device)
        n_draft = sum(p.numel() for p in draft.parameters())
        print(f"draft: {args.draft} ({draft.config.model_type}, {n_draft / 1e6:.1f}M params)")
        target.generation_config.eos_token_id = None  # fixed-length outputs: every method emits the same count
        if args.target == "demo-target":
            source = "held-out standard-library code"
            prompts = [p.to(device) for p in held_out_prompts(demo_pair()[2], args.prompts, args.prompt_len)]
        else:
            source = "random tokens"
            prompts = [torch.randint(0, target.config.vocab_size, (1, args.prompt_len), device=device)
                       for _ in range(args.prompts)]
        print(f"prompts: {args.prompts} x {args.prompt_len} tokens of {source}, "
              f"{args.max_new_tokens} new tokens each\n")
        rows = []
        for temperature in args.temperatures:
            rows += run_methods(target, draft, prompts, args, temperature, device)
        print(f"{'T':>4} {'method':>12} {'nodes':>6} {'tok/s':>9} {'tau':>6} {'speedup':>8} {'exact':>6}")
        for row in rows:
            print(f"{row['temperature']:>4} {row['method']:>12} {row['mean_nodes']:>6.1f} {row['tokens_per_s']:>9.1f} "
                  f"{row['tau']:>6.2f} {row['speedup']:>8.2f} {str(row['exact']):>6}")
        plot(rows, args)
        result.update(draft=args.draft, draft_params=n_draft, prompts=args.prompts, prompt_len=args.prompt_len,
                      max_new_tokens=args.max_new_tokens, rows=rows)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"generate-{args.target.replace('/', '_')}-{device.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
