"""releases: the vLLM releases PyPI publishes, against the patch sets; port-missing: a patch set for each one lacking.

    ministream releases [--index-url URL]     every release line from 0.4 on, newest release first in mind
    ministream port --missing [--index-url]   `make port` (and the release pins) for every release that needs one

The index is read through its simple API (PEP 691's JSON where the server offers it, else the HTML page),
from --index-url or PIP_INDEX_URL as pip takes them, else PyPI. Pre-releases and yanked files are left out.
A release line is covered when its newest release has a patch set (patches/versions.json) or, being another
release of a line that has one, its files the patch touches are byte-identical to a listed release's (read
from its release wheel, as `make matrix` reads them: release_files, check_pristine); a line's older releases
need nothing. A release that is not covered is named with the `make port` that makes its patch set: from the
line's own set when its files differ, else from the nearest older supported release. Exit 0 when every line
is covered, 1 otherwise.
"""

import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .. import MiniStreamError
from ..atomic import write_bytes
from ..net import parse_json, read_url
from ..paths import CACHE, PATCH_SETS, RELEASE_PINS
from .patchset import check_pristine, manifest, patch_set_dir, release_line, supported_versions
from .release import DISTRIBUTIONS, INDEX_TYPE, TIMEOUT, index_files, release_files

PYPI = "https://pypi.org/simple"
INDEX_ENV = "PIP_INDEX_URL"  # pip's own: a mirror, or a test's server


def index_url(given: str | None = None) -> str:
    return (given or os.environ.get(INDEX_ENV) or PYPI).rstrip("/")


# --- what the index publishes ----------------------------------------------------------------------


def published(dist: str, index: str, timeout: float = TIMEOUT) -> dict[str, dict[str, str]]:
    """Final release -> {file name: sha256} of `dist` on the index (yanked files, pre- and dev releases left
    out); {} when the index has no such project. The page is read within `timeout` s in all (net.py)."""
    url = f"{index}/{dist}/"
    request = urllib.request.Request(url, headers={"Accept": f"{INDEX_TYPE}, text/html;q=0.1"})
    try:
        _, body, kind = read_url(request, timeout, f"check the index, or give it longer (--timeout, now {timeout:g})")
    except MiniStreamError:  # a stalled or dribbling index, an answer that is not HTTP: said by net.py
        raise
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return {}
        raise MiniStreamError(f"{url} answered HTTP {e.code}: check --index-url ({INDEX_ENV})") from None
    except OSError as e:
        raise MiniStreamError(
            f"could not reach {url} to list vLLM's releases ({getattr(e, 'reason', None) or e}): check the network "
            f"(or the proxy settings), or name a reachable index with --index-url or {INDEX_ENV}"
        ) from None
    advice = f"is {index} a package index? check --index-url ({INDEX_ENV})"
    files = _json_files(body, url, advice) if kind == INDEX_TYPE else _html_files(body.decode(errors="replace"))
    releases: dict[str, dict[str, str]] = {}
    for name, sha, yanked in files:
        version = _version_of(name, dist)
        if version is None or yanked or version.is_prerelease or version.is_devrelease:
            continue
        releases.setdefault(str(version), {})[name] = sha
    return releases


def _json_files(body: bytes, url: str, advice: str) -> list[tuple[str, str, bool]]:
    return [
        (f["filename"], f["hashes"].get("sha256", ""), bool(f.get("yanked"))) for f in index_files(body, url, advice)
    ]


def _html_files(page: str) -> list[tuple[str, str, bool]]:
    """PEP 503's page: an anchor per file, its sha256 in the URL's fragment, data-yanked when yanked."""
    found = []
    for attrs, text in re.findall(r"<a\s([^>]*)>([^<]+)</a>", page, re.I):
        sha = re.search(r"#sha256=([0-9a-f]{64})", attrs)
        found.append((text.strip(), sha.group(1) if sha else "", "data-yanked" in attrs))
    return found


