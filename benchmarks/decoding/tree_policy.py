"""Tree-sizing policies compared without timing noise: costs measured once, then frozen, and every round scored by them.

The adaptive tree (stree's default) sizes each round from timings, and a shared CPU's timings drift by a third from
run to run, which buries differences of a few percent between policies. This script:
  1. measures the bundled pair's costs once, greedy: a draft level and what a round's drafting costs beyond its
     levels (rounds of the fixed DynamicTree(16)), target passes of 1, 2, 4, 8 and 17 nodes (the adaptive tree's
     own calibration, the median of --calibrations), and the rest of a round;
  2. runs each tree greedy on held-out prompts with those costs frozen (the adaptive tree still learns what it
     learns from acceptance: its calibration and its greedy agreement table; pacing, which is judged by timings,
     is off for every tree);
  3. scores each round by the frozen model: draft_round + passes * draft + target(nodes) + other.
The modelled tokens/s are then the same on every run of the same code; the real tokens/s of the same runs are
printed beside them. Also printed: how often the target chose a draft child of each draft probability, and how
often nodes of each depth were accepted against their draft path probability (rounds of DynamicTree(16)): what the
adaptive tree's greedy estimates are built on. The device, CPU flags and the pair's shapes come first; JSON last.

    python -m benchmarks.decoding.tree_policy                  # the bundled pair, float32, 8 prompts x 128 tokens
    python -m benchmarks.decoding.tree_policy --dtype bfloat16
    python -m benchmarks.decoding.tree_policy --costs benchmarks/results/cpu-epyc-avx2/tree-policy-fp32.json
                                                               # the same frozen costs as that run
"""
import argparse
import json
import math
import statistics
import time

import torch

import stree
import stree.decoding as decoding
from benchmarks.common import SHORT_DTYPES, device_line, machine_info, model_shape, results_path, write_json
from stree.demo import demo_pair, held_out_prompts
from stree.draft import RoundCosts, tree_shapes

# label -> (tree, draft_on_device): an adaptive tree grown on the device decides its depth after the first level;
# "by path probability": the adaptive tree estimating greedy nodes by their draft path probability (the rule before
# the measured agreement, RoundCosts.agreement)
TREES = {
    "default (adaptive)": (stree.DynamicTree(adaptive=True), False),
    "default, device-grown": (stree.DynamicTree(adaptive=True), True),
    "adaptive by path prob.": (stree.DynamicTree(adaptive=True), False),
    "DynamicTree(16)": (stree.DynamicTree(16), False),
    "DynamicTree(8, depth 4)": (stree.DynamicTree(8, depth=4), False),
    "DynamicTree(6, depth 3)": (stree.DynamicTree(6, depth=3), False),
    "DynamicTree(4, depth 2)": (stree.DynamicTree(4, depth=2), False),
    "chain (1, 1, 1, 1)": (stree.StaticTree((1, 1, 1, 1)), False),
    "chain (1, 1)": (stree.StaticTree((1, 1)), False),
}


class FrozenCosts(RoundCosts):
    """RoundCosts whose timings stay as measured: update() learns only from acceptance, and every round drafts."""

    def update(self, *args):
        timings = (self.draft, self.draft_round, self.verify, self.other)
        super().update(*args)
        self.draft, self.draft_round, self.verify, self.other = timings

    def speculates(self, context):
        return True


class PathProbabilityCosts(FrozenCosts):
    """FrozenCosts whose greedy agreement stays the draft's own probability (no tries outweigh the prior)."""
    AGREE_PRIOR = 1e12


class Recorder:
    """Wraps stree.decoding's draft_tree and verify_greedy to keep each greedy round: (the drafted tree, the trunk
    length, the target's argmax after each node of the verified tree), and the drafting seconds."""

    def __init__(self):
        self.rounds, self.drafting = [], []
        self.draft_tree, self.verify_greedy = decoding.draft_tree, decoding.verify_greedy

    def __enter__(self):
        def draft_tree(draft, trunk, *args):
            start = time.perf_counter()
            drafted = self.draft_tree(draft, trunk, *args)
            self.drafting.append((time.perf_counter() - start, drafted.level_seconds, drafted.passes))
            self.rounds.append([drafted, len(trunk), None])
            return drafted

        def verify_greedy(tokens, parents, greedy, *args):
            self.rounds[-1][2] = list(greedy)
            return self.verify_greedy(tokens, parents, greedy, *args)

        decoding.draft_tree, decoding.verify_greedy = draft_tree, verify_greedy
        return self

    def __exit__(self, *exc):
        decoding.draft_tree, decoding.verify_greedy = self.draft_tree, self.verify_greedy


