"""Tree search on a verifiable task: generated arithmetic word problems (stree.search.arithmetic).

A small hybrid policy (Bamba: two Mamba2 and two attention layers, character-level) is trained with stree.distill's
Trainer on solution traces (once; saved under benchmarks/assets/arith-policy, rebuilt with --retrain). A program
checks every step and serves as the verifier. For each strategy at the same width: accuracy, mean peak retained-tree
bytes (stree.search.TreeMemory: attention K/V per node + one SSM snapshot per state-holding node: every
unfinished leaf, or only the expanded parents with replayed leaves), step tokens and wall time.
Table on stdout, JSON and a PNG (accuracy against peak memory) in benchmarks/results/.

    python benchmarks/search.py                       # 40 held-out two-operation problems, width 8
    python benchmarks/search.py --problems 10 --width 4
    python benchmarks/search.py --width 16 --strategies "sync beam" "sync beam (CD)" "spec beam (EP)" \
        "spec beam (EP+CD)" --out benchmarks/results/search-cpu-w16.json

The policy was trained on solutions whose step lines are shown worked (longer) half of the time, so its steps vary
in length within a level, as reasoning steps do: the case speculative execution is for.

Beam search on the batched step decoder (the "sync beam" and "spec beam" rows, stree.search.beam) keeps k = 2 and
expands each survivor into width/2 children; throughput is problems/s and decoded row-tokens/s (step tok: tokens the
decoder fed, i.e. after dedup), verifier = requests scored per problem, passes = model forward passes per problem
(batched: one per decode step; the sequential loop: one per step token).
"""
import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time

# Python puts this script's folder first on sys.path; there benchmarks/kernels.py would shadow the `kernels`
# package that transformers probes for when it is imported. Drop the folder first.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import transformers  # noqa: E402

from stree.distill import TokenChunks, TrainConfig, Trainer  # noqa: E402
from stree.search import SearchConfig, tree_search  # noqa: E402
from stree.search.arithmetic import CharTokenizer, check_step, extract_answer, make_problems  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
POLICY_DIR = os.path.join(HERE, "assets", "arith-policy")
POLICY_CONFIG = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=4, attn_layer_indices=[1, 3],
                     num_attention_heads=6, num_key_value_heads=2, mamba_n_heads=6, mamba_d_head=64,
                     mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                     max_position_embeddings=1024, tie_word_embeddings=True)
STRATEGY_RUNS = {  # name -> SearchConfig overrides
    "best_of_n": dict(strategy="best_of_n"),
    "beam": dict(strategy="beam"),
    "dvts": dict(strategy="dvts"),
    "rebase": dict(strategy="rebase"),
    "ets (lb=1, ld=1)": dict(strategy="ets", lambda_b=1.0, lambda_d=1.0),
    "ets (lb=2, ld=1)": dict(strategy="ets", lambda_b=2.0, lambda_d=1.0),
    "rebase (replay)": dict(strategy="rebase", leaf_states="replay"),
    "ets (lb=1, ld=1, replay)": dict(strategy="ets", lambda_b=1.0, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=1.5, ld=1, replay)": dict(strategy="ets", lambda_b=1.5, lambda_d=1.0, leaf_states="replay"),
    "ets (lb=2, ld=1, replay)": dict(strategy="ets", lambda_b=2.0, lambda_d=1.0, leaf_states="replay"),
}
BATCHED_BEAM = dict(strategy="beam", beam_width=2, batched=True)  # k = 2 kept, width/k children each
STRATEGY_RUNS.update({  # beam search on the batched step decoder (stree.search.beam)
    "sync beam": dict(BATCHED_BEAM, dedup=False),
    "sync beam (CD)": dict(BATCHED_BEAM),
    "spec beam (naive)": dict(BATCHED_BEAM, speculative=True, dedup=False),
    "spec beam (EP)": dict(BATCHED_BEAM, speculative=True, early_pruning=True, dedup=False),
    "spec beam (EP+CD)": dict(BATCHED_BEAM, speculative=True, early_pruning=True),
    "spec beam (EP+CD+LV)": dict(BATCHED_BEAM, speculative=True, early_pruning=True, lazy_verification=True),
})


