"""Tree search on a verifiable task: generated arithmetic word problems (stree.search.arithmetic).

A small hybrid policy (Bamba: two Mamba2 and two attention layers, character-level) is trained with stree.distill's
Trainer on solution traces (once per setting; saved under benchmarks/tree_search/assets/, rebuilt with --retrain).
A program checks every step and serves as the verifier. For each strategy at the same width: accuracy, mean peak
retained-tree bytes (stree.search.TreeMemory: attention K/V per node + one SSM snapshot per state-holding node: every
unfinished leaf, or only the expanded parents with replayed leaves), step tokens and wall time. Strategies run
interleaved, problem by problem, so that load changes on a shared machine hit them alike.
Prints the device, CPU flags and the policy, then a table; JSON and a PNG (accuracy against peak memory) in
benchmarks/results/<machine kind>/.

Two settings (--setting):
- easy: two-operation problems and a 1.6M policy trained on them (arith-policy): nearly every strategy solves
  nearly everything;
- hard: four-operation problems (longer solutions, so errors compound) and a 0.7M policy trained briefly on two to
  five operations (arith-policy-hard): the strategies separate.

    python -m benchmarks.tree_search.arithmetic_search                 # easy: 40 two-operation problems, width 8
    python -m benchmarks.tree_search.arithmetic_search --setting hard  # 40 four-operation problems
    python -m benchmarks.tree_search.arithmetic_search --problems 10 --width 4
    python -m benchmarks.tree_search.arithmetic_search --width 16 --strategies "sync beam" "sync beam (CD)" \
        "spec beam (EP)" "spec beam (EP+CD)"
    python -m benchmarks.tree_search.arithmetic_search --setting hard --strategies rebase \
        "ets (lb=6, ld=1, replay)" --together 1 4 16  # several problems per batch: throughput against batch memory

The policies were trained on solutions whose step lines are shown worked (longer) half of the time, so their steps
vary in length within a level, as reasoning steps do: the case speculative execution is for.

Every strategy generates its steps on batched rows (stree.search.batched.StepDecoder: one forward pass per token
for all live trajectories' branches of a problem). The "sync beam" and "spec beam" rows are strategy "spec_beam"
(stree.search.strategies.spec_beam: k = 2 kept, each survivor expanded into width/2 children, synchronous or
speculative); the "beam" row is the level-synchronous beam of the other strategies (k = sqrt(width)). Throughput is
problems/s and decoded row-tokens/s (step tok: tokens the decoder drew and fed, after dedup; replayed leaves' tokens
not included), verifier = requests scored per problem, passes = batched forward passes per problem, critical
(spec_beam rows) = the tokens on the longest chain of surviving steps, the fewest passes any schedule that selects
the same survivors could take (one token per row per pass): synchronous passes / critical bounds what speculation
can save in passes while keeping synchronous beam's survivors. Memory: peak tree KiB is
TreeMemory's model (what a prefix-sharing tree keeps), peak held KiB what the row engine really kept (the padded
batch, every row with its own copy of its prefix, plus every live snapshot).
"""
import argparse
import os
import random
import tempfile
import time

import torch
import transformers

from benchmarks.common import device_line, machine_info, results_path, write_json
from stree.distill import TokenChunks, TrainConfig, Trainer
from stree.search import BeamOptions, SearchConfig, tree_search, tree_search_batch
from stree.search.arithmetic import CharTokenizer, check_step, extract_answer, make_problems

HERE = os.path.dirname(os.path.abspath(__file__))
POLICY_CONFIG = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=4, attn_layer_indices=[1, 3],
                     num_attention_heads=6, num_key_value_heads=2, mamba_n_heads=6, mamba_d_head=64,
                     mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                     max_position_embeddings=1024, tie_word_embeddings=True)
