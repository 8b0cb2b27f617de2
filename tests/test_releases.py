"""`ministream releases` and `make port-missing`: vLLM's releases as a package index lists them, against the patch sets.

A real HTTP server on 127.0.0.1 serves a PyPI-like simple index (conftest.PackageIndex: PEP 691 JSON, or PEP 503
HTML), built here from the supported releases; the command reads it through --index-url or PIP_INDEX_URL, as pip
would. Porting reads the real release files (build/cache/members, else PyPI), as `make port` does.
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from ministream.fork import pypi
from ministream.fork.patchset import supported_versions
from ministream.paths import PATCH_SETS, RELEASE_PINS

from conftest import PackageIndex, file_entry

OLDER = ["0.3.3", "0.4.0", "0.4.0.post1", "0.6.4", "0.20.0", "0.20.1"]  # before 0.4; older releases of a line


def files_of(versions: dict[str, bool]) -> list[dict]:
    """A simple index's file list: one wheel and the sdist of each version (True: yanked)."""
    return [
        file_entry(name, f"https://files.example/{name}", _sha(name), yanked)
        for v, yanked in versions.items()
        for name in (f"vllm-{v}-cp38-abi3-manylinux_2_28_x86_64.whl", f"vllm-{v}.tar.gz")
    ]


def _sha(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.fixture
def index():
    with PackageIndex() as served:
        yield served


def supported(**more: bool) -> dict[str, bool]:
    return {**dict.fromkeys(OLDER, False), **dict.fromkeys(supported_versions(), False), **more}


def releases(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ministream.cli", "releases", *args], capture_output=True, text=True, env=env
    )


def test_every_line_with_its_patch_set_is_clean(index):
    index.projects["vllm"] = files_of(supported(**{"0.35.0rc1": False, "0.35.0": True}))  # a pre-release; yanked
    run = releases("--index-url", index.url)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every line has its patch set" in run.stdout
    assert "0.34   0.34.0: v0.34.0" in run.stdout
    assert "0.4    0.4.3: v0.4.3 (older: 0.4.0, 0.4.0.post1)" in run.stdout
    assert "0.3.3" not in run.stdout and "0.35" not in run.stdout


def test_a_release_of_a_new_line_is_named_with_its_make_port(index):
    index.projects["vllm"] = files_of(supported(**{"0.35.0": False, "0.36.1": False}))
    run = releases("--index-url", index.url)
    assert run.returncode == 1
    assert "error: vLLM 0.35.0 has no MiniStream patch set: make port FROM=0.34.0 TO=0.35.0" in run.stdout
    assert "error: vLLM 0.36.1 has no MiniStream patch set: make port FROM=0.34.0 TO=0.36.1" in run.stdout
    assert "2 release(s) without a patch set: `make port-missing` ports them all" in run.stdout


def test_the_html_index_and_pip_index_url_are_read_as_pip_reads_them(index):
    index.projects["vllm"] = files_of(supported(**{"0.35.0": True}))  # yanked: HTML's data-yanked
    index.json = False
    env = {**os.environ, "PIP_INDEX_URL": index.url}
    got = pypi.published("vllm", index.url)
    assert "0.35.0" not in got and got["0.34.0"]["vllm-0.34.0.tar.gz"] == _sha("vllm-0.34.0.tar.gz")
    run = releases(env=env)
    assert run.returncode == 0 and f"vLLM releases on {index.url}/vllm/" in run.stdout, run.stdout + run.stderr


def test_the_newest_release_of_a_line_with_the_same_files_is_accepted(index):
    # the 0.20 line as it stood before 0.20.2: 0.20.1's files (read from its release wheel) are 0.20.2's
    versions = supported()
    del versions["0.20.2"]
    found = {r.version: r for r in pypi.survey(list(versions))}
    assert found["0.20.1"].said() == "v0.20.2 (its files are 0.20.2's, byte for byte)"
    assert found["0.20.0"].said() == "older release of its line: nothing needed"


def test_a_newest_release_whose_files_differ_is_ported_from_its_lines_set():
    versions = [v for v in supported() if not v.startswith("0.6.")] + ["0.6.3", "0.6.4"]
    found = {r.version: r for r in pypi.survey(versions)}
    assert found["0.6.4"].said() == "no patch set: make port FROM=0.6.6.post1 TO=0.6.4"  # as `make patch` says


def test_an_unreachable_index_is_one_line_naming_what_to_do():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/simple"
    run = releases("--index-url", url)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith(f"error: could not reach {url}/vllm/ to list vLLM's releases") and "--index-url" in line


def test_port_missing_makes_the_patch_set_and_pins_it(index, tmp_path):
    patch_sets, pins = tmp_path / "patches", tmp_path / "releases.json"
    shutil.copytree(PATCH_SETS, patch_sets)
    shutil.rmtree(patch_sets / "v0.34.0")
    listed = supported_versions(patch_sets)
    del listed["0.34.0"]
    (patch_sets / "versions.json").write_text(json.dumps(listed, indent=2) + "\n")
    before = json.loads(RELEASE_PINS.read_text())
    del before["vllm"]["0.34.0"]
    pins.write_text(json.dumps(before, indent=1) + "\n")
    index.projects["vllm"] = files_of(supported())
    assert [r.version for r in pypi.survey(list(supported()), patch_sets) if r.port_from] == ["0.34.0"]
    assert pypi.port_missing(index.url, patch_sets, pins) == 0
    for name in ("model.diff", "registry.diff", "upstream/upstream.diff", "manifest.json"):
        assert (patch_sets / "v0.34.0" / name).read_text() == (PATCH_SETS / "v0.34.0" / name).read_text(), name
    assert json.loads(pins.read_text())["vllm"]["0.34.0"] == {
        f["filename"]: f["hashes"]["sha256"] for f in files_of({"0.34.0": False})
    }
    assert pypi.port_missing(index.url, patch_sets, pins) == 0  # nothing left to port
