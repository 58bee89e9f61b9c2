"""What the Mamba1 and Gated DeltaNet tree passes keep per node, measured: one layer at a real model's shape, a draft
round (a root pass, then one extend per level: 3, then 9 nodes, DynamicTree's default shape) and a target pass (a whole
17-node tree of depth 6 in one pass), for each way of getting the new nodes' outputs:

    Mamba1 (Jamba-like, dim 8192, N 16)
      kept states  every node's state in a per-slot buffer; a pass walks only its new nodes from their parents'
                   (stree.triton_kernels.tree_selective_rows, what Mamba1Layers runs)
      recompute    the node-form op over every node from the committed state, outputs of the new rows
                   (tree_selective_scan(..., rows=new)); nothing kept but the inputs
    Gated DeltaNet (Qwen3.5-like, Hk 16, Hv 32, Dk = Dv 128)
      UT form      the tree's closed form: k, g and the delta writes u kept per node, the new rows solved by
                   forward substitution (stree.triton_kernels.tree_gated_delta_rows, what GatedDeltaLayers runs)
      kept states  every node's (Hv, Dk, Dv) state kept; a pass walks only its new nodes
      recompute    the node-form op over every node (tree_gated_delta_rule(..., rows=new)): the UT form from
                   fresh buffers each pass

Prints the device, the layer shapes and a table of milliseconds per pass (median of --reps) and the memory each way
keeps per node and layer; writes JSON. CPU or CUDA, fp32; --backend picks the package ops' backend (auto: Triton on
CUDA).

    python -m benchmarks.scan_kernels.recurrent_trees [--device cuda] [--reps 5] [--backend auto] [--out PATH]
"""
import argparse

import torch

from benchmarks.common import device_line, machine_info, median_ms, results_path, write_json
from stree.triton_kernels import (TreeIndex, tree_gated_delta_rows, tree_gated_delta_rule, tree_selective_rows,
                                  tree_selective_scan)

DRAFT = [1, 3, 9, 9, 9, 9]               # nodes per pass of a draft round (DynamicTree): root, then a level each
TARGET_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 10, 11, 13, 14]  # 17 nodes, depth 6
MAMBA1_SHAPE = dict(dim=8192, dstate=16)                                  # Jamba-v0.1's Mamba1 layer
GATED_DELTA_SHAPE = dict(key_heads=16, value_heads=32, head_dim=128)      # Qwen3.5's Gated DeltaNet layer


