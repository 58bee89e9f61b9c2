"""What the Triton launchers share: block sizes, the int32 indexing limit, and the Launch record that the
ahead-of-time check (aot.py) compiles. Each *_triton module lists its launches in compile_specs (see aot.py)."""
import dataclasses

import triton

INT32_MAX = 2**31 - 1


def block(n, lo=16, hi=64):
    """The power of two >= n, clamped to [lo, hi] (tl.dot needs every dimension >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(n)))


def check_int32(kernel, **tensors):
    """The kernels index with int32 offsets: refuse a tensor of 2**31 elements or more with a ValueError naming it."""
    for name, t in tensors.items():
        if t is not None and t.numel() > INT32_MAX:
            raise ValueError(f"{kernel}: {name} has {t.numel()} elements, but the Triton kernel indexes with int32 "
                             f"offsets and takes at most 2**31 - 1 = {INT32_MAX}; split the batch (or the stacked "
                             f"layers), or use backend='torch'")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as its launcher makes it, for aot.check to compile without a GPU."""
    kernel: object       # the @triton.jit function
    args: dict           # every runtime argument by name: a torch.dtype stands for a tensor of that dtype
    constexprs: dict     # the constexpr arguments (flags, block sizes)
    num_warps: int = 4
    num_stages: int = 3  # triton's default on CUDA
    grid: tuple = ()

    @classmethod
    def of(cls, kernel, args, flags, config, grid=()):
        """From a launcher's keyword arguments: flags and config are constexprs plus num_warps / num_stages."""
        constexprs = dict(flags, **config)
        options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
        return cls(kernel, args, constexprs, grid=tuple(grid), **options)
