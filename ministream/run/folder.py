"""What an engine needs of a converted folder beyond checkpoint/folder.py's check (which every command that reads
a folder runs): whether this machine's vLLM can run it, its quantized head and its kernels for the folder's dtype
and width (kernels.py: read from the installed vLLM's files and the CPU's flags).

check_servable is serve's, generate's and verify's pre-flight; doctor reports the same findings one by one.
"""

import os
from pathlib import Path

from ..checkpoint.findings import Finding, FolderError
from ..checkpoint.folder import Folder, checked
from ..checkpoint.scheme import Quantization, needs_16_bits
from ..spec import DTYPES
from . import engine
from .kernels import (
    BF16_GEMM_ENV,
    CPU_GEMM,
    CPU_INT4,
    CPU_INT4_W4A8,
    CPU_INT8,
    CPU_INT8_AMX,
    CT_CONFIG,
    FP16_FLAG,
    INT4_GEMM,
    INT8_SPLIT_ENV,
    W4A8_ENV,
    bf16_kernel,
    c_compiler,
    cpu_kernels,
    float16_fails,
    installed_vllm_dir,
    int4_gemm_missing,
    int4_runs_w4a8,
    int8_kernel,
    int8_needs_16_bits,
    int8_own_kernel,
    reads_quantized_head,
)

GB = 1e9
# where the CPU part finds no compiler to build its kernels (kernels.c_compiler): what to do, in both findings
NO_COMPILER_FIX = "install a C compiler (Debian: apt install gcc) or set CC; vLLM's torch.compile needs one too"


def quantized_head(q: Quantization | None, vllm_dir: Path | None) -> Finding | None:
    """A folder whose head `quantize --head quantized` wrote (`q`: its scheme as read_scheme reads it), against
    the vLLM at `vllm_dir` (read, not imported): None where the head is not quantized or no vLLM is there to
    judge."""
    if q is None or not q[1] or vllm_dir is None:
        return None
    scheme = q[0]
    if reads_quantized_head(vllm_dir):
        return Finding("ok", "quantized head", f"this vLLM's compressed-tensors reads a {scheme} lm_head")
    return Finding(
        "error",
        "quantized head",
        f"the folder's lm_head is quantized ({scheme}), and the vLLM at {vllm_dir} gives a head no compressed-"
        f"tensors scheme ({CT_CONFIG} has no ParallelLMHead case, vLLM PR #37291): it would multiply by the "
        "stored int8 values as if they were weights",
        "quantize the converted folder again with --head float, or install a vLLM with that PR (0.32.0 has it)",
    )


def int4_kernel(
    q: Quantization | None, vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo"), env=os.environ
) -> Finding | None:
    """What a 4-bit folder (`q`: its scheme as read_scheme reads it) is computed with where that is not what its
    name says (w4a8 on an AMX CPU); None elsewhere. Not an error: verify holds it to the 4-bit rule all the same
    (docs/quantize.md)."""
    if q is None or q[0] != "w4a16" or not int4_runs_w4a8(vllm_dir, cpuinfo, env):
        return None
    return Finding(
        "ok",
        "4-bit kernel",
        f"on this CPU (AMX) vLLM computes the 4-bit weights with int8 activations ({CPU_INT4_W4A8} in {CPU_INT4}: "
        f"w4a8), which verify holds to the w4a16 rule; {W4A8_ENV}=0 gives bf16 activations (cpu_gemm_wna16: slower; "
        "docs/quantize.md)",
    )


def int8_split(
    q: Quantization | None, vllm_dir: Path | None, cpuinfo: Path = Path("/proc/cpuinfo"), env=os.environ
) -> Finding | None:
    """What an int8 folder is computed with where oneDNN's int8 products would saturate (an x86 CPU without VNNI)
    and the CPU part mends them: its own kernel, or oneDNN's split; None elsewhere (where they saturate, check_dtype
    refuses)."""
    if q is None or q[0] != "w8a8" or int8_kernel(vllm_dir, cpuinfo, env) != "split":
        return None
    if int8_own_kernel(vllm_dir, env) and c_compiler(env):
        return Finding(
            "ok",
            "int8 kernel",
            f"on this CPU (x86 without VNNI) oneDNN's int8 products sum pairs in int16 and would saturate; the patched "
            f"wheel's CPU part computes them with its own int8 kernel, built at the engine's first start with the C "
            f"compiler ({CPU_INT8}): exact int32 sums, at many times oneDNN's speed here (docs/bench.md)",
        )
    if int8_own_kernel(vllm_dir, env):
        return Finding(
            "warn",
            "int8 kernel",
            f"on this CPU (x86 without VNNI) oneDNN's int8 products would saturate; the patched wheel's CPU part finds "
            f"no C compiler ($CC, cc, gcc) to build its int8 kernel, so it splits each product in two that cannot "
            f"({CPU_INT8}): exact, but some 30 times slower at batch 1 (docs/bench.md)",
            NO_COMPILER_FIX,
        )
    return Finding(
        "ok",
        "int8 kernel",
        f"on this CPU (x86 without VNNI) oneDNN's int8 products sum pairs in int16 and would saturate; the patched "
        f"wheel's CPU part splits each in two that cannot ({CPU_INT8}): exact, for twice the weight bytes read "
        "(docs/quantize.md)",
    )


