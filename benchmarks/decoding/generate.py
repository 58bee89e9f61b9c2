"""End-to-end decoding: HF's own generate vs stree's autoregressive loop vs chain and tree decoding, same run.

Both regimes: the bundled trained pair (a 6.7M target: a decode step is bound by per-operation overhead) and, with
--large, the same target inflated function-preservingly to 0.9B, 2.7B or 8B parameters (benchmarks/decoding/pairs.py;
bound by reading weights), in the
dtypes asked for, at temperatures 0 and 1. For every method: tokens/s, speedup over HF generate and over stree's
own autoregressive loop (ranges over --repeats same-run repeats), tau, draft passes per round, a per-round
breakdown (draft / verify / commit / other ms, host transfers) and, greedy, agreement with HF's output (all tokens
equal in float32; the mean identical prefix in bf16 / fp16, where rounding differs between a tree pass and a decode
step). Also the cost of a target tree pass of 1-32 nodes against HF's decode step and stree's own one-node pass.
Prints the device, CPU flags and models, then the tables; writes JSON and a PNG to benchmarks/results/<machine kind>/.

    python -m benchmarks.decoding.generate                                    # bundled pair, float32
    python -m benchmarks.decoding.generate --dtypes float32 bfloat16 --large  # both regimes, both dtypes
    python -m benchmarks.decoding.generate --dtypes bfloat16 --large --large-draft  # 0.9B with a 35M draft
    python -m benchmarks.decoding.generate --dtypes bfloat16 --large 8b --large-draft --large-only  # a GPU's pair
    python -m benchmarks.decoding.generate --compile          # torch.compile'd passes (warm-up reported)
    python -m benchmarks.decoding.generate --both-drafting    # greedy trees drafted on host and device
    python -m benchmarks.decoding.generate --profile 25       # + where each method's host time goes
    python -m benchmarks.decoding.generate --head none        # without the draft-head rows
    python -m benchmarks.decoding.generate --target PATH --draft PATH   # any local HF checkpoints
    python -m benchmarks.decoding.generate --overhead-only --target mamba2-2.7b-4layers --dtypes bfloat16
"""
import argparse
import os

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from benchmarks.anchors import hf_mamba_kernels
from benchmarks.common import SHORT_DTYPES, device_line, machine_info, median_ms, results_path, write_json
from benchmarks.decoding.pairs import PAIRS, head_sizes, inflate_pair, pair_tag
from stree import BeamTree, random_parents
from stree.benchmark import compare, format_profile, format_rows
from stree.demo import demo_head, demo_pair, held_out_prompts
from stree.heads import DraftHead
from stree.heads.inflate import inflate_head
from stree.drafting import grows_on_device
from stree.models import TreeModel, tiny_model
from stree.shapes import parse_tree, tree_name

# Built-in random models: (family, config overrides on stree.models.TINY_CONFIGS).
PRESETS = {
    "bamba-small": ("bamba", dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                                  attn_layer_indices=[3, 7], num_attention_heads=8, num_key_value_heads=4,
                                  mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64)),
    "mamba2-draft": ("mamba2", dict(vocab_size=4096, hidden_size=128, num_hidden_layers=2, num_heads=4, head_dim=64,
                                    state_size=64, n_groups=1)),
    "mamba2-2.7b-4layers": ("mamba2", dict(vocab_size=50288, hidden_size=2560, num_hidden_layers=4, num_heads=80,
                                           head_dim=64, state_size=128, n_groups=1)),
    # Nemotron-H-8B's layer shape (Mamba2: 128 heads of 64, state 128, 8 groups; attention 32 / 8 heads of 128;
    # ReLU² MLP 21504): one layer of each kind and a second MLP.
    "nemotron-h-8b-4layers": ("nemotron_h", dict(
        vocab_size=32768, hidden_size=4096, layers_block_type=["mamba", "mlp", "attention", "mlp"],
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504, ssm_state_size=128,
        mamba_num_heads=128, mamba_head_dim=64, n_groups=8, conv_kernel=4, expand=2, chunk_size=128)),
    # Qwen3.5's layer shape (HF's default config: Gated DeltaNet 16 key / 32 value heads of 128, gated attention 16 /
    # 4 heads of 256, partial rotary), three GDN layers and one attention layer, a smaller vocabulary.
    "qwen3.5-like-4layers": ("qwen3_5", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # Jamba-v0.1's layer shape (Mamba1: dim 8192, state 16, dt rank 256; attention 32 / 8 heads), three Mamba layers
    # and one attention layer, no MoE layer among them (16 experts of 14336 would be 2.8B parameters a layer).
    "jamba-like-4layers": ("jamba", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=8, expert_layer_offset=7,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=256)),
}
DEFAULT_TREES = ["chain-4", "dynamic-16", "adaptive"]  # tree names (stree.shapes.parse_tree)
# This script's labels before the trees had one vocabulary -> their names (the same specs).
OLD_LABELS = {"static-2211": "static-2,2,1,1", "dynamic-8": "dynamic-8-d5-k2-f2", "dynamic-16-adaptive": "adaptive",
              "dynamic-32": "dynamic-32-d7-k4-f4"}