def draft_tree(slots):
    """Parents of a draft round's tree (each level: 9 children of the previous level's first 3 nodes) over `slots`."""
    parents, level = [-1], [0]
    for width in DRAFT[1:]:
        new = [level[i // 3] for i in range(width)]
        level = list(range(len(parents), len(parents) + width))
        parents += new
    return parents + [-1] * (slots - len(parents))


def delta_update(S, k, v, decay, beta):
    """S (n, H, Dk, Dv) parents' states -> decay * S + k ⊗ beta (v - (decay * S)ᵀ k): one delta-rule step per node.
    k (n, H, Dk); v (n, H, Dv); decay, beta (n, H)."""
    S = S * decay[..., None, None]
    return S + k[..., None] * ((v - torch.matmul(k[..., None, :], S)[..., 0, :]) * beta[..., None])[..., None, :]


def levels_of(parents, rows):
    """rows' positions grouped by level among the rows (HostTree.levels for one tree)."""
    level, where = {}, {r: p for p, r in enumerate(rows)}
    for p, r in enumerate(rows):
        level[p] = level[where[parents[r]]] + 1 if parents[r] in where else 0
    return [torch.tensor([p for p in level if level[p] == d]) for d in range(max(level.values()) + 1)]


def passes(parents_list, schedule):
    """The passes of a schedule: (rows tensor, its level positions)."""
    out, start = [], 0
    for width in schedule:
        rows = list(range(start, start + width))
        out.append((torch.tensor(rows), levels_of(parents_list, rows)))
        start += width
    return out


def mamba1(device, reps, backend):
    dim, N, slots = MAMBA1_SHAPE["dim"], MAMBA1_SHAPE["dstate"], 64
    g = torch.Generator().manual_seed(0)
    A = -torch.rand(dim, N, generator=g).add_(0.5).to(device)
    rows_by_case = {"draft round": (draft_tree(slots), DRAFT), "target pass": (TARGET_PARENTS + [-1] * (
        slots - len(TARGET_PARENTS)), [len(TARGET_PARENTS)])}
    results = {}
    for case, (parents_list, schedule) in rows_by_case.items():
        parents = torch.tensor([parents_list], device=device)
        index = TreeIndex(parents)
        x, dt = (torch.randn(1, slots, dim, generator=g).to(device) for _ in range(2))
        B, C = (torch.randn(1, slots, N, generator=g).to(device) for _ in range(2))
        dt = torch.nn.functional.softplus(dt)
        h0 = torch.randn(1, dim, N, generator=g).to(device)
        states = torch.zeros(1, slots + 1, 1, dim, N, device=device)
        plan = [(rows.to(device), [lv.to(device) for lv in levels]) for rows, levels in passes(parents_list, schedule)]

        def kept():
            states[:, slots, 0] = h0
            for rows, levels in plan:
                h = tree_selective_rows(states, index, rows, dt[:, rows, None], B[:, rows, None], x[:, rows, None],
                                        A[None], levels=levels, backend=backend, validate=False)
                torch.matmul(h[:, :, 0], C[:, rows, :, None])

        def recompute():
            for rows, _ in plan:
                tree_selective_scan(x, dt, A, B, C, index, initial_states=h0, rows=rows, backend=backend)

        results[case] = {"kept states": median_ms(kept, device, reps) / len(plan),
                         "recompute": median_ms(recompute, device, reps) / len(plan)}
    memory = {"kept states": dim * N * 4 + dim * 2, "recompute": dim * 4 * 2 + N * 4 * 2}
    return results, memory


def gated_delta(device, reps, backend):
    Hk, Hv, D = (GATED_DELTA_SHAPE[k] for k in ("key_heads", "value_heads", "head_dim"))
    slots = 64
    g = torch.Generator().manual_seed(1)
    results = {}
    for case, (parents_list, schedule) in {"draft round": (draft_tree(slots), DRAFT), "target pass": (
            TARGET_PARENTS + [-1] * (slots - len(TARGET_PARENTS)), [len(TARGET_PARENTS)])}.items():
        parents = torch.tensor([parents_list], device=device)
        index = TreeIndex(parents)
        q, k = (torch.nn.functional.normalize(torch.randn(1, slots, Hk, D, generator=g), dim=-1).to(device)
                for _ in range(2))
        v = torch.randn(1, slots, Hv, D, generator=g).to(device)
        gates = -torch.rand(1, slots, Hv, generator=g).to(device)
        beta = torch.rand(1, slots, Hv, generator=g).to(device)
        S0 = torch.randn(1, Hv, D, D, generator=g).to(device) * 0.1
        plan = [(rows.to(device), [lv.to(device) for lv in levels]) for rows, levels in passes(parents_list, schedule)]
        keys, kept_g, updates = (torch.zeros(1, slots, *shape, device=device) for shape in ((Hk, D), (Hv,), (Hv, D)))
        states = torch.zeros(1, slots + 1, Hv, D, D, device=device)

        def ut_form():
            for rows, _ in plan:
                tree_gated_delta_rows(q[:, rows] * D ** -0.5, k[:, rows], v[:, rows], gates[:, rows], beta[:, rows],
                                      S0, index, rows, keys, kept_g, updates, backend=backend, validate=False)

        def kept_states():
            states[:, slots] = S0
            flat = states.view(slots + 1, Hv, D, D)
            up = torch.where(parents[0] >= 0, parents[0], slots)
            for rows, levels in plan:
                for level in levels:
                    nodes = rows[level]
                    S = delta_update(flat.index_select(0, up[nodes]), k[0, nodes].repeat_interleave(2, 1),
                                     v[0, nodes], gates[0, nodes].exp(), beta[0, nodes])
                    flat.index_copy_(0, nodes, S)
                    torch.matmul(q[0, nodes].repeat_interleave(2, 1)[:, :, None] * D ** -0.5, S)

        def recompute():
            for rows, _ in plan:
                tree_gated_delta_rule(q, k, v, gates, beta, index, initial_state=S0, use_qk_l2norm=False, rows=rows,
                                      backend=backend)

        results[case] = {"UT form": median_ms(ut_form, device, reps) / len(plan),
                         "kept states": median_ms(kept_states, device, reps) / len(plan),
                         "recompute": median_ms(recompute, device, reps) / len(plan)}
    memory = {"UT form": 4 * (Hk * D + Hv * D + Hv) + 2 * (2 * Hk * D + Hv * D),
              "kept states": 4 * Hv * D * D + 2 * (2 * Hk * D + Hv * D), "recompute": 2 * (2 * Hk * D + Hv * D) * 2}
    return results, memory


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<machine kind>/recurrent-trees.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    machine = machine_info(device)
    print(device_line(machine))
    print(f"fp32; ms per pass (draft round: {len(DRAFT)} passes of {DRAFT} nodes; target: one pass of "
          f"{len(TARGET_PARENTS)} nodes)")
    layers = []
    with torch.no_grad():
        for name, shape, run in (("Mamba1, Jamba-like layer", MAMBA1_SHAPE, mamba1),
                                 ("Gated DeltaNet, Qwen3.5-like layer", GATED_DELTA_SHAPE, gated_delta)):
            results, memory = run(device, args.reps, args.backend)
            print(f"\n{name}: " + ", ".join(f"{k} {v}" for k, v in shape.items()))
            print(f"{'method':<14}{'draft pass':>12}{'target pass':>13}{'kept per node':>16}")
            for method in memory:
                print(f"{method:<14}{results['draft round'][method]:>12.2f}{results['target pass'][method]:>13.2f}"
                      f"{memory[method] / 1024:>13.0f} KB")
            layers.append(dict(layer=name, shape=shape, ms_per_pass=results, bytes_per_node=memory))
    out = args.out or results_path(machine, "recurrent-trees.json")
    write_json(out, dict(machine, reps=args.reps, draft_nodes_per_pass=DRAFT, target_parents=TARGET_PARENTS,
                         layers=layers))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
