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
from benchmarks.common import SHORT_DTYPES, device_line, machine_info, model_shape, results_path, write_json
from stree.adaptive import Acceptance, Pacing, PassTimes, RoundCosts, calibrate
from stree.decoding import Generation
from stree.demo import demo_pair, held_out_prompts
from stree.shapes import tree_shapes

# label -> (tree, draft_on_device): an adaptive tree grown on the device decides its depth after the first level;
# "by path probability": the adaptive tree estimating greedy nodes by their draft path probability (the rule before
# the measured agreement, Acceptance.agreement)
TREES = {
    "adaptive": (stree.DynamicTree(adaptive=True), False),
    "adaptive, device-grown": (stree.DynamicTree(adaptive=True), True),
    "adaptive by path prob.": (stree.DynamicTree(adaptive=True), False),
    "dynamic-16": (stree.DynamicTree(16), False),
    "dynamic-8-d4": (stree.DynamicTree(8, depth=4), False),
    "dynamic-6-d3": (stree.DynamicTree(6, depth=3), False),
    "dynamic-4-d2": (stree.DynamicTree(4, depth=2), False),
    "chain-4": (stree.StaticTree((1, 1, 1, 1)), False),
    "chain-2": (stree.StaticTree((1, 1)), False),
}

TIMINGS = ("draft", "draft_round", "verify", "verify_curve", "other")


class FrozenTimes(PassTimes):
    """PassTimes that stay as measured: rounds teach them nothing."""

    def update(self, *args):
        pass


class AlwaysSpeculate(Pacing):
    """Pacing that never takes a plain step (pacing is judged by timings)."""

    def speculates(self, context):
        return True


class PathProbability(Acceptance):
    """Acceptance whose greedy agreement stays the draft's own probability (no tries outweigh the prior)."""
    AGREE_PRIOR = 1e12


def frozen(times, acceptance=Acceptance):
    """A RoundCosts with `times`' timings frozen: it still learns its calibration and agreement table."""
    return RoundCosts(FrozenTimes(**{f: getattr(times, f) for f in TIMINGS}), acceptance(), AlwaysSpeculate())


def generate_rounds(target, draft, prompt, spec, new_tokens, **kwargs):
    """stree.generate's loop, driven here: (its GenerationStats, [(Round, drafting seconds)])."""
    generation, rounds = Generation(target, prompt, draft_model=draft, max_new_tokens=new_tokens, tree=spec,
                                    **kwargs), []
    while not generation.done:
        drafting = generation.stats.draft_time
        result = generation.round()
        rounds.append((result, generation.stats.draft_time - drafting))
    return generation.output(return_stats=True)[1], rounds


def node_statistics(rounds):
    """Per verified draft node: (draft probability given its parent, whether the target's argmax after its parent is
    its token, depth, draft path probability, accepted: every node on its path agreed)."""
    nodes = []
    for result, _ in rounds:
        if result.greedy is None or result.drafted is None or result.drafted.draft_q is None:
            continue
        tokens, parents, greedy = result.tokens, result.parents, result.greedy
        draft_q = result.drafted.draft_q[result.drafted.root:]
        depth, path, accepted = [0], [1.0], [True]
        for n in range(1, len(tokens)):
            q, agreed = draft_q[n], greedy[parents[n]] == tokens[n]
            depth.append(depth[parents[n]] + 1)
            path.append(path[parents[n]] * q)
            accepted.append(accepted[parents[n]] and agreed)
            nodes.append((q, agreed, depth[n], path[n], accepted[n]))
    return nodes


def measure_costs(target, draft, prompts, calibrations, new_tokens):
    """PassTimes measured on this pair: target passes from stree's own calibration (the median of `calibrations`
    runs), a draft level, a round's drafting beyond its levels and the rest of a round from greedy rounds of
    DynamicTree(16)."""
    spec = stree.DynamicTree(16)
    target_nodes, draft_nodes, draft_width = tree_shapes(spec, paced=True)
    runs = []
    for _ in range(calibrations):
        t, d = stree.TreeModel(target, nodes=target_nodes), stree.TreeModel(draft, nodes=draft_nodes)
        t.prefill(prompts[0], max_length=256)
        d.prefill(prompts[0], max_length=256)
        runs.append(calibrate(RoundCosts(), t, d, target_nodes, spec.frontier, 7).times)
    times = PassTimes(verify=statistics.median(r.verify for r in runs),
                      verify_curve=tuple((n, statistics.median(r.verify_curve[i][1] for r in runs))
                                         for i, (n, _) in enumerate(runs[0].verify_curve)))
    drafting, other = [], []
    for prompt in prompts:
        stats, rounds = generate_rounds(target, draft, prompt, spec, new_tokens, sync=True)
        drafting += [(seconds, r.drafted.level_seconds, r.drafted.passes) for r, seconds in rounds if r.drafted]
        breakdown = stats.breakdown()
        other.append((breakdown["commit_ms"] + breakdown["other_ms"]) / 1e3)
    times.draft = statistics.median(level / (passes - 1) for _, level, passes in drafting)
    times.draft_round = statistics.median(total - passes * times.draft for total, _, passes in drafting)
    times.other = statistics.median(other)
    return times


def run_tree(target, draft, prompts, label, spec, on_device, times, new_tokens):
    """(modelled seconds, real seconds, tokens, rounds, draft passes, target nodes, recorded rounds) of `spec` over
    the prompts, with `times` frozen for an adaptive tree (one RoundCosts kept across prompts, as generate keeps
    it)."""
    costs = frozen(times, PathProbability if label == "adaptive by path prob." else Acceptance)
    real = modelled = 0.0
    tokens = rounds = passes = nodes = 0
    recorded = []
    for prompt in prompts:
        start = time.perf_counter()
        stats, prompt_rounds = generate_rounds(target, draft, prompt, spec, new_tokens, sync=True,
                                               draft_on_device=on_device, costs=costs)
        real += time.perf_counter() - start - stats.prefill_time
        recorded += prompt_rounds
        tokens += stats.new_tokens - 1  # the first new token is the prefill's
        rounds, passes = rounds + stats.rounds, passes + stats.draft_passes
        nodes += sum(stats.tree_sizes)
        modelled += (stats.rounds * (times.draft_round + times.other) + stats.draft_passes * times.draft +
                     sum(times.target_time(n) for n in stats.tree_sizes))
    agreement = costs.acceptance
    return dict(modelled_s=modelled, real_s=real, tokens=tokens, rounds=rounds, draft_passes=passes, nodes=nodes,
                agreement={low: agreement.agreement((low + high) / 2) for low, high in
                           zip(agreement.AGREE_EDGES, agreement.AGREE_EDGES[1:] + (1.0,))}
                if getattr(spec, "adaptive", False) else None), recorded


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
        costs = PassTimes(**{**kept, "verify_curve": tuple(map(tuple, kept["verify_curve"]))})
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

    nodes = node_statistics(recorded["dynamic-16"])
    edges = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
    by_q = []
    print("\ndynamic-16's verified nodes: how often the target chose a child of draft probability q")
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
