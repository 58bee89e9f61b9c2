"""Ahead-of-time compile check: every Triton kernel launch the launchers can make, compiled for NVIDIA GPUs on a
machine without one (triton's wheel carries ptxas), with the registers, spills and shared memory each one uses.

A kernel module takes part by defining ``compile_specs(shape, T, dtype) -> [launch.Launch]``: the launches its launchers
would make for one layer shape (a dict like MODEL_SHAPES' values), trees of T nodes and inputs of `dtype`, built
from the same block-size function the launcher calls, so that the two cannot drift. Every ``*_triton`` module of
this package is collected by ``launches``; a module that needs shape fields a family lacks returns no launch.

    from stree.triton_kernels import aot
    results = aot.check(aot.launches(["mamba2-2.7b"], [16], [torch.bfloat16]), archs=[80, 90])

Uses triton's own JIT binder to specialize launches as the JIT would (checked with triton 3.6 and 3.9); the command
line is `python benchmarks/gpu.py --compile-only`.
"""
import dataclasses
import importlib
import itertools
import os
import pickle
import pkgutil
import re
import subprocess
import sys
import tempfile
import time

import torch

from .launch import Launch

# Per-block limits of each target. CUDA C Programming Guide, "Features and Technical Specifications", table
# "Technical Specifications per Compute Capability": shared memory per block (opt-in) 163 KB on 8.0 and 227 KB on
# 9.0 (164 / 228 KB per SM, 1 KB of each block's reserved); 64K 32-bit registers per SM and per block; 255 per thread.
ARCHS = {
    80: dict(gpu="A100", smem=163 * 1024, regs_per_block=65536, regs_per_thread=255),
    90: dict(gpu="H100/H200", smem=227 * 1024, regs_per_block=65536, regs_per_thread=255),
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}



def _mamba2(nheads, headdim, dstate, ngroups, conv_width=4):
    """A Mamba2 mixer; its conv runs over x, B and C (HF's xBC): nheads * headdim + 2 * ngroups * dstate channels."""
    return dict(nheads=nheads, headdim=headdim, dstate=dstate, ngroups=ngroups, conv_width=conv_width,
                conv_dim=nheads * headdim + 2 * ngroups * dstate)


# One layer of each supported family. Mamba2 fields: nheads, headdim, dstate, ngroups; Mamba1, Gated DeltaNet and KDA
# layers use HF's config names; conv_width taps over conv_dim channels (HF keeps conv_width state columns).
MODEL_SHAPES = {
    # state-spaces/mamba2-130m config.json (d_model 768; ssm_cfg: layer Mamba2) with mamba_ssm's Mamba2 defaults
    # (expand 2, headdim 64, d_state 128, ngroups 1, d_conv 4).
    "mamba2-130m": _mamba2(24, 64, 128, 1),
    # state-spaces/mamba2-2.7b config.json (d_model 2560), same Mamba2 defaults.
    "mamba2-2.7b": _mamba2(80, 64, 128, 1),
    # nvidia/Nemotron-H-8B-Base-8K config.json: mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128,
    # n_groups 8, conv_kernel 4.
    "nemotron-h-8b": _mamba2(128, 64, 128, 8),
    # ibm-fms/Bamba-9B config.json: mamba_n_heads 128, mamba_d_head 64, mamba_d_state 128, mamba_n_groups 1,
    # mamba_d_conv 4.
    "bamba-9b": _mamba2(128, 64, 128, 1),
    # ibm-granite/granite-4.0-h-tiny config.json: hidden 1536, mamba_n_heads 48, mamba_d_head 64, mamba_d_state 128,
    # mamba_n_groups 1, mamba_d_conv 4.
    "granite-4.0-h-tiny": _mamba2(48, 64, 128, 1),
    # ibm-granite/granite-4.0-h-small config.json: hidden 4096, mamba_expand 2, mamba_n_heads 128, mamba_d_head 64,
    # mamba_d_state 128, mamba_n_groups 1, mamba_d_conv 4.
    "granite-4.0-h-small": _mamba2(128, 64, 128, 1),
    # tiiuae/Falcon-H1-7B config.json (HF FalconH1 docs' table: 24 Mamba heads, d_head 128, d_state 256):
    # mamba_d_ssm 3072, mamba_n_heads 24, mamba_d_head 128, mamba_d_state 256, mamba_n_groups 1, mamba_d_conv 4.
    "falcon-h1-7b": _mamba2(24, 128, 256, 1),
    # Zyphra/Zamba2-7B config.json: hidden 3584, expansion_factor 2, mamba_headdim 64 (so 112 heads), state_size 64,
    # mamba_ngroups 2, conv_dimension 4.
    "zamba2-7b": _mamba2(112, 64, 64, 2),
    # Mamba1: tiiuae/falcon-mamba-7b config.json: intermediate_size 8192, state_size 16, conv_kernel 4.
    "falcon-mamba-7b": dict(intermediate_size=8192, state_size=16, conv_width=4, conv_dim=8192),
    # Gated DeltaNet: Qwen/Qwen3-Next-80B-A3B config.json: linear_num_key_heads 16, linear_num_value_heads 32,
    # linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4 (conv over q, k, v).
    "qwen3-next-80b-a3b": dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, conv_width=4, conv_dim=2 * 16 * 128 + 32 * 128),
    # KDA: moonshotai/Kimi-Linear-48B-A3B (linear_attn_config: num_heads 32, head_dim 128, short_conv_kernel_size
    # 4), which are also HF's KimiLinearConfig defaults (linear_num_heads 32, linear_head_dim 128,
    # linear_conv_kernel_dim 4); the conv runs over q, k and v.
    "kimi-linear-48b-a3b": dict(linear_num_heads=32, linear_head_dim=128, conv_width=4, conv_dim=3 * 32 * 128),
}
TREE_SIZES = (1, 16, 64, 128)  # the decoder's largest tree is ~64 nodes


