"""Tree scan vs the ways an SSM can verify a token tree without it, at real Mamba2 layer shapes.

For each layer shape and tree size T, times in one run (fastest of interleaved repeats):
  tree_random  tree_scan over a random T-node tree (with an initial state, D, dt_bias, softplus)
  tree_chain   tree_scan over a T-node chain
  step1        one single-token state update (the decode step the tree replaces)
  seqT         T sequential single-token updates (per-node recurrence over the tree, as SGLang does)
  unrolled     every root-to-leaf path of the random tree as a batch row of an ordinary sequence scan
               (mamba_ssm's chunk scan when installed, else stree's scan over chains, which equals it)
  hf_chunk     HF's own chunked scan (transformers' mamba2_chunk_scan, the path HF's Mamba2 prefill takes) over
               T tokens: what an ordinary model pays to verify a T-token chain
  chunk_seq    (CUDA with mamba_ssm only) mamba_ssm's chunk scan over T tokens
CPU runs the PyTorch path, CUDA the Triton path (--backend overrides). Prints the device and CPU flags, the shapes
and a table of ratios; writes JSON. Layer shapes are stree.triton_kernels.aot.MODEL_SHAPES (plus "tiny", for smoke runs).

    python -m benchmarks.scan_kernels.tree_kernels            # three shapes, T in 1..128
    python -m benchmarks.scan_kernels.tree_kernels --quick    # one shape, a few T (smoke run)
"""
import argparse

import torch
import torch.nn.functional as F
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

from benchmarks.common import SHORT_DTYPES, device_line, machine_info, results_path, time_all, write_json
from stree import random_parents
from stree.triton_kernels import tree_scan
from stree.triton_kernels.aot import MODEL_SHAPES

# (nheads, headdim, dstate, ngroups) of one Mamba2 mixer.
SHAPES = {name: tuple(s[k] for k in ("nheads", "headdim", "dstate", "ngroups")) for name, s in MODEL_SHAPES.items()
          if "dstate" in s}
SHAPES["tiny"] = (2, 16, 16, 1)
DEFAULT_SHAPES = ("mamba2-130m", "mamba2-2.7b", "nemotron-h-8b")
TREE_SIZES = (1, 4, 8, 16, 32, 64, 128)


def make_layer(shape, batch, T, device, dtype, generator):
    nheads, headdim, dstate, ngroups = shape

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=generator) * scale).to(device, dtype)

    return dict(x=rnd(batch, T, nheads, headdim), dt=rnd(batch, T, nheads, scale=0.5),
                A=-torch.rand(nheads, generator=generator).add(0.5).to(device),
                B=rnd(batch, T, ngroups, dstate), C=rnd(batch, T, ngroups, dstate),
                D=torch.randn(nheads, generator=generator).to(device),
                dt_bias=torch.randn(nheads, generator=generator).to(device),
                h0=torch.randn(batch, nheads, headdim, dstate, generator=generator).to(device))