def node_statistics(rounds):
    """Per verified draft node: (draft probability given its parent, whether the target's argmax after its parent is
    its token, depth, draft path probability, accepted: every node on its path agreed)."""
    nodes = []
    for drafted, trunk, greedy in rounds:
        if greedy is None or drafted.draft_q is None:
            continue
        offset = trunk - 1
        tokens, parents = drafted.tokens[offset:], [p - offset for p in drafted.parents[offset:]]
        depth, path, accepted = [0], [1.0], [True]
        for n in range(1, len(tokens)):
            q, agreed = drafted.draft_q[n + offset], greedy[parents[n]] == tokens[n]
            depth.append(depth[parents[n]] + 1)
            path.append(path[parents[n]] * q)
            accepted.append(accepted[parents[n]] and agreed)
            nodes.append((q, agreed, depth[n], path[n], accepted[n]))
    return nodes


def measure_costs(target, draft, prompts, calibrations, new_tokens):
    """A RoundCosts measured on this pair: target passes from stree's own calibration (the median of
    `calibrations` runs), a draft level, a round's drafting beyond its levels and the rest of a round from greedy
    rounds of DynamicTree(16)."""
    spec = stree.DynamicTree(16)
    target_nodes, draft_nodes, draft_width = tree_shapes(spec, paced=True)
    runs = []
    for _ in range(calibrations):
        t, d = stree.TreeModel(target, nodes=target_nodes), stree.TreeModel(draft, nodes=draft_nodes)
        t.prefill(prompts[0], max_length=256)
        d.prefill(prompts[0], max_length=256)
        runs.append(decoding._calibrate(RoundCosts(), t, d, target_nodes, spec.frontier, 7))
    costs = FrozenCosts(verify=statistics.median(r.verify for r in runs),
                        verify_curve=tuple((n, statistics.median(r.verify_curve[i][1] for r in runs))
                                           for i, (n, _) in enumerate(runs[0].verify_curve)))
    with Recorder() as recorder:
        other = []
        for prompt in prompts:
            _, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=new_tokens, tree=spec,
                                      return_stats=True)
            breakdown = stats.breakdown()
            other.append((breakdown["commit_ms"] + breakdown["other_ms"]) / 1e3)
    costs.draft = statistics.median(level / (passes - 1) for _, level, passes in recorder.drafting)
    costs.draft_round = statistics.median(total - passes * costs.draft for total, _, passes in recorder.drafting)
    costs.other = statistics.median(other)
    return costs


