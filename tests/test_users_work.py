"""Nothing lost where the tool meets the user's world (issue 21): their fork's commits through a re-patch,
`make clean` beside their work, two runs at once, kill -9 half-way, files any user may read, paths with
spaces, and broken files handed to the tool.

Real git repositories, real `make` and `ministream` processes, real SIGKILL (at the named pause points of
atomic.pause_point), a real second uid; no mocks.
"""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest
from test_patch import CONFIG_CLASS, MINISTREAM, PATCH_SET, VERSION, commit_all, make_checkout, pristine, state

from ministream import MiniStreamError
from ministream.atomic import lock, mark_made, new_folder, sweep
from ministream.fork.patch import TREE_TRAILER, applied_hash, patch_tree
from ministream.fork.patchset import patch_set_hash
from ministream.fork.pristine import IDENTITY as OURS
from ministream.paths import PATCH_SETS

ROOT = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).parent / "ministream"
HOST = socket.gethostname()
__all__ = ["pristine"]  # the fixture, from test_patch


def changed_patch_sets(where: Path, line: str = "# changed\n") -> Path:
    """A copy of the shipped patch sets whose 0.32.0 set differs (its config class gains `line`)."""
    shutil.copytree(PATCH_SETS, where)
    with open(where / "common" / "files" / CONFIG_CLASS, "a") as f:
        f.write(line)
    return where


def amend(repo: git.Repo, edit) -> None:
    """The user folds a change into the patch commit, as `ministream wheel` tells them to."""
    edit(Path(repo.working_tree_dir))
    repo.git.add("-A")
    with repo.git.custom_environment(GIT_COMMITTER_NAME="me", GIT_COMMITTER_EMAIL="me@fork"):
        repo.git.commit("-q", "--amend", "--no-edit")


def append(rel: str, text: str):
    def edit(tree: Path) -> None:
        with open(tree / rel, "a") as f:
            f.write(text)

    return edit


def reachable(repo: git.Repo, sha: str) -> list[str]:
    """The branches that hold commit `sha`."""
    return [h.name for h in repo.heads if repo.is_ancestor(sha, h.commit.hexsha)]


# --- 1. re-patching a fork whose patch commit holds the user's fix -----------------------------------


@pytest.fixture
def fork(pristine, tmp_path) -> git.Repo:
    repo = make_checkout(tmp_path / "vllm", pristine)
    patch_tree(VERSION, src=tmp_path / "vllm")
    return repo


def test_the_patch_commit_records_the_tree_the_patch_set_made(fork):
    assert f"\n{TREE_TRAILER}: {fork.head.commit.tree.hexsha}\n" in fork.head.commit.message


def test_a_fix_folded_into_the_patch_commit_is_carried_onto_a_newer_patch_set(fork, tmp_path, capsys):
    amend(fork, append(MINISTREAM, "# the fork's fix\n"))
    theirs = fork.head.commit.hexsha
    patch_tree(VERSION, src=Path(fork.working_tree_dir), patch_sets=changed_patch_sets(tmp_path / "p"))
    said = capsys.readouterr().out
    head = fork.head.commit
    tree = Path(fork.working_tree_dir)
    assert applied_hash(head) == patch_set_hash(tmp_path / "p" / "v0.32.0") != patch_set_hash(PATCH_SET)
    assert (tree / MINISTREAM).read_text().endswith("# the fork's fix\n")  # carried
    assert (tree / CONFIG_CLASS).read_text().endswith("# changed\n")  # and the new patch set
    assert head.parents[0].hexsha == fork.heads["main"].commit.hexsha and not fork.is_dirty(untracked_files=True)
    backup = f"ministream/v{VERSION}-before-{theirs[:8]}"
    assert backup in reachable(fork, theirs)  # the old commit stays on a branch
    assert f"your changes to {MINISTREAM} come along" in said and backup in said
    # the next re-patch still tells the carried fix from the patch set's work
    assert head.tree.hexsha != re.search(rf"^{TREE_TRAILER}: (\w+)$", head.message, re.M)[1]
    assert f"Carried from {theirs[:12]}" in head.message