@dataclasses.dataclass
class Result:
    kernel: str
    arch: int
    dtype: str
    constexprs: dict
    num_warps: int
    num_stages: int
    regs: int = 0
    spill_bytes: int = 0  # the local-memory stack frame: Triton kernels have one only for register spills
    smem: int = 0         # bytes of shared memory the launch asks for
    seconds: float = 0.0  # compile time
    error: str = ""
    problems: list = dataclasses.field(default_factory=list)
    used_by: list = dataclasses.field(default_factory=list)  # "model T=.." cases that make this launch

    @property
    def fits(self):
        return not self.error and not self.problems


def kernel_modules():
    """Every *_triton module of this package, imported; each must define compile_specs."""
    package = importlib.import_module(__package__)
    modules = [importlib.import_module(f"{__package__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)
               if m.name.endswith("_triton")]
    for module in modules:
        if not hasattr(module, "compile_specs"):
            raise TypeError(f"{module.__name__} defines no compile_specs(shape, T, dtype): list its launches there "
                            f"(see {__name__}) so that the compile check covers its kernels")
    return modules


def launches(models=None, sizes=TREE_SIZES, dtypes=tuple(DTYPES.values())):
    """[(case, Launch)] of every registered kernel module for each model shape x tree size x dtype."""
    out = []
    for module, name, T, dtype in itertools.product(kernel_modules(), models or list(MODEL_SHAPES), sizes, dtypes):
        for launch in module.compile_specs(MODEL_SHAPES[name], T, dtype):
            out.append((f"{name} T={T}", launch))
    return out


def _jit_function(kernel):
    """The JITFunction behind a kernel (under TRITON_INTERPRET=1, @triton.jit returns an InterpretedFunction)."""
    from triton.runtime.jit import JITFunction
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _source(launch, arch):
    """ASTSource of a launch, specialized exactly as the JIT would (triton's own binder; tensors 16-byte aligned)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature
    fn = _jit_function(launch.kernel)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    args = {k: MockTensor(v) if isinstance(v, torch.dtype) else v for k, v in launch.args.items()}
    bound, specialization, _ = binder(**args, **launch.constexprs, num_warps=launch.num_warps,
                                      num_stages=launch.num_stages)
    _, signature, constexprs, attrs = fn._pack_args(backend, dict(num_warps=launch.num_warps,
                                                                    num_stages=launch.num_stages),
                                                     bound, specialization, None)
    return ASTSource(fn, signature, constexprs, attrs)


def _key(launch, arch):
    src = _source(launch, arch)
    return (src.name, tuple(sorted(src.signature.items())), tuple(sorted(src.constants.items())),
            str(sorted(src.attrs.items())), launch.num_warps, launch.num_stages, arch)


def resource_usage(cubin):
    """(registers, stack bytes) of the one kernel in a cubin, from cuobjdump --dump-resource-usage."""
    import triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                              check=True, capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", text).groups()
    return int(regs), int(stack)


def problems(result):
    """Why a compiled launch does not fit its target (empty when it fits)."""
    limit = ARCHS[result.arch]
    threads = 32 * result.num_warps
    found = []
    if result.spill_bytes:
        found.append(f"spills: {result.spill_bytes} bytes of local memory")
    if result.regs > limit["regs_per_thread"]:
        found.append(f"{result.regs} registers per thread > {limit['regs_per_thread']}")
    if result.regs * threads > limit["regs_per_block"]:
        found.append(f"{result.regs} registers x {threads} threads > {limit['regs_per_block']} per block")
    if result.smem > limit["smem"]:
        found.append(f"{result.smem} bytes of shared memory > {limit['smem']} per block")
    return found


def compile_launch(launch, arch):
    """Compile one launch for sm_<arch> and measure it: a Result (error set when it does not compile)."""
    import triton
    from triton.backends.compiler import GPUTarget
    floats = [v for v in launch.args.values() if v in (torch.float16, torch.bfloat16, torch.float32)]
    dtype = str(next((v for v in floats if v != torch.float32), torch.float32)).removeprefix("torch.")  # the inputs'
    result = Result(getattr(launch.kernel, "__name__", str(launch.kernel)), arch, dtype, dict(launch.constexprs),
                    launch.num_warps, launch.num_stages)
    start = time.perf_counter()
    try:
        compiled = triton.compile(_source(launch, arch), target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
        result.regs, result.spill_bytes = resource_usage(compiled.asm["cubin"])
        result.smem = compiled.metadata.shared
    except Exception as e:  # a kernel that does not compile is a finding, not a crash of the check
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    result.seconds = time.perf_counter() - start
    result.problems = problems(result) if not result.error else []
    return result


def _compile_jobs(jobs):
    """compile_launch of each (module, kernel name, args, constexprs, num_warps, num_stages, arch): [Result dict]."""
    results = []
    for module, name, args, constexprs, num_warps, num_stages, arch in jobs:
        kernel = getattr(importlib.import_module(module), name)
        results.append(dataclasses.asdict(compile_launch(Launch(kernel, args, constexprs, num_warps, num_stages),
                                                         arch)))
    return results


def check(cases, archs=tuple(ARCHS), jobs=1):
    """Compile every distinct launch of `cases` ([(case, Launch)] as launches() gives) for each arch: [Result].

    Launches the JIT would compile to the same binary are compiled once; Result.used_by lists their cases. The
    compiler runs in `jobs` fresh Python processes without TRITON_INTERPRET (the interpreter patches triton.language
    for good, so a process that has interpreted a kernel cannot compile one).
    """
    unique, used_by = {}, {}
    for (case, launch), arch in itertools.product(cases, archs):
        key = _key(launch, arch)
        unique.setdefault(key, (launch, arch))
        used_by.setdefault(key, []).append(case)
    work = [(_jit_function(l.kernel).fn.__module__, l.kernel.__name__, l.args, l.constexprs, l.num_warps,
             l.num_stages, arch) for l, arch in unique.values()]
    n = max(1, min(jobs, len(work)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    results = [None] * len(work)
    with tempfile.TemporaryDirectory() as tmp:
        workers = []
        for i in range(n):
            paths = [os.path.join(tmp, f"{i}.{ext}") for ext in ("in", "out", "log")]
            with open(paths[0], "wb") as f:
                pickle.dump(work[i::n], f)
            with open(paths[2], "w") as log:
                workers.append((subprocess.Popen([sys.executable, "-m", __name__, *paths[:2]], env=env,
                                                 stdout=log, stderr=subprocess.STDOUT), paths))
        for i, (worker, paths) in enumerate(workers):
            if worker.wait():
                with open(paths[2]) as log:
                    raise RuntimeError(f"compile worker exited with {worker.returncode}:\n{log.read()[-3000:]}")
            with open(paths[1], "rb") as f:
                for j, row in zip(range(i, len(work), n), pickle.load(f)):
                    results[j] = Result(**row)
    for result, key in zip(results, unique):
        result.used_by = sorted(set(used_by[key]))
    return results


if __name__ == "__main__":  # a compile worker of check(): python -m stree.triton_kernels.aot JOBS.pkl RESULTS.pkl
    with open(sys.argv[1], "rb") as f:
        _jobs = pickle.load(f)
    _results = _compile_jobs(_jobs)
    with open(sys.argv[2], "wb") as f:
        pickle.dump(_results, f)
