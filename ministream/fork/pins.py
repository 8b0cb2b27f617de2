"""pins: a release's own requirements that no package index publishes, found before pip or uv fails on them,
said by name; and, only when asked, the nearest published version in their place, recorded.

vLLM 0.34.0 pins `flashinfer-python==0.7.3`, which PyPI never published (0.7.2.post1, then 0.7.4), so `pip
install vllm==0.34.0` fails on every machine, and our patched wheel of it with it. `install`, `image` and
`cuda-smoke` read the wheel's own requirements (METADATA's Requires-Dist, markers evaluated for this
interpreter, no extras), ask the sources their installer reads (pip's configured indexes and find-links,
or the index uv uses) which versions each one publishes for this interpreter, and name every requirement
none satisfies. With `nearest` (`--nearest-pins`, `NEAREST_PINS=1`) an exact pin is replaced by the nearest
version published in its own series (the next above it, else the last below it), and the change is written
beside the environment (ministream-pins.json), never in silence.
"""

import os
import re
import subprocess
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import date
from email.parser import BytesParser
from email.policy import compat32
from html.parser import HTMLParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, sys_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from .. import MiniStreamError
from ..atomic import write_json
from ..net import read_url
from .release import index_files

PYPI = "https://pypi.org/simple/"
# "name==version" -> the upstream issue about that pin; empty where none was found (flashinfer-python==0.7.3,
# vLLM 0.34.0: the search and its result are in docs/gpu.md).
UPSTREAM_ISSUES: dict[str, str] = {}
RECORD = "ministream-pins.json"  # beside the environment's bin/: what an install put in place of a pin
TIMEOUT = 60
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


@dataclass
class Sources:
    """Where an installer looks for packages: simple indexes (http(s) or file URLs) and find-links (folders,
    or pages of links)."""

    indexes: list[str] = field(default_factory=lambda: [PYPI])
    find_links: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return ", ".join(self.indexes + self.find_links) or "no package source"


@dataclass
class Unresolvable:
    """A requirement of the wheel that no source satisfies for this interpreter."""

    requirement: str  # as the wheel states it, without its marker: "flashinfer-python==0.7.3"
    name: str  # canonical: flashinfer-python
    published: list[str]  # the versions the sources publish for this interpreter, oldest first
    nearest: str | None  # an exact pin's nearest published version in its series; None: nothing to put instead
    upstream: str | None  # the upstream issue about it, if one is known

    def said(self) -> str:
        """One clause: what is required, what is published beside it, the upstream issue."""
        pin = _exact(self.requirement)
        if not self.published:
            where = "of which no source publishes any version for this interpreter"
        elif pin is None:
            where = f"which no published version satisfies (the last: {', '.join(self.published[-3:])})"
        else:
            below = [v for v in self.published if Version(v) < pin]
            above = [v for v in self.published if Version(v) > pin]
            near = ([f"{below[-1]} below"] if below else []) + ([f"{above[0]} above"] if above else [])
            where = f"which no source publishes ({', '.join(near)})"
        issue = f"upstream issue: {self.upstream}" if self.upstream else "no upstream issue found"
        return f"{self.requirement}, {where}; {issue}"


# --- the wheel's own requirements ----------------------------------------------------------------------------