def test_commits_on_top_of_the_patch_commit_are_carried_and_kept_on_a_branch(fork, tmp_path, capsys):
    tree = Path(fork.working_tree_dir)
    (tree / "vllm" / "fork_extra.py").write_text("FORK = 1\n")
    commit_all(fork, "fork: an extra module")
    append(MINISTREAM, "# second fix\n")(tree)
    commit_all(fork, "fork: a fix to the model")
    theirs = fork.head.commit.hexsha
    patch_tree(VERSION, src=tree, patch_sets=changed_patch_sets(tmp_path / "p"))
    assert applied_hash(fork.head.commit) == patch_set_hash(tmp_path / "p" / "v0.32.0")
    assert (tree / "vllm" / "fork_extra.py").read_text() == "FORK = 1\n"
    assert (tree / MINISTREAM).read_text().endswith("# second fix\n")
    assert reachable(fork, theirs) == [f"ministream/v{VERSION}-before-{theirs[:8]}"]
    assert "come along onto the new patch commit" in capsys.readouterr().out


def test_a_change_the_new_patch_set_conflicts_with_is_refused_and_nothing_moves(fork, tmp_path):
    amend(fork, append(CONFIG_CLASS, "# the fork's own last line\n"))
    before, theirs = state(fork), fork.head.commit.hexsha
    with pytest.raises(MiniStreamError) as e:
        patch_tree(VERSION, src=Path(fork.working_tree_dir), patch_sets=changed_patch_sets(tmp_path / "p"))
    assert f"your changes to {CONFIG_CLASS} do not apply onto the new patch set" in str(e.value)
    assert f"{theirs[:12]}` is what you changed" in str(e.value)
    assert state(fork) == before and fork.head.commit.hexsha == theirs
    assert not (Path(fork.git_dir) / "ministream-patch-in-progress").exists()


def test_commits_on_top_of_an_up_to_date_patch_commit_stay_and_the_fold_is_named(fork, capsys):
    tree = Path(fork.working_tree_dir)
    append(MINISTREAM, "# on top\n")(tree)
    commit_all(fork, "fork: on top")
    head = fork.head.commit.hexsha
    patch_tree(VERSION, src=tree)
    said = capsys.readouterr().out
    assert fork.head.commit.hexsha == head and "nothing to do" in said
    assert "1 commit(s) of yours are on top of the patch commit" in said and "reset --soft" in said


def test_a_changed_patch_commit_of_an_older_ministream_is_refused(fork, tmp_path):
    """Trees made before the tree trailer: ours only while our identity committed them last."""
    message = re.sub(rf"^{TREE_TRAILER}: \w+\n", "", fork.head.commit.message, flags=re.M)
    with fork.git.custom_environment(GIT_COMMITTER_NAME="me", GIT_COMMITTER_EMAIL="me@fork"):
        fork.git.commit("-q", "--amend", "-m", message)
    before = state(fork)
    with pytest.raises(MiniStreamError, match=r"was changed after an older ministream made it.*nothing was changed"):
        patch_tree(VERSION, src=Path(fork.working_tree_dir), patch_sets=changed_patch_sets(tmp_path / "p"))
    assert state(fork) == before


def test_uncommitted_changes_name_the_real_next_step(fork):
    append(MINISTREAM, "# wip\n")(Path(fork.working_tree_dir))
    with pytest.raises(MiniStreamError, match=r"uncommitted changes .*git commit -a --amend.*git stash"):
        patch_tree(VERSION, src=Path(fork.working_tree_dir))


# --- 2. make clean removes only what the tool made -------------------------------------------------


def ours_tree(where: Path) -> git.Repo:
    """A tree as `ministream patch` makes one: every commit by the tool's identity."""
    (where / "vllm").mkdir(parents=True)
    (where / "vllm" / "__init__.py").write_text("")
    repo = git.Repo.init(where, initial_branch=f"ministream/v{VERSION}")
    repo.git.add("-A")
    with repo.git.custom_environment(**OURS):
        repo.git.commit("-q", "-m", "vLLM: pristine")
    return repo


