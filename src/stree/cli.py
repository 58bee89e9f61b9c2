"""The `stree` command: generate, bench, distill. Without --target/--draft the bundled demo pair is used.

    stree generate --prompt "def fibonacci(n):"       # stream text, then tau and tokens/s
    stree bench                                        # autoregressive vs chain vs tree on held-out prompts
    stree distill --target PATH --student-config student.json --data FILES_OR_DIRS --output DIR
"""
import argparse
import dataclasses
import json
import math
import os
import re
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


def _number(convert, check, requirement):
    """An argparse type: convert(text), kept when check(value) holds, else an error naming the value."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value
    parse.__name__ = requirement
    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
_nonnegative_float = _number(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
_probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _losses(text):
    """--loss: name=weight pairs separated by commas, e.g. forward_kl=0.9,cross_entropy=0.1."""
    from .distill.losses import check_weights
    losses = {}
    for part in text.split(","):
        name, equals, weight = part.partition("=")
        try:
            losses[name.strip()] = float(weight)
        except ValueError:
            equals = ""
        if not equals:
            raise argparse.ArgumentTypeError(f"{part!r} is not name=weight (e.g. forward_kl=0.9,cross_entropy=0.1)")
    try:
        check_weights(losses)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))
    return losses


def parse_feature_layers(text):
    """--feature-layers: "last" (None), "eagle3", or layer indices separated by commas (a tuple); new_head checks
    them against the target."""
    if text in ("last", "eagle3"):
        return None if text == "last" else text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be last, eagle3 or layer indices such as 1,3,4, got {text!r}")


def _device(text):
    """--device: a torch device string (cpu, cuda, cuda:1, ...)."""
    try:
        return torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)")


# A Hugging Face Hub id: name or namespace/name.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _check_model_path(parser, option, path):
    """A model or tokenizer option must name a folder here, or a Hub id (namespace/name, whose namespace is not a
    folder here: runs/draft with a runs/ folder is a missing local folder)."""
    if path is None or os.path.isdir(path):
        return
    if os.path.exists(path) or not _HUB_ID.fullmatch(path) or os.path.isdir(path.split("/")[0]):
        parser.error(f"{option}: no such folder: {path}")


def _student_config(parser, text):
    """--student-config: a JSON object (literal, or the path of a file holding one), checked by config_from_dict."""
    from .distill.student import config_from_dict
    literal = text.lstrip().startswith(("{", "["))
    if not literal and not os.path.isfile(text):
        parser.error(f"--student-config: no such file, and not a JSON object: {text!r}")
    source = "the JSON literal" if literal else text
    try:
        if literal:
            config = json.loads(text)
        else:
            with open(text) as f:
                config = json.load(f)
    except json.JSONDecodeError as error:
        parser.error(f"--student-config: {source} is not valid JSON ({error})")
    if not isinstance(config, dict):
        parser.error(f"--student-config: {source} must hold a JSON object, got {type(config).__name__}")
    try:
        config_from_dict(config)
    except ValueError as error:
        parser.error(f"--student-config: {error}")
    return config


def check_args(parser, args):
    """Errors that argparse's types cannot see (combinations, folders, JSON): parser.error, before any loading."""
    if args.command in ("generate", "bench"):
        if (args.target is None) != (args.draft is None):
            parser.error("give both --target and --draft, or neither (the bundled demo pair)")
        if args.tokenizer is not None and args.target is None:
            parser.error("--tokenizer goes with --target and --draft (the bundled demo pair has its own)")
        for option in ("target", "draft", "tokenizer"):
            _check_model_path(parser, f"--{option}", getattr(args, option))
    if args.command == "distill":
        _check_model_path(parser, "--target", args.target)
        _check_model_path(parser, "--tokenizer", args.tokenizer)
        for path in args.data:
            if not os.path.exists(path):
                parser.error(f"--data: no such file or folder: {path}")
        if args.resume is not None and not os.path.isdir(args.resume):
            parser.error(f"--resume: no such folder: {args.resume}")
        if args.continuations and args.seq_len < 3:
            parser.error(f"--continuations needs --seq-len >= 3 (prompts are a third of it), got {args.seq_len}")
        if (args.student_config is None) == (args.head_layers is None):
            parser.error("give --student-config (train a draft model) or --head-layers (train a draft head), not both")
        if args.student_config is not None:
            args.student_config = _student_config(parser, args.student_config)


