"""Batched decoding: HF's batched generate (left padding) vs stree's batched autoregressive loop vs batched tree
decoding, same run, at several batch sizes with prompts of mixed lengths.

For each batch size B: total tokens/s of every method (ranges over --repeats same-run repeats), tree / stree AR and
stree AR / HF ratios, tau (tokens per row per round), the trees' mean node count per row, and per-row latency (the
mean time from the call's start to the row's last token; HF returns every row at the end). The default tree is the
adaptive one, which sizes each round for the batch (stree.adaptive.BatchSizes): one untimed call per method and size
warms it up. Prints the device, CPU flags and models, then a table; writes JSON and a PNG to
benchmarks/results/<machine kind>/.

    python -m benchmarks.decoding.batch                                   # bundled pair, float32, B = 1 4 16 64
    python -m benchmarks.decoding.batch --large --dtype bfloat16 --batches 1 4 16   # the 0.9B target, bf16
    python -m benchmarks.decoding.batch --large --large-draft --dtype bfloat16      # ... with the 35M draft
    python -m benchmarks.decoding.batch --large 8b --large-draft --dtype bfloat16 --device cuda  # 8.9B / 364M pair
    python -m benchmarks.decoding.batch --prompts-per-row 4    # 4B prompts, B at once: rows join as others end
    python -m benchmarks.decoding.batch --head                 # drafted by the bundled draft head instead
    python -m benchmarks.decoding.batch --large --head --dtype bfloat16   # ... inflated with the 0.9B target
    python -m benchmarks.decoding.batch --compile --batches 4 16          # stree's loops with compiled passes

A batch of fixed-length rows ends with its slowest row: speculation advances rows by different counts, so a tree's
last rounds run few rows (the plain loop's rows all end together). With --prompts-per-row K a prompt joins as a row
ends (serving's continuous batching) and only the last of the K x B prompts leave such a tail.
"""
import argparse
import os
import statistics
import time

import torch

from benchmarks.anchors import hf_mamba_kernels
from benchmarks.common import device_line, machine_info, model_shape, results_path, write_json, SHORT_DTYPES
from benchmarks.decoding.pairs import PAIRS, head_sizes, inflate_pair, pair_tag
from stree.batch import Batch
from stree.demo import demo_head, demo_pair, held_out_prompts
from stree.heads.inflate import inflate_head
from stree.shapes import parse_tree, tree_name
from stree.warm_up import warmup


def mixed_prompts(tokenizer, batch, shortest, longest, seed):
    """`batch` held-out code prompts of lengths drawn uniformly in [shortest, longest]."""
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    windows = held_out_prompts(tokenizer, batch, longest, seed=seed)
    return [w[0, :n] for w, n in zip(windows, lengths.tolist())]


