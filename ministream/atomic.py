"""Output folders that appear whole or not at all, and never overwrite a user's work unasked."""

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from . import MiniStreamError


def check_output(out: Path, force: bool = False) -> None:
    """Refuse a file at `out`, and a non-empty folder unless `force`: before any long work starts."""
    if out.exists() and not out.is_dir():
        raise MiniStreamError(f"{out} is a file, not a folder: choose another output path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MiniStreamError(f"{out} exists and is not empty: choose another output folder or pass --force to replace it")


@contextmanager
def new_folder(out: str | Path, force: bool = False):
    """Yield an empty temporary folder beside `out`; on success it replaces `out`, on error it vanishes.

    A non-empty `out` is refused unless `force`; a file at `out` is always refused.
    """
    out = Path(out)
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