def wheel_requirements(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel, from its METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        info = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        meta = BytesParser(policy=compat32).parsebytes(zf.read(info), headersonly=True)
    return meta["Name"], meta["Version"], [str(r) for r in meta.get_all("Requires-Dist") or []]


def applies(requirement: Requirement, environment: dict | None = None) -> bool:
    """Whether a requirement is installed here: its marker true for this interpreter, asked for by no extra."""
    if requirement.marker is None:
        return True
    env: dict[str, str] = {**(environment or {k: str(v) for k, v in default_environment().items()}), "extra": ""}
    return requirement.marker.evaluate(env)


def _exact(spec: str) -> Version | None:
    """The version of an exact pin ("name==1.2.3", no wildcard), else None."""
    req = Requirement(spec)
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        return Version(specs[0].version)
    return None


# --- what the sources publish ------------------------------------------------------------------------------


class _Links(HTMLParser):
    """The file names a PEP 503 page links to (an anchor's text, or the last part of its href)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href") or ""

    def handle_data(self, data):
        if self._href is not None and data.strip():
            self.names.append(data.strip())
            self._href = None

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:  # an anchor without text: its href names the file
            path = urllib.parse.urlsplit(self._href).path
            self.names.append(urllib.parse.unquote(path.rsplit("/", 1)[-1]))
            self._href = None


def _page_names(text: str, kind: str, url: str) -> list[str]:
    if "json" in kind:  # a malformed page: net.NotJSON, and the source counts as unread (`check`)
        return [f["filename"] for f in index_files(text.encode(), url, "check the index in pip's settings")]
    parser = _Links()
    parser.feed(text)
    return parser.names


def _read_url(url: str) -> tuple[str, str] | None:
    """(text, content type) of a page; None where the source has no such page (HTTP 404, no such file)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.request.url2pathname(parts.path))
        if path.is_dir():
            index = path / "index.html"
            if index.is_file():
                return index.read_text(errors="replace"), "text/html"
            return "\n".join(f'<a href="{p.name}">{p.name}</a>' for p in path.iterdir()), "text/html"
        return (path.read_text(errors="replace"), "text/html") if path.is_file() else None
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    try:
        _, body, kind = read_url(request, TIMEOUT)  # within TIMEOUT s in all (net.py)
        return body.decode("utf-8", "replace"), kind
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def _file_names(name: str, sources: Sources) -> list[str]:
    """Every file name the sources offer that may be `name`'s (an installer reads the same)."""
    names: list[str] = []
    for index in sources.indexes:
        url = index.rstrip("/") + "/" + canonicalize_name(name) + "/"
        got = _read_url(url)
        if got is not None:
            names += _page_names(got[0], got[1], url)
    for link in sources.find_links:
        if "://" not in link:
            link = Path(link).resolve().as_uri()
        got = _read_url(link)
        if got is not None:
            names += _page_names(got[0], got[1], link)
    return names


def _versions(name: str, files: list[str], tags: frozenset[Tag]) -> set[Version]:
    """The versions of `name` among `files` that this interpreter can install: a wheel whose tags it
    accepts, or an sdist."""
    want, found = canonicalize_name(name), set()
    for f in files:
        try:
            if f.endswith(".whl"):
                dist, version, _, wheel_tags = parse_wheel_filename(f)
                if not wheel_tags & tags:
                    continue
            elif f.endswith((".tar.gz", ".zip")):
                dist, version = parse_sdist_filename(f)
            else:
                continue
        except (InvalidWheelFilename, InvalidSdistFilename, ValueError):
            continue
        if canonicalize_name(dist) == want:
            found.add(version)
    return found


def published(name: str, sources: Sources, tags: frozenset[Tag] | None = None) -> list[Version]:
    """The versions of `name` the sources publish for this interpreter, oldest first."""
    return sorted(_versions(name, _file_names(name, sources), tags or frozenset(sys_tags())))


def nearest(pin: Version, versions: list[Version]) -> Version | None:
    """The published version nearest a pin nobody published, in its own series (same major.minor): the next
    above it (a later release of the series carries what the pinned one would have), else the last below
    it; final releases only. None when its series has none."""
    series = [v for v in versions if v.release[:2] == pin.release[:2] and not v.is_prerelease and not v.is_devrelease]
    above = [v for v in series if v > pin]
    below = [v for v in series if v < pin]
    return min(above) if above else (max(below) if below else None)


# --- the check -------------------------------------------------------------------------------------------------


def check(wheel: Path, sources: Sources, environment: dict | None = None) -> tuple[list[Unresolvable], list[str]]:
    """The wheel's own requirements that no source satisfies, and the sources that could not be read (a
    requirement whose sources could not all be read is not judged: pip or uv says what it finds)."""
    _, _, lines = wheel_requirements(wheel)
    reqs = []
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.url is None and applies(req, environment):
            reqs.append(req)
    tags = frozenset(sys_tags())

    def one(req: Requirement) -> tuple[Requirement, list[Version] | None, str | None]:
        try:
            return req, published(req.name, sources, tags), None
        except (OSError, ValueError) as e:  # ValueError: a page that is not an index's (net.NotJSON)
            return req, None, f"{req.name}: {getattr(e, 'reason', None) or e}"

    found, unread = [], []
    with ThreadPoolExecutor(8) as pool:
        for req, versions, error in pool.map(one, reqs):
            if versions is None:
                unread.append(error or req.name)
                continue
            if any(req.specifier.contains(v, prereleases=True) for v in versions):
                continue
            spec = f"{req.name}{req.specifier}"
            pin = _exact(spec)
            near = nearest(pin, versions) if pin is not None else None
            found.append(
                Unresolvable(
                    requirement=spec,
                    name=canonicalize_name(req.name),
                    published=[str(v) for v in versions],
                    nearest=str(near) if near else None,
                    upstream=UPSTREAM_ISSUES.get(f"{canonicalize_name(req.name)}=={pin}") if pin else None,
                )
            )
    return found, unread


