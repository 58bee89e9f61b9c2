"""The `stree` command: generate, bench, distill. Without --target/--draft the bundled demo pair is used.

    stree generate --prompt "def fibonacci(n):"       # stream text, then tau and tokens/s
    stree bench                                        # autoregressive vs chain vs tree on held-out prompts
    stree distill --target PATH --student-config student.json --data FILES_OR_DIRS --output DIR
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import torch


def _tree(text):
    """--tree: a tree name (stree.shapes.parse_tree: adaptive, adaptive-24, dynamic-16, 3,2,2,1, chain-4, beam-4x4).
    The older spellings dynamic[:budget] (adaptive), fixed[:budget] (a dynamic tree of that budget) and
    beam[:beams:steps] still work, with a warning naming the new one."""
    from .shapes import BeamTree, DynamicTree, parse_tree, tree_name
    kind, _, rest = text.partition(":")
    if kind in ("dynamic", "fixed", "beam"):  # the new names of these kinds always hold a "-"
        numbers = [int(x) for x in rest.replace(":", ",").split(",") if x] if rest else []
        spec = BeamTree(*numbers) if kind == "beam" else DynamicTree(*numbers, adaptive=kind == "dynamic")
        print(f"stree: --tree {text} is an old spelling; use --tree {tree_name(spec)}", file=sys.stderr)
        return spec
    try:
        return parse_tree(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))


def _load_pair(args, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .demo import demo_pair
    if args.target is None and args.draft is None:
        return demo_pair(dtype=dtype)
    if args.target is None or args.draft is None:
        sys.exit("give both --target and --draft, or neither (the bundled demo pair)")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    return target, draft, tokenizer


def cmd_generate(args):
    from transformers import TextStreamer

    from .decoding import generate
    target, draft, tokenizer = _load_pair(args)
    input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    _, stats = generate(target, input_ids, draft_model=draft, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, tree=args.tree,
                        streamer=TextStreamer(tokenizer), generator=generator, return_stats=True)
    elapsed = time.perf_counter() - start
    print(f"\n[{stats.new_tokens} tokens in {elapsed:.2f} s: {stats.new_tokens / elapsed:.1f} tokens/s, "
          f"tau {stats.tau:.2f} tokens per target pass, {stats.target_passes} target passes]", file=sys.stderr)


def _cpu_name():
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def cmd_bench(args):
    import platform

    from .benchmark import compare, format_rows
    from .demo import held_out_prompts
    from .models import inflate_bamba
    from .shapes import DynamicTree, tree_name
    dtype = getattr(torch, args.dtype)
    target, draft, tokenizer = _load_pair(args, dtype)
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_len)
    trees = {tree_name(args.chain): args.chain}
    if isinstance(args.tree, DynamicTree) and args.tree.adaptive:  # the same tree always grown to its depth
        fixed = dataclasses.replace(args.tree, adaptive=False)
        trees[tree_name(fixed)] = fixed
    trees[tree_name(args.tree)] = args.tree
    targets = [("target", target)]
    if args.large:  # a realistic-size target computing the same function: bound by reading weights
        targets.append(("target inflated to 0.9B", inflate_bamba(target, hidden_size=2048, mamba_heads=64,
                                                                 d_state=128, intermediate_size=8192, num_layers=12)))
    device = (f"cpu ({_cpu_name() or platform.processor() or platform.machine()}, torch capability "
              f"{torch.backends.cpu.get_cpu_capability()}), torch threads {torch.get_num_threads()}")
    print(f"device {device}, {args.dtype}, {args.prompts} held-out prompts x {args.max_new_tokens} new "
          f"tokens, {args.repeats} repeats{', compiled' if args.compile else ''}")
    report = []
    for label, model in targets:
        model.generation_config.eos_token_id = None  # equal lengths for every method
        params = sum(p.numel() for p in model.parameters()) / 1e6
        new_tokens = args.max_new_tokens if model is target else max(8, args.max_new_tokens // 4)
        for temperature in args.temperatures:
            print(f"\n{label} ({params:.1f}M params), draft {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M, "
                  f"temperature {temperature}, {new_tokens} new tokens")
            rows = compare(model, draft, prompts, trees, max_new_tokens=new_tokens, temperature=temperature,
                           repeats=args.repeats, compile=args.compile)
            print(format_rows(rows))
            report.append(dict(target=label, params_m=params, temperature=temperature, dtype=args.dtype,
                               new_tokens=new_tokens, device=device, compile=args.compile, rows=rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


def cmd_distill(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from torch.utils.data import ConcatDataset

    from .distill import (TokenChunks, TrainConfig, Trainer, load_tokens, random_windows, student_from_config,
                          target_continuations, text_files, tokenize_files)
    device = torch.device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun / accelerate: one device per process
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    if args.student_config.lstrip().startswith("{"):
        student_config = json.loads(args.student_config)
    else:
        with open(args.student_config) as f:
            student_config = json.load(f)
    student = student_from_config(target, student_config, share_embeddings=args.share_embeddings).to(device)
    token_files = [p for p in args.data if p.endswith((".pt", ".npy"))]
    texts = text_files([p for p in args.data if p not in token_files])
    streams = [load_tokens(p) for p in token_files]
    if texts:
        streams.append(tokenize_files(texts, AutoTokenizer.from_pretrained(args.tokenizer or args.target)))
    tokens = torch.cat(streams)
    datasets = [TokenChunks(tokens, args.seq_len)]
    if args.continuations:
        prompts = random_windows(tokens, args.continuations, args.seq_len // 3, torch.Generator().manual_seed(0))
        datasets.append(target_continuations(target, prompts, args.seq_len + 1 - args.seq_len // 3,
                                             temperature=args.continuation_temperature))
    losses = {name: float(weight) for name, weight in (part.split("=") for part in args.loss.split(","))}
    config = TrainConfig(output_dir=args.output, steps=args.steps, batch_size=args.batch_size,
                         grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup, losses=losses,
                         temperature=args.temperature, teacher_top_k=args.teacher_top_k, eval_every=args.eval_every,
                         save_every=args.save_every)
    eval_prompts = random_windows(tokens, 4, 32, torch.Generator().manual_seed(1)) if args.eval_every else None
    trainer = Trainer(student, config, ConcatDataset(datasets), teacher=target, eval_prompts=eval_prompts)
    if args.resume:
        trainer.resume(args.resume)
    history = trainer.train()
    print(json.dumps(history[-1] if history else {}, indent=1))


def build_parser():
    parser = argparse.ArgumentParser(prog="stree", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def pair_options(p):
        p.add_argument("--target", help="HF checkpoint folder (default: the bundled demo pair)")
        p.add_argument("--draft", help="HF checkpoint folder of the draft")
        p.add_argument("--tokenizer", help="tokenizer folder (default: the target's)")
        p.add_argument("--tree", type=_tree, default=_tree("adaptive"),
                       help="adaptive (default: sized every round by measured costs) | adaptive-24 | dynamic-16 | "
                       "3,2,2,1 | chain-4 | beam-4x4")

    gen = commands.add_parser("generate", help="speculative tree decoding of one prompt, streamed")
    pair_options(gen)
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=cmd_generate)

    bench = commands.add_parser("bench", help="HF generate vs stree autoregressive vs chain vs tree decoding")
    pair_options(bench)
    bench.add_argument("--chain", type=_tree, default=_tree("chain-4"))
    bench.add_argument("--prompts", type=int, default=4)
    bench.add_argument("--prompt-len", type=int, default=32)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--repeats", type=int, default=3, help="timed runs of every method (ratios: min-max)")
    bench.add_argument("--large", action="store_true",
                       help="also the bundled target inflated to 0.9B parameters (same outputs, bandwidth-bound)")
    bench.add_argument("--compile", action="store_true", help="torch.compile every pass (pays a warm-up)")
    bench.add_argument("--json", help="also write the tables as JSON here")
    bench.set_defaults(run=cmd_bench)

    dist = commands.add_parser("distill", help="train a draft for a target")
    dist.add_argument("--target", required=True)
    dist.add_argument("--student-config", required=True, help='JSON file or literal, e.g. {"model_type": "mamba2", ...}')
    dist.add_argument("--data", nargs="+", required=True, help="text files/folders, or .pt/.npy token files")
    dist.add_argument("--tokenizer")
    dist.add_argument("--output", required=True)
    dist.add_argument("--share-embeddings", action="store_true")
    dist.add_argument("--continuations", type=int, default=0, help="add N target continuations of corpus prompts")
    dist.add_argument("--continuation-temperature", type=float, default=0.7)
    dist.add_argument("--loss", default="forward_kl=1", help="e.g. forward_kl=0.9,cross_entropy=0.1")
    dist.add_argument("--temperature", type=float, default=1.0)
    dist.add_argument("--teacher-top-k", type=int, default=0)
    dist.add_argument("--steps", type=int, default=1000)
    dist.add_argument("--batch-size", type=int, default=8)
    dist.add_argument("--grad-accum", type=int, default=1)
    dist.add_argument("--seq-len", type=int, default=128)
    dist.add_argument("--lr", type=float, default=1e-3)
    dist.add_argument("--warmup", type=int, default=50)
    dist.add_argument("--eval-every", type=int, default=0)
    dist.add_argument("--save-every", type=int, default=0)
    dist.add_argument("--resume", help="checkpoint folder to continue from")
    dist.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    dist.set_defaults(run=cmd_distill)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
