"""The suite's `cli` fixture forks each `ministream` command from a process that imported torch and the package
once (launcher.py): what a command answers must be what a fresh interpreter running the console script answers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import worker_cores
from launcher import Launcher

from ministream.run.engine import core_binding

EXE = str(Path(sys.executable).parent / "ministream")


@pytest.fixture(scope="module")
def launcher():
    launched = Launcher()
    yield launched
    launched.close()


def test_a_forked_command_answers_as_the_console_script_in_a_fresh_interpreter(launcher, tiny_hf, tiny, tmp_path):
    for args in (
        ["--help"],
        ["doctor", tiny_hf],  # exit 0, a report on stdout
        ["convert", tmp_path / "none", tmp_path / "out"],  # exit 2, one line on stderr
        ["convert", tiny, tmp_path / "@" / "hf"],  # the work itself: the same folder
        ["gguf", tmp_path / "@" / "hf", tmp_path / "@" / "m.gguf", "--dtype", "q8_0"],  # named by the folder
    ):
        argv = {how: [EXE, *(str(a).replace("@", how) for a in args)] for how in ("by-fork", "by-exec")}
        forked = launcher.run(argv["by-fork"], timeout=300)
        fresh = subprocess.run(argv["by-exec"], capture_output=True, text=True, timeout=300)
        same = [forked.stdout.replace("by-fork", "by-exec"), forked.stderr.replace("by-fork", "by-exec")]
        assert (forked.returncode, *same) == (
            fresh.returncode,
            fresh.stdout,
            fresh.stderr,
        ), args
    for made in ("hf/model.safetensors", "hf/config.json", "m.gguf"):
        assert (tmp_path / "by-fork" / made).read_bytes() == (tmp_path / "by-exec" / made).read_bytes(), made


def test_a_forked_command_works_in_the_callers_directory(launcher, tiny, tmp_path, monkeypatch):
    """Relative paths are the caller's, as a process started in its working directory takes them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raw").symlink_to(tiny)
    r = launcher.run([EXE, "convert", "raw", "hf"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


def test_a_forked_command_runs_on_the_cores_of_the_test_that_runs_it(launcher, tiny_hf):
    """As a child of the test's own would: the fork server keeps the cores it started with, the command takes the
    asking test's (a worker's share, or every core for a test marked every_core). --tp beyond them is refused
    naming the cores, before any engine starts."""
    every, asked = sorted(worker_cores.EVERY), os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("one core: no other set of cores to run on")
    try:
        for cores in ({every[0]}, set(every)):  # one of them differs from the server's, whichever worker runs this
            os.sched_setaffinity(0, cores)
            argv = [EXE, "generate", str(tiny_hf), "--engine", "vllm", "--tp", str(len(cores) + 1)]
            forked = launcher.run(argv, timeout=300)
            fresh = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr)
            assert f"may use {len(cores)} core(s) ({core_binding(1, cores)})" in forked.stderr, forked.stderr
    finally:
        os.sched_setaffinity(0, asked)


def test_an_environment_that_the_preloaded_imports_read_starts_a_fresh_interpreter(launcher):
    assert launcher.takes(None)
    assert launcher.takes({**os.environ, "PYTEST_CURRENT_TEST": "another", "TORCHINDUCTOR_CACHE_DIR": "/x"})
    for name in ("MINISTREAM_CACHE", "OMP_NUM_THREADS", "HF_HOME", "PYTHONPATH", "TORCH_LOGS"):
        assert not launcher.takes({**os.environ, name: "1"}), name
    assert not launcher.takes({k: v for k, v in os.environ.items() if k != "PATH"} | {"MINISTREAM_X": "1"})


def test_what_vllm_leaves_in_the_environment_of_the_suites_in_process_engines_keeps_commands_forked(
    launcher, monkeypatch
):
    """vLLM's import and its CPU platform's engine settings write into the caller's environment (VLLM_SETS), and so
    does scikit-learn's import (LIBRARY_SETS); the suite starts engines in its own processes and imports libraries
    that import sklearn, so without this every later command ran fresh (seen: 0.32.0; sklearn in test_serve_checks)."""
    import sklearn  # noqa: F401  # KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK
    import vllm  # noqa: F401  # env_override's writes, whatever this vLLM's are

    for name in ("LD_PRELOAD", "NUMEXPR_MAX_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1")  # the CPU platform's (check_and_update_config)
    assert launcher.read_at_import(None) == []


def test_a_command_past_its_timeout_is_killed_and_raises_as_subprocess_run_does(launcher, tmp_path):
    import socket

    with socket.socket() as silent:  # accepts, never answers: `ready` waits for it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(subprocess.TimeoutExpired):
            launcher.run([EXE, "ready", "--url", url, "--timeout", "120"], timeout=3)
