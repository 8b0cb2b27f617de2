"""patch: a pristine vLLM source tree plus the MiniStream patch set, as two git commits.

    ministream patch 0.32.0                    build/vllm-0.32.0/ from the release wheel
    ministream patch 0.32.0 --git-url URL      ... cloned from URL at tag v0.32.0 instead
    ministream patch 0.32.0 --src CHECKOUT     patch a clean vLLM checkout on branch ministream/v0.32.0
    ministream patch 0.32.0 --refresh-diff     (developer) rewrite patches/v0.32.0/model.diff

Contract with the wheel builder: in the patched tree HEAD is the patch commit (subject
"ministream: MiniStream patch set <name>", trailer "MiniStream-Patch-Hash: sha256:...")
and HEAD~1 is the pristine base; the patch is exactly the files that differ between them.

A patch set is a folder of patches/ (patches/versions.json maps each supported vLLM version
to one; versions may share a folder): *.diff applied with `git apply` (model.diff turns the
tree's llama.py into ministream.py), files/ copied in, manifest.json with the sha256 of the
pristine files the patch touches. scripts/apply_patch.sh applies one to a tree.
"""

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import git
from packaging.version import Version

from .. import MiniStreamError
from ..paths import APPLY_SCRIPT, BUILD, MODEL_FILE, PATCH_SETS
from .release import release_wheel

PATCHES = PATCH_SETS
MODEL = MODEL_FILE
APPLY = APPLY_SCRIPT

LLAMA = "vllm/model_executor/models/llama.py"
MINISTREAM = "vllm/model_executor/models/ministream.py"

SUBJECT = "ministream: MiniStream patch set "
HASH_TRAILER = "MiniStream-Patch-Hash"
# Our commits are machine-made: one identity, whatever the user's git config says.
IDENTITY = {
    "GIT_AUTHOR_NAME": "ministream patch", "GIT_AUTHOR_EMAIL": "ministream@localhost",
    "GIT_COMMITTER_NAME": "ministream patch", "GIT_COMMITTER_EMAIL": "ministream@localhost",
}
# Wheel members left out of a source tree: compiled code (ELF files are caught by content too).
BINARY_SUFFIXES = re.compile(r"\.(so(\.\d+)*|pyd|dylib|a|o|cubin|fatbin)$")


# --- patch sets ---------------------------------------------------------------------------

def supported_versions(patches: Path = PATCHES) -> dict[str, str]:
    """vLLM version -> patch-set folder name, from patches/versions.json."""
    return json.loads((patches / "versions.json").read_text())


def release_line(version: str) -> str:
    """The minor release line of a version: 0.6.6.post1 -> 0.6."""
    return ".".join(version.split(".")[:2])


def patch_dir(version: str, patches: Path = PATCHES) -> Path:
    """The patch-set folder for vLLM `version`.

    A version listed in versions.json has its own entry. Another release of a listed line
    (0.20.0 of the 0.20 line) gets the patch set of that line's newest listed release, on
    condition: check_pristine accepts its tree only when the files the patch touches are
    byte-identical to that release's (sha256 in the manifest)."""
    versions = supported_versions(patches)
    if version in versions:
        return patches / versions[version]
    line = sorted((v for v in versions if release_line(v) == release_line(version)), key=Version)
    if not line:
        raise MiniStreamError(
            f"no MiniStream patch set for vLLM {version} in {patches / 'versions.json'}; "
            f"supported versions: {', '.join(sorted(versions, key=Version))} (and their lines' other "
            f"releases whose files are identical); a new release needs its own: make port FROM=<nearest> TO={version}")
    return patches / versions[line[-1]]


def manifest(patchdir: Path) -> dict:
    return json.loads((patchdir / "manifest.json").read_text())


