"""Outputs fail in one line for every OS error (issue 32): `convert` and `gguf` onto a read-only file system,
a folder the user may not write, a mount point, a file system mounted inside OUT, a symbolic link as OUT
(written at its target, the link kept) and a dangling one; Ctrl-C (SIGINT) handled like SIGTERM. Each ends in
one line, `error: ...` naming the path, errno's words and what to do, or in the output written whole, and
nothing the user had is lost.

Real mounts (tmpfs, read-only bind mounts: root only, skipped with the reason elsewhere), real `ministream`
processes, a real second uid, real signals; no mocks.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ministream import MiniStreamError
from ministream.atomic import MADE, check_output, lock, new_file, new_folder, signals_held, temp_folder, write_text
from ministream.checkpoint import fingerprint
from ministream.checkpoint.demo import make_checkpoint

from conftest import one_line_error, quiet

EXE = Path(sys.executable).parent / "ministream"
AS_NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` (relative path -> sha256), the record of what the tool made left out."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MADE
    }


def converted_alike(a: Path, b: Path) -> bool:
    """Two conversions of one checkpoint: every file the same bytes, but the fingerprint, whose float32 logprobs
    two processes compute ~1e-6 apart (their threads sum in another order): its tokens the same."""
    fa, fb = (json.loads((f / fingerprint.FILE).read_text()) for f in (a, b))
    same_tokens = (fa["prompt_ids"], fa["ids"], fa["weights"]) == (fb["prompt_ids"], fb["ids"], fb["weights"])
    drop = {fingerprint.FILE}
    return same_tokens and {k: v for k, v in digest(a).items() if k not in drop} == {
        k: v for k, v in digest(b).items() if k not in drop
    }


def _mounts_below(folder: Path) -> list[str]:
    real = os.path.realpath(folder) + "/"
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(real)]


@pytest.fixture
def mount(tmp_path):
    """mount(*args, at=None) -> a folder (`at`, or a new one) with `mount ARGS FOLDER` done on it. Everything
    mounted below tmp_path is unmounted after the test, wherever a run moved it. Root only: skipped, with
    mount's reason, where this machine does not allow it."""

    def do(*args, at: Path | None = None) -> Path:
        where = at or Path(tempfile.mkdtemp(dir=tmp_path))
        run = subprocess.run(["mount", *map(str, args), str(where)], capture_output=True, text=True)
        if run.returncode != 0:
            pytest.skip(f"cannot mount here: {run.stderr.strip()[:120]}")
        return where

    yield do
    for where in sorted(_mounts_below(tmp_path), key=len, reverse=True):  # the deepest first
        if subprocess.run(["umount", where], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", where], check=False)


def read_only(mount, folder: Path) -> Path:
    """`folder` seen through a read-only bind mount (a new folder beside it)."""
    where = mount("--bind", folder)
    mount("-o", "remount,ro,bind", at=where)
    return where


def test_convert_onto_a_read_only_file_system_is_one_line_naming_it(tiny, mount, cli):
    disk = mount("-t", "tmpfs", "-o", "ro", "tmpfs")
    line = one_line_error(cli("convert", tiny, disk / "hf"))
    assert f"cannot write {disk / 'hf'}" in line and "read-only file system" in line and "writable disk" in line


def test_gguf_onto_a_read_only_file_system_is_one_line_naming_it(tiny_hf, mount, cli):
    disk = mount("-t", "tmpfs", "-o", "ro", "tmpfs")
    line = one_line_error(cli("gguf", tiny_hf, disk / "m.gguf"))
    assert f"cannot write {disk / 'm.gguf'}" in line and "read-only file system" in line and "writable disk" in line


def test_force_over_an_output_on_a_read_only_mount_keeps_it_and_is_one_line(tiny, tiny_hf, mount, tmp_path, cli):
    disk = tmp_path / "disk"
    shutil.copytree(tiny_hf, disk / "hf")
    (disk / "m.gguf").write_bytes(b"the user's old export")
    ro = read_only(mount, disk)
    before = digest(ro)
    for command, src, out in [("convert", tiny, ro / "hf"), ("gguf", tiny_hf, ro / "m.gguf")]:
        line = one_line_error(cli(command, src, out, "--force"))
        assert f"cannot write {out}" in line and "read-only file system" in line
    assert digest(ro) == before and sorted(p.name for p in ro.iterdir()) == ["hf", "m.gguf"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to act as uid 65534")
@pytest.mark.parametrize("command", ["convert", "gguf"])
def test_an_output_folder_the_user_may_not_write_is_one_line(command, tiny, tiny_hf, tmp_path):
    shared = tmp_path / "shared"
    shutil.copytree(tiny if command == "convert" else tiny_hf, shared / "src")
    (shared / "home").mkdir()
    (shared / "theirs").mkdir()  # root's, 0755: nobody may read it, not write it
    for p in shared.rglob("*"):
        p.chmod(0o777 if p.name == "home" else 0o755 if p.is_dir() else 0o644)
    for p in [shared, *shared.parents]:  # pytest's tmp folders are 0700: the way in must be open to all
        if p.stat().st_mode & 0o005 != 0o005 and str(p).startswith(str(tmp_path.parents[2])):
            p.chmod(p.stat().st_mode | 0o055)
    out = shared / "theirs" / ("hf" if command == "convert" else "m.gguf")
    run = subprocess.run(
        [*AS_NOBODY, str(EXE), command, str(shared / "src"), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(shared / "home")},
    )
    line = one_line_error(run)
    assert f"cannot write {out}" in line and "permission denied" in line and "you may write" in line
    assert list((shared / "theirs").iterdir()) == []


@pytest.mark.parametrize("kind", ["tmpfs", "bind"])  # a bind mount of the same file system: os.path.ismount misses it
def test_a_mount_point_as_out_is_refused_before_converting_and_its_files_kept(kind, tiny, mount, tmp_path, cli):
    out = tmp_path / "hf"
    out.mkdir()
    if kind == "tmpfs":
        mount("-t", "tmpfs", "tmpfs", at=out)
    else:
        (tmp_path / "elsewhere").mkdir()
        mount("--bind", tmp_path / "elsewhere", at=out)
    (out / "old.txt").write_text("the user's file")
    with pytest.raises(MiniStreamError, match="is a mount point"):  # the check convert makes before loading
        check_output(out, force=True)
    line = one_line_error(cli("convert", tiny, out, "--force"))
    assert f"{out} is a mount point" in line and f"a folder inside it, e.g. {out / 'model'}" in line
    assert [p.name for p in out.iterdir()] == ["old.txt"] and (out / "old.txt").read_text() == "the user's file"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_force_never_deletes_the_files_of_a_file_system_mounted_inside_out(tiny, tiny_hf, mount, tmp_path, cli):
    out = tmp_path / "hf"
    shutil.copytree(tiny_hf, out)
    (out / "data").mkdir()
    inner = mount("-t", "tmpfs", "tmpfs", at=out / "data")
    (inner / "results.txt").write_text("another disk's file")
    line = one_line_error(cli("convert", tiny, out, "--force"))
    assert f"{out} holds the mount point {inner}" in line
    assert (inner / "results.txt").read_text() == "another disk's file"
    assert digest(out) == {**digest(tiny_hf), "data/results.txt": digest(inner)["results.txt"]}


def test_force_through_a_symlinked_out_replaces_its_target_whole_and_keeps_the_link(tiny, tiny_hf, tmp_path, cli):
    target = tmp_path / "store" / "hf"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("the previous conversion")
    link = tmp_path / "hf"
    link.symlink_to(target)
    run = cli("convert", tiny, link, "--force")
    assert run.returncode == 0, run.stderr
    assert f"{link} is a symbolic link: writing its target {target}" in run.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert converted_alike(target, tiny_hf)  # the new folder, whole; old.txt gone with the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "store"]  # no leftover beside the link
    assert [p.name for p in target.parent.iterdir()] == ["hf"]  # nor beside the target


def test_a_dangling_symlink_as_out_gets_the_output_at_its_target(tiny, tiny_hf, tmp_path, cli):
    (tmp_path / "store").mkdir()
    link = tmp_path / "hf"
    link.symlink_to(tmp_path / "store" / "hf")
    run = cli("convert", tiny, link)
    assert run.returncode == 0, run.stderr
    assert link.is_symlink() and converted_alike(tmp_path / "store" / "hf", tiny_hf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "store"]
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["hf"]


def test_a_symlink_into_a_missing_folder_is_refused_naming_its_target(tiny, tmp_path, cli):
    link = tmp_path / "hf"
    link.symlink_to(tmp_path / "unmounted" / "hf")
    line = one_line_error(cli("convert", tiny, link))
    assert f"{link} is a symbolic link to {tmp_path / 'unmounted' / 'hf'}" in line and "does not exist" in line
    assert link.is_symlink() and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_gguf_force_through_a_symlink_replaces_its_target_and_keeps_the_link(tiny_hf, tmp_path, cli):
    target = tmp_path / "store" / "m.gguf"
    target.parent.mkdir()
    target.write_bytes(b"the user's old export")
    link = tmp_path / "m.gguf"
    link.symlink_to(target)
    run = cli("gguf", tiny_hf, link, "--force")
    assert run.returncode == 0, run.stderr
    assert link.is_symlink() and target.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "store"]
    assert [p.name for p in target.parent.iterdir()] == ["m.gguf"]


# --- the mechanism: every step of atomic.py on a read-only disk ---------------------------------------------


def _folder(out: Path) -> None:
    with new_folder(out) as tmp:
        (tmp / "a").write_text("a")


def _file(out: Path) -> None:
    with new_file(out) as tmp:
        tmp.write_text("a")


def _lock(out: Path) -> None:
    with lock(out, "a test"):
        pass


@pytest.mark.parametrize(
    "write",
    [_folder, _file, lambda out: write_text(out, "a"), _lock, lambda out: temp_folder(out, "tmp")],
    ids=["new_folder", "new_file", "write_text", "lock", "temp_folder"],
)
def test_every_output_step_on_a_read_only_disk_raises_one_line_naming_it(write, mount):
    disk = mount("-t", "tmpfs", "-o", "ro", "tmpfs")
    with pytest.raises(MiniStreamError) as e:
        write(disk / "out")
    assert f"cannot write {disk / 'out'}" in str(e.value) and "read-only file system" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_interrupt_during_a_swap_waits_until_the_swap_is_done():
    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    old = signal.signal(signal.SIGINT, stop)
    done = []
    try:
        with pytest.raises(Stopped):
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler would run here, were the signal not held
                done.append("the swap")
        assert done == ["the swap"]
    finally:
        signal.signal(signal.SIGINT, old)


# --- Ctrl-C, like SIGTERM ----------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_conversion_is_one_line_and_keeps_the_old_output(signum, tiny, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("the previous conversion")
    proc = subprocess.Popen(
        [str(EXE), "convert", str(tiny), str(out), "--force", "--max-shard-size", "100KB"],
        env={**os.environ, "MINISTREAM_PAUSE_AT": "convert:weights"},  # paused after the first shard
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("paused at convert:weights"), proc.stderr.read()
    assert list(tmp_path.glob(".hf.tmp-*/*.safetensors"))  # half-way: a shard written, more to come
    proc.send_signal(signum)
    rc, err = proc.wait(60), proc.stderr.read()
    assert rc == 128 + signum and "Traceback" not in err, err
    name = signal.Signals(signum).name
    assert err.splitlines() == [f"error: interrupted ({name}): what was being written is removed, an old output kept"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A ~80M-parameter checkpoint: its export takes long enough to be interrupted while it writes."""
    out = tmp_path_factory.mktemp("big") / "raw"
    make_checkpoint(out, "reference", steps=0, log=quiet)
    return out


def test_ctrl_c_mid_gguf_export_is_one_line_and_keeps_the_old_file(big, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"the user's old export")
    proc = subprocess.Popen(
        [str(EXE), "gguf", str(big), str(out), "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not [p for p in tmp_path.glob(".m.gguf.part-*") if p.stat().st_size]:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)  # as Ctrl-C in a terminal: the data is being written
    rc, err = proc.wait(60), proc.stderr.read()  # type: ignore[union-attr]
    assert rc == 130 and err.splitlines()[-1].startswith("error: interrupted (SIGINT)"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert out.read_bytes() == b"the user's old export"
