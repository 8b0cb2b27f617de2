"""Output folders (and files) that appear whole or not at all, never overwrite a user's work unasked, and never
destroy an input: a training checkpoint can be weeks of GPU time."""

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from . import MiniStreamError


def check_output(out: Path, force: bool = False, inputs: Iterable[Path] = ()) -> None:
    """Before any long work starts: refuse a file at `out`, a non-empty folder unless `force`, and an
    output that is, holds or lies inside one of the `inputs` (resolved through symlinks, `.` and `..`)."""
    out = Path(out)
    check_apart(out, inputs)
    if out.exists() and not out.is_dir():
        raise MiniStreamError(f"{out} is a file, not a folder: choose another output path")
    if _non_empty(out) and not force:
        raise MiniStreamError(
            f"{out} exists and is not empty: choose another output folder or pass --force to replace it"
        )


def check_apart(out: Path, inputs: Iterable[Path]) -> None:
    """Refuse an output that would replace, or be written into, something the command reads."""
    where = Path(out).resolve()
    for given in inputs:
        path = Path(given).resolve()
        if where == path:
            how = "is"
        elif where in path.parents:
            how = "holds"
        elif path in where.parents:
            how = "lies inside"
        else:
            continue
        raise MiniStreamError(
            f"the output {out} {how} the input {given}: replacing it would destroy what the "
            "command reads; choose an output folder outside it"
        )


def _non_empty(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


@contextmanager
def new_folder(out: str | Path, force: bool = False, inputs: Iterable[Path] = ()):
    """Yield an empty temporary folder beside `out`; on success it replaces `out`, on error or interrupt
    (KeyboardInterrupt, SystemExit: the CLI turns SIGTERM into one) it vanishes and `out` stays as it was.

    A non-empty `out` is refused unless `force`, also one that appeared or filled up while the work ran;
    a file at `out`, and an `out` that overlaps an input, are always refused.
    """
    out = Path(out)
    inputs = list(inputs)
    check_output(out, force, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    # mkdtemp makes it 0700, and the rename would keep that: the folder gets what `mkdir` would give (the umask
    # decides), so another user (a container's unprivileged server) can read what was converted here
    tmp.chmod(0o777 & ~_umask())
    try:
        yield tmp
        check_output(out, force, inputs)  # again: something may have appeared at `out` meanwhile
        _replace(out, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(out: Path, tmp: Path) -> None:
    """`tmp` takes `out`'s name; an old `out` is moved aside first and removed only once `tmp` is in place."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old)


def write_bytes(path: Path, data: bytes) -> Path:
    """`path` whole or not at all: a temporary file beside it, then a rename (a reader, or a run stopped
    half-way, never sees half a file). The file gets the mode a plain write would (the umask decides)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: Path, data) -> Path:
    return write_text(path, json.dumps(data, indent=1) + "\n")


@contextmanager
def new_file(final: Path):
    """A temporary path beside `final` for a writer that needs a file name (a zip, a download); renamed to
    `final` on success with the mode a plain write would give, removed on error: `final` is never half-written."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, final)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