def bf16_products(
    q: Quantization | None,
    dtype: str | None,
    vllm_dir: Path | None,
    cpuinfo: Path = Path("/proc/cpuinfo"),
    env=os.environ,
) -> Finding | None:
    """How a folder of float weights computed in bfloat16 (`dtype`: runs_in's) is multiplied on an x86 CPU whose
    oneDNN makes no bfloat16 matmul (AVX2 alone); None elsewhere. Slow, not wrong: a warning where nothing mends it."""
    kernel = bf16_kernel(vllm_dir, cpuinfo, env) if q is None and dtype == "bfloat16" else None
    if kernel == "widened" and not c_compiler(env):
        return Finding(
            "warn",
            "bfloat16 kernel",
            "on this CPU (AVX2, no AVX-512) oneDNN makes no bfloat16 matmul; the patched wheel's CPU part widens a "
            f"batch's products to float32 ({CPU_GEMM}), but finds no C compiler ($CC, cc, gcc) to build its kernel "
            "for a decode step's few rows, which stay torch's F.linear, at about half its read rate (docs/bench.md)",
            NO_COMPILER_FIX,
        )
    if kernel == "widened":
        return Finding(
            "ok",
            "bfloat16 kernel",
            "on this CPU (AVX2, no AVX-512) oneDNN makes no bfloat16 matmul; the patched wheel's CPU part runs a "
            f"decode step's products through its own kernel, built at the engine's first start with the C compiler, "
            f"and widens a batch's or a prompt's to float32 ({CPU_GEMM}; docs/bench.md)",
        )
    if kernel == "F.linear":
        return Finding(
            "warn",
            "bfloat16 kernel",
            "on this CPU (AVX2, no AVX-512) oneDNN makes no bfloat16 matmul and this vLLM multiplies bfloat16 "
            f"weights with torch's F.linear ({CPU_GEMM}): from a few rows on ~0.6 GB/s of weights, so batches, "
            "prompts and the engine's warm-up are slow (a 1.2B model's warm-up took over 17 min; docs/bench.md)",
            f"install the patched wheel (make install; {BF16_GEMM_ENV}=0 turns its fix off), or run the folder "
            "with --dtype float32 (twice the memory)",
        )
    return None


def check_dtype(scheme: str | None, runs_in: str | None, what: str, vllm_dir: Path | None = None) -> None:
    """FolderError where this machine's vLLM cannot run weights quantized `scheme` (None: float weights)
    computing in `runs_in` (`what`: the folder or width named in the error). The one rule of what this machine
    runs: check_servable's (serve, generate, verify), doctor's and the benches' (widths.refusal). `vllm_dir`: the
    vLLM package folder whose kernels would run it (default: the installed one)."""
    vllm_dir = vllm_dir or installed_vllm_dir()
    int4 = scheme is not None and needs_16_bits(scheme)
    if runs_in == "float16" and float16_fails(vllm_dir):
        raise FolderError(
            "dtype",
            f"{what} in float16: on this CPU vLLM's ZenCpuPlatform runs every linear layer through zentorch, "
            f"whose float16 kernels need {FP16_FLAG}, which this CPU lacks (/proc/cpuinfo): the engine would start "
            "and fail its first request",
            "run it with --dtype bfloat16 (or float32)",
        )
    # The request's own error first: it holds on every machine, and its fix (16 bits) is asked of the kernel next.
    if runs_in == "float32" and int4:
        raise FolderError(
            "dtype",
            f"{what} is quantized {scheme}, whose int4 kernels take 16-bit activations only (vLLM 0.32: "
            "cpu_gemm_wna16 and zentorch's WOQ linear fail on float32 at the first step, Marlin on GPUs too)",
            "run it with --dtype bfloat16 (or float16)",
        )
    if int4 and int4_gemm_missing(vllm_dir):
        lib = cpu_kernels(vllm_dir)
        raise FolderError(
            "kernel",
            f"{what} is quantized {scheme}, and the kernels vLLM loads on this CPU ({lib.name if lib else '?'}: no "
            f"AVX-512) have no 4-bit GEMM ({INT4_GEMM}): the engine would start and fail its first step",
            "serve the bfloat16 or w8a8 folder on this machine, or the 4-bit one on a CPU with AVX-512",
        )
    if scheme == "w8a8" and int8_kernel(vllm_dir) == "saturates":
        raise FolderError(
            "kernel",
            f"{what} is quantized {scheme}, and on this CPU (x86 without VNNI) the vLLM here computes int8 products "
            f"with oneDNN's kernel ({CPU_INT8}), whose int16 pair sums saturate with 8-bit weights (PyTorch issue "
            f"#103646): the model would compute wrongly",
            f"serve it with the patched wheel (make install; its CPU part splits the products, unless {INT8_SPLIT_ENV}"
            "=0), or the bfloat16 folder on this machine",
        )
    if runs_in == "float32" and scheme == "w8a8" and int8_needs_16_bits(vllm_dir):
        raise FolderError(
            "dtype",
            f"{what} is quantized {scheme}, and on this CPU (AMX) vLLM runs int8 weights through "
            f"{CPU_INT8_AMX} ({CPU_INT8}), which takes 16-bit activations only: float32 fails at the first step",
            "run it with --dtype bfloat16",
        )