@pytest.fixture
def checkout_root(tmp_path) -> Path:
    """A folder `make` runs in as in the checkout: its Makefile, setup inputs and .venv, and the outputs the
    tool makes there (a patched tree, a wheel, a converted folder) beside the cache it keeps."""
    root = tmp_path / "root"
    root.mkdir()
    for name in ["Makefile", "pyproject.toml", "scripts", ".venv"]:
        (root / name).symlink_to(ROOT / name)
    ours_tree(root / "build" / f"vllm-{VERSION}")
    (root / "build" / "cache").mkdir()
    (root / "build" / "cache" / "vllm-0.32.0.tar.gz").write_bytes(b"kept")
    (root / "dist").mkdir()
    (root / "dist" / "vllm_cpu-0.32.0+ministream.0.1.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"w")
    with new_folder(root / "out" / "demo" / "hf") as tmp:
        (tmp / "config.json").write_text("{}")
    verified = root / "out" / "verify" / "hf"  # what `make verify` leaves, rewritten run after run
    (verified / "dump").mkdir(parents=True)
    (verified / "golden-float32.json").write_text("{}")
    mark_made(verified)
    return root


def make(root: Path, *args: str) -> subprocess.CompletedProcess:
    # .venv is the checkout's own (a link): were pyproject.toml newer than its stamp, `setup` would reinstall the
    # package into it from this folder, which has no ministream/ (an editable install of nothing)
    cmd = ["make", "--no-print-directory", "--old-file=.venv/.setup-done", *args]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True)


def test_make_clean_removes_what_the_tool_made_and_keeps_the_cache(checkout_root):
    run = make(checkout_root, "clean")
    assert run.returncode == 0, run.stderr
    assert not (checkout_root / "build" / f"vllm-{VERSION}").exists() and not (checkout_root / "out").exists()
    assert list((checkout_root / "dist").iterdir()) == []
    assert (checkout_root / "build" / "cache" / "vllm-0.32.0.tar.gz").read_bytes() == b"kept"


@pytest.mark.parametrize(
    "work, named",
    [
        ("commit", "commits not made by the tool"),
        ("branch", "branches of yours (mine)"),
        ("untracked", "uncommitted changes (vllm/notes.py)"),
        ("stash", "a stash"),
        ("plain", "not a git repository the tool made"),
        ("out", "out/demo/hf: files the tool did not write, or changed since (config.json)"),
        ("out-file", "out/my-checkpoint.pt: not made by the tool"),
        ("dist", "dist/mine.tar.gz: not a wheel the tool builds"),
    ],
)
def test_make_clean_refuses_the_users_work_names_it_and_removes_nothing(checkout_root, tree, work, named):
    t = checkout_root / "build" / f"vllm-{VERSION}"
    repo = git.Repo(t)
    if work == "commit":
        (t / "vllm" / "fix.py").write_text("x = 1\n")
        commit_all(repo, "my fix")
    elif work == "branch":
        repo.git.branch("mine")
    elif work in ("untracked", "stash"):
        (t / "vllm" / "notes.py").write_text("# mine\n")
        if work == "stash":
            repo.git.add("-A")
            with repo.git.custom_environment(**OURS):
                repo.git.stash()
    elif work == "plain":
        shutil.rmtree(t / ".git")
    elif work == "out":
        (checkout_root / "out" / "demo" / "hf" / "config.json").write_text('{"edited": 1}')
    elif work == "out-file":
        (checkout_root / "out" / "my-checkpoint.pt").write_bytes(b"weeks of GPU time")
    elif work == "dist":
        (checkout_root / "dist" / "mine.tar.gz").write_bytes(b"mine")

    def everything() -> tuple:
        """Each file's size and mtime (git's own .git/ aside: reading a repository refreshes its index), and
        every ref of the tree."""
        files = {f"{d}/{k}": v for d in ("build", "out", "dist") for k, v in tree(checkout_root / d).items()}
        refs = repo.git.for_each_ref() if (t / ".git").exists() else ""
        return {k: v for k, v in files.items() if "/.git" not in k}, refs

    before = everything()
    run = make(checkout_root, "clean")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "nothing was removed" in run.stderr and named in run.stderr and "make clean FORCE=1" in run.stderr
    assert everything() == before
    forced = make(checkout_root, "clean", "FORCE=1")
    assert forced.returncode == 0, forced.stderr
    assert not t.exists() and not (checkout_root / "out").exists()


