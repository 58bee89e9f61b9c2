"""Ahead-of-time compile check (aot.py) on every CI run: every Triton kernel, compiled for sm_80 and sm_90 at its
largest layer shape and tree, one dtype; no GPU needed (triton's wheel carries ptxas). The full matrix is
`python benchmarks/gpu.py --compile-only`."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from stree.triton_kernels import aot  # noqa: E402

def largest_launches():
    """Each kernel's launch with the most flags on and the largest shape (all model shapes, the largest tree), in fp32
    (the most registers)."""
    best = {}
    for case, launch in aot.launches(sizes=[max(aot.TREE_SIZES)], dtypes=[torch.float32]):
        size = (sum(v is True for v in launch.constexprs.values()),
                sum(v for v in launch.args.values() if isinstance(v, int)))
        name = launch.kernel.__name__
        if name not in best or size > best[name][0]:
            best[name] = size, (case, launch)
    return {name: entry for name, (_, entry) in best.items()}


def test_every_kernel_is_registered():
    names = set(largest_launches())
    assert {"_tree_scan_kernel", "_tree_states_kernel", "_tree_conv_kernel", "_tree_conv_state_kernel"} <= names
    for module in aot.kernel_modules():  # every @triton.jit *_kernel of a *_triton module has a launch listed
        kernels = {k for k, v in vars(module).items() if k.endswith("_kernel") and hasattr(v, "fn")}
        assert kernels <= names, f"{module.__name__}: {kernels - names} missing from compile_specs"


def test_every_kernel_compiles_and_fits_sm80_and_sm90():
    results = aot.check(list(largest_launches().values()), archs=(80, 90), jobs=2)
    assert len(results) == 2 * len(largest_launches())
    for r in results:
        assert not r.error, f"{r.kernel} sm_{r.arch}: {r.error}"
        assert r.fits, f"{r.kernel} sm_{r.arch} {r.constexprs}: {r.problems}"
        assert 0 < r.regs <= 255 and r.spill_bytes == 0


def test_oversized_and_invalid_configs_are_reported():
    """The check is not vacuous: 256-wide headdim tiles with all of a 128 dstate at once ask for 272 KB of shared
    memory, over both targets' limits (and spill on sm_80); a block that is not a power of two does not compile,
    which is reported as an error, not raised."""
    case, launch = largest_launches()["_tree_scan_kernel"]
    big = dataclasses.replace(launch, constexprs=dict(launch.constexprs, BLOCK_P=256, BLOCK_N=128), num_warps=8)
    bad = dataclasses.replace(launch, constexprs=dict(launch.constexprs, BLOCK_P=48))  # tl.arange: powers of 2
    results = aot.check([("big", big), ("bad", bad)], archs=(80, 90), jobs=2)
    for result in results:
        assert not result.fits
        if result.used_by == ["big"]:
            assert not result.error
            assert f"{result.smem} bytes of shared memory > {aot.ARCHS[result.arch]['smem']} per block" in \
                result.problems
        else:
            assert result.error
    spilling = dataclasses.replace(results[0], smem=0, spill_bytes=8)
    assert aot.problems(spilling) == ["spills: 8 bytes of local memory"]


def test_int32_offsets_are_a_clear_error():
    """The kernels index with int32 offsets; a tensor of 2**31 elements (here a broadcast view, no memory) is refused
    with the limit named (the commit stacks every layer along heads, so big batches can reach it)."""
    from stree.triton_kernels.launch import check_int32
    check_int32("tree_states", states=torch.zeros(1).expand(2**31 - 1))
    with pytest.raises(ValueError, match=r"tree_states: states has 2147483648 elements.*int32.*backend='torch'"):
        check_int32("tree_states", states=torch.zeros(1).expand(2**31))