SETTINGS = {  # problems to solve and the policy (trained once, shipped in assets/ beside this file; --retrain)
    # two operations; a 1.6M policy trained on two-operation solutions: most strategies solve nearly everything
    "easy": dict(ops=2, policy="arith-policy", config=POLICY_CONFIG, train_ops=(2,), train_steps=2500, chunk=192),
    # four operations (longer solutions: errors compound); a 0.7M policy trained briefly on 2-5 operations
    "hard": dict(ops=4, policy="arith-policy-hard", train_ops=(2, 3, 4, 5), train_steps=1500, chunk=384,
                 config=dict(POLICY_CONFIG, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                             mamba_n_heads=4)),
}
STRATEGY_RUNS = {  # name -> SearchConfig overrides
    "best_of_n": dict(strategy="best_of_n"),
    "beam": dict(strategy="beam"),
    "dvts": dict(strategy="dvts"),
    "rebase": dict(strategy="rebase"),
    "ets (lb=1, ld=1)": dict(strategy="ets", lambda_b=1.0, lambda_d=1.0),  # ETS as its authors wrote it: unit costs
    "ets (lb=2, ld=1)": dict(strategy="ets", lambda_b=2.0, lambda_d=1.0),
    "rebase (replay)": dict(strategy="rebase", leaf_states="replay"),
    "ets (lb=1, ld=1, replay)": dict(strategy="ets", lambda_b=1.0, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=1.5, ld=1, replay)": dict(strategy="ets", lambda_b=1.5, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=2, ld=1, replay)": dict(strategy="ets", lambda_b=2.0, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=3, ld=1, replay)": dict(strategy="ets", lambda_b=3.0, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=4, ld=1, replay)": dict(strategy="ets", lambda_b=4.0, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=6, ld=1, replay)": dict(strategy="ets", lambda_b=6.0, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=8, ld=1, replay)": dict(strategy="ets", lambda_b=8.0, lambda_d=1.0, leaf_states="replay"),
    # stree's extensions: the node term in bytes (TreeMemory), softmax outcome weights
    "ets bytes (lb=1.5, ld=1, replay)": dict(strategy="ets", lambda_b=1.5, lambda_d=1.0, leaf_states="replay",
                                             ets_costs="bytes"),
    "ets bytes (lb=2, ld=1, replay)": dict(strategy="ets", lambda_b=2.0, lambda_d=1.0, leaf_states="replay",
                                           ets_costs="bytes"),
    "ets softmax (lb=2, ld=1, replay)": dict(strategy="ets", lambda_b=2.0, lambda_d=1.0, leaf_states="replay",
                                             ets_weights="softmax"),
}
SPEC_BEAM = dict(strategy="spec_beam", beam_width=2)  # k = 2 kept, width/k children each


def spec_beam(dedup=True, **options):
    return dict(SPEC_BEAM, dedup=dedup, spec_beam=BeamOptions(**options))


STRATEGY_RUNS.update({  # strategy "spec_beam" (stree.search.beam); CD = dedup, EP = early pruning, LV = lazy
    # verification, SC = its sibling-completion flush; "ties: first" = SpecScale's literal perfect-score stop
    # (perfect_ties="first_verified"; the others are exact: the same survivors as synchronous beam)
    "sync beam": spec_beam(dedup=False),
    "sync beam (CD)": spec_beam(),
    "spec beam (naive)": spec_beam(dedup=False, speculative=True),
    "spec beam (EP)": spec_beam(dedup=False, speculative=True, early_pruning=True),
    "spec beam (EP+CD)": spec_beam(speculative=True, early_pruning=True),
    "spec beam (EP+CD, ties: first)": spec_beam(speculative=True, early_pruning=True, perfect_ties="first_verified"),
    "spec beam (EP+CD+LV)": spec_beam(speculative=True, early_pruning=True, lazy_verification=True),
    "spec beam (EP+CD+LV+SC)": spec_beam(speculative=True, early_pruning=True, lazy_verification=True,
                                         verify_sibling_completion=True),
})