# --- 3. one writer at a time --------------------------------------------------------------------------


def both(cmds: list[list[str]], cwd: Path = ROOT, env=None) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in cmds
    ]
    out = [p.communicate(timeout=900) for p in procs]
    return [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(cmds, procs, out)]


def test_five_rounds_of_two_concurrent_make_patch_on_one_tree_all_end_patched(pristine, tmp_path):
    src = tmp_path / "my vllm"
    repo = make_checkout(src, pristine)
    for _ in range(5):
        runs = both([["make", "--no-print-directory", "patch", "DEVICE=cuda", f"VLLM_SRC={src}"]] * 2)
        for r in runs:
            assert r.returncode == 0, r.stderr
            assert "Traceback" not in r.stderr and "index.lock" not in r.stderr
        said = [r.stdout for r in runs]
        assert sum("nothing to do" in s for s in said) == 1 and sum("on branch ministream/" in s for s in said) == 1
        assert applied_hash(repo.head.commit) == patch_set_hash(PATCH_SET)
        assert not repo.is_dirty(untracked_files=True) and repo.head.commit.parents[0] == repo.heads["main"].commit
        repo.git.checkout("-q", "main")
        repo.git.branch("-D", f"ministream/v{VERSION}")


@pytest.mark.full  # two sdist extractions (~25 s); the five rounds above run in make test
def test_two_patches_into_a_fresh_build_folder_both_end_with_one_good_tree(tmp_path):
    build = tmp_path / "build"
    runs = both([[str(EXE), "patch", VERSION, "--device", "cuda", "--build-dir", str(build)]] * 2)
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert sum("nothing to do" in r.stdout for r in runs) == 1
    assert any("waiting for pid" in r.stderr for r in runs)
    repo = git.Repo(build / f"vllm-{VERSION}")
    assert applied_hash(repo.head.commit) == patch_set_hash(PATCH_SET) and not repo.is_dirty(untracked_files=True)
    assert sorted(p.name for p in build.iterdir()) == [f"vllm-{VERSION}"]  # no partial, no lock file left


def holding(target: Path, what: str, seconds: float) -> subprocess.Popen:
    """A process that holds `lock(target, what)` for `seconds`, returned once it holds it."""
    code = (
        "import pathlib, time; from ministream.atomic import lock\n"
        f"with lock(pathlib.Path({str(target)!r}), {what!r}):\n"
        f"    print('held', flush=True); time.sleep({seconds})\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_writer_waits_for_the_lock_and_says_for_whom(tmp_path):
    target = tmp_path / "out"
    holder = holding(target, "the other run", 3)
    start = time.monotonic()
    second = holding(target, "second", 0)  # returns once it holds the lock: after the holder let go
    _, said = second.communicate(timeout=60)
    holder.wait()
    assert second.returncode == 0 and time.monotonic() - start >= 1
    assert f"waiting for pid {holder.pid}@{HOST} (the other run) to finish with {target}" in said
    assert not (tmp_path / ".out.lock").exists()


def test_a_lock_of_a_killed_holder_is_free_at_once(tmp_path):
    target = tmp_path / "out"
    holder = holding(target, "killed", 600)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / ".out.lock").exists()  # the file stays, the lock does not
    with lock(target, "next"):
        pass


# --- 4. outputs anyone may read ----------------------------------------------------------------------