def runs_in(config: dict, dtype: str | None) -> str | None:
    """The dtype an engine run with --dtype `dtype` computes the folder in: the asked one; None or auto: the
    folder's own, except float16, held only when asked for (vLLM's auto takes bfloat16 where float16 cannot
    run), which is None here, as is a folder that names none."""
    own = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype not in (None, "auto") else None if own == "float16" else own


def runs(config: dict, q: Quantization | None, dtype: str | None, what: str, vllm_dir: Path | None = None) -> None:
    """check_dtype for a folder the check passed (config.json's values, and its scheme `q` as the check read it: one
    of ours, or None) run with the engine's --dtype `dtype` (runs_in)."""
    check_dtype(q[0] if q else None, runs_in(config, dtype), what, vllm_dir)


def check_memory(
    folder: Folder,
    dtype: str | None,
    ranks: int = 1,
    share: float = 1.0,
    environ: dict | None = None,
    available: int | None = None,
) -> None:
    """FolderError where an engine on the folder, computing in `dtype` (runs_in's; None: 16 bits), could not fit
    this machine's memory now: the weights it holds in that dtype (Folder.held_bytes; `share` of them, where other
    machines hold the rest) and the KV cache each of its `ranks` here allocates whole at start
    (VLLM_CPU_KVCACHE_SPACE in `environ`, else ours), against the memory available (engine.memory_available, or
    `available`). Both are what vLLM takes before its first step, its own runtime on top: a refusal here is an
    engine that could not start, said before the minutes it would take to load and be killed. Not where a GPU
    is: the weights go to its memory, which vLLM checks itself."""
    if engine.gpu_visible():
        return
    dtype = dtype if dtype in DTYPES else "bfloat16"  # the least an engine of a 16-bit auto can hold
    weights = int(folder.held_bytes(dtype) * share)
    kv = engine.kv_cache_bytes(environ, ranks) * ranks
    have = engine.memory_available() if available is None else available
    if weights + kv <= have:
        return
    half = folder.held_bytes("bfloat16") * share
    smaller = [f"in bfloat16 (--dtype bfloat16: {half / GB:.1f} GB; verify holds it to bfloat16's rule)"]
    quantize = [] if "quantization_config" in folder.config else ["quantized (`ministream quantize`)"]
    ways = [*(smaller if dtype == "float32" else []), *quantize]
    kv_said = f"{kv / GB:.1f} GB of KV cache" + (f" ({ranks} ranks)" if ranks > 1 else "")
    raise FolderError(
        "memory",
        f"{folder.path}: vLLM computing in {dtype} holds {weights / GB:.1f} GB of its weights and {kv_said} "
        f"({engine.KV_CACHE}), {(weights + kv) / GB:.1f} GB, and {have / GB:.1f} GB of memory is available now: "
        "the engine could not start",
        "run it "
        + ", or ".join([*ways, f"with a smaller {engine.KV_CACHE} (GiB)"])
        + ", or on a machine with more memory",
    )


def check_servable(
    folder: Path,
    dtype: str | None = None,
    ranks: int = 1,
    share: float = 1.0,
    memory: bool = True,
) -> dict:
    """What `serve`, `generate` and `verify` need of a folder before vLLM spends a minute starting: the one folder
    check (checkpoint/folder.py) without an error, a vLLM that reads its quantized head where it has one, a
    dtype (the engine's --dtype, else config.json's) this machine's vLLM runs the folder's weights in (runs),
    and, unless `memory` is False (no engine starts here), the memory its engine takes at start (check_memory:
    `ranks` here holding `share` of the weights, the KV cache this process's environment gives them). The
    config; FolderError naming the file and key otherwise (the first error). config.json and its scheme are read
    once, by the check."""
    seen, vllm_dir = checked(folder), installed_vllm_dir()
    config = seen.config
    head = quantized_head(config.quantization, vllm_dir)
    if head is not None and head.level == "error":
        raise FolderError(head.topic, head.text, head.fix)
    runs(config.values, config.quantization, dtype, str(folder), vllm_dir)
    if memory:
        check_memory(seen.folder, runs_in(config.values, dtype), ranks, share)
    return config.values
