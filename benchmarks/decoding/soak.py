"""Soak: a few thousand mixed calls on one model object, checked against references, with the process's memory.

The calls are drawn at random (seeded) from these kinds, on the bundled pair:
  stree greedy        stree.generate greedy with a random tree (adaptive, dynamic-16, chain-4, a static tree);
  stree compiled      the same through compiled passes (one fixed tree, so the compilation is paid once);
  stree sampled       seeded sampling (T=1, top_p=0.95) with a random tree;
  stree AR            stree's own autoregressive loop (draft_model=None);
  drop-in             model.generate(..., draft_model=draft) after stree.enable(model);
  HF greedy / HF sampled   HF's own generate on the same model object, between stree's calls.
Every greedy output is compared with HF's greedy search (computed once per prompt before the soak); every seeded
sampled output with the first output of its (prompt, tree, seed); HF's sampled outputs (seeded through the global
RNG) with their first. The peak resident memory (ru_maxrss) is read every `--every` calls. Prints the device, CPU
flags, the pair's shapes, a table per kind (calls, outputs that differ from their reference, mean ms a call) and the
memory series; writes JSON (results/<machine>/soak.json).

    python -m benchmarks.decoding.soak                       # 2000 calls, float32 (about 10 minutes on 2 cores)
    python -m benchmarks.decoding.soak --calls 300 --no-compile
"""
import argparse
import random
import resource
import time

import torch

import stree
from benchmarks.common import device_line, machine_info, model_shape, results_path, write_json
from stree.demo import demo_pair, held_out_prompts
from stree.shapes import parse_tree

TREES = ["adaptive", "dynamic-16", "chain-4", (2, 2, 1)]
COMPILED_TREE = (2, 2, 1)
NEW_TOKENS = 24


def peak_rss_mb():
    """The process's peak resident memory so far, in MB (ru_maxrss is in KB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tree_of(name):
    return parse_tree(name) if isinstance(name, str) else name


class Soak:
    """The pair, the prompts, the references and the tallies of one soak."""

    def __init__(self, target, draft, prompts, compile):
        self.target, self.draft, self.prompts, self.compile = target, draft, prompts, compile
        with torch.no_grad():
            self.hf_greedy = [target.generate(p, attention_mask=torch.ones_like(p), do_sample=False,
                                              max_new_tokens=NEW_TOKENS) for p in prompts]
        self.first = {}  # (kind, key) -> the first output of a seeded sampled call
        self.tally = {}  # kind -> dict(calls, differ, seconds)
        stree.enable(target)

    def call(self, kind, rng):
        """One call of `kind` on a random prompt; returns whether its output equals its reference."""
        i = rng.randrange(len(self.prompts))
        prompt, target, draft = self.prompts[i], self.target, self.draft
        tree = rng.choice(TREES)
        if kind == "stree greedy":
            return torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=NEW_TOKENS,
                                              tree=tree_of(tree)), self.hf_greedy[i])
        if kind == "stree compiled":
            return torch.equal(stree.generate(target, prompt, draft_model=draft, max_new_tokens=NEW_TOKENS,
                                              tree=COMPILED_TREE, compile=True), self.hf_greedy[i])
        if kind == "stree AR":
            return torch.equal(stree.generate(target, prompt, draft_model=None, max_new_tokens=NEW_TOKENS),
                               self.hf_greedy[i])
        if kind == "drop-in":
            return torch.equal(target.generate(prompt, draft_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False),
                               self.hf_greedy[i])
        if kind == "HF greedy":
            return torch.equal(target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                               max_new_tokens=NEW_TOKENS), self.hf_greedy[i])
        seed = rng.randrange(4)
        if kind == "stree sampled":
            out = stree.generate(target, prompt, draft_model=draft, max_new_tokens=NEW_TOKENS, temperature=1.0,
                                 top_p=0.95, tree=tree_of(tree), generator=torch.Generator().manual_seed(seed))
            key = (kind, i, str(tree), seed)
        else:  # HF sampled
            torch.manual_seed(seed)
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                  max_new_tokens=NEW_TOKENS)
            key = (kind, i, seed)
        return torch.equal(out, self.first.setdefault(key, out))

    def run(self, calls, seed, every):
        kinds = ["stree greedy", "stree sampled", "stree AR", "drop-in", "HF greedy", "HF sampled"]
        kinds += ["stree compiled"] if self.compile else []
        rng = random.Random(seed)
        memory = [(0, peak_rss_mb())]
        for n in range(1, calls + 1):
            kind = rng.choice(kinds)
            start = time.perf_counter()
            same = self.call(kind, rng)
            entry = self.tally.setdefault(kind, dict(calls=0, differ=0, seconds=0.0))
            entry["calls"] += 1
            entry["differ"] += not same
            entry["seconds"] += time.perf_counter() - start
            if n % every == 0:
                memory.append((n, peak_rss_mb()))
                differ = sum(t["differ"] for t in self.tally.values())
                print(f"{n} calls, {differ} differ, peak RSS {memory[-1][1]:.0f} MB", flush=True)
        stree.disable(self.target)
        return memory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--every", type=int, default=250, help="read the peak memory every this many calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    info = machine_info("cpu")
    print(device_line(info))
    target, draft, tokenizer = demo_pair()
    print(f"target: {model_shape(target)}\ndraft: {model_shape(draft)}")
    print(f"{args.calls} calls, {args.prompts} held-out prompts of {args.prompt_length} tokens, {NEW_TOKENS} new "
          f"tokens each, float32; trees {[str(t) for t in TREES]}, compiled tree {COMPILED_TREE}")
    soak = Soak(target, draft, held_out_prompts(tokenizer, args.prompts, args.prompt_length), args.compile)
    start = time.perf_counter()
    memory = soak.run(args.calls, args.seed, args.every)
    wall = time.perf_counter() - start
    print(f"\n{'kind':16s} {'calls':>6s} {'differ':>7s} {'ms/call':>8s}")
    for kind, t in sorted(soak.tally.items()):
        print(f"{kind:16s} {t['calls']:6d} {t['differ']:7d} {1e3 * t['seconds'] / t['calls']:8.1f}")
    print(f"\npeak RSS (MB) by calls done: " + ", ".join(f"{n}: {mb:.0f}" for n, mb in memory))
    settled = [mb for n, mb in memory if n >= args.calls // 5]  # after the first fifth: compilation and caches done
    print(f"growth after the first fifth of the calls: {settled[-1] - settled[0]:.1f} MB; wall {wall:.0f} s")
    write_json(args.json or results_path(info, "soak.json"), dict(
        **info, calls=args.calls, seed=args.seed, new_tokens=NEW_TOKENS, prompts=args.prompts,
        prompt_length=args.prompt_length, trees=[str(t) for t in TREES], compiled_tree=str(COMPILED_TREE),
        compile=args.compile, tally=soak.tally, peak_rss_mb=memory, wall_s=wall,
        growth_after_first_fifth_mb=settled[-1] - settled[0]))


if __name__ == "__main__":
    main()