def other_uid_reads(paths: list[Path]) -> subprocess.CompletedProcess:
    """`cat` every file as uid/gid 65534 (nobody), with no supplementary groups."""
    files = [str(p) for p in paths]
    return subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "cat", *files],
        capture_output=True,
    )


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to act as another uid")
def test_a_folder_converted_under_umask_022_is_read_by_another_uid(tiny, tmp_path, cli):
    shared = Path(tmp_path, "shared")
    shared.mkdir()
    for p in [shared, *shared.parents]:  # pytest's tmp folders are 0700: the way in must be open to all
        if p.stat().st_mode & 0o005 != 0o005 and str(p).startswith(str(tmp_path.parents[2])):
            p.chmod(p.stat().st_mode | 0o055)
    old = os.umask(0o022)
    try:
        run = cli("convert", tiny, shared / "hf")
    finally:
        os.umask(old)
    assert run.returncode == 0, run.stderr
    out = shared / "hf"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    read = other_uid_reads(sorted(out.iterdir()))
    assert read.returncode == 0, read.stderr
    assert len(read.stdout) == sum(p.stat().st_size for p in out.iterdir())


# --- 5. leftovers of a killed run ----------------------------------------------------------------------


def killed_at(point: str, cmd: list, cwd: Path = ROOT) -> int:
    """Start `cmd` to stop at pause point `point`, then SIGKILL it there; its pid."""
    env = {**os.environ, "MINISTREAM_PAUSE_AT": point}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if line.startswith(f"paused at {point}"):
            break
    else:
        raise AssertionError(f"{cmd} ended (rc {proc.wait()}) before pause point {point}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.pid


def hidden(folder: Path, pid: int) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if f"-{pid}@{HOST}-" in p.name)


def test_kill_9_during_convert_leaves_a_named_leftover_the_next_run_removes(tiny, tmp_path, cli, tree):
    out = tmp_path / "hf"
    raw = tree(tiny)
    pid = killed_at("convert:weights", [str(EXE), "convert", str(tiny), str(out)])
    left = hidden(tmp_path, pid)
    assert left and left[0].startswith(".hf.tmp-") and not out.exists()
    run = cli("convert", tiny, out)
    assert run.returncode == 0, run.stderr
    assert f"removed {tmp_path / left[0]}, left by a run that was killed" in run.stderr
    assert hidden(tmp_path, pid) == [] and (out / "model.safetensors").is_file() and tree(tiny) == raw


def test_kill_9_of_patch_src_half_way_is_undone_by_the_next_run(pristine, tmp_path, cli):
    src = tmp_path / "vllm"
    repo = make_checkout(src, pristine)
    main = repo.head.commit.hexsha
    killed_at("patch:apply", [str(EXE), "patch", VERSION, "--device", "cuda", "--src", str(src)])
    assert repo.is_dirty(untracked_files=True)  # half-applied files, our note beside them
    assert (Path(repo.git_dir) / "ministream-patch-in-progress").exists()
    run = cli("patch", VERSION, "--device", "cuda", "--src", src)
    assert run.returncode == 0, run.stderr
    assert "undid the unfinished patch of a run that was killed" in run.stdout and "uncommitted" not in run.stderr
    assert repo.head.commit.parents[0].hexsha == main and applied_hash(repo.head.commit) == patch_set_hash(PATCH_SET)
    assert not repo.is_dirty(untracked_files=True) and sorted(h.name for h in repo.heads) == [
        "main",
        f"ministream/v{VERSION}",
    ]


@pytest.mark.full  # a whole sdist extraction and patch (~30 s)
def test_kill_9_while_the_tree_is_made_leaves_a_partial_the_next_run_removes(tmp_path, cli):
    build = tmp_path / "build"
    cmd = [str(EXE), "patch", VERSION, "--device", "cuda", "--build-dir", str(build)]
    pid = killed_at("patch:pristine", cmd)
    left = hidden(build, pid)
    assert left and left[0].startswith(f".vllm-{VERSION}.partial-")
    run = cli(*cmd[1:])
    assert run.returncode == 0, run.stderr
    assert hidden(build, pid) == [] and applied_hash(git.Repo(build / f"vllm-{VERSION}").head.commit)


