"""Output folders (and files) that appear whole or not at all, never overwrite a user's work unasked, and never
destroy an input: a training checkpoint can be weeks of GPU time.

Two more guarantees for where the tool meets other runs:
- One writer at a time: `lock(path)` around whatever writes an output (a tree, a folder, a file in dist/ or
  the cache). A second run waits, saying for whom, and then finds the work done; flock(2) frees a lock of a
  killed process by itself, so no lock is ever stale.
- Leftovers name their maker: every temporary name beside an output is `.<name>.<kind>-<pid>@<host>-<random>`,
  so the next run beside it removes those whose process is gone (`sweep`), and only those.

And every way writing an output can fail ends in one line: an OSError of any step here (the lock, mkdir, mkstemp,
a rename, a removal) becomes a `MiniStreamError` naming the path, errno's words and what to do (`output_error`);
what cannot work is refused before the work starts (`check_output`: a read-only disk, a folder the user may not
write, a mount point, which no rename can replace). An output given as a symbolic link is written where the link
points (the link stays; its target is replaced whole, like any output), and SIGINT/SIGTERM wait while an output
is swapped in (`signals_held`), so an interrupt never leaves it half-replaced.
"""

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from . import MiniStreamError


def check_output(out: Path, force: bool = False, inputs: Iterable[Path] = ()) -> None:
    """Before any long work starts: refuse a file at `out`, a non-empty folder unless `force`, an
    output that is, holds or lies inside one of the `inputs` (resolved through symlinks, `.` and `..`), and
    one that cannot be written whole where it is (`check_place`)."""
    out = Path(out)
    check_apart(out, inputs)
    if out.exists() and not out.is_dir():
        raise MiniStreamError(f"{out} is a file, not a folder: choose another output path")
    target = output_path(out)
    check_place(out, target)
    if _non_empty(out) and not force:
        raise MiniStreamError(
            f"{out} exists and is not empty: choose another output folder or pass --force to replace it"
        )
    if inside := mounts_inside(target):  # rmtree of the old folder would delete files of that file system
        raise MiniStreamError(
            f"{out} holds the mount point {inside[0]}: replacing {out} would delete the files of that other file "
            "system; unmount it, or choose another output folder"
        )


def output_path(out: Path) -> Path:
    """Where an output given as `out` is written: `out` itself, or for a symbolic link its target (the link
    stays and points at the new output; renaming onto the link would replace the link instead)."""
    out = Path(out)
    if not out.is_symlink():
        return out
    target = Path(os.path.realpath(out))
    if target.is_symlink():
        raise MiniStreamError(f"{out} is a symbolic link that loops ({target}): remove it or point it at a folder")
    if not target.parent.is_dir():
        raise MiniStreamError(
            f"{out} is a symbolic link to {target}, whose folder {target.parent} does not exist (a disk not "
            "mounted?): mount or create it, or remove the link, and run again"
        )
    return target