def refusal(dist: str, version: str, found: list[Unresolvable], sources: Sources, option: str | None) -> str:
    """The error for requirements nobody can install: each by name, and what to do (`option`: how to ask for
    the nearest published versions; None where this command takes no stand-in)."""
    release = version.split("+")[0]
    each = "; ".join(u.said() for u in found)
    can = [u for u in found if u.nearest]
    instead = ", ".join(f"{u.name} {u.nearest}" for u in can)
    if not can:
        fix = "no version of its series is published either: nothing can stand in for it"
    elif option is None:
        fix = (
            f"this build installs the release's requirements as they are; `make install NEAREST_PINS=1` puts {instead}"
        )
        fix += " in their place"
    else:
        fix = (
            f"to install with the nearest published version instead ({instead}), run again with {option}; the "
            f"change is recorded in the environment's {RECORD}"
        )
    return (
        f"{dist} {version}'s own requirements cannot be installed from {sources}: {each}. `pip install "
        f"{dist}=={release}` fails the same way; {fix}"
    )


def substitutes(found: list[Unresolvable], dist: str, version: str) -> dict[str, str]:
    """name -> the requirement installed in its place ("flashinfer-python==0.7.4"); refused where there is none."""
    missing = [u for u in found if not u.nearest]
    if missing:
        raise MiniStreamError(
            f"{dist} {version} requires " + "; ".join(u.said() for u in missing) + ", and no version of its series is "
            "published to put in its place: it cannot be installed here"
        )
    return {u.name: f"{u.name}=={u.nearest}" for u in found}


def replaced_requirements(lines: list[str], subs: dict[str, str]) -> list[str]:
    """The wheel's Requires-Dist lines but those of its extras, each substituted requirement replaced (its
    marker kept): a requirements file for the installer, which evaluates the markers itself."""
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        new = subs.get(canonicalize_name(req.name))
        out.append(new + (f" ; {req.marker}" if req.marker else "") if new and req.url is None else line)
    return out


def record(env: Path, dist: str, version: str, found: list[Unresolvable] | None) -> Path | None:
    """Write (or, with nothing replaced, remove) ENV/ministream-pins.json: what the install put in place of
    the release's own pins."""
    path = Path(env) / RECORD
    if not found:
        path.unlink(missing_ok=True)
        return None
    write_json(
        path,
        {
            "distribution": dist,
            "version": version,
            "date": date.today().isoformat(),
            "replaced": [
                {**asdict(u), "installed": f"{u.name}=={u.nearest}", "published": u.published[-8:]} for u in found
            ],
        },
    )
    return path


def said_replaced(found: list[Unresolvable]) -> str:
    return ", ".join(f"{u.requirement} -> {u.name}=={u.nearest}" for u in found)


# --- the sources an installer reads --------------------------------------------------------------------------


_CONFIG_LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip_sources(python: str) -> Sources:
    """The indexes and find-links `python -m pip` reads: its configuration files and PIP_* variables, as `pip
    config list` shows them (the environment's own settings win over the files')."""
    run = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, env=os.environ.copy())
    values: dict[str, dict[str, str]] = {}
    for line in run.stdout.splitlines():
        m = _CONFIG_LINE.match(line.strip())
        if m and m["section"] in ("global", "install", ":env:"):
            values.setdefault(m["key"], {})[m["section"]] = m["value"]

    def value(key: str) -> list[str]:
        got = values.get(key, {})
        text = next((got[s] for s in (":env:", "install", "global") if s in got), "")
        return text.split()

    if value("no-index") and value("no-index")[0].lower() in ("1", "true", "yes", "on"):
        indexes = []
    else:
        indexes = (value("index-url") or [PYPI])[:1] + value("extra-index-url")
    return Sources(indexes=indexes, find_links=value("find-links"))


def uv_sources(environ: dict | None = None) -> Sources:
    """The indexes uv reads from its environment variables (PyPI unless told otherwise)."""
    env = os.environ if environ is None else environ
    default = env.get("UV_DEFAULT_INDEX") or env.get("UV_INDEX_URL") or PYPI
    # UV_INDEX entries may be named ("name=url")
    extra = [i.split("=", 1)[-1] for i in (env.get("UV_INDEX") or "").split()]
    extra += (env.get("UV_EXTRA_INDEX_URL") or "").split()
    links = [f for f in (env.get("UV_FIND_LINKS") or "").split(",") if f]
    return Sources(indexes=[default, *extra], find_links=links)
