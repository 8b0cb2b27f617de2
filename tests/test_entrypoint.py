"""The image's entry point forwards each value as one argument, exactly: the real entrypoint.sh under /bin/sh.

Its job is argv forwarding, so a stand-in `ministream` first on PATH records the argv it is given (NUL-separated,
so that a space, a newline or a glob in a value shows); what `ministream serve` then makes of those values runs
with the real command in tests/test_deploy.py, and in the image in tests/test_image.py (test-full).
"""

import subprocess
from pathlib import Path

import pytest

from ministream.paths import DOCKER

ENTRYPOINT = Path(str(DOCKER)) / "entrypoint.sh"
LISTEN = ["--host", "0.0.0.0", "--port", "8000"]  # the defaults, when HOST and PORT are not set
STAND_IN = """#!/bin/sh
printf '%s\\0' "$@" > "$ARGV_RECORD"
"""


@pytest.fixture
def run_entrypoint(tmp_path):
    """run_entrypoint(*args, **env) -> the argv the stand-in ministream got (None: it did not run), and the
    run; cwd is a folder of files, so an unquoted * would glob."""
    bin_dir, cwd, record = tmp_path / "bin", tmp_path / "cwd", tmp_path / "argv"
    bin_dir.mkdir()
    cwd.mkdir()
    (bin_dir / "ministream").write_text(STAND_IN)
    (bin_dir / "ministream").chmod(0o755)
    for name in ("config.json", "model.safetensors"):
        (cwd / name).write_text("")

    def run(*args, **env) -> tuple[list[str] | None, subprocess.CompletedProcess]:
        record.unlink(missing_ok=True)
        r = subprocess.run(
            ["/bin/sh", str(ENTRYPOINT), *map(str, args)],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_RECORD": str(record), **env},
            timeout=30,
        )
        argv = record.read_text().split("\0")[:-1] if record.exists() else None
        return argv, r

    return run


# --- hostile values: each forwarded as one argument --------------------------------------------------------


def test_a_host_with_spaces_and_options_is_one_argument_not_injected_options(run_entrypoint):
    argv, _ = run_entrypoint(HOST="0.0.0.0 --api-key x")
    assert argv == ["serve", "/model", "--host", "0.0.0.0 --api-key x", "--port", "8000"]


def test_a_port_that_is_a_glob_is_not_expanded(run_entrypoint):
    argv, _ = run_entrypoint(PORT="*")
    assert argv == ["serve", "/model", "--host", "0.0.0.0", "--port", "*"]


def test_a_port_with_a_newline_and_an_option_stays_one_argument(run_entrypoint):
    argv, _ = run_entrypoint("--dtype", "float32", PORT="8000\n--served-model-name evil")
    port = "8000\n--served-model-name evil"
    assert argv == ["serve", "/model", "--host", "0.0.0.0", "--port", port, "--dtype", "float32"]


def test_a_model_path_with_spaces_and_globs_is_one_argument(run_entrypoint):
    argv, _ = run_entrypoint(MODEL="/models/my model/*")
    assert argv == ["serve", "/models/my model/*", *LISTEN]


def test_arguments_with_spaces_and_globs_are_forwarded_as_given(run_entrypoint):
    argv, _ = run_entrypoint("--served-model-name", "a b *", "--max-num-seqs", "*")
    assert argv == ["serve", "/model", *LISTEN, "--served-model-name", "a b *", "--max-num-seqs", "*"]


# --- what the script's header promises ----------------------------------------------------------------------


def test_no_arguments_serve_the_folder_at_MODEL_on_HOST_and_PORT(run_entrypoint):
    argv, _ = run_entrypoint(MODEL="/models/hf", HOST="127.0.0.1", PORT="8123")
    assert argv == ["serve", "/models/hf", "--host", "127.0.0.1", "--port", "8123"]


def test_no_arguments_and_no_MODEL_serve_the_mounted_folder(run_entrypoint):
    argv, _ = run_entrypoint()
    assert argv == ["serve", "/model", *LISTEN]


def test_options_first_go_to_serve_after_the_folder(run_entrypoint):
    argv, _ = run_entrypoint("--dtype", "float32", "--tp", "2")
    assert argv == ["serve", "/model", *LISTEN, "--dtype", "float32", "--tp", "2"]


@pytest.mark.parametrize("model", [["--model", "/data/m"], ["--model=/data/m"]], ids=["two_words", "equals"])
def test_vllms_model_option_names_the_folder_instead_of_MODEL(run_entrypoint, model):
    argv, _ = run_entrypoint("--max-num-seqs", "8", *model, MODEL="/nowhere")
    assert argv == ["serve", *LISTEN, "--max-num-seqs", "8", *model]


def test_a_folder_first_is_served(run_entrypoint, tmp_path):
    argv, _ = run_entrypoint(tmp_path, "--dtype", "float32", MODEL="/nowhere")
    assert argv == ["serve", *LISTEN, str(tmp_path), "--dtype", "float32"]


def test_a_command_runs_as_it_is_with_its_arguments_unchanged(run_entrypoint):
    argv, r = run_entrypoint("sh", "-c", 'printf "[%s]" "$@"', "sh", "a b", "*")
    assert argv is None and r.returncode == 0 and r.stdout == "[a b][*]"


def test_a_ministream_command_runs_as_it_is(run_entrypoint):
    argv, r = run_entrypoint("ministream", "releases", "--index-url", "http://127.0.0.1:1/simple a")
    assert r.returncode == 0 and argv == ["releases", "--index-url", "http://127.0.0.1:1/simple a"]