def _load_pair(args, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .demo import demo_pair
    if args.target is None and args.draft is None:
        return demo_pair(dtype=dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    return target, draft, tokenizer


def _load_head(args, target, default=None):
    """The DraftHead --head names for `target` (`default` when it names none; None for 'none')."""
    from .demo import demo_head
    from .heads import DraftHead
    name = args.head or default
    if name in (None, "none"):
        return None
    if name == "demo":
        if args.target is not None:
            sys.exit("stree: --head demo is the bundled target's head; with --target give the head's folder")
        return demo_head(target)
    return DraftHead.from_pretrained(name, target=target)


def cmd_generate(args):
    from transformers import TextStreamer

    from .decoding import generate
    target, draft, tokenizer = _load_pair(args)
    input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if input_ids.shape[1] == 0:
        sys.exit(f"stree generate: --prompt {args.prompt!r} is no tokens at all; give some text")
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    head = _load_head(args, target)
    _, stats = generate(target, input_ids, draft_model=head or draft, max_new_tokens=args.max_new_tokens,
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
    from .heads.inflate import inflate_head
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
    head = _load_head(args, target, default="demo" if args.target is None else None)
    targets = [("target", target, head)]
    if args.large:  # a realistic-size target computing the same function: bound by reading weights
        sizes = dict(hidden_size=2048, mamba_heads=64, d_state=128, intermediate_size=8192)
        large = inflate_bamba(target, **sizes, num_layers=12)
        targets.append(("target inflated to 0.9B", large, head and inflate_head(head, large, **sizes)))
    device = (f"cpu ({_cpu_name() or platform.processor() or platform.machine()}, torch capability "
              f"{torch.backends.cpu.get_cpu_capability()}), torch threads {torch.get_num_threads()}")
    print(f"device {device}, {args.dtype}, {args.prompts} held-out prompts x {args.max_new_tokens} new "
          f"tokens, {args.repeats} repeats{', compiled' if args.compile else ''}")
    report = []
    for label, model, model_head in targets:
        model.generation_config.eos_token_id = None  # equal lengths for every method
        params = sum(p.numel() for p in model.parameters()) / 1e6
        new_tokens = args.max_new_tokens if model is target else max(8, args.max_new_tokens // 4)
        for temperature in args.temperatures:
            head_params = "" if model_head is None else \
                f", head {sum(p.numel() for p in model_head.own_parameters()) / 1e6:.1f}M (+ the target's LM head)"
            print(f"\n{label} ({params:.1f}M params), draft {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M"
                  f"{head_params}, "
                  f"temperature {temperature}, {new_tokens} new tokens")
            with_head = {**trees, **({f"head {tree_name(args.tree)}": dict(tree=args.tree, draft_model=model_head)}
                                     if model_head is not None else {})}
            rows = compare(model, draft, prompts, with_head, max_new_tokens=new_tokens, temperature=temperature,
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
    device = args.device
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun / accelerate: one device per process
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    if args.head_layers:
        from .heads import new_head
        student = new_head(target, layers=args.head_layers, feature_layers=args.feature_layers)
    else:
        student = student_from_config(target, args.student_config, share_embeddings=args.share_embeddings).to(device)
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
    config = TrainConfig(output_dir=args.output, steps=args.steps, batch_size=args.batch_size,
                         grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup, losses=args.loss,
                         temperature=args.temperature, teacher_top_k=args.teacher_top_k, eval_every=args.eval_every,
                         save_every=args.save_every)
    eval_prompts = random_windows(tokens, 4, 32, torch.Generator().manual_seed(1)) if args.eval_every else None
    if args.head_layers:
        from .distill.heads import HeadTrainer
        trainer = HeadTrainer(student, config, ConcatDataset(datasets), target, eval_prompts=eval_prompts,
                              unroll=args.unroll)
    else:
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
        p.add_argument("--head", help="a draft head's folder (DraftHead.from_pretrained: a head stree trained, or the "
                       "target's checkpoint folder holding a published MTP head); 'demo': the bundled target's head; "
                       "bench: 'none' leaves heads out (default there: the bundled head with the bundled pair)")
        p.add_argument("--tree", type=_tree, default=_tree("adaptive"),
                       help="adaptive (default: sized every round by measured costs) | adaptive-24 | dynamic-16 | "
                       "3,2,2,1 | chain-4 | beam-4x4")

    gen = commands.add_parser("generate", help="speculative tree decoding of one prompt, streamed")
    pair_options(gen)
    gen.add_argument("--prompt", default="def ")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--temperature", type=_nonnegative_float, default=0.0)
    gen.add_argument("--top-k", type=_positive_int, default=None)
    gen.add_argument("--top-p", type=_probability, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=cmd_generate)

    bench = commands.add_parser("bench", help="HF generate vs stree autoregressive vs chain vs tree decoding")
    pair_options(bench)
    bench.add_argument("--chain", type=_tree, default=_tree("chain-4"))
    bench.add_argument("--prompts", type=_positive_int, default=4)
    bench.add_argument("--prompt-len", type=_positive_int, default=32)
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128)
    bench.add_argument("--temperatures", type=_nonnegative_float, nargs="+", default=[0.0, 1.0])
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--repeats", type=_positive_int, default=3, help="timed runs of every method (ratios: min-max)")
    bench.add_argument("--large", action="store_true",
                       help="also the bundled target inflated to 0.9B parameters (same outputs, bandwidth-bound)")
    bench.add_argument("--compile", action="store_true", help="torch.compile every pass (pays a warm-up)")
    bench.add_argument("--json", help="also write the tables as JSON here")
    bench.set_defaults(run=cmd_bench)

    dist = commands.add_parser("distill", help="train a draft for a target")
    dist.add_argument("--target", required=True)
    dist.add_argument("--student-config", help='a draft model to train: JSON file or literal, e.g. {"model_type": '
                      '"mamba2", ...}')
    dist.add_argument("--head-layers", type=_positive_int, help="train a draft head of this many attention blocks "
                      "instead (EAGLE-style, on the target's features; --loss is then not used)")
    dist.add_argument("--unroll", type=_positive_int, default=3, help="a head's training-time-test steps")
    dist.add_argument("--feature-layers", type=parse_feature_layers, default=None, help="what a head reads of the target: "
                      "last (its last hidden state, default), eagle3 (an early, the middle and a late layer) or "
                      "layer indices such as 1,3,4")
    dist.add_argument("--data", nargs="+", required=True, help="text files/folders, or .pt/.npy token files")
    dist.add_argument("--tokenizer")
    dist.add_argument("--output", required=True)
    dist.add_argument("--share-embeddings", action="store_true")
    dist.add_argument("--continuations", type=_nonnegative_int, default=0,
                      help="add N target continuations of corpus prompts")
    dist.add_argument("--continuation-temperature", type=_nonnegative_float, default=0.7)
    dist.add_argument("--loss", type=_losses, default="forward_kl=1", help="e.g. forward_kl=0.9,cross_entropy=0.1")
    dist.add_argument("--temperature", type=_positive_float, default=1.0)
    dist.add_argument("--teacher-top-k", type=_nonnegative_int, default=0)
    dist.add_argument("--steps", type=_positive_int, default=1000)
    dist.add_argument("--batch-size", type=_positive_int, default=8)
    dist.add_argument("--grad-accum", type=_positive_int, default=1)
    dist.add_argument("--seq-len", type=_positive_int, default=128)
    dist.add_argument("--lr", type=_positive_float, default=1e-3)
    dist.add_argument("--warmup", type=_nonnegative_int, default=50)
    dist.add_argument("--eval-every", type=_nonnegative_int, default=0)
    dist.add_argument("--save-every", type=_nonnegative_int, default=0)
    dist.add_argument("--resume", help="checkpoint folder to continue from")
    dist.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu")
    dist.set_defaults(run=cmd_distill)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.run(args)


if __name__ == "__main__":
    main()