def run_tree(target, draft, prompts, label, spec, on_device, costs, new_tokens):
    """(modelled seconds, real seconds, tokens, rounds, draft passes, target nodes, recorded rounds) of `spec` over
    the prompts, with `costs` frozen for an adaptive tree (kept across prompts, as generate keeps it)."""
    target.__dict__.pop("_stree_costs", None)
    kind = PathProbabilityCosts if label == "adaptive by path prob." else FrozenCosts
    frozen = kind(**{f: getattr(costs, f) for f in ("draft", "draft_round", "verify", "verify_curve",
                                                           "other")})
    real = modelled = 0.0
    tokens = rounds = passes = nodes = 0
    original = decoding._calibrate
    decoding._calibrate = lambda *args: frozen
    try:
        with Recorder() as recorder:
            for prompt in prompts:
                start = time.perf_counter()
                _, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=new_tokens, tree=spec,
                                          return_stats=True, draft_on_device=on_device)
                real += time.perf_counter() - start - stats.prefill_time
                tokens += stats.new_tokens - 1  # the first new token is the prefill's
                rounds, passes = rounds + stats.rounds, passes + stats.draft_passes
                nodes += sum(stats.tree_sizes)
                modelled += (stats.rounds * (costs.draft_round + costs.other) + stats.draft_passes * costs.draft +
                             sum(costs.target_time(n) for n in stats.tree_sizes))
    finally:
        decoding._calibrate = original
    return dict(modelled_s=modelled, real_s=real, tokens=tokens, rounds=rounds, draft_passes=passes, nodes=nodes,
                agreement={low: frozen.agreement((low + high) / 2) for low, high in
                           zip(frozen.AGREE_EDGES, frozen.AGREE_EDGES[1:] + (1.0,))}
                if getattr(spec, "adaptive", False) else None), recorder.rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--calibrations", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--costs", default=None, metavar="JSON",
                        help="reuse the frozen costs of an earlier run's JSON instead of measuring them: the same "
                        "figures then compare two versions of the code exactly")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<machine kind>/tree-policy-<dtype>.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, draft, tokenizer = demo_pair(dtype=getattr(torch, args.dtype))
    target.generation_config.eos_token_id = None
    prompts = held_out_prompts(tokenizer, args.prompts, 32, seed=1)
    machine = machine_info("cpu")
    print(device_line(machine))
    print(f"{args.dtype}; the bundled pair (target: {model_shape(target)}; draft: {model_shape(draft)}), "
          f"{args.prompts} held-out prompts x {args.max_new_tokens} new tokens, greedy")

    if args.costs:
        with open(args.costs) as f:
            kept = json.load(f)["costs"]
        costs = FrozenCosts(**{**kept, "verify_curve": tuple(map(tuple, kept["verify_curve"]))})
    else:
        costs = measure_costs(target, draft, prompts[:3], args.calibrations, 64)
    curve = ", ".join(f"{n}: {1e3 * (costs.verify + s):.2f}" for n, s in costs.verify_curve)
    print(f"frozen costs (ms): draft level {1e3 * costs.draft:.2f}, a round's drafting beyond its levels "
          f"{1e3 * costs.draft_round:.2f}, target pass by nodes {{{curve}}}, rest of a round {1e3 * costs.other:.2f}")

    rows, recorded = {}, {}
    for label, (spec, on_device) in TREES.items():
        rows[label], recorded[label] = run_tree(target, draft, prompts, label, spec, on_device, costs,
                                                args.max_new_tokens)
    best_fixed = max(r["tokens"] / r["modelled_s"] for label, r in rows.items() if r["agreement"] is None)
    print(f"\n{'tree':>24} {'modelled tok/s':>15} {'x best fixed':>13} {'real tok/s':>11} {'tau':>5} "
          f"{'levels':>7} {'nodes':>6} {'draft share':>12}")
    for label, r in rows.items():
        rate = r["tokens"] / r["modelled_s"]
        share = r["draft_passes"] * costs.draft + r["rounds"] * costs.draft_round
        print(f"{label:>24} {rate:15.1f} {rate / best_fixed:13.3f} {r['tokens'] / r['real_s']:11.1f} "
              f"{r['tokens'] / r['rounds']:5.2f} {r['draft_passes'] / r['rounds']:7.2f} "
              f"{r['nodes'] / r['rounds']:6.1f} {share / r['modelled_s']:11.1%}")
        r.update(modelled_tokens_per_s=rate, x_best_fixed=rate / best_fixed, draft_share=share / r["modelled_s"])

    nodes = node_statistics(recorded["DynamicTree(16)"])
    edges = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
    by_q = []
    print("\nDynamicTree(16)'s verified nodes: how often the target chose a child of draft probability q")
    for low, high in zip(edges, edges[1:]):
        group = [n for n in nodes if low <= n[0] < high]
        if group:
            by_q.append(dict(q_low=low, q_high=min(high, 1.0), nodes=len(group),
                             mean_q=statistics.fmean(n[0] for n in group),
                             chosen=statistics.fmean(n[1] for n in group)))
            print(f"  q {low:.2f}-{min(high, 1.0):.2f}: {len(group):5d} nodes, mean q {by_q[-1]['mean_q']:.3f}, "
                  f"chosen {by_q[-1]['chosen']:.3f}")
    by_depth = []
    print("... and how often nodes of each depth were accepted against their draft path probability")
    for depth in sorted({n[2] for n in nodes}):
        group = [n for n in nodes if n[2] == depth]
        path, accepted = statistics.fmean(n[3] for n in group), statistics.fmean(n[4] for n in group)
        by_depth.append(dict(depth=depth, nodes=len(group), path_probability=path, accepted=accepted))
        print(f"  depth {depth}: {len(group):5d} nodes, path probability {path:.3f}, accepted {accepted:.3f} "
              f"({accepted / path if path else math.inf:.2f}x)")

    out = args.out or results_path(machine, f"tree-policy-{SHORT_DTYPES[args.dtype]}.json")
    write_json(out, dict(machine, dtype=args.dtype, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                         costs=dict(draft=costs.draft, draft_round=costs.draft_round, verify=costs.verify,
                                    verify_curve=costs.verify_curve, other=costs.other),
                         trees=rows, agreement_by_q=by_q, acceptance_by_depth=by_depth))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
