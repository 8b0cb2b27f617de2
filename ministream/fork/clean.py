"""clean: remove what the tool made and can make again, and refuse whatever holds the user's work.

    ministream clean            check everything first; remove it all, or (exit 2) nothing, naming what is yours
    ministream clean --force    remove it all the same (the old `rm -rf`)

What it may remove, under the current folder (the checkout's root under `make`):
- build/vllm-*/   a tree `ministream patch` made, whose every commit on every ref is ours, with no other
                  branch than ours, no stash and no uncommitted or untracked file; a plain folder is the user's
- dist/           our wheels (`*+ministream.*.whl`, the plugin's) and the leftovers of killed runs
- out/            folders the tool wrote whole and recorded (atomic.mark_made: a checkpoint, a converted folder,
                  verify's results), unchanged since; anything else there is the user's
- build/lib, build/bdist.*, *.egg-info   what `pip install .` leaves (setuptools)
build/cache/ (the verified release files), build/lines/ (`make matrix CLEAN=1`) and build/bench/ stay.
"""

import fnmatch
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import git

from .. import MiniStreamError
from ..atomic import changed_since_made, dead_leftover
from ..paths import BUILD, DIST
from .pristine import IDENTITY

OUT = Path("out")
OUR_WHEELS = ("*+ministream.*.whl", "ministream_vllm_plugin-*.whl")


@dataclass
class Plan:
    remove: list[Path] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # "<path>: <what of the user's it holds>"


def _tree_work(tree: Path) -> str | None:
    """What of the user's a build tree holds, in words; None if it is all the tool's."""
    try:
        repo = git.Repo(tree)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return "not a git repository the tool made (a folder of yours?)"
    ours = IDENTITY["GIT_AUTHOR_EMAIL"]
    try:
        commits = list(repo.iter_commits("--all"))
    except (git.GitCommandError, ValueError):
        return "a git repository whose history cannot be read"
    theirs = [c.hexsha[:12] for c in commits if c.author.email != ours or c.committer.email != ours]
    if theirs:
        return f"commits not made by the tool ({', '.join(theirs[:5])}{', ...' if len(theirs) > 5 else ''})"
    branches = [h.name for h in repo.heads if not fnmatch.fnmatch(h.name, "ministream/v*") or "-before-" in h.name]
    if branches:
        return f"branches of yours ({', '.join(branches[:5])})"
    if any(r.path == "refs/stash" for r in repo.refs):
        return "a stash (git stash list)"
    if repo.is_dirty(untracked_files=True):
        changed = [d.a_path or "?" for d in repo.index.diff(None)] + repo.untracked_files
        return f"uncommitted changes ({', '.join(sorted(changed)[:5])}{', ...' if len(changed) > 5 else ''})"
    return None


def _out_work(folder: Path, plan: Plan) -> None:
    """Plan out/: a folder the tool recorded goes whole if unchanged; other folders are walked."""
    changed = changed_since_made(folder)
    if changed is not None:
        if changed:
            plan.refused.append(f"{folder}: files the tool did not write, or changed since ({', '.join(changed[:5])})")
        else:
            plan.remove.append(folder)
        return
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            _out_work(entry, plan)
        elif not dead_leftover(entry):
            plan.refused.append(f"{entry}: not made by the tool")
    if all(not r.startswith(f"{folder}/") for r in plan.refused):
        plan.remove.append(folder)


def plan(root: Path = Path("."), force: bool = False) -> Plan:
    root = Path(root)
    build, dist, out = root / BUILD, root / DIST, root / OUT
    p = Plan()
    for tree in sorted(build.glob("vllm-*")) if build.is_dir() else []:
        work = None if force else _tree_work(tree)
        (p.refused.append(f"{tree}: {work}") if work else p.remove.append(tree))
    for entry in sorted(build.glob(".vllm-*")) if build.is_dir() else []:
        if force or dead_leftover(entry):
            p.remove.append(entry)
    p.remove += [x for x in [build / "lib", *build.glob("bdist.*")] if x.exists()]
    p.remove += sorted(root.glob("*.egg-info"))
    if dist.is_dir():
        for entry in sorted(dist.iterdir()):
            if force or any(fnmatch.fnmatch(entry.name, w) for w in OUR_WHEELS) or dead_leftover(entry):
                p.remove.append(entry)
            else:
                p.refused.append(f"{entry}: not a wheel the tool builds")
    if out.is_dir():
        if force:
            p.remove.append(out)
        else:
            _out_work(out, p)
    return p


def clean(root: Path = Path("."), force: bool = False) -> int:
    """`ministream clean`: remove the plan whole, or nothing when anything in it is the user's."""
    p = plan(root, force)
    if p.refused:
        raise MiniStreamError(
            "nothing was removed, because these hold work that is not the tool's: "
            + "; ".join(p.refused)
            + ". Move what you want to keep elsewhere, or remove everything regardless: make clean FORCE=1"
        )
    for path in p.remove:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        print(f"removed {path}")
    if not p.remove:
        print("nothing to clean")
    return 0