def synchronize(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def run_stree(model, draft, prompts, new_tokens, tree, active=None, compile=False):
    """(seconds, new tokens, per-row latencies, tau, mean nodes per row) of one Batch run to the end. active: rows
    decoded at once (default all); more prompts than that join as rows finish (continuous batching). compile: the
    Batch's (compiled passes)."""
    options = {"compile": compile} if draft is None else {"tree": tree, "compile": compile}
    active = active or len(prompts)
    synchronize(model)
    start = time.perf_counter()
    batch = Batch(model, draft_model=draft, max_new_tokens=new_tokens, **options)
    rows = dict(zip(batch.add(prompts[:active]), range(active)))  # row id -> prompt index
    waiting, latency, tokens = list(range(active, len(prompts))), {}, 0
    while batch.active:
        batch.step()
        done = batch.finished()
        for i, output in done.items():
            latency[rows[i]] = time.perf_counter() - start
            tokens += output.numel() - prompts[rows[i]].numel()
        joining, waiting = waiting[:len(done)], waiting[len(done):]
        if joining:
            rows.update(zip(batch.add([prompts[k] for k in joining]), joining))
    synchronize(model)
    batch.close()
    seconds = time.perf_counter() - start
    stats = batch.stats
    nodes = sum(stats.tree_sizes) / max(len(stats.tree_sizes), 1)
    return seconds, tokens, [latency[k] for k in range(len(prompts))], stats.tau, nodes


def run_hf(model, prompts, new_tokens, active=None):
    """The same for HF's batched generate with left padding, `active` prompts a batch, one batch after another (tau
    and nodes: 1)."""
    active = active or len(prompts)
    eos = model.generation_config.eos_token_id
    eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
    synchronize(model)
    start, tokens, latency = time.perf_counter(), 0, []
    for first in range(0, len(prompts), active):
        group = prompts[first:first + active]
        width = max(p.numel() for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=model.device)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(group):
            ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        synchronize(model)
        for row in out[:, width:].tolist():
            ends = [k for k, t in enumerate(row) if t in eos]
            tokens += ends[0] + 1 if ends else len(row)
        latency += [time.perf_counter() - start] * len(group)
    return time.perf_counter() - start, tokens, latency, 1.0, 1.0


def measure_batch(model, draft, prompts, args):
    """{method: [(seconds, tokens, latencies, tau, nodes)] per repeat}, methods timed round-robin after one
    untimed call each."""
    tree, active = parse_tree(args.tree), len(prompts) // args.prompts_per_row
    methods = {"hf": lambda: run_hf(model, prompts, args.new_tokens, active),
               "stree_ar": lambda: run_stree(model, None, prompts, args.new_tokens, None, active, args.compile),
               "tree": lambda: run_stree(model, draft, prompts, args.new_tokens, tree, active, args.compile)}
    if args.compile:  # every batch size a compiled Batch pads its rows to, compiled before the untimed calls
        lengths = tuple(p.numel() for p in prompts[:4])
        for drafter, options in ((None, {}), (draft, {"tree": tree})):
            warmup(model, drafter, prompt_lengths=lengths, max_new_tokens=args.new_tokens, batch_sizes=(active,),
                   compile=True, **options)
    for fn in methods.values():
        fn()
    runs = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            runs[name].append(fn())
    return runs


def summarise(batch, runs):
    """One table row: tokens/s per method (median), ratio ranges, tau, nodes, mean per-row latency."""
    rate = {name: [tokens / seconds for seconds, tokens, *_ in r] for name, r in runs.items()}
    ratio = lambda a, b: sorted(x / y for x, y in zip(rate[a], rate[b]))  # noqa: E731 (same-run pairs)
    median = statistics.median  # of an even count: the mean of the middle two
    return dict(batch=batch, tok_s={name: median(r) for name, r in rate.items()},
                tree_vs_ar=ratio("tree", "stree_ar"), ar_vs_hf=ratio("stree_ar", "hf"), tree_vs_hf=ratio("tree", "hf"),
                tau=median([r[3] for r in runs["tree"]]), nodes=median([r[4] for r in runs["tree"]]),
                latency_s={name: median([sum(r[2]) / len(r[2]) for r in rs]) for name, rs in runs.items()})


def format_table(rows):
    span = lambda xs: f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
    lines = [f"{'B':>3} | {'HF tok/s':>9} | {'AR tok/s':>9} | {'tree tok/s':>10} | {'tree / AR':>18} | "
             f"{'AR / HF':>18} | {'tau':>5} | {'nodes':>5} | latency s (HF / AR / tree)"]
    for r in rows:
        t = r["tok_s"]
        lines.append(f"{r['batch']:>3} | {t['hf']:>9.1f} | {t['stree_ar']:>9.1f} | {t['tree']:>10.1f} | "
                     f"{span(r['tree_vs_ar']):>18} | {span(r['ar_vs_hf']):>18} | {r['tau']:>5.2f} | "
                     f"{r['nodes']:>5.1f} | {r['latency_s']['hf']:.2f} / {r['latency_s']['stree_ar']:.2f} / "
                     f"{r['latency_s']['tree']:.2f}")
    return "\n".join(lines)


def plot(rows, title, path):
    """Total tokens/s against the batch size, one line per method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("hf", "HF generate"), ("stree_ar", "stree AR"), ("tree", "stree tree")):
        ax.plot([r["batch"] for r in rows], [r["tok_s"][name] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("total tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--dtype", default="float32", choices=list(SHORT_DTYPES))
    parser.add_argument("--large", nargs="?", const="0.9b", default=None, choices=list(PAIRS),
                        help="the bundled target inflated to 0.9b (the default), 2.7b or 8b parameters")
    parser.add_argument("--large-draft", action="store_true",
                        help="with --large, the draft inflated likewise (35M, 128M, 364M)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="with --large-draft, the inflated draft's layer count instead of the pair's")
    parser.add_argument("--head", action="store_true",
                        help="draft with the bundled draft head (with --large: inflated with the target) instead of "
                             "the draft model")
    parser.add_argument("--tree", default="adaptive", help="the tree (a name stree.shapes.parse_tree reads)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=[16, 64], metavar=("SHORTEST", "LONGEST"))
    parser.add_argument("--prompts-per-row", type=int, default=1,
                        help="K > 1: K x B prompts, B decoded at once; stree's loops let the next prompt join as a "
                             "row ends (continuous batching), HF decodes K padded batches in turn")
    parser.add_argument("--compile", action="store_true",
                        help="stree's loops with compiled passes (inductor on a CPU, CUDA graphs on CUDA); HF's "
                             "generate stays eager. The untimed first call per method and size pays the compilation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<machine>/batch-...)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    machine = machine_info(args.device)
    print(device_line(machine))
    hf_kernels = hf_mamba_kernels(torch.device(args.device))
    dtype = getattr(torch, args.dtype)
    target, draft, tokenizer = demo_pair(dtype=dtype)
    head = demo_head(target) if args.head else None
    if args.large:
        target, draft = inflate_pair(target, draft, args.large, args.device, inflate_draft=args.large_draft,
                                     draft_layers=args.draft_layers)
        head = head and inflate_head(head, target, **head_sizes(args.large))
    target, draft = target.to(args.device), (head or draft).to(args.device)
    print(f"target: {model_shape(target)}\ndraft: {model_shape(draft)}")
    print(f"{args.dtype}, greedy, {'compiled' if args.compile else 'eager'} passes, "
          f"tree {tree_name(parse_tree(args.tree))}, {args.new_tokens} new tokens a row, "
          f"prompts of {args.prompt_lens[0]}-{args.prompt_lens[1]} held-out tokens, "
          f"{f'{args.prompts_per_row} a row (continuous batching), ' if args.prompts_per_row > 1 else ''}"
          f"{args.repeats} repeats")
    pair = pair_tag(args.large, args.large_draft, args.draft_layers) if args.large else ["demo"]
    continuous = [f"continuous{args.prompts_per_row}"] if args.prompts_per_row > 1 else []
    name = "-".join(["batch", *pair, *(["head"] if args.head else []), SHORT_DTYPES[args.dtype], *continuous,
                     *(["compiled"] if args.compile else [])])
    out = args.out or results_path(machine, name + ".json")
    result = dict(machine, target=model_shape(target), draft=model_shape(draft), hf_kernels=hf_kernels,
                  target_params=sum(p.numel() for p in target.parameters()),
                  draft_params=sum(p.numel() for p in draft.parameters()),
                  dtype=args.dtype, tree=args.tree, compiled=args.compile,
                  drafter="head" if args.head else "draft model",
                  new_tokens=args.new_tokens, prompt_lens=args.prompt_lens, prompts_per_row=args.prompts_per_row,
                  repeats=args.repeats, rows=[],
                  complete=False)
    for batch in args.batches:
        prompts = mixed_prompts(tokenizer, batch * args.prompts_per_row, *args.prompt_lens, seed=batch)
        result["rows"].append(summarise(batch, measure_batch(target, draft, prompts, args)))
        print(format_table(result["rows"][-1:]) if batch == args.batches[0] else format_table(result["rows"][-1:])
              .split("\n", 1)[1], flush=True)
        write_json(out, result)
    result["complete"] = True
    write_json(out, result)
    plot(result["rows"], f"{name} on {machine['machine']}", os.path.splitext(out)[0] + ".png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