def train_policy(tokenizer, setting, steps, worked, seed=0, path=None):
    """Train a setting's policy on 40000 generated problems and their solutions (problems seeded apart from the test
    set; the setting's train_ops operation counts in turn), each step line shown worked (longer) with probability
    `worked`: the policy's steps then vary in length. Saved in float16 to `path` (default: the setting's asset)."""
    stream, rng = [], random.Random(seed)
    for k, ops in enumerate(setting["train_ops"]):
        for problem in make_problems(40000 // len(setting["train_ops"]), seed=1000 + seed + k, steps=ops):
            solution = "".join(problem.solution(rng, worked=worked))
            stream += tokenizer.encode(problem.text + solution) + [tokenizer.eos_token_id]
    stream = _shuffle_problems(stream, tokenizer.eos_token_id, rng) if len(setting["train_ops"]) > 1 else stream
    config = transformers.BambaConfig(vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=0, pad_token_id=0,
                                      **setting["config"])
    policy = transformers.BambaForCausalLM(config)
    Trainer(policy, TrainConfig(output_dir=tempfile.mkdtemp(prefix="arith-policy-"), steps=steps,
                                batch_size=16, lr=3e-3, warmup=50, losses={"cross_entropy": 1.0}, seed=seed),
            TokenChunks(torch.tensor(stream), setting["chunk"])).train()
    policy.to(torch.float16).save_pretrained(path or os.path.join(HERE, "assets", setting["policy"]),
                                             safe_serialization=True)


def _shuffle_problems(stream, eos, rng):
    """The stream's problems (each ending in eos) in a random order, so every batch mixes operation counts."""
    problems, start = [], 0
    for i, token in enumerate(stream):
        if token == eos:
            problems.append(stream[start:i + 1])
            start = i + 1
    rng.shuffle(problems)
    return [token for problem in problems for token in problem]


def _verifier(tokenizer, problem):
    def verifier(prompt, steps):
        texts = [tokenizer.decode(s) for s in steps]
        return check_step(problem, texts[:-1], texts[-1])
    return verifier


def _config(tokenizer, max_steps, overrides, width, seed, temperature):
    # 48 characters: longer than any step line, worked ones included (at most 44 with values below 1000)
    return SearchConfig(width=width, max_steps=max_steps, step_delimiter_ids=(tokenizer.newline_id,),
                        eos_token_ids=(tokenizer.eos_token_id,), step_max_tokens=48, seed=seed,
                        temperature=temperature, **overrides)


def solve(policy, tokenizer, problem, index, overrides, width, seed, temperature):
    """One search on one problem (problem `index` of the run, which seeds it): whether its answer is right, its stats
    and its wall time."""
    config = _config(tokenizer, len(problem.ops) + 2, overrides, width, seed + index, temperature)
    start = time.perf_counter()
    result = tree_search(policy, tokenizer.encode(problem.text), _verifier(tokenizer, problem), config,
                         answer_fn=lambda t: extract_answer(tokenizer.decode(t)))
    return result.answer == problem.results()[-1], result.stats, time.perf_counter() - start


def solve_together(policy, tokenizer, problems, first, overrides, width, seed, temperature):
    """Problems first, first + 1, ... of the run searched in one batch (tree_search_batch; each seeded as solve
    seeds it alone, so the answers are the same): whether each answer is right, and the batch's peak held bytes
    and wall time."""
    if len({len(p.ops) for p in problems}) > 1:
        raise ValueError("problems searched together share one max_steps: give them one operation count")
    config = _config(tokenizer, len(problems[0].ops) + 2, overrides, width, seed, temperature)
    start = time.perf_counter()
    results = tree_search_batch(policy, [tokenizer.encode(p.text) for p in problems],
                                [_verifier(tokenizer, p) for p in problems], config,
                                answer_fn=lambda t: extract_answer(tokenizer.decode(t)),
                                seeds=[seed + first + i for i in range(len(problems))])
    seconds = time.perf_counter() - start
    return ([r.answer == p.results()[-1] for r, p in zip(results, problems)],
            max(r.stats["peak_held_bytes"] for r in results), seconds)


def run_together(policy, tokenizer, problems, names, width, seed, temperature, together):
    """Every strategy in `names`, the problems `together` at a time, interleaved batch by batch: one row per
    (strategy, together) with accuracy, the mean over batches of a batch's peak held KiB, and problems/s."""
    rows = []
    for count in together:
        runs = {name: [] for name in names}
        for first in range(0, len(problems), count):
            for name in names:
                runs[name].append(solve_together(policy, tokenizer, problems[first:first + count], first,
                                                 STRATEGY_RUNS[name], width, seed, temperature))
        for name in names:
            correct = [c for answers, _, _ in runs[name] for c in answers]
            elapsed = sum(seconds for *_, seconds in runs[name])
            rows.append(dict(strategy=name, together=count, accuracy=sum(correct) / len(correct),
                             peak_batch_held_kib=sum(held for _, held, _ in runs[name]) / len(runs[name]) / 1024,
                             problems_per_s=len(correct) / elapsed))
    return rows


def run(policy, tokenizer, problems, names, width, seed, temperature):
    """Every strategy in `names` on every problem, interleaved problem by problem so that load changes on a shared
    machine hit all strategies alike; one row per strategy."""
    runs = {name: [] for name in names}
    for i, problem in enumerate(problems):
        for name in names:
            runs[name].append(solve(policy, tokenizer, problem, i, STRATEGY_RUNS[name], width, seed, temperature))
    return [summary(name, runs[name]) for name in names]


def summary(name, runs):
    """A strategy's row: accuracy, mean peak retained-tree bytes, and per-problem and per-second work."""
    count, elapsed = len(runs), sum(seconds for *_, seconds in runs)

    def mean(key):
        return sum(stats[key] for _, stats, _ in runs) / count

    tokens = mean("step_tokens")
    return dict(strategy=name, accuracy=sum(correct for correct, *_ in runs) / count,
                peak_tree_kib=mean("peak_tree_bytes") / 1024, peak_held_kib=mean("peak_held_bytes") / 1024,
                step_tokens=tokens, replay_tokens=mean("replay_tokens"), seconds=elapsed / count,
                problems_per_s=count / elapsed, tokens_per_s=tokens * count / elapsed,
                verifier_calls=mean("verifier_calls"), forward_passes=mean("forwards"),
                # spec_beam: the fewest passes any schedule selecting the same survivors needs (its longest chain)
                critical_path=mean("critical_path") if "critical_path" in runs[0][1] else None)


def _figure():
    """(figure, axes) of a 6 x 4 inch plot on matplotlib's Agg backend, or None (with a message) without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return None
    return plt.subplots(figsize=(6, 4))


def _save(fig, png):
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def write_results(out, machine, args, ops, rows):
    """The rows, the run's settings and the machine as JSON at `out`."""
    write_json(out, dict(machine, setting=args.setting, ops=ops, problems=args.problems, width=args.width,
                         temperature=args.temperature, rows=rows))
    print(f"wrote {out}")


def plot_accuracy(rows, png):
    """Accuracy against peak retained-tree memory, one point per strategy."""
    figure = _figure()
    if figure is None:
        return
    fig, ax = figure
    for r in rows:
        ax.scatter(r["peak_tree_kib"], r["accuracy"])
        ax.annotate(r["strategy"], (r["peak_tree_kib"], r["accuracy"]), fontsize=8)
    ax.set_xlabel("peak retained tree (KiB)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    _save(fig, png)


def plot_together(rows, png):
    """Problems/s against the batch's peak held memory, one line per strategy over the batch sizes."""
    figure = _figure()
    if figure is None:
        return
    fig, ax = figure
    for name in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == name]
        ax.plot([r["peak_batch_held_kib"] for r in mine], [r["problems_per_s"] for r in mine], marker="o", label=name)
        for r in mine:
            ax.annotate(str(r["together"]), (r["peak_batch_held_kib"], r["problems_per_s"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("peak held memory of a batch (KiB); labels: problems per batch")
    ax.set_ylabel("problems / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, png)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=list(SETTINGS), default="easy",
                        help="easy: two-operation problems, the 1.6M policy; hard: four operations, the 0.7M policy")
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--ops", type=int, help="operations per problem (default: the setting's)")
    parser.add_argument("--train-steps", type=int, help="--retrain: optimiser steps (default: the setting's)")
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--worked", type=float, default=0.5,
                        help="--retrain: share of training step lines shown worked (longer)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGY_RUNS), choices=list(STRATEGY_RUNS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="the policy's sampling temperature")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<machine kind>/arithmetic-search-"
                        "<setting>[-w<width>][-together].json; the PNG goes beside it)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--together", type=int, nargs="+",
                        help="search the problems this many at a time in one batch (stree.search.tree_search_batch), "
                             "for each count given: throughput against the batch's peak memory")
    return parser.parse_args(argv)


def default_name(args):
    """e.g. arithmetic-search-hard.json, arithmetic-search-easy-w16.json, arithmetic-search-hard-together.json."""
    width = f"-w{args.width}" if args.width != 8 else ""
    return f"arithmetic-search-{args.setting}{width}{'-together' if args.together else ''}.json"


def load_policy(tokenizer, setting, args):
    """The setting's shipped policy (trained first when --retrain or missing), float32, eval mode."""
    policy_dir = os.path.join(HERE, "assets", setting["policy"])
    if args.retrain or not os.path.exists(os.path.join(policy_dir, "model.safetensors")):
        train_policy(tokenizer, setting, args.train_steps or setting["train_steps"], args.worked, args.seed)
    return transformers.AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()


def print_together(rows):
    print(f"{'strategy':>32} {'together':>9} {'accuracy':>9} {'batch held KiB':>15} {'problems/s':>11}")
    for r in rows:
        print(f"{r['strategy']:>32} {r['together']:>9} {r['accuracy']:>9.3f} {r['peak_batch_held_kib']:>15.1f} "
              f"{r['problems_per_s']:>11.2f}")


def print_rows(rows):
    print(f"{'strategy':>32} {'accuracy':>9} {'tree KiB':>9} {'held KiB':>9} {'step tok':>9} {'s/problem':>10} "
          f"{'problems/s':>10} {'tok/s':>8} {'verifier':>9} {'passes':>7} {'critical':>9}")
    for r in rows:
        critical = "" if r["critical_path"] is None else format(r["critical_path"], ".1f")
        print(f"{r['strategy']:>32} {r['accuracy']:>9.3f} {r['peak_tree_kib']:>9.1f} {r['peak_held_kib']:>9.1f} "
              f"{r['step_tokens']:>9.1f} {r['seconds']:>10.3f} {r['problems_per_s']:>10.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['verifier_calls']:>9.1f} {r['forward_passes']:>7.1f} {critical:>9}")


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    setting = SETTINGS[args.setting]
    ops = args.ops or setting["ops"]
    tokenizer = CharTokenizer()
    policy = load_policy(tokenizer, setting, args)
    problems = make_problems(args.problems, seed=args.seed, steps=ops)  # training problems use seeds 1000+
    machine = machine_info("cpu")
    print(device_line(machine))
    params = sum(p.numel() for p in policy.parameters())
    print(f"{args.setting} setting: policy {setting['policy']} {params / 1e6:.2f}M params (bamba, "
          f"{policy.config.num_hidden_layers} layers); {args.problems} problems of {ops} operations, width "
          f"{args.width}, temperature {args.temperature}")
    run(policy, tokenizer, problems[:1], args.strategies[:1], args.width, args.seed, args.temperature)  # warm-up
    if args.together:
        rows = run_together(policy, tokenizer, problems, args.strategies, args.width, args.seed, args.temperature,
                            args.together)
        print_together(rows)
    else:
        rows = run(policy, tokenizer, problems, args.strategies, args.width, args.seed, args.temperature)
        print_rows(rows)
    out = args.out or results_path(machine, default_name(args))
    write_results(out, machine, args, ops, rows)
    (plot_together if args.together else plot_accuracy)(rows, os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