def test_kill_9_while_the_wheel_is_written_leaves_a_part_the_next_run_removes(tmp_path, cli):
    from test_wheel import make_tree, ministream_patch

    tree = make_tree(tmp_path, ministream_patch)
    dist = tmp_path / "dist"
    cmd = [str(EXE), "wheel", VERSION, "--device", "cpu", "--tree", str(tree), "--dist", str(dist)]
    pid = killed_at("wheel:zip", cmd)
    left = hidden(dist, pid)
    assert left and ".part-" in left[0] and not list(dist.glob("*.whl"))
    run = cli(*cmd[1:])
    assert run.returncode == 0, run.stderr
    assert hidden(dist, pid) == [] and len(list(dist.glob("*.whl"))) == 1


def test_sweep_keeps_a_live_runs_and_another_hosts_leftovers(tmp_path):
    live = tmp_path / f".hf.tmp-{os.getpid()}@{HOST}-abc"
    other = tmp_path / ".hf.tmp-1@elsewhere-abc"
    dead = tmp_path / f".hf.tmp-{dead_pid()}@{HOST}-abc"
    for p in (live, other, dead):
        p.mkdir()
    assert sweep(tmp_path / "hf") == [dead]
    assert live.exists() and other.exists() and not dead.exists()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- 7. paths with spaces and other scripts through the Makefile ----------------------------------------


def test_make_convert_doctor_and_patch_take_paths_with_spaces_and_non_ascii(tiny, pristine, tmp_path):
    where = tmp_path / "my ck" / "é 模型"
    shutil.copytree(tiny, where)
    out = tmp_path / "hf out" / "模型 ü"
    run = make(ROOT, "convert", f"RAW={where}", f"OUT={out}")
    assert run.returncode == 0, run.stderr
    assert (out / "config.json").is_file()
    doctor = make(ROOT, "doctor", f"MODEL={out}")
    assert "unrecognized arguments" not in doctor.stderr and f"{out}: 0 error(s)" in doctor.stdout, doctor.stdout
    src = tmp_path / "vllm ck" / "fork é"
    repo = make_checkout(src, pristine)
    patched = make(ROOT, "patch", "DEVICE=cuda", f"VLLM_SRC={src}")
    assert patched.returncode == 0, patched.stderr
    assert applied_hash(repo.head.commit) == patch_set_hash(PATCH_SET)


# --- 8. advice that names the real next step ---------------------------------------------------------------


def test_offline_without_the_sdist_names_the_network_and_the_sdist(tmp_path, cli):
    env = {**os.environ, "MINISTREAM_CACHE": str(tmp_path / "cache"), "HTTPS_PROXY": "http://127.0.0.1:9"}
    env["https_proxy"] = env["HTTPS_PROXY"]
    run = cli("patch", VERSION, "--device", "cuda", "--build-dir", tmp_path / "build", env=env)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "could not reach PyPI" in run.stderr and "check the network" in run.stderr
    assert f"put vllm-{VERSION}.tar.gz in {tmp_path / 'cache' / 'sdists'}/" in run.stderr, run.stderr
    assert "release wheel" not in run.stderr
    assert not (tmp_path / "build" / f"vllm-{VERSION}").exists()


def test_a_plain_folder_where_the_tree_goes_is_kept_and_the_advice_keeps_it(tmp_path, cli):
    (tmp_path / "build" / f"vllm-{VERSION}").mkdir(parents=True)
    (tmp_path / "build" / f"vllm-{VERSION}" / "mine.txt").write_text("mine")
    run = cli("patch", VERSION, "--device", "cuda", "--build-dir", tmp_path / "build")
    assert run.returncode == 2 and "make clean" not in run.stderr and "move it aside" in run.stderr
    assert (tmp_path / "build" / f"vllm-{VERSION}" / "mine.txt").read_text() == "mine"


def test_the_patch_note_of_a_run_on_another_host_is_not_undone(fork):
    note = Path(fork.git_dir) / "ministream-patch-in-progress"
    note.write_text(json.dumps({"pid": 1, "host": "elsewhere", "head": "x", "branch": None, "patch_branch": "y"}))
    with pytest.raises(MiniStreamError, match="being patched by process 1 on elsewhere"):
        patch_tree(VERSION, src=Path(fork.working_tree_dir), patch_sets=PATCH_SETS)
    assert note.exists()