def check_place(out: Path, target: Path) -> None:
    """Refuse an output (`out`, written at `target`) that cannot be written whole there: a mount point (no
    rename replaces one, and writing into it in place could leave half an output), and a folder the user may
    not write or that lies on a read-only file system."""
    if is_mount_point(target):
        inside = f"a folder inside it, e.g. {out / 'model'}" if target.is_dir() else "another path"
        raise MiniStreamError(
            f"{out} is a mount point{f' ({target})' if target != out else ''}: a rename cannot replace it, so "
            f"it cannot be written whole (and in place a failure would leave half an output there): give {inside}"
        )
    folder = next(p for p in [target.parent, *target.parent.parents] if p.exists())  # mkdir starts there
    if os.access(folder, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return
    code = errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES
    raise output_error(OSError(code, os.strerror(code), str(folder)), out)


def mount_points() -> set[str]:
    """The mount points of this process's mount namespace (bind mounts of a folder of the same file system
    included, which `os.path.ismount` does not see)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    # the 5th field, with space, tab, newline and backslash written as octal escapes
    return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in lines}


def is_mount_point(path: Path) -> bool:
    return os.path.lexists(path) and (os.path.realpath(path) in mount_points() or os.path.ismount(path))


def mounts_inside(folder: Path) -> list[str]:
    """The mount points below `folder` (not `folder` itself)."""
    if not Path(folder).is_dir():
        return []
    real = os.path.realpath(folder).rstrip("/") + "/"
    return sorted(m for m in mount_points() if m.startswith(real) and m != real)


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
    given = Path(out)
    inputs = list(inputs)
    check_output(given, force, inputs)
    out = output_path(given)
    if out != given:
        print(f"note: {given} is a symbolic link: writing its target {out} (the link stays)", file=sys.stderr)
    with _writing(given):
        out.parent.mkdir(parents=True, exist_ok=True)
    with lock(out, f"writing {out}"):
        check_output(given, force, inputs)  # again: a run we waited for may have filled it
        sweep(out)
        tmp = temp_folder(out, "tmp")
        try:
            yield tmp  # the caller's own OSErrors pass as they are: it knows what it was doing
            with _writing(given):
                mark_made(tmp)
            check_output(given, force, inputs)  # again: something may have appeared at `out` meanwhile
            with _writing(given):
                _replace(out, tmp)
        except BaseException:
            with signals_held():
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _replace(out: Path, tmp: Path) -> None:
    """`tmp` takes `out`'s name; an old `out` is moved aside first and removed only once `tmp` is in place."""
    old = None
    with signals_held():  # between the two renames `out` is missing: an interrupt waits until it is back
        if out.exists():
            old = out.with_name(f".{out.name}.old-{maker()}-{tmp.name.rsplit('-', 1)[-1]}")
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)
            raise
        if old is not None:
            try:
                shutil.rmtree(old)
            except OSError as e:  # the new output is whole and in place: a leftover to name, not a failure
                print(
                    f"warning: wrote {out}, but could not remove the old one, moved aside to {old} "
                    f"({_words(e)}): remove it yourself",
                    file=sys.stderr,
                )


def write_bytes(path: Path, data: bytes) -> Path:
    """`path` whole or not at all: a temporary file beside it, then a rename (a reader, or a run stopped
    half-way, never sees half a file). The file gets the mode a plain write would (the umask decides)."""
    with new_file(Path(path)) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: Path, data) -> Path:
    return write_text(path, json.dumps(data, indent=1) + "\n")


@contextmanager
def new_file(final: Path):
    """A temporary path beside `final` for a writer that needs a file name (a zip, a download); renamed to
    `final` on success with the mode a plain write would give, removed on error: `final` is never half-written."""
    given = Path(final)
    final = output_path(given)
    check_place(given, final)
    with _writing(given):
        final.parent.mkdir(parents=True, exist_ok=True)
    sweep(final)
    with _writing(given):
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.part-{maker()}-")
        os.close(fd)
    try:
        yield Path(tmp)  # the caller's own OSErrors pass as they are: it knows what it was doing
        with _writing(given), signals_held():
            os.chmod(tmp, 0o666 & ~umask())
            os.replace(tmp, final)
    finally:
        with signals_held(), suppress(OSError):
            Path(tmp).unlink(missing_ok=True)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- leftovers of killed runs -----------------------------------------------------------------

KINDS = ("tmp", "old", "part", "partial", "wheel-made", "download")  # what a leftover beside an output can be
_LEFTOVER = re.compile(rf"^\.(?P<name>.+)\.(?P<kind>{'|'.join(KINDS)})-(?P<pid>\d+)@(?P<host>.+)-(?P<rand>[^-]+)$")


def maker() -> str:
    """`<pid>@<host>`: who made a temporary name, for `sweep` to tell a live run's work from a dead one's."""
    return f"{os.getpid()}@{socket.gethostname()}"


