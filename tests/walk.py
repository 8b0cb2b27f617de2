"""The walk of a folder through serve's check: which of ministream's modules the pre-flight passes through, and
how often it reads what it needs once (config.json, the train config it holds, the quantization scheme). A dev
tool, and what test_folder_check.py holds the check to.

`python tests/walk.py FOLDER [FOLDER ...]`: check_servable(FOLDER) (what `serve`, `generate` and `verify` run
before vLLM starts) under a profiler, printing its stays in order, their count, each module's entries, the opens
of config.json and the calls that read or parse it (COUNTED), and the check's wall time without the profiler
(rough on a loaded machine).

A stay is a maximal run of consecutive calls into code written in the same ministream module; calls into other
code (the standard library, tokenizers, compressed-tensors, a dataclass's generated __init__) do not end one. A
walk of many stays is a check that bounces between modules: each bounce is a place a reader follows it to another
file.
"""

import functools
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import ministream
from ministream import MiniStreamError
from ministream.run.folder import check_servable

PACKAGE = str(Path(ministream.__file__).parent)
# the functions that read or parse what a check needs once: config.json's object, the train config it holds
# (spec), its quantization_config's scheme (scheme.py; scheme_name: read_scheme's --scheme alone)
COUNTED = ("read_config", "train_config_from_hf", "read_scheme", "scheme_name")


@dataclass
class Walk:
    stays: list[str] = field(default_factory=list)  # the module of each stay, in order
    config_reads: int = 0  # opens of a config.json
    calls: Counter = field(default_factory=Counter)  # calls of each COUNTED function
    refused: str | None = None  # the check's refusal, if it refused

    @property
    def entries(self) -> Counter:
        return Counter(self.stays)


_active: list[Walk] = []  # the walk the audit hook counts into (a hook cannot be removed: it stays, idle)


def _audit(event: str, args: tuple) -> None:
    if _active and event == "open" and isinstance(args[0], (str, Path)) and Path(args[0]).name == "config.json":
        _active[-1].config_reads += 1


@functools.cache
def _hooked() -> None:
    sys.addaudithook(_audit)  # once per process, at the first walk


def walk(folder: Path, dtype: str | None = None) -> Walk:
    """check_servable(folder, dtype) under the profiler: its stays and reads (a refusal is a walk too). After one
    check unwatched, so that the walk is the check's own calls, not the bodies of the modules it imports first."""
    _hooked()
    _check(folder, dtype)
    seen = Walk()

    def profile(frame, event, _arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("ministream.") and frame.f_code.co_filename.startswith(PACKAGE)):
            return  # not ministream's, or code no one wrote there (a dataclass's generated __init__)
        if not seen.stays or seen.stays[-1] != module:
            seen.stays.append(module)
        if frame.f_code.co_name in COUNTED:
            seen.calls[frame.f_code.co_name] += 1

    _active.append(seen)
    sys.setprofile(profile)
    try:
        seen.refused = _check(folder, dtype)
    finally:
        sys.setprofile(None)
        _active.pop()
    return seen


def _check(folder: Path, dtype: str | None = None) -> str | None:
    try:
        check_servable(folder, dtype)
    except MiniStreamError as e:
        return str(e)
    return None


def seconds(folder: Path, times: int = 3) -> float:
    """The check's best wall time of `times`, without the profiler."""
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        _check(folder)
        best = min(best, time.perf_counter() - start)
    return best


def report(folder: Path) -> str:
    w = walk(folder)
    short = lambda m: m.removeprefix("ministream.")  # noqa: E731
    lines = [
        f"{folder}: {len(w.stays)} stays" + (f" (refused: {w.refused})" if w.refused else ""),
        "  " + " > ".join(short(m) for m in w.stays),
        "  entries: " + ", ".join(f"{short(m)} {n}" for m, n in w.entries.most_common()),
        f"  config.json opened {w.config_reads}x; " + ", ".join(f"{f} {w.calls[f]}x" for f in COUNTED),
        f"  check_servable: {seconds(folder) * 1000:.0f} ms (best of 3, no profiler)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} FOLDER [FOLDER ...]")
    for arg in sys.argv[1:]:
        print(report(Path(arg)))
