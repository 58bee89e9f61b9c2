"""Train the bundled demo target's draft head: one Bamba attention block (the target's own attention and MLP classes),
fed the target's features, trained EAGLE-style (stree.distill.heads) on the target's continuations of training text
and the text itself, from the Python standard library files the demo pair trained on.

    python -m stree.distill.demo_head --out src/stree/assets/demo/head --steps 1200 --windows 1024  # what shipped
    python -m stree.distill.demo_head --out /tmp/head --steps 20 --windows 16         # a quick smoke run

stree.demo_head(target) loads it; build.json beside it records the command and step counts.
"""
import argparse
import json
import os
import tempfile
import time

import torch
from torch.utils.data import ConcatDataset

from .data import TokenChunks, random_windows, stdlib_split, target_continuations, tokenize_files
from ..cli import parse_feature_layers
from .heads import HeadTrainer
from .trainer import TrainConfig


def build(out, steps, windows, seed=0, workdir=None, feature_layers=None):
    from ..demo import demo_pair
    from ..heads import new_head
    torch.manual_seed(seed)
    target, _, tokenizer = demo_pair()
    train_files, held_out = stdlib_split()
    tokens, eval_tokens = tokenize_files(train_files, tokenizer), tokenize_files(held_out, tokenizer)
    g = torch.Generator().manual_seed(seed)
    started = time.time()
    continuations = target_continuations(target, random_windows(tokens, windows, 32, g), max_new_tokens=64,
                                         temperature=0.7)
    print(f"{windows} target continuations in {time.time() - started:.0f} s")
    data = ConcatDataset([continuations, TokenChunks(tokens, 95)])
    head = new_head(target, feature_layers=feature_layers)
    config = TrainConfig(output_dir=workdir or tempfile.mkdtemp(prefix="stree-head-"), steps=steps, batch_size=16,
                         lr=3e-3, warmup=50, eval_every=steps, eval_new_tokens=48, seed=seed)
    started = time.time()
    history = HeadTrainer(head, config, data, target, eval_prompts=random_windows(eval_tokens, 4, 32, g)).train()
    print(f"head trained in {time.time() - started:.0f} s; held-out tau {history[-1].get('tau')}")
    head.to(torch.float16).save_pretrained(out)
    with open(os.path.join(out, "build.json"), "w") as f:
        layers = "" if feature_layers is None else f" --feature-layers {','.join(map(str, head.feature_layers))}"
        json.dump(dict(steps=steps, windows=windows, seed=seed, batch_size=16, unroll=3,
                       feature_layers=head.feature_layers,
                       parameters=sum(p.numel() for p in head.own_parameters()),
                       held_out_tau=history[-1].get("tau"), seconds=round(time.time() - started),
                       command=f"python -m stree.distill.demo_head --out {out} --steps {steps} --windows {windows}"
                               + layers),
                  f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--windows", type=int, default=256, help="prompts the target continues for the training data")
    parser.add_argument("--workdir", default=None, help="where trainer checkpoints go (default: a temp folder)")
    parser.add_argument("--feature-layers", type=parse_feature_layers, default=None,
                        help="last (default), eagle3 or layer indices such as 1,3,4 (stree distill's option)")
    args = parser.parse_args()
    build(args.out, args.steps, args.windows, workdir=args.workdir, feature_layers=args.feature_layers)


if __name__ == "__main__":
    main()