def temp_folder(beside: Path, kind: str) -> Path:
    """An empty folder `.<name>.<kind>-<pid>@<host>-<random>` beside `beside`, with the mode `mkdir` would give.

    mkdtemp makes it 0700, and a rename keeps that: the umask decides instead, so another user (a container's
    unprivileged server, a colleague) can read what was made here, as after `cp -r`."""
    assert kind in KINDS
    with _writing(beside):
        tmp = Path(tempfile.mkdtemp(prefix=f".{beside.name}.{kind}-{maker()}-", dir=beside.parent))
        tmp.chmod(0o777 & ~umask())
    return tmp


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def dead_leftover(path: Path) -> bool:
    """Is `path` a temporary name (`.<name>.<kind>-<pid>@<host>-<random>`) whose run is gone from this host?"""
    m = _LEFTOVER.match(Path(path).name)
    return m is not None and m["host"] == socket.gethostname() and not alive(int(m["pid"]))


def leftovers(beside: Path) -> list[tuple[Path, bool]]:
    """The temporary names of runs beside `beside`, each with whether its maker is gone (same host, dead pid)."""
    beside = Path(beside)
    try:
        entries = list(beside.parent.iterdir())
    except OSError:
        return []
    return [
        (entry, dead_leftover(entry))
        for entry in entries
        if (m := _LEFTOVER.match(entry.name)) and m["name"] == beside.name
    ]


def sweep(beside: Path) -> list[Path]:
    """Remove what killed runs left beside `beside` (their pid is gone on this host); a live run's, or one of
    another host (a shared disk), stays. Returns what was removed."""
    removed = []
    for path, dead in leftovers(beside):
        if not dead:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with suppress(OSError):  # a read-only disk: the leftover stays, the write then says why
                path.unlink(missing_ok=True)
        if not path.exists():
            print(f"removed {path}, left by a run that was killed", file=sys.stderr)
            removed.append(path)
    return removed


# --- one writer at a time -------------------------------------------------------------------------


def lock_file(target: Path) -> Path:
    """Where `lock(target)` locks: `.<name>.lock` beside the target."""
    target = Path(target)
    return target.with_name(f".{target.name}.lock")


@contextmanager
def lock(target: Path, what: str, path: Path | None = None) -> Iterator[None]:
    """Hold the lock of `target` (at `path`, by default `lock_file(target)`) while the block writes it.

    A second run prints who holds it (`what` it is doing, pid and host) and waits: when its turn comes it
    sees what the first made. The lock file goes when the holder is done; flock frees a killed holder's."""
    path = Path(path) if path is not None else lock_file(target)
    with _writing(target):
        path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd, writable = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
        except PermissionError as denied:  # another user's lock file (a shared cache): flock needs a read handle
            try:
                fd, writable = os.open(path, os.O_RDONLY), False
            except OSError:
                raise output_error(denied, target) from None
        except OSError as e:
            raise output_error(e, target) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another run"
                print(f"waiting for {holder} to finish with {target} ...", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            # the holder before us may have removed the file we locked: then lock the one at `path` now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
        except BaseException:
            os.close(fd)
            raise
        break
    try:
        if writable:
            with _writing(target):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {maker()} ({what})\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)


def pause_point(name: str) -> None:
    """Where the tests kill a run with a real SIGKILL: MINISTREAM_PAUSE_AT=<name> stops the process here,
    having said so on stderr, until a signal ends it (the points: convert:weights, convert-lora:weights,
    patch:pristine, patch:apply, wheel:zip)."""
    if os.environ.get("MINISTREAM_PAUSE_AT") == name:
        print(f"paused at {name} (pid {os.getpid()})", file=sys.stderr, flush=True)
        while True:
            signal.pause()


# --- interrupts ------------------------------------------------------------------------------------


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done, then act as they would have: a swap of two names,
    or the removal of a temporary, is never cut half-way. Handlers can be set in the main thread only:
    elsewhere this holds nothing."""
    held = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.getsignal(s) for s in held}
    if threading.current_thread() is not threading.main_thread() or None in old.values():
        yield
        return
    caught: list[int] = []
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


# --- an OS error in one line --------------------------------------------------------------------------

_ADVICE = {  # what to do, by errno
    errno.EROFS: "choose an output on a writable disk, or remount that one read-write",
    errno.EACCES: "choose an output folder you may write, or ask its owner for write access",
    errno.EPERM: "choose an output folder you may write, or ask its owner for write access",
    errno.EBUSY: "something holds it (a mount point, a program using it): choose another path",
    errno.ENOENT: "a folder on the way went missing: check the path and run again",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another output path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "symbolic links loop on the way: fix the link",
}


def _words(e: OSError) -> str:
    """errno's words, as `ls` prints them: "read-only file system", "permission denied"."""
    words = os.strerror(e.errno) if e.errno else str(e)
    return words[:1].lower() + words[1:]