def _patch_files(patchdir: Path) -> list[Path]:
    return sorted(p for p in patchdir.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def patch_set_hash(patchdir: Path) -> str:
    """sha256 over the patch set's files (names and contents): changes whenever the patch does."""
    h = hashlib.sha256()
    for p in _patch_files(patchdir):
        h.update(p.relative_to(patchdir).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _hashes(tree: Path, expected: dict[str, str]) -> dict[str, str]:
    return {rel: hashlib.sha256((tree / rel).read_bytes()).hexdigest() if (tree / rel).is_file() else "missing"
            for rel in expected}


def check_pristine(tree: Path, version: str, patchdir: Path, origin: str) -> None:
    """Fail unless the files the patch touches in `tree` are those of the vLLM `version` release.

    For a release the manifest does not list (another release of a listed line), the files
    must be identical to those of a release it lists: then the same patch applies unchanged."""
    listed = manifest(patchdir)["pristine_sha256"]
    if version in listed:
        for rel, got in _hashes(tree, listed[version]).items():
            sha = listed[version][rel]
            if got != sha:
                raise MiniStreamError(
                    f"{rel} from {origin} is not vLLM {version}'s (sha256 {got[:12]}, the release has {sha[:12]}, "
                    f"per {patchdir / 'manifest.json'}); check that {origin} is the vLLM {version} release")
        return
    same_line = {v: e for v, e in listed.items() if release_line(v) == release_line(version)}
    if not same_line:
        raise MiniStreamError(f"{patchdir / 'manifest.json'} has no pristine_sha256 entry for vLLM {version}; "
                              f"add one (sha256 of each file the patch touches in that release)")
    for v, expected in same_line.items():
        if _hashes(tree, expected) == expected:
            return
    v, expected = max(same_line.items(), key=lambda kv: Version(kv[0]))
    differ = [rel for rel, got in _hashes(tree, expected).items() if got != expected[rel]]
    raise MiniStreamError(
        f"vLLM {version} is not in {patchdir.parent / 'versions.json'} and its {', '.join(differ)} from {origin} "
        f"differ from vLLM {v}'s, whose patch set {patchdir.name} serves the {release_line(v)} line "
        f"(sha256 in {patchdir / 'manifest.json'}); the patch may not fit it: port it with "
        f"`make port FROM={v} TO={version}` and review the result")


# --- model.diff: models/ministream.py as a diff against the release's llama.py -------------

def model_diff(llama: str, model: str) -> str:
    """A git copy diff: applied in a tree, it writes MINISTREAM = that tree's LLAMA + our changes."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "a").write_text(llama)
        Path(tmp, "b").write_text(model)
        run = subprocess.run(["git", "diff", "--no-index", "--no-color", "--no-ext-diff",
                              "--diff-algorithm=myers", "-U3", "a", "b"],
                             cwd=tmp, capture_output=True, text=True)
    if run.returncode not in (0, 1) or "\n@@" not in run.stdout:
        raise MiniStreamError(f"git diff of {LLAMA} and {MODEL} failed: {run.stderr.strip() or 'no difference'}")
    hunks = run.stdout[run.stdout.index("\n@@") + 1:]
    return (f"diff --git a/{LLAMA} b/{MINISTREAM}\ncopy from {LLAMA}\ncopy to {MINISTREAM}\n"
            f"--- a/{LLAMA}\n+++ b/{MINISTREAM}\n{hunks}")


def refresh_diff(version: str, model: Path = MODEL, patches: Path = PATCHES) -> Path:
    """Rewrite the patch set's model.diff from `model` and the release wheel's llama.py."""
    patchdir = patch_dir(version, patches)
    wheel = release_wheel(version, "cuda")
    with zipfile.ZipFile(wheel) as z:
        llama = z.read(LLAMA)
    sha = manifest(patchdir)["pristine_sha256"][version][LLAMA]
    if hashlib.sha256(llama).hexdigest() != sha:
        raise MiniStreamError(f"{LLAMA} in {wheel.name} does not match {patchdir / 'manifest.json'}; "
                              f"is the cached wheel the vLLM {version} release?")
    out = patchdir / "model.diff"
    out.write_text(model_diff(llama.decode(), model.read_text()))
    return out


# --- obtaining a pristine tree ------------------------------------------------------------

def extract_wheel(wheel: Path, dest: Path) -> int:
    """Write the wheel's vllm/ package, compiled files left out, under `dest`; returns the file count."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith("/") or BINARY_SUFFIXES.search(name):
                continue
            data = z.read(info)
            if data[:4] == b"\x7fELF":  # executables without a suffix (vllm/vllm-rs)
                continue
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            n += 1
    return n


def _pristine_from_wheel(version: str, dest: Path) -> None:
    wheel = release_wheel(version, "cuda")
    n = extract_wheel(wheel, dest)
    repo = git.Repo.init(dest, initial_branch=f"ministream/v{version}")
    (dest / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")
    repo.git.add("-A")
    _commit(repo, f"vLLM {version}: pristine Python tree of {wheel.name}\n\n"
                  f"The wheel's vllm/ package ({n} files) without its compiled files.\n")
    repo.create_tag(f"v{version}")


def _pristine_from_git(version: str, url: str, dest: Path) -> None:
    try:
        git.Repo.clone_from(url, dest, branch=f"v{version}", depth=1)
    except git.GitCommandError as e:
        raise MiniStreamError(f"could not clone tag v{version} of {url}: {e.stderr.strip()}; "
                              f"check the URL and that the repository has that tag") from None


# --- applying in a git repository ---------------------------------------------------------

def _commit(repo: git.Repo, message: str) -> None:
    with repo.git.custom_environment(**IDENTITY):
        repo.git.commit("-q", "--no-verify", "-m", message)


def applied_hash(commit: git.Commit) -> str | None:
    """The patch-set hash recorded by a MiniStream patch commit, None for any other commit."""
    if not commit.message.startswith(SUBJECT):
        return None
    m = re.search(rf"^{HASH_TRAILER}: sha256:([0-9a-f]{{64}})$", commit.message, re.M)
    return m.group(1) if m else None


def _message(version: str, patchdir: Path, digest: str) -> str:
    return (f"{SUBJECT}{patchdir.name}\n\n"
            f"MiniStream (the LLaMA architecture under its own name) for vLLM {version}: adds\n"
            f"{MINISTREAM} and\nvllm/transformers_utils/configs/ministream.py and registers\n"
            f"MiniStreamForCausalLM and model_type \"ministream\". The parent commit is the\n"
            f"unpatched base; `git diff HEAD~1 HEAD` is the whole patch.\n\n"
            f"MiniStream-Patch-Version: {manifest(patchdir)['patch_version']}\n"
            f"{HASH_TRAILER}: sha256:{digest}\n")


def _dirt(repo: git.Repo) -> list[str]:
    changed = [d.a_path for d in repo.index.diff(None)] + [d.a_path for d in repo.index.diff("HEAD")]
    untracked = [p for p in repo.untracked_files if p.startswith("vllm/")]
    return sorted(set(changed + untracked))


def _apply(repo: git.Repo, version: str, patchdir: Path, where: str) -> bool:
    """Put the patch set on the repo as one commit on branch ministream/v<version>.

    HEAD is either unpatched (the patch goes on top) or a patch commit (nothing to do when its
    hash matches, else the patch is redone on its parent). On failure the repository is put
    back as it was. Returns False when there was nothing to do.
    """
    tree = Path(repo.working_tree_dir)
    digest = patch_set_hash(patchdir)
    dirt = _dirt(repo)
    if dirt:
        raise MiniStreamError(f"{where} has uncommitted changes ({', '.join(dirt[:5])}"
                              f"{', ...' if len(dirt) > 5 else ''}); commit or stash them first")
    head = repo.head.commit
    old = applied_hash(head)
    if old == digest:
        print(f"{where} already carries patch set {patchdir.name} (hash {digest[:12]}); nothing to do")
        return False
    if old and not head.parents:
        raise MiniStreamError(f"{where}: the patch commit {head.hexsha[:12]} has no parent to re-apply onto")
    base = head.parents[0] if old else head
    branch = f"ministream/v{version}"
    current = None if repo.head.is_detached else repo.active_branch.name
    if branch in repo.heads and current != branch:
        raise MiniStreamError(f"{where} already has a branch {branch}; check it out to update it, "
                              f"or delete it (git -C {tree} branch -D {branch})")
    if old:
        print(f"{where} carries an older patch set (hash {old[:12]}); re-applying {patchdir.name} "
              f"(hash {digest[:12]}) onto {base.hexsha[:12]}")
    try:
        repo.git.checkout("-q", "-B", branch, base.hexsha)
        run = subprocess.run(["bash", str(APPLY), str(tree), str(patchdir)], capture_output=True, text=True)
        if run.returncode != 0:
            errors = run.stderr.strip().splitlines()
            at_fault = [e.removeprefix("error: ") for e in errors if re.search(r"hunk #|already exists", e)]
            raise MiniStreamError(
                f"patch set {patchdir} does not apply to {where}: {'; '.join(at_fault or errors)}; "
                f"the tree is unchanged. Is it vLLM {version}? A newer release needs its own patch set "
                f"(models/ministream.py re-derived from that llama.py, patches/versions.json extended)")
        repo.git.add("-A", "--", "vllm")
        _commit(repo, _message(version, patchdir, digest))
    except BaseException:
        # back to exactly where we started: same HEAD, same branch, clean tree
        repo.git.reset("-q", "--hard")
        if current == branch:
            repo.git.checkout("-q", "-B", branch, head.hexsha)
        else:
            repo.git.checkout("-q", current or head.hexsha)
            if branch in repo.heads:
                repo.git.branch("-D", branch)
        raise
    print(f"{where}: {base.hexsha[:12]} + patch set {patchdir.name} = {repo.head.commit.hexsha[:12]} "
          f"on branch {branch}")
    return True


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def patch_tree(version: str, src: Path | None = None, git_url: str | None = None,
               build: Path = BUILD, patches: Path = PATCHES) -> Path:
    """The vLLM `version` source tree with the MiniStream patch set committed on top; returns its root.

    src: patch that git checkout in place on a new branch. Otherwise build/vllm-<version>,
    made from a clone of `git_url` at tag v<version>, or from the release wheel's vllm/ package.
    `build` and `patches` are parameters so that tests can use their own.
    """
    patchdir = patch_dir(version, patches)
    if src is not None:
        src = Path(src)
        try:
            repo = git.Repo(src)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError):
            raise MiniStreamError(f"--src {src} is not the root of a git checkout; "
                                  f"pass the directory of a vLLM {version} clone") from None
        if not (src / "vllm").is_dir():
            raise MiniStreamError(f"--src {src} has no vllm/ package; pass the root of a vLLM {version} checkout")
        if not repo.head.is_valid():
            raise MiniStreamError(f"--src {src} has no commits; check out vLLM {version} there first")
        _apply(repo, version, patchdir, _shown(src))
        return src

    tree = Path(build) / f"vllm-{version}"
    if not tree.exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{tree.name}.partial-", dir=tree.parent))
        try:
            if git_url:
                print(f"cloning {git_url} at tag v{version} into {_shown(tree)}")
                shutil.rmtree(partial)
                _pristine_from_git(version, git_url, partial)
                origin = f"{git_url} (tag v{version})"
            else:
                print(f"extracting the vLLM {version} release wheel's Python files into {_shown(tree)}")
                _pristine_from_wheel(version, partial)
                origin = f"the vllm {version} release wheel"
            check_pristine(partial, version, patchdir, origin)
            partial.rename(tree)  # only a complete, checked tree gets the real name
        finally:
            if partial.exists():
                shutil.rmtree(partial)
    try:
        repo = git.Repo(tree)
    except git.InvalidGitRepositoryError:
        raise MiniStreamError(f"{_shown(tree)} exists but is not a git repository made by `ministream patch`; "
                              f"remove it (make clean) and run again") from None
    _apply(repo, version, patchdir, _shown(tree))
    return tree


# --- command line -------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser("patch", help="pristine vLLM source tree + the MiniStream patch set, as two git commits",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("version", help="vLLM release, e.g. 0.32.0")
    p.add_argument("--src", type=Path, help="patch this clean vLLM git checkout in place, on a new branch")
    p.add_argument("--git-url", help="clone the pristine tree from this repository's tag v<version> "
                                     "instead of extracting the release wheel")
    p.add_argument("--build-dir", type=Path, default=BUILD, help="where vllm-<version>/ goes (default: %(default)s)")
    p.add_argument("--refresh-diff", action="store_true",
                   help="developer: rewrite patches/<set>/model.diff from models/ministream.py, then stop")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    if args.refresh_diff:
        out = refresh_diff(args.version)
        print(f"wrote {_shown(out)} from {_shown(MODEL)}")
        return 0
    tree = patch_tree(args.version, src=args.src, git_url=args.git_url, build=args.build_dir)
    print(f"patched tree: {_shown(tree)}")
    return 0