def decode_step_torch(state, x, dt, A, B, C, D, dt_bias):
    """One in-place Mamba2 decode step. state (b, H, P, N) fp32; x (b, H, P); dt (b, H); B, C (b, G, N)."""
    nheads = x.shape[1]
    dt = F.softplus(dt.float() + dt_bias)
    Bh = B.float().repeat_interleave(nheads // B.shape[1], dim=1)
    Ch = C.float().repeat_interleave(nheads // C.shape[1], dim=1)
    state.mul_(torch.exp(dt * A)[..., None, None]).add_((dt[..., None] * x.float())[..., None] * Bh[:, :, None, :])
    return (torch.einsum("bhpn,bhn->bhp", state, Ch) + D[:, None] * x.float()).to(x.dtype)


def decode_step_fn(device):
    """mamba_ssm's selective_state_update on CUDA when installed, else the torch step above."""
    if device.type == "cuda":
        try:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        except ImportError:
            return decode_step_torch, "torch"

        def step(state, x, dt, A, B, C, D, dt_bias):
            nheads, headdim, dstate = state.shape[1:]
            return selective_state_update(state, x, dt[..., None].expand(-1, -1, headdim),
                                          A[:, None, None].expand(nheads, headdim, dstate), B, C,
                                          D=D[:, None].expand(nheads, headdim),
                                          dt_bias=dt_bias[:, None].expand(nheads, headdim), dt_softplus=True)
        return step, "mamba_ssm"
    return decode_step_torch, "torch"


def mamba_chunk_scan_fn(device):
    if device.type != "cuda":
        return None
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return mamba_chunk_scan_combined


def leaf_paths(parents):
    """Every root-to-leaf path of a tree, as lists of node ids."""
    has_child = set(p for p in parents if p >= 0)
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    return paths


def bench_case(shape, T, batch, device, dtype, generator, backend="auto", min_time=1.0, min_reps=7):
    layer = make_layer(shape, batch, T, device, dtype, generator)
    parents_random = [random_parents(T, generator, max_children=3) for _ in range(batch)]
    chain = torch.arange(T, device=device).expand(batch, T) - 1
    kwargs = dict(D=layer["D"], dt_bias=layer["dt_bias"], dt_softplus=True, initial_states=layer["h0"],
                  backend=backend)
    scan_args = [layer[k] for k in ("x", "dt", "A", "B", "C")]
    step, step_impl = decode_step_fn(device)
    state = layer["h0"].clone()

    def one_step(i=0):
        return step(state, layer["x"][:, i], layer["dt"][:, i], layer["A"], layer["B"][:, i], layer["C"][:, i],
                    layer["D"], layer["dt_bias"])

    # Unrolled: row r of the batch holds path r (padded at the end; padding only costs time).
    paths = leaf_paths(parents_random[0])
    depth = max(len(p) for p in paths)
    index = torch.tensor([p + [p[-1]] * (depth - len(p)) for p in paths], device=device)
    unrolled = {k: layer[k][0][index] for k in ("x", "dt", "B", "C")}
    h0_rows = layer["h0"][:1].expand(len(paths), *layer["h0"].shape[1:]).contiguous()
    chunk_scan = mamba_chunk_scan_fn(device)

    def sequence_scan(x, dt, B, C, h0):
        """The ordinary scan over sequences: mamba_ssm's chunk scan when installed, else stree on chains."""
        if chunk_scan is not None:
            return chunk_scan(x, dt, layer["A"], B, C, chunk_size=256, D=layer["D"], dt_bias=layer["dt_bias"],
                              initial_states=h0, dt_softplus=True)
        rows, length = x.shape[:2]
        chains = torch.arange(length, device=device).expand(rows, length) - 1
        return tree_scan(x, dt, layer["A"], B, C, chains, D=layer["D"], dt_bias=layer["dt_bias"],
                         dt_softplus=True, initial_states=h0, backend=backend)

    parents = torch.tensor(parents_random, device=device)
    fns = {
        "tree_random": lambda: tree_scan(*scan_args, parents, **kwargs),
        "tree_chain": lambda: tree_scan(*scan_args, chain, **kwargs),
        "step1": one_step,
        "seqT": lambda: [one_step(i) for i in range(T)],
        "unrolled": lambda: sequence_scan(unrolled["x"], unrolled["dt"], unrolled["B"], unrolled["C"], h0_rows),
        "hf_chunk": lambda: mamba2_chunk_scan(*(layer[k] for k in ("x", "dt", "A", "B", "C")), chunk_size=256,
                                              D=layer["D"], dt_bias=layer["dt_bias"], initial_states=layer["h0"],
                                              dt_softplus=True),
    }
    if chunk_scan is not None:
        fns["chunk_seq"] = lambda: sequence_scan(layer["x"], layer["dt"], layer["B"], layer["C"], layer["h0"])
    with torch.inference_mode():
        times = time_all(fns, device, min_time=min_time, min_reps=min_reps)
    return times, dict(step_impl=step_impl, unrolled_rows=len(paths), unrolled_len=depth,
                       sequence_scan="mamba_ssm" if chunk_scan is not None else "stree-chain")


def ratios_of(times):
    """The tree scan's time over each other way's, from bench_case's times."""
    ratios = {"tree_over_step1": times["tree_random"] / times["step1"],
              "chain_over_step1": times["tree_chain"] / times["step1"],
              "tree_over_seqT": times["tree_random"] / times["seqT"],
              "tree_over_unrolled": times["tree_random"] / times["unrolled"],
              "tree_over_hf_chunk": times["tree_random"] / times["hf_chunk"]}
    if "chunk_seq" in times:
        ratios["tree_over_chunk_seq"] = times["tree_random"] / times["chunk_seq"]
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(TREE_SIZES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                        help="tree_scan's backend (auto: Triton on CUDA, PyTorch on CPU)")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds of repeats per case")
    parser.add_argument("--min-reps", type=int, default=7, help="repeats per case at least")
    parser.add_argument("--quick", action="store_true", help="mamba2-2.7b only, T in 1, 16, 64")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/<machine kind>/tree-kernels-<dtype>.json)")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.sizes = ["mamba2-2.7b"], [1, 16, 64]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    machine = machine_info(device)
    print(device_line(machine))
    backend = args.backend if args.backend != "auto" else "triton" if device.type == "cuda" else "torch"
    print(f"dtype {dtype}, batch {args.batch}, backend " + ("Triton" if backend == "triton" else "PyTorch reference"))
    generator = torch.Generator().manual_seed(0)
    results = []
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        print(f"\n{shape_name}: nheads={shape[0]} headdim={shape[1]} dstate={shape[2]} ngroups={shape[3]}")
        header = (f"{'T':>4} {'tree ms':>9} {'step1 ms':>9} {'tree/step1':>10} {'chain/step1':>11} "
                  f"{'tree/seqT':>9} {'tree/unroll':>11} {'tree/hf':>8}")
        print(header + (f" {'tree/chunk':>10}" if device.type == "cuda" else ""))
        for T in args.sizes:
            times, info = bench_case(shape, T, args.batch, device, dtype, generator, backend, args.min_time,
                                     args.min_reps)
            ratios = ratios_of(times)
            line = (f"{T:>4} {times['tree_random']:>9.3f} {times['step1']:>9.3f} {ratios['tree_over_step1']:>10.2f} "
                    f"{ratios['chain_over_step1']:>11.2f} {ratios['tree_over_seqT']:>9.3f} "
                    f"{ratios['tree_over_unrolled']:>11.2f} {ratios['tree_over_hf_chunk']:>8.2f}")
            if "tree_over_chunk_seq" in ratios:
                line += f" {ratios['tree_over_chunk_seq']:>10.2f}"
            print(line, flush=True)
            results.append(dict(shape=shape_name, nheads=shape[0], headdim=shape[1], dstate=shape[2],
                                ngroups=shape[3], T=T, batch=args.batch, times_ms=times, ratios=ratios, **info))
    dtype_name = str(dtype).removeprefix("torch.")
    out = args.out or results_path(machine, f"tree-kernels-{SHORT_DTYPES[dtype_name]}.json")
    write_json(out, dict(machine, dtype=str(dtype), backend=backend, results=results))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