def tree_arg(text):
    """--trees: a tree name, or one of this script's older labels."""
    return parse_tree(OLD_LABELS.get(text, text))
def load(name, dtype, device):
    if name in ("demo-target", "demo-draft"):  # the bundled trained pair
        return demo_pair(dtype=dtype, device=device)[0 if name == "demo-target" else 1]
    if name in PRESETS:
        family, overrides = PRESETS[name]
        return tiny_model(family, dtype=dtype, **overrides).to(device)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()


def op_counts(fn, device):
    """What one call of fn launches: aten ops called from outside other aten ops ("ops"), and on CUDA the kernels
    that ran on the GPU ("kernels", Triton's included). Both regimes' cost: per-op overhead and launches."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    ops = sum(e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
              for e in events)
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
                  for e in events) if device.type == "cuda" else None
    return dict(ops=ops, kernels=kernels)


def tree_overhead(model, device, sizes=(1, 4, 8, 16, 32), prompt_len=64, reps=20, compile=False):
    """Median time of one target tree pass of each size in `sizes` over one HF single-token decode step and over
    stree's own one-node pass, on the same prefix (random trees with at most 4 children per node). Returns
    {"decode_step_ms", "stree_step_ms", "decode_step_ops", "decode_step_kernels", "trees": [{"nodes", "ms", "ratio",
    "ratio_to_stree_step", "ops", "kernels"}]} (op_counts of one call each): the curve that decides how large a tree
    pays off on this device, and the launches that explain it."""
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True, position_ids=torch.arange(prompt_len, device=device)[None])
    position = torch.tensor([[prompt_len]], device=device)

    def hf_step():
        with torch.no_grad():
            model(prompt[:, :1], cache=cache, use_cache=True, position_ids=position)
        for layer in cache.layers:  # drop the fed token from attention caches: every step sees the same prefix
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.numel():
                layer.keys, layer.values = layer.keys[..., :prompt_len, :], layer.values[..., :prompt_len, :]

    hf_step()
    step_ms = median_ms(hf_step, device, reps)
    step_counts = op_counts(hf_step, device)
    rows, stree_step_ms = [], None
    for T in sizes:
        g = torch.Generator().manual_seed(T)
        parents = [random_parents(T, g, max_children=4)]
        tokens = torch.randint(0, model.config.vocab_size, (1, T), generator=g).tolist()
        tm = TreeModel(model, nodes=T, pass_width=T if compile else None)
        tm.prefill(prompt)
        if compile:
            tm.compile()

        def tree_pass():
            tm.tree_forward(tokens, parents)
            tm.discard()

        tree_pass()
        ms = median_ms(tree_pass, device, reps)
        stree_step_ms = ms if T == 1 else stree_step_ms
        rows.append(dict(nodes=T, ms=ms, ratio=ms / step_ms,
                         ratio_to_stree_step=ms / stree_step_ms if stree_step_ms else None,
                         **op_counts(tree_pass, device)))
    return dict(decode_step_ms=step_ms, stree_step_ms=stree_step_ms, compiled=compile, trees=rows,
                decode_step_ops=step_counts["ops"], decode_step_kernels=step_counts["kernels"])


def print_overhead(label, overhead):
    print(f"\n{label}: HF single-token decode step {overhead['decode_step_ms']:.2f} ms, stree one-node pass "
          f"{overhead['stree_step_ms']:.2f} ms{' (compiled)' if overhead['compiled'] else ''}. A tree pass "
          "(STree: 2.04x a step at 16 nodes on a 2.7B model, GPU):")
    kernels = overhead["decode_step_kernels"] is not None
    print(f"{'nodes':>6} {'ms':>8} {'x HF step':>10} {'x stree 1-node':>15} {'ops':>6}{' kernels' if kernels else ''}"
          f"   (HF's step: {overhead['decode_step_ops']} ops"
          f"{', %s kernels' % overhead['decode_step_kernels'] if kernels else ''})")
    for row in overhead["trees"]:
        print(f"{row['nodes']:>6} {row['ms']:>8.2f} {row['ratio']:>10.2f} {row['ratio_to_stree_step']:>15.2f} "
              f"{row['ops']:>6}{' %7s' % row['kernels'] if kernels else ''}")


def plot(tables, path):
    """Speedup over HF generate (bars, with the repeat range) per method, one panel per target/dtype/temperature."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return
    fig, axes = plt.subplots(1, len(tables), figsize=(3.2 * len(tables) + 1, 3.6), squeeze=False)
    for ax, table in zip(axes[0], tables):
        rows = table["rows"]
        mids = [r["speedup_vs_hf"][1] for r in rows]
        errs = [[m - r["speedup_vs_hf"][0] for m, r in zip(mids, rows)],
                [r["speedup_vs_hf"][2] - m for m, r in zip(mids, rows)]]
        ax.bar(range(len(rows)), mids, yerr=errs, color="tab:blue")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(rows)), [r["method"].replace("dynamic-16-", "") for r in rows], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(f"{table['target']}\n{table['dtype']}, T={table['temperature']}", fontsize=8)
        ax.set_ylabel("speedup over HF generate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target",
                        help=f"a local checkpoint, demo-target, or one of {list(PRESETS)}")
    parser.add_argument("--draft", default="demo-draft", help="a local checkpoint, demo-draft, or a preset name")
    parser.add_argument("--head", default=None, help="a draft head's folder (DraftHead.from_pretrained), demo (the "
                        "default with demo-target: the bundled head) or none; its rows are 'head <tree>' for each tree")
    parser.add_argument("--trees", nargs="+", type=tree_arg, default=[parse_tree(n) for n in DEFAULT_TREES],
                        help="tree names: adaptive, dynamic-16, chain-4, static-2,2,1,1, beam-4x4, ...")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(SHORT_DTYPES))
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large", nargs="?", const="0.9b", default=None, choices=list(PAIRS),
                        help="also the demo target inflated to a realistic size (benchmarks/decoding/pairs.py): "
                        "0.9b (the default), 2.7b or 8b parameters")
    parser.add_argument("--large-new-tokens", type=int, default=24)
    parser.add_argument("--large-only", action="store_true", help="with --large, skip the bundled pair's own tables")
    parser.add_argument("--large-draft", action="store_true",
                        help="with --large, draft the large target with the bundled draft inflated likewise (35M "
                        "parameters for 0.9b, 128M for 2.7b, 364M for 8b: same drafts, a realistic cost) instead of "
                        "the 1.2M one")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="with --large-draft, the inflated draft's layer count instead of the pair's (0.9b: 4; "
                        "8 gives the 61M draft)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every pass (warm-up reported)")
    parser.add_argument("--both-drafting", action="store_true",
                        help="also draft each greedy static/dynamic tree the other way than stree.generate's default "
                        "(draft_on_device: on the device with compiled passes on a GPU, else on the host)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then one more run of each stree method under cProfile: its N functions with the most "
                        "own time per round (printed and in the JSON rows' 'profile')")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--overhead-only", action="store_true", help="only the tree-pass cost curve of --target")
    parser.add_argument("--no-overhead", action="store_true",
                        help="skip the tree-pass cost curve (compiled, each of its sizes compiles passes of its own)")
    parser.add_argument("--overhead-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                        help="tree sizes of the cost curve, 1 first (the others are also given per one-node "
                             "pass); compiled, each size compiles its own passes")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<machine kind>/"
                        "generate[-overhead]-<target>[-large]-<dtypes>[-t<temperatures>][-drafting][-compiled].json)")
    args = parser.parse_args(argv)
    if args.no_overhead and args.overhead_only:
        parser.error("--no-overhead and --overhead-only contradict each other")
    if args.overhead_sizes[0] != 1:
        parser.error("--overhead-sizes must start with 1 (the one-node pass the others are compared with)")
    return args


