"""This machine's CPU as /proc/cpuinfo names it: the one reader, for every floor (the checkpoint's GPTQ dtype, the
fork's zentorch plan, run/'s kernel rules, the benches' machine line). Nothing here imports torch or vLLM.

The instruction sets below decide what a kernel computes or how fast, so each rule that asks them names them here.
"""

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# int8 dot products summed in int32 (AVX512-VNNI, AVX-VNNI, AMX): without them oneDNN sums pairs of u8 x s8
# products in int16, which saturates with 8-bit weights (run/kernels.int8_kernel, fork/cpu.py's int8 split)
VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")
# bfloat16 products in hardware: oneDNN makes bfloat16 matmuls only with them; torch's own run far slower
BF16 = ("avx512_bf16", "amx_bf16")
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what torch.cpu._is_avx512_supported asks of the CPU


def fields(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """Each `key: value` of /proc/cpuinfo, as its first processor gives it ({} where there is no such file)."""
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            found.setdefault(key.strip(), value.strip())
    return found


def flags(cpuinfo: Path = CPUINFO) -> list[str]:
    """The instruction sets the first flags line names ([] where there is none)."""
    return fields(cpuinfo).get("flags", "").split()


def has_any(names: tuple[str, ...], cpuinfo: Path = CPUINFO) -> bool:
    return bool(set(names) & set(flags(cpuinfo)))