def train_policy(tokenizer, steps, ops, worked, seed=0):
    """Train the policy on 40000 generated problems and their solutions (problems seeded apart from the test set),
    each step line shown worked (longer) with probability `worked`: the policy's steps then vary in length."""
    stream, rng = [], random.Random(seed)
    for problem in make_problems(40000, seed=1000 + seed, steps=ops):
        solution = "".join(problem.solution(rng, worked=worked))
        stream += tokenizer.encode(problem.text + solution) + [tokenizer.eos_token_id]
    config = transformers.BambaConfig(vocab_size=len(tokenizer), eos_token_id=0, bos_token_id=0, pad_token_id=0,
                                      **POLICY_CONFIG)
    policy = transformers.BambaForCausalLM(config)
    Trainer(policy, TrainConfig(output_dir=tempfile.mkdtemp(prefix="arith-policy-"), steps=steps,
                                batch_size=16, lr=3e-3, warmup=50, losses={"cross_entropy": 1.0}, seed=seed),
            TokenChunks(torch.tensor(stream), 192)).train()
    policy.to(torch.float16).save_pretrained(POLICY_DIR, safe_serialization=True)


def run(policy, tokenizer, problems, name, overrides, width, seed, temperature):
    correct, peaks, tokens, elapsed, calls, passes = 0, [], 0, 0.0, 0, 0
    for i, problem in enumerate(problems):
        def verifier(prompt, steps, problem=problem):
            texts = [tokenizer.decode(s) for s in steps]
            return check_step(problem, texts[:-1], texts[-1])

        # 48 characters: longer than any step line, worked ones included (at most 44 with values below 1000)
        config = SearchConfig(width=width, max_steps=len(problem.ops) + 2, step_delimiter_ids=(tokenizer.newline_id,),
                              eos_token_ids=(tokenizer.eos_token_id,), step_max_tokens=48, seed=seed + i,
                              temperature=temperature, **overrides)
        start = time.perf_counter()
        result = tree_search(policy, tokenizer.encode(problem.text), verifier, config,
                             answer_fn=lambda t: extract_answer(tokenizer.decode(t)))
        elapsed += time.perf_counter() - start
        correct += result.answer == problem.results()[-1]
        peaks.append(result.stats["peak_tree_bytes"])
        tokens += result.stats["step_tokens"]
        calls += result.stats["verifier_calls"]
        passes += result.stats.get("forwards", result.stats["step_tokens"])  # the sequential loop: a pass per token
    return dict(strategy=name, accuracy=correct / len(problems), peak_tree_kib=sum(peaks) / len(peaks) / 1024,
                step_tokens=tokens / len(problems), seconds=elapsed / len(problems),
                problems_per_s=len(problems) / elapsed, tokens_per_s=tokens / elapsed,
                verifier_calls=calls / len(problems), forward_passes=passes / len(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--ops", type=int, default=2, help="operations per problem")
    parser.add_argument("--train-steps", type=int, default=2500)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--worked", type=float, default=0.5,
                        help="--retrain: share of training step lines shown worked (longer)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGY_RUNS), choices=list(STRATEGY_RUNS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="the policy's sampling temperature")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/search-cpu.json; the PNG goes beside it)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = CharTokenizer()
    if args.retrain or not os.path.exists(os.path.join(POLICY_DIR, "model.safetensors")):
        train_policy(tokenizer, args.train_steps, args.ops, args.worked, args.seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(POLICY_DIR, dtype=torch.float32).eval()
    problems = make_problems(args.problems, seed=args.seed, steps=args.ops)  # training problems use seeds 1000+
    print(f"device: cpu ({platform.processor() or 'cpu'}), torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; policy {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M params "
          f"(bamba, {policy.config.num_hidden_layers} layers); {args.problems} problems, width {args.width}, "
          f"temperature {args.temperature}")
    run(policy, tokenizer, problems[:1], args.strategies[0], STRATEGY_RUNS[args.strategies[0]], args.width,
        args.seed, args.temperature)  # warm-up (lazy initialisation), untimed
    rows = [run(policy, tokenizer, problems, name, STRATEGY_RUNS[name], args.width, args.seed, args.temperature)
            for name in args.strategies]
    print(f"{'strategy':>20} {'accuracy':>9} {'peak KiB':>9} {'step tok':>9} {'s/problem':>10} {'problems/s':>10} "
          f"{'tok/s':>8} {'verifier':>9} {'passes':>7}")
    for r in rows:
        print(f"{r['strategy']:>20} {r['accuracy']:>9.3f} {r['peak_tree_kib']:>9.1f} {r['step_tokens']:>9.1f} "
              f"{r['seconds']:>10.3f} {r['problems_per_s']:>10.2f} {r['tokens_per_s']:>8.0f} {r['verifier_calls']:>9.1f} "
              f"{r['forward_passes']:>7.1f}")
    out = args.out or os.path.join(HERE, "results", "search-cpu.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(problems=args.problems, width=args.width, temperature=args.temperature, rows=rows), f, indent=1)
    print(f"wrote {out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["peak_tree_kib"], r["accuracy"])
        ax.annotate(r["strategy"], (r["peak_tree_kib"], r["accuracy"]), fontsize=8)
    ax.set_xlabel("peak retained tree (KiB)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.splitext(out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