def default_name(args):
    """The JSON's file name from what the run measures, e.g. generate-demo-target-large-bf16-t1.json."""
    parts = ["generate-overhead" if args.overhead_only else "generate", os.path.basename(args.target.rstrip("/"))]
    parts += pair_tag(args.large, args.large_draft, args.draft_layers) if args.large and not args.overhead_only else []
    parts += [SHORT_DTYPES[d] for d in args.dtypes]
    if not args.overhead_only and args.temperatures != [0.0, 1.0]:
        parts.append("t" + "-".join(f"{t:g}" for t in args.temperatures))
    parts += (["drafting"] if args.both_drafting and not args.overhead_only else []) + (
        ["compiled"] if args.compile else [])
    return "-".join(parts) + ".json"


def prompts_for(args, model, device):
    """(prompts, what they are): held-out code for the bundled target, else random tokens."""
    if args.target == "demo-target":
        prompts = held_out_prompts(demo_pair()[2], args.prompts, args.prompt_len)
        return [p.to(device) for p in prompts], "held-out standard-library code"
    return [torch.randint(0, model.config.vocab_size, (1, args.prompt_len), device=device)
            for _ in range(args.prompts)], "random tokens"


def load_head(args, target):
    """The --head for `target` (None: no head rows)."""
    name = args.head or ("demo" if args.target == "demo-target" else "none")
    if name == "none":
        return None
    return demo_head(target) if name == "demo" else DraftHead.from_pretrained(name, target=target)