def _version_of(filename: str, dist: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return version if name == dist else None


# --- each release against the patch sets --------------------------------------------------------------


@dataclass
class Release:
    version: str
    newest: bool  # the newest release of its line
    patch_set: str | None = None  # the set that serves it
    same_as: str | None = None  # a listed release whose files it has, byte for byte
    port_from: str | None = None  # the make port it needs

    def said(self) -> str:
        if self.port_from:
            return f"no patch set: make port FROM={self.port_from} TO={self.version}"
        if self.same_as:
            return f"{self.patch_set} (its files are {self.same_as}'s, byte for byte)"
        return self.patch_set or "older release of its line: nothing needed"


def survey(releases: list[str], patch_sets: Path = PATCH_SETS, cache: Path = CACHE) -> list[Release]:
    """Every release of `releases` from the oldest supported line on, oldest first, judged against the sets."""
    sets = supported_versions(patch_sets)
    oldest = min((Version(release_line(v)) for v in sets), default=Version("0"))
    chosen = sorted((v for v in releases if Version(release_line(v)) >= oldest), key=Version)
    newest = {release_line(v): v for v in chosen}
    found = []
    for v in chosen:
        r = Release(v, newest[release_line(v)] == v)
        if v in sets:
            r.patch_set = sets[v]
        elif r.newest:
            _judge(r, sets, patch_sets, cache)
        found.append(r)
    return found


def _judge(r: Release, sets: dict[str, str], patch_sets: Path, cache: Path) -> None:
    """A line's newest release that versions.json does not list: byte-identical to a listed one, or to port."""
    line = sorted((v for v in sets if release_line(v) == release_line(r.version)), key=Version)
    if not line:
        older = [v for v in sets if Version(v) < Version(r.version)]
        r.port_from = max(older, key=Version) if older else min(sets, key=Version)
        return
    folder = patch_set_dir(r.version, patch_sets)
    from .port import touched  # port imports what this module does not need at import

    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rel, text in release_files(r.version, touched(r.version), cache=cache).items():
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / rel).write_text(text)
            check_pristine(Path(tmp), r.version, folder, f"the vllm {r.version} release wheel")
    except MiniStreamError:
        r.port_from = line[-1]
        return
    listed = manifest(folder)["pristine_sha256"]
    r.patch_set, r.same_as = folder.name, next(v for v in sorted(listed, key=Version) if v in line)


def report(found: list[Release], index: str) -> int:
    """One line per release line; 1 when any line is not covered."""
    print(f"vLLM releases on {index}/vllm/ (lines {release_line(found[0].version)} on; pre-releases left out):")
    lines: dict[str, list[Release]] = {}
    for r in found:
        lines.setdefault(release_line(r.version), []).append(r)
    for line, releases in lines.items():
        shown = [r for r in releases if r.patch_set or r.port_from]
        older = [r.version for r in releases if r not in shown]
        print(f"  {line:<6} " + "; ".join(f"{r.version}: {r.said()}" for r in shown), end="")
        print(f" (older: {', '.join(older)})" if older else "")
    missing = [r for r in found if r.port_from]
    for r in missing:
        print(f"error: vLLM {r.version} has no MiniStream patch set: make port FROM={r.port_from} TO={r.version}")
    if missing:
        print(f"{len(missing)} release(s) without a patch set: `make port-missing` ports them all")
        return 1
    print(f"{len(found)} releases in {len(lines)} lines: every line has its patch set")
    return 0


def releases_command(index: str | None = None, timeout: float = TIMEOUT) -> int:
    """`ministream releases`: the exit status."""
    url = index_url(index)
    found = survey(list(published(DISTRIBUTIONS["cuda"], url, timeout)))
    if not found:
        raise MiniStreamError(f"{url}/vllm/ lists no release of a supported line: is it vLLM's index?")
    return report(found, url)


# --- port-missing: a patch set for each ----------------------------------------------------------------


def port_missing(
    index: str | None = None,
    patch_sets: Path = PATCH_SETS,
    pins: Path = RELEASE_PINS,
    cache: Path = CACHE,
    timeout: float = TIMEOUT,
) -> int:
    """`ministream port --missing` (make port-missing): port each release the survey finds without a patch set,
    oldest first (a new line's nearest older set may be one just made), and pin its files' sha256 from the
    index (each page read within `timeout` s); the exit status (1 when a port left conflicts to resolve)."""
    from .port import port, report as port_report

    url = index_url(index)
    files = published(DISTRIBUTIONS["cuda"], url, timeout)
    todo = [r for r in survey(list(files), patch_sets, cache) if r.port_from]
    if not todo:
        print("every release line has its patch set: nothing to port")
        return 0
    for r in todo:
        source = r.port_from or ""  # todo: each has one
        if release_line(source) != release_line(r.version):  # a new line: the nearest set, made just now or not
            source = max((v for v in supported_versions(patch_sets) if Version(v) < Version(r.version)), key=Version)
        print(f"make port FROM={source} TO={r.version}")
        if port_report(source, r.version, port(source, r.version, patch_sets)):
            return 1
        _pin(pins, r.version, {DISTRIBUTIONS["cuda"]: files[r.version]} | _cpu_files(url, r.version, timeout))
    ported = ",".join(r.version for r in todo)
    print(f"ported {len(todo)}; pinned in {pins.name}; check them with `make matrix VERSIONS={ported}`")
    return 0


def _cpu_files(index: str, version: str, timeout: float) -> dict[str, dict[str, str]]:
    cpu = published(DISTRIBUTIONS["cpu"], index, timeout).get(version)
    return {DISTRIBUTIONS["cpu"]: cpu} if cpu else {}


def _pin(pins: Path, version: str, files: dict[str, dict[str, str]]) -> None:
    """releases.json with the sha256 the index publishes for each file of `version` (release.pin_releases' form)."""
    data = parse_json(pins.read_text(), str(pins), "restore it (git checkout), then run again")
    for dist, named in files.items():
        data.setdefault(dist, {})[version] = dict(sorted(named.items()))
    write_bytes(pins, (json.dumps(data, indent=1) + "\n").encode())