def output_error(e: OSError, out: Path | str) -> MiniStreamError:
    """The one-line error for an OSError met while writing the output `out` (`e.filename` is the file it
    was about: `out`, or its lock or temporary beside it): the path, errno's words, what to do."""
    full = disk_full(e, Path(out), "while writing it")
    if full is not None:
        return full
    about = f"{e.filename}: " if e.filename and str(e.filename) != str(out) else ""
    advice = _ADVICE.get(e.errno or 0, "check that path and the disk, and run again")
    return MiniStreamError(f"cannot write {out} ({about}{_words(e)}); nothing was replaced: {advice}")


def os_error(e: OSError) -> MiniStreamError:
    """The one line for an OSError that no output step named (the CLI's last resort): the file and errno's words."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
    if not where:  # a socket, a pipe: no path to name
        return MiniStreamError(f"{_words(e)} ({type(e).__name__}): check what the command reaches, and run again")
    return disk_full(e, Path(where), "") or MiniStreamError(f"{where}: {_words(e)}: check that path and run again")


@contextmanager
def _writing(out: Path | str) -> Iterator[None]:
    """The block writes the output `out`: its OSErrors become `output_error`s."""
    try:
        yield
    except OSError as e:
        raise output_error(e, out) from None


# --- a full disk ------------------------------------------------------------------------------------


def check_space(where: Path, needed: int, what: str) -> None:
    """Refuse, before writing, an output of about `needed` bytes in `where` that the disk cannot hold."""
    where = Path(where)
    probe = next((p for p in [where, *where.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise MiniStreamError(
            f"{what} needs about {_gb(needed)} free in {probe}, which has {_gb(free)}: "
            f"free some space there or choose an output on another disk"
        )


def disk_full(e: OSError, where: Path, what: str) -> MiniStreamError | None:
    """The error to raise for a write that failed because the disk filled up (`what`: "while converting X"); None
    for any other OSError."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return MiniStreamError(
        f"the disk holding {where} filled up {what} ({os.strerror(e.errno)}); nothing was "
        f"replaced and the partial output is removed: free some space there, or choose another output, and run again"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.0f} GB"


# --- what the tool made, for `ministream clean` to tell from the user's ---------------------------

MADE = ".ministream-made.json"  # in each folder the tool writes whole: its files, as they were written


def _files(folder: Path) -> dict[str, list[int]]:
    return {
        p.relative_to(folder).as_posix(): [st.st_size, st.st_mtime_ns]
        for p in sorted(folder.rglob("*"))
        if (p.is_file() or p.is_symlink()) and p.name != MADE
        for st in [p.stat()]
    }


def mark_made(folder: Path) -> None:
    """Record in `folder` the files the tool just wrote there (size and mtime): `changed_since_made` tells
    them from files a user added or edited later."""
    folder = Path(folder)
    write_json(folder / MADE, {"made_by": f"ministream {' '.join(sys.argv[1:2])}".strip(), "files": _files(folder)})


def mark_remade(folder: Path, names: list[str]) -> None:
    """After the tool rewrote `names` in a folder it made (`ministream hf-files`): record those files as they are
    now, and only those (a user's own change elsewhere stays one). Nothing where the tool made no record."""
    path = Path(folder) / MADE
    try:
        made = json.loads(path.read_text())
        files = made["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    now = _files(Path(folder))
    files.update({name: now[name] for name in names if name in now})
    write_json(path, made)


def changed_since_made(folder: Path) -> list[str] | None:
    """The files of `folder` the tool did not write, or that changed since (relative paths); None when the
    tool made no record there (a folder it did not make)."""
    try:
        made = json.loads((Path(folder) / MADE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = _files(Path(folder))
    return sorted(rel for rel, seen in now.items() if made.get(rel) != seen)
