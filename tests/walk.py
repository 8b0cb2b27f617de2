"""The walk of a folder through serve's check, or through doctor: which of ministream's modules the check passes
through, and how often it reads what it needs once (config.json, the train config it holds, the quantization scheme).
A dev tool, and what test_folder_check.py holds both checks to.

`python tests/walk.py [--doctor] FOLDER [FOLDER ...]`: check_servable(FOLDER) (what `serve`, `generate` and `verify`
run before vLLM starts), or with --doctor `ministream doctor`'s findings (doctor(FOLDER): the folder, the installed
vLLM, this machine's memory), under a profiler, printing its stays in order, their count, each module's entries,
the opens of config.json and the calls that read or parse it (COUNTED), and the check's wall time without the
profiler (rough on a loaded machine).

A stay is a maximal run of consecutive calls into code written in the same ministream module; calls into other
code (the standard library, tokenizers, compressed-tensors, a dataclass's generated __init__) do not end one. A
walk of many stays is a check that bounces between modules: each bounce is a place a reader follows it to another
file.
"""

import functools
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ministream
from ministream import MiniStreamError
from ministream.run.doctor import doctor
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
    returned: object = None  # else what it returned (doctor: its findings)

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
    """check_servable(folder, dtype) under the profiler: its stays and reads (a refusal is a walk too)."""
    return watched(lambda: check_servable(folder, dtype))


def walk_doctor(folder: Path, **judged) -> Walk:
    """doctor(folder, **judged) (its vllm_dir, settings, memory_gib) under the profiler: its stays and reads (a
    folder it cannot read at all is a refusal)."""
    return watched(lambda: doctor(folder, **judged))


def watched(check: Callable[[], object]) -> Walk:
    """The check's stays and reads. After one run unwatched, so that the walk is the check's own calls, not the
    bodies of the modules it imports first, nor what a module caches once per process."""
    _hooked()
    _run(check)
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
        seen.returned = check()
    except MiniStreamError as e:
        seen.refused = str(e)
    finally:
        sys.setprofile(None)
        _active.pop()
    return seen


def _run(check: Callable[[], object]) -> str | None:
    try:
        check()
    except MiniStreamError as e:
        return str(e)
    return None


def seconds(check: Callable[[], object], times: int = 3) -> float:
    """The check's best wall time of `times`, without the profiler."""
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        _run(check)
        best = min(best, time.perf_counter() - start)
    return best


def report(folder: Path, with_doctor: bool = False) -> str:
    name, check = (
        ("doctor", lambda: doctor(folder)) if with_doctor else ("check_servable", lambda: check_servable(folder))
    )
    w = watched(check)
    short = lambda m: m.removeprefix("ministream.")  # noqa: E731
    lines = [
        f"{folder} ({name}): {len(w.stays)} stays" + (f" (refused: {w.refused})" if w.refused else ""),
        "  " + " > ".join(short(m) for m in w.stays),
        "  entries: " + ", ".join(f"{short(m)} {n}" for m, n in w.entries.most_common()),
        f"  config.json opened {w.config_reads}x; " + ", ".join(f"{f} {w.calls[f]}x" for f in COUNTED),
        f"  {name}: {seconds(check) * 1000:.0f} ms (best of 3, no profiler)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    with_doctor = "--doctor" in args
    folders = [a for a in args if a != "--doctor"]
    if not folders:
        sys.exit(f"usage: {sys.argv[0]} [--doctor] FOLDER [FOLDER ...]")
    for arg in folders:
        print(report(Path(arg), with_doctor))
