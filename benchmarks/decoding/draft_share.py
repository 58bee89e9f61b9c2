"""How small can the draft's share of a round get? The bundled pair's draft pass against a floor.

A round drafts p levels (one draft pass each) and verifies them in one target pass, so the draft's share of a round
is about p·d / (p·d + V) for a draft pass of d seconds and a target pass of V. This script measures, in one run:
  stree level    one level of drafting as stree.generate runs it: the draft's pass over a level's expanded nodes
                 (TreeModel.extend), then scores, log-softmax, top-k and the copy to the host (stree.drafting);
  floor level    the same work written by hand as a plain batched single-token step through the draft's own modules
                 (embedding, norm, in_proj, conv and SSM state updates, gated norm, out_proj, final norm, LM head,
                 top-k), one row per expanded node, each from its own state: what any eager engine has to run for a
                 level, with no tree bookkeeping at all (checked against HF's own forward before it is timed);
  target pass    the target's pass over a tree of `--nodes` nodes (what verifies a round), and its one-node pass;
  cold trunk     the trunk pass right after a target pass, as a round's first draft pass runs (the target's pass
                 pushes the draft's weights out of the CPU's caches: timed as both minus the target pass alone);
and prints the share a round of p draft levels would have with either (p from 1 to 6; the default adaptive tree
drafts 2-5 levels a round on the bundled pair), then the measured shares of stree.generate's default tree and of
DynamicTree(16) on held-out prompts. Medians of interleaved repeats. Prints the device, CPU flags and the pair's
shapes, then the tables; writes JSON.

    python -m benchmarks.decoding.draft_share                      # the bundled pair, float32
    python -m benchmarks.decoding.draft_share --dtype bfloat16
    python -m benchmarks.decoding.draft_share --dtype bfloat16 --large --repeats 15 --prompts 2   # the 0.9B pair
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import stree
from benchmarks.common import SHORT_DTYPES, device_line, machine_info, model_shape, results_path, write_json
from benchmarks.decoding.pairs import PAIRS, inflate_pair, pair_tag
from stree.demo import demo_pair, held_out_prompts
from stree.drafting import draft_tree
from stree.models import TreeModel
from stree.sampling import Sampler


def hand_step(draft, tokens, conv, ssm):
    """One decoding step of a Mamba2 draft for a batch of rows, written out by hand: tokens (E,) ints, conv
    (E, layers, conv_dim, K) and ssm (E, layers, heads, head_dim, d_state) the rows' states (updated in place).
    Returns logits (E, vocab). HF's decode path, without its wrappers (cache objects, masks, output classes)."""
    hidden = draft.backbone.embeddings(tokens)
    for j, block in enumerate(draft.backbone.layers):
        m = block.mixer
        H, P, N, G = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups
        I = m.intermediate_size
        gate, xbc, dt = m.in_proj(block.norm(hidden)).split([I, I + 2 * G * N, H], dim=-1)
        window = conv[:, j]
        window.copy_(torch.cat([window[:, :, 1:], xbc[:, :, None]], dim=-1))
        xbc = F.silu((window * m.conv1d.weight[:, 0]).sum(-1) + m.conv1d.bias)
        x, B, C = xbc.split([I, G * N, G * N], dim=-1)
        dt = F.softplus(dt + m.dt_bias)                                                     # (E, H)
        x = x.view(-1, H, P)
        B, C = (t.view(-1, G, 1, N).repeat_interleave(H // G, dim=1) for t in (B, C))       # (E, H, 1, N)
        state = ssm[:, j]
        state.mul_(torch.exp(dt * -torch.exp(m.A_log))[..., None, None]).add_((dt[..., None] * x)[..., None] * B)
        y = (state @ C.to(state.dtype).transpose(-1, -2))[..., 0].to(x.dtype) + m.D[:, None] * x  # (E, H, P)
        hidden = hidden + m.out_proj(m.norm(y.reshape(-1, I), gate))
    return draft.lm_head(draft.backbone.norm_f(hidden))


def committed_states(model):
    """A prefilled TreeModel's committed states, every layer stacked, as hand_step takes them: conv
    (batch, layers, conv_dim, K) and ssm (batch, layers, heads, head_dim, d_state), copies."""
    cache, layers = model.cache, range(model.config.num_hidden_layers)
    return (torch.stack([cache.conv[j] for j in layers], dim=1).clone(),
            torch.stack([cache.recurrent[j] for j in layers], dim=1).clone())


def check_hand_step(draft, prompt, token):
    """The hand-written step after HF's prefill of `prompt` gives HF's logits for prompt + [token] (up to 0.1% of the
    largest logit in fp32, 2% in bf16, where HF's whole-sequence scan rounds differently from a step)."""
    with torch.no_grad():
        tm = TreeModel(draft)
        tm.prefill(prompt)
        got = hand_step(draft, torch.tensor([token]), *committed_states(tm))[0]
        want = draft(torch.cat([prompt, torch.tensor([[token]])], dim=1)).logits[0, -1]
    error = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if error > (1e-3 if draft.dtype == torch.float32 else 2e-2) * max(scale, 1.0):
        raise AssertionError(f"the hand-written step differs from HF's forward by {error:.2e} (logits up to {scale:.1f})")
    return error


def interleaved_median_ms(functions, repeats):
    """{name: median ms} of interleaved calls of each function."""
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, f in functions.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=3, help="expanded nodes per level (DynamicTree's frontier)")
    parser.add_argument("--nodes", type=int, default=17, help="target tree nodes, root included")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--large", nargs="?", const="0.9b", default=None, choices=list(PAIRS),
                        help="the pair inflated to a realistic size (benchmarks/decoding/pairs.py), draft included")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="with --large, the inflated draft's layer count instead of the pair's")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<machine kind>/draft-share[-<pair>]-<dtype>.json)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    target, draft, tokenizer = demo_pair(dtype=dtype)
    if args.large:
        target, draft = inflate_pair(target, draft, args.large, draft_layers=args.draft_layers)
    target.generation_config.eos_token_id = None
    prompts = held_out_prompts(tokenizer, args.prompts, 32)
    machine = machine_info("cpu")
    print(device_line(machine) + f"; {args.dtype}")
    print(f"draft: {model_shape(draft)}; target: {model_shape(target)}")
    print(f"a level expands {args.rows} nodes, the target verifies {args.nodes}")
    error = check_hand_step(draft, prompts[0], 7)
    print(f"hand-written step vs HF's forward: max |logit difference| {error:.1e}")

    E, k = args.rows, 3
    draft_model, target_model = TreeModel(draft, nodes=32), TreeModel(target, nodes=32)
    draft_model.prefill(prompts[0], max_length=256)
    target_model.prefill(prompts[0], max_length=256)
    sampler = Sampler()
    level_spec = stree.StaticTree((E, k))  # the root's E children, then one level: top-k children of each
    conv, ssm = (t.expand(E, *t.shape[1:]).clone() for t in committed_states(draft_model))
    tokens = torch.arange(E) + 5

    @torch.no_grad()
    def stree_root():  # a trunk pass alone: the root's children
        draft_tree(draft_model, [5], stree.StaticTree((E,)), sampler, 0)
        draft_model.discard()

    @torch.no_grad()
    def stree_two_levels():
        draft_tree(draft_model, [5], level_spec, sampler, 0)
        draft_model.discard()

    @torch.no_grad()
    def floor_level():
        logits = hand_step(draft, tokens, conv, ssm)
        return logits.double().log_softmax(-1).topk(k, dim=-1).values.tolist()

    @torch.no_grad()
    def target_pass(n):
        def run():
            target_model.tree_forward([[5] * n], [[-1] + [0] * (n - 1)])[0, 0].tolist()
            target_model.discard()
        return run

    def target_then_root():  # as in a round: the target's pass has just pushed the draft out of the CPU's caches
        target_pass(args.nodes)()
        stree_root()

    for f in (stree_root, stree_two_levels, floor_level, target_pass(args.nodes), target_pass(1), target_then_root):
        for _ in range(5):
            f()
    ms = interleaved_median_ms({"stree root": stree_root, "stree root + level": stree_two_levels, "floor level": floor_level,
                    "target pass": target_pass(args.nodes), "target 1-node pass": target_pass(1),
                    "target pass, then stree root": target_then_root}, args.repeats)
    stree_level = ms["stree root + level"] - ms["stree root"]
    verify = ms["target pass"]
    cold_trunk = ms["target pass, then stree root"] - verify
    print(f"\n{'':>30} {'ms':>8} {'x floor':>8}")
    pass_ms = dict(stree_level=stree_level, floor_level=ms["floor level"], stree_trunk=ms["stree root"],
                   stree_trunk_after_target=cold_trunk, target_pass=verify, target_one_node=ms["target 1-node pass"])
    for label, value in (("stree level", stree_level), ("floor level", ms["floor level"]),
                         ("stree trunk pass", ms["stree root"]), ("stree trunk pass after target", cold_trunk),
                         (f"target {args.nodes}-node pass", verify), ("target 1-node pass", ms["target 1-node pass"])):
        print(f"{label:>30} {value:8.2f} {value / ms['floor level']:8.2f}")
    print("\ndraft share of a round of p levels, p·d / (p·d + target pass):")
    print(f"{'p':>4} {'stree':>8} {'floor':>8}")
    shares = []
    for p in range(1, 7):
        s, f = (p * d / (p * d + verify) for d in (stree_level, ms["floor level"]))
        shares.append(dict(levels=p, stree=s, floor=f))
        print(f"{p:>4} {s:8.1%} {f:8.1%}")

    measured = []
    print(f"\nmeasured rounds ({args.prompts} held-out prompts x {args.max_new_tokens} tokens):")
    print(f"{'tree':>22} {'tok/s':>7} {'tau':>5} {'levels':>7} {'draft ms':>9} {'verify ms':>10} {'share':>6}")
    for label, tree in (("default (adaptive)", stree.DynamicTree(adaptive=True)), ("DynamicTree(16)",
                                                                                   stree.DynamicTree(16))):
        totals = dict(tokens=0, seconds=0.0, draft=0.0, verify=0.0, rounds=0, passes=0)
        for prompt in prompts:
            _, stats = stree.generate(target, prompt, draft_model=draft, max_new_tokens=args.max_new_tokens,
                                      tree=tree, return_stats=True)
            totals["tokens"] += stats.new_tokens
            totals["seconds"] += stats.total_time - stats.prefill_time
            totals["draft"] += stats.draft_time
            totals["verify"] += stats.verify_time
            totals["rounds"] += stats.rounds
            totals["passes"] += stats.draft_passes
        decode = totals["seconds"]
        row = dict(tree=label, tokens_per_s=totals["tokens"] / decode, tau=totals["tokens"] / totals["rounds"],
                   levels_per_round=totals["passes"] / totals["rounds"],
                   draft_ms=1e3 * totals["draft"] / totals["rounds"],
                   verify_ms=1e3 * totals["verify"] / totals["rounds"], draft_share=totals["draft"] / decode)
        measured.append(row)
        print(f"{label:>22} {row['tokens_per_s']:7.1f} {row['tau']:5.2f} {row['levels_per_round']:7.2f} "
              f"{row['draft_ms']:9.2f} {row['verify_ms']:10.2f} {row['draft_share']:6.1%}")
    pair = pair_tag(args.large, True, args.draft_layers) if args.large else []
    out = args.out or results_path(machine, "-".join(["draft-share", *pair, SHORT_DTYPES[args.dtype]]) + ".json")
    write_json(out, dict(machine, dtype=args.dtype, rows_per_level=E, target_nodes=args.nodes, hand_step_error=error,
                         pass_ms=pass_ms, shares=shares, measured=measured))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
