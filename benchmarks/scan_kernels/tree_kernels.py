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
With --gated-delta, the same for a Gated DeltaNet layer at Qwen3-Next's / Qwen3.5's shape: stree's
tree_gated_delta_rule over a random T-node tree and over a T-node chain against flash-linear-attention's
chunk_gated_delta_rule over T tokens (CUDA with fla installed; its output over the chain is checked against stree's).
CPU runs the PyTorch path, CUDA the Triton path (--backend overrides). Prints the device and CPU flags, the shapes
and a table of ratios; writes JSON. Layer shapes are stree.triton_kernels.aot.MODEL_SHAPES (plus "tiny", for smoke runs).

    python -m benchmarks.scan_kernels.tree_kernels            # three shapes, T in 1..128
    python -m benchmarks.scan_kernels.tree_kernels --quick    # one shape, a few T (smoke run)
    python -m benchmarks.scan_kernels.tree_kernels --gated-delta --sizes 1 16 64   # also Gated DeltaNet vs fla
"""
import argparse

import torch
import torch.nn.functional as F
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

from benchmarks.anchors import fla_chunk_gated_delta, mamba_chunk_scan, mamba_state_update
from benchmarks.common import SHORT_DTYPES, device_line, machine_info, results_path, time_all, write_json
from stree import random_parents
from stree.triton_kernels import tree_gated_delta_rule, tree_scan
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
    selective_state_update = mamba_state_update(device)
    if selective_state_update is not None:
        def step(state, x, dt, A, B, C, D, dt_bias):
            nheads, headdim, dstate = state.shape[1:]
            return selective_state_update(state, x, dt[..., None].expand(-1, -1, headdim),
                                          A[:, None, None].expand(nheads, headdim, dstate), B, C,
                                          D=D[:, None].expand(nheads, headdim),
                                          dt_bias=dt_bias[:, None].expand(nheads, headdim), dt_softplus=True)
        return step, "mamba_ssm"
    return decode_step_torch, "torch"


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
    chunk_scan = mamba_chunk_scan(device)

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


# (key heads, value heads, key dim, value dim) of one Gated DeltaNet layer
GATED_DELTA_SHAPES = {"qwen3-next-80b-a3b": tuple(MODEL_SHAPES["qwen3-next-80b-a3b"][k] for k in (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")),
    "tiny": (2, 4, 16, 16)}


def gated_delta_case(shape, T, device, dtype, generator, backend, min_time, min_reps):
    """Times (ms) of a Gated DeltaNet layer over T nodes, batch 1, at `shape` (GATED_DELTA_SHAPES): stree's tree
    kernel over a random tree and over a chain, and fla's chunk kernel over T tokens when it runs here; with fla,
    also the largest difference between fla's outputs and stree's over the chain, over the largest output."""
    Hk, Hv, Dk, Dv = GATED_DELTA_SHAPES[shape]
    q, k = (torch.randn(1, T, Hk, Dk, generator=generator).to(device, dtype) for _ in range(2))
    v = torch.randn(1, T, Hv, Dv, generator=generator).to(device, dtype)
    g = (-torch.rand(1, T, Hv, generator=generator)).to(device)
    beta = torch.rand(1, T, Hv, generator=generator).to(device, dtype)
    state = (0.1 * torch.randn(1, Hv, Dk, Dv, generator=generator)).to(device)
    parents = torch.tensor([random_parents(T, generator, max_children=3)], device=device)
    chain = torch.arange(T, device=device)[None] - 1
    kwargs = dict(initial_state=state, use_qk_l2norm=True, backend=backend)
    fns = {"tree_random": lambda: tree_gated_delta_rule(q, k, v, g, beta, parents, **kwargs),
           "tree_chain": lambda: tree_gated_delta_rule(q, k, v, g, beta, chain, **kwargs)}
    fla = fla_chunk_gated_delta(device)
    info = {"fla": fla is not None}
    if fla is not None:  # fla's heads are value heads: HF repeats the key heads for it, so does this
        qv, kv = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
        fns["fla_chunk"] = lambda: fla(qv, kv, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True)[0]
        with torch.inference_mode():
            ours, theirs = fns["tree_chain"]().float(), fns["fla_chunk"]().float()
        info["fla_vs_chain_error"] = float((ours - theirs).abs().max() / theirs.abs().max())
    with torch.inference_mode():
        times = time_all(fns, device, min_time=min_time, min_reps=min_reps)
    return times, info


def run_gated_delta(args, device, dtype, generator, backend):
    """The --gated-delta table: one row per tree size."""
    shape = args.gated_delta
    print(f"\nGated DeltaNet, {shape} layer: key heads, value heads, key dim, value dim {GATED_DELTA_SHAPES[shape]}")
    print(f"{'T':>4} {'tree ms':>9} {'chain ms':>9} {'fla ms':>8} {'tree/fla':>9} {'chain-vs-fla err':>17}")
    rows = []
    for T in args.sizes:
        times, info = gated_delta_case(shape, T, device, dtype, generator, backend, args.min_time, args.min_reps)
        fla_ms = times.get("fla_chunk")
        ratio = times["tree_random"] / fla_ms if fla_ms else None
        error = info.get("fla_vs_chain_error")
        print(f"{T:>4} {times['tree_random']:>9.3f} {times['tree_chain']:>9.3f} "
              f"{'-' if fla_ms is None else f'{fla_ms:.3f}':>8} {'-' if ratio is None else f'{ratio:.2f}':>9} "
              f"{'-' if error is None else f'{error:.1e}':>17}", flush=True)
        rows.append(dict(shape=shape, T=T, times_ms=times, tree_over_fla=ratio, **info))
    return rows


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
    parser.add_argument("--gated-delta", nargs="?", const="qwen3-next-80b-a3b", default=None,
                        choices=list(GATED_DELTA_SHAPES),
                        help="also a Gated DeltaNet layer (default: Qwen3-Next's shape) against fla's chunk kernel")
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
    gated_delta = run_gated_delta(args, device, dtype, generator, backend) if args.gated_delta else []
    dtype_name = str(dtype).removeprefix("torch.")
    out = args.out or results_path(machine, f"tree-kernels-{SHORT_DTYPES[dtype_name]}.json")
    write_json(out, dict(machine, dtype=str(dtype), backend=backend, results=results, gated_delta=gated_delta))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
