"""What every benchmark shares: the machine it ran on, where its JSON goes, and how it times a call.

Results live in benchmarks/results/<machine kind>/, the kind named from the GPU (gpu-h200) or from the CPU's family
and the widest vector or matrix extension it has (cpu-epyc-avx2, cpu-epyc-avx512, cpu-xeon-amx): the extension
decides what a multi-row matrix product costs, and so whether a tree pass costs about one decode step.
"""
import json
import os
import platform
import re
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The CPU flags printed and recorded with every result: the ones a tree pass's products can use.
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
CPU_FAMILIES = ("epyc", "xeon", "ryzen", "core")
CPU_VENDORS = {"amd": "amd", "authenticamd": "amd", "intel": "intel", "genuineintel": "intel"}
# Parts of a GPU's name that say nothing about the chip: the vendor, memory size and type, form factor.
GPU_NOISE = re.compile(r"nvidia|amd|\d+gb|hbm\d*e?|pcie|sxm\d*|nvl")
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # as result file names spell them


def cpu_description():
    """(model name, vendor id, set of flags) of this machine's first CPU, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine(), "", set()

    def field(name):
        found = re.search(rf"^{name}\s*:\s*(.*)$", text, re.MULTILINE)
        return found.group(1).strip() if found else ""
    return field("model name") or platform.machine(), field("vendor_id"), set(field("flags").split())


def cpu_kind(model, vendor, flags):
    """cpu-<family>-<extension>, e.g. cpu-epyc-avx2: the family from the model name (else the vendor, else the
    architecture), the extension the widest of amx, avx512 and avx2 in `flags` (else torch's CPU capability)."""
    name = model.lower()
    family = (next((f for f in CPU_FAMILIES if f in name), None)
              or next((v for k, v in CPU_VENDORS.items() if k in name or k == vendor.lower()), None)
              or platform.machine().lower())
    extension = ("amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags
                 else torch.backends.cpu.get_cpu_capability().lower().replace(" ", ""))
    return f"cpu-{family}-{extension}"


def gpu_kind(name):
    """gpu-<chip>, e.g. "NVIDIA H100 80GB HBM3" -> gpu-h100, "NVIDIA GeForce RTX 4090" -> gpu-geforce-rtx-4090."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and not GPU_NOISE.fullmatch(w)]
    return "gpu-" + "-".join(words)


def machine_info(device):
    """Where a benchmark runs, as every JSON records it: machine (the results folder's name), device, device_name,
    cpu, cpu_flags (those of FLAGS present), cpu_capability (torch's), torch, threads."""
    device = torch.device(device)
    model, vendor, flags = cpu_description()
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else model
    return dict(machine=gpu_kind(name) if gpu else cpu_kind(model, vendor, flags), device=device.type,
                device_name=name, cpu=model, cpu_flags=[f for f in FLAGS if f in flags],
                cpu_capability=torch.backends.cpu.get_cpu_capability(), torch=torch.__version__,
                threads=torch.get_num_threads())


def device_line(info):
    """The first line every benchmark prints: its device, the CPU's flags and torch's threads."""
    return (f"device: {info['device']} ({info['device_name']}), machine {info['machine']}; CPU {info['cpu']}, flags "
            f"{' '.join(info['cpu_flags']) or '-'} (torch: {info['cpu_capability']}); torch {info['torch']}, "
            f"threads {info['threads']}")


def model_shape(model):
    """One line of a model's shape: family, layers, hidden size, vocabulary, parameters."""
    config = model.config
    return (f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
            f"{config.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")


def results_path(info, filename):
    """benchmarks/results/<machine kind>/<filename>."""
    return os.path.join(RESULTS, info["machine"], filename)


def write_json(path, data):
    """Write `data` as indented JSON at `path`, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, reps):
    """Median wall time of `reps` calls of fn, in ms (CUDA synchronised around each call)."""
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_all(fns, device, min_time=1.0, min_reps=7, max_reps=500):
    """Fastest wall time in ms of each fn in `fns` (a dict), timed round-robin so machine drift hits all alike.

    Each timed call directly follows an untimed call of the same fn, so every fn is measured warm (its data in
    cache), as a microbenchmark loop would. The minimum, not the median, because on a shared machine the
    noise only ever adds time.
    """
    times = {name: [] for name in fns}
    first = times[next(iter(fns))]
    start = time.perf_counter()
    while len(first) < min_reps or (time.perf_counter() - start < min_time and len(first) < max_reps):
        for name, fn in fns.items():
            fn()
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * min(t) for name, t in times.items()}