def trees_for(args, temperature, device, head=None):
    """The tree methods of one table: --trees (no beam trees when sampling), each also drafted by `head` if given,
    and, greedy with --both-drafting, each static/dynamic tree drafted the other way too."""
    trees = {tree_name(t): t for t in args.trees if temperature == 0 or not isinstance(t, BeamTree)}
    if head is not None:
        trees.update({f"head {name}": dict(tree=spec, draft_model=head) for name, spec in list(trees.items())})
    if args.both_drafting and temperature == 0:
        other = not grows_on_device(device, args.compile)
        trees.update({f"{n}, {'device' if other else 'host'} drafting": dict(tree=spec, draft_on_device=other)
                      for n, spec in list(trees.items()) if not isinstance(spec, BeamTree)})
    return trees


def measure(args, device, result, save):
    """Every table of the run into result["overhead"] and result["tables"], saved after each."""
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target = load(args.target, dtype, device)
        head = load_head(args, target)
        draft = load(args.draft, dtype, device)
        targets = [] if args.large and args.large_only else [(args.target, target, args.max_new_tokens, head, draft)]
        if args.large:
            large, large_draft = inflate_pair(target, draft, args.large, device, inflate_draft=args.large_draft,
                                              draft_layers=args.draft_layers)
            targets.append((f"{args.target} inflated to {args.large.upper()}", large, args.large_new_tokens,
                            head and inflate_head(head, large, **head_sizes(args.large)), large_draft))
        for label, model, new_tokens, model_head, draft in targets:
            params = sum(p.numel() for p in model.parameters())
            if not args.no_overhead:
                overhead = tree_overhead(model, device, sizes=args.overhead_sizes, compile=args.compile)
                print_overhead(f"{label} ({params / 1e6:.1f}M params, {dtype_name})", overhead)
                result["overhead"].append(dict(target=label, params=params, dtype=dtype_name, **overhead))
                save()
            if args.overhead_only:
                continue
            model.generation_config.eos_token_id = None  # fixed-length outputs: every method emits the same count
            prompts, source = prompts_for(args, model, device)
            draft_params = sum(p.numel() for p in draft.parameters())
            head_params = model_head and sum(p.numel() for p in model_head.own_parameters())
            head_size = "" if model_head is None else f" (head: {head_params / 1e6:.1f}M + the target's LM head)"
            for temperature in args.temperatures:
                print(f"\n{label}, draft {args.draft} ({draft_params / 1e6:.1f}M){head_size}, {dtype_name}, "
                      f"temperature {temperature}: "
                      f"{args.prompts} x "
                      f"{args.prompt_len}-token prompts of {source}, {new_tokens} new tokens, {args.repeats} repeats")
                rows = compare(model, draft, prompts, trees_for(args, temperature, device, model_head),
                               max_new_tokens=new_tokens,
                               temperature=temperature, repeats=args.repeats, compile=args.compile,
                               profile=args.profile)
                print(format_rows(rows))
                if args.profile:
                    print(format_profile(rows))
                result["tables"].append(dict(target=label, params=params, draft_params=draft_params,
                                             head_params=head_params, dtype=dtype_name,
                                             temperature=temperature,
                                             new_tokens=new_tokens, prompts=args.prompts, rows=rows))
                save()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    machine = machine_info(device)
    print(device_line(machine))
    hf_kernels = hf_mamba_kernels(device)
    result = dict(machine, target=args.target, compile=args.compile, hf_kernels=hf_kernels, complete=False,
                  overhead=[], tables=[])
    out = args.out or results_path(machine, default_name(args))
    # saved after every measurement: a run stopped midway keeps what it measured ("complete": false)
    measure(args, device, result, lambda: write_json(out, result))
    result["complete"] = True
    write_json(out, result)
    print(f"\nwrote {out}")
    if result["tables"]:
        plot(result["tables"], os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
