"""The kernels stree's are measured against, when installed: mamba_ssm's Triton ops and fla's chunk kernels.

Neither needs a CUDA build: `fla-core` is pure Python, and mamba-ssm built with MAMBA_SKIP_CUDA_BUILD=TRUE keeps its
Triton ops (chunk scan, state update) but lacks its compiled extension `selective_scan_cuda`, which its package
`__init__` imports; `enable_mamba_ssm` stands a placeholder in for that extension (only when it is missing), so that
the Triton ops import, and so does HF's Mamba2 / Bamba code, which then runs mamba_ssm's kernels on CUDA.
benchmarks/gpu_wheels.sh builds both as wheels for a GPU machine without internet.
"""
import importlib.util
import sys
import types


class _MissingExtension(types.ModuleType):
    def __getattr__(self, name):
        raise ImportError(f"{self.__name__}.{name}: mamba_ssm was installed without its CUDA extensions "
                          "(MAMBA_SKIP_CUDA_BUILD); only its Triton ops run")


def enable_mamba_ssm(device):
    """Whether mamba_ssm's Triton ops import and run on `device` (CUDA only), placing the stand-in extension first
    if mamba_ssm is installed without it. Call before the first HF Mamba2 / Bamba model is built: HF picks its
    kernels at import. Every accessor below answers None off CUDA through this check."""
    if device.type != "cuda" or importlib.util.find_spec("mamba_ssm") is None:
        return False
    if "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None:
        sys.modules.setdefault("selective_scan_cuda", _MissingExtension("selective_scan_cuda"))
    try:
        importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        return True
    except ImportError as e:
        print(f"mamba_ssm is installed but its Triton ops do not import: {e}")
        return False


def hf_mamba_kernels(device):
    """What HF's Mamba2 / Bamba models will run on `device`, printed and returned: "mamba_ssm" (its Triton ops,
    enabled here before any model is built) or "torch" (HF's PyTorch path)."""
    kernels = "mamba_ssm" if enable_mamba_ssm(device) else "torch"
    print(f"HF's Mamba2 kernels: {kernels}")
    return kernels


def mamba_chunk_scan(device):
    """mamba_ssm's mamba_chunk_scan_combined for `device`, or None."""
    if not enable_mamba_ssm(device):
        return None
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined


def mamba_state_update(device):
    """mamba_ssm's selective_state_update for `device`, or None."""
    if not enable_mamba_ssm(device):
        return None
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    return selective_state_update


def fla_chunk_gated_delta(device):
    """fla's chunk_gated_delta_rule for `device` (CUDA only: its Triton kernels need a GPU driver), or None."""
    if device.type != "cuda" or importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        print(f"fla is installed but its gated delta rule does not import: {e}")
        return None
    return chunk_gated_delta_rule
