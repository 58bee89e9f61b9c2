"""Mamba1 over a tree: the masked closed form against the level-by-level recurrence, at real layer shapes.

The two exact ways to compute a Mamba1 (per-channel A) selective scan over a T-node tree:
  closed   the masked closed form, with s_i = sum of dt over path(i) (per channel):
               y_i[d] = sum_{k on path(i)} sum_n exp(A[d,n] (s_i[d] - s_k[d])) dt_k[d] x_k[d] B_k[n] C_i[n]
                        + sum_n exp(A[d,n] s_i[d]) h0[d,n] C_i[n] + D[d] x_i[d]
           O(T^2 dim N) work in a few large ops, chunked over dim so a (T, T, chunk, N) block stays ~16 MB;
  levels   stree.triton_kernels.tree_selective_scan (backend="torch"): the engine form (tree_selective_rows) over
           every node from fresh kept states, all nodes of one level at once from their parents' states, O(T dim N)
           work in `depth` sequential steps;
  step1    one HF-style single-token decode update (what the tree pass replaces), for scale.
Both tree methods are checked against each other before timing. Prints the device and CPU flags, the shapes and a
table (ms, fastest of interleaved repeats); writes JSON.

    python -m benchmarks.scan_kernels.selective_scan_methods [--threads 1] [--quick] [--out PATH]
"""
import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import device_line, machine_info, results_path, time_all, write_json
from stree import random_parents
from stree.triton_kernels import TreeIndex, tree_selective_scan

SHAPES = {"mamba-130m": 1536, "mamba-1.4b": 4096, "mamba-2.8b": 5120, "jamba": 8192}  # intermediate size
DSTATE = 16
TREE_SIZES = (1, 2, 4, 8, 16, 32)


def closed_form(x, dt, A, B, C, index, D, h0, chunk_elems=1 << 22):
    """The masked closed form (see the module docstring). Shapes as tree_selective_scan; dt processed."""
    batch, T, dim = x.shape
    N = A.shape[1]
    mask = index.mask
    s = torch.matmul(index.ancestors, dt)                                   # (batch, T, dim) path sums of dt
    u = dt * x
    y = torch.empty_like(x)
    chunk = max(1, chunk_elems // max(1, T * T * N))
    for lo in range(0, dim, chunk):
        c = slice(lo, lo + chunk)
        diff = (s[:, :, None, c] - s[:, None, :, c]).masked_fill_(~mask[..., None], 0.0)   # (b, i, k, d)
        w = torch.exp(diff[..., None] * A[c]).mul_(mask[..., None, None])                 # (b, i, k, d, n)
        w = w.mul_(B[:, None, :, None, :]).mul_(C[:, :, None, None, :]).sum(-1)           # (b, i, k, d)
        y[..., c] = torch.einsum("bikd,bkd->bid", w, u[..., c])
        y[..., c] += (torch.exp(s[..., c, None] * A[c]) * h0[:, None, c] * C[:, :, None, :]).sum(-1)
    return y + D * x


def make_case(dim, T, kind, generator):
    def rnd(*size, scale=1.0):
        return torch.randn(*size, generator=generator) * scale

    parents = torch.tensor([random_parents(T, generator, kind=kind, max_children=3 if kind == "random" else None)])
    return dict(x=rnd(1, T, dim), dt=rnd(1, T, dim, scale=0.5), A=-torch.rand(dim, DSTATE, generator=generator) - 0.5,
                B=rnd(1, T, DSTATE), C=rnd(1, T, DSTATE), D=rnd(dim), h0=rnd(1, dim, DSTATE), parents=parents)


def bench(dim, T, kind, generator):
    case = make_case(dim, T, kind, generator)
    index = TreeIndex(case["parents"])
    dt = F.softplus(case["dt"])
    args = [case[k] for k in ("x", "dt", "A", "B", "C")]
    kw = dict(D=case["D"], initial_states=case["h0"], dt_softplus=True, backend="torch")
    levels = lambda: tree_selective_scan(*args, index, **kw)
    closed = lambda: closed_form(case["x"], dt, case["A"], case["B"], case["C"], index, case["D"], case["h0"])
    err = (levels() - closed()).abs().max().item() / (closed().abs().max().item() + 1e-6)
    assert err < 1e-4, f"closed form and levels disagree: {err:.3g}"
    state = case["h0"].clone()

    def step1():  # HF's single-token update on one token
        d1 = dt[:, 0]
        state.copy_(state * torch.exp(d1[..., None] * case["A"]) + (d1[..., None] * case["B"][:, 0, None, :])
                    * case["x"][:, 0, :, None])
        return state @ case["C"][:, 0, :, None]

    times = time_all(dict(closed=closed, levels=levels, step1=step1), "cpu", min_time=0.3, min_reps=3)
    return dict(times, depth=int(index.depth.max()) + 1, rel_err=err)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="mamba-130m only, T in 1, 8, 32")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<machine kind>/selective-scan-methods.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shapes = {"mamba-130m": SHAPES["mamba-130m"]} if args.quick else SHAPES
    sizes = (1, 8, 32) if args.quick else TREE_SIZES
    machine = machine_info("cpu")
    print(device_line(machine))
    print("fp32, batch 1, dstate " + str(DSTATE) + "; intermediate size per shape: "
          + ", ".join(f"{name} {dim}" for name, dim in shapes.items()))
    print(f"{'shape':12} {'tree':6} {'T':>3} {'depth':>5} {'closed ms':>10} {'levels ms':>10} {'step1 ms':>9} "
          f"{'closed/levels':>13}")
    rows = []
    for name, dim in shapes.items():
        for kind in ("random", "chain"):
            for T in sizes:
                r = dict(shape=name, dim=dim, kind=kind, T=T, **bench(dim, T, kind, generator))
                rows.append(r)
                print(f"{name:12} {kind:6} {T:3d} {r['depth']:5d} {r['closed']:10.3f} {r['levels']:10.3f} "
                      f"{r['step1']:9.3f} {r['closed'] / r['levels']:13.2f}", flush=True)
    out = args.out or results_path(machine, "selective-scan-methods.json")
    write_json(out, dict(machine, dstate=DSTATE, rows=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
