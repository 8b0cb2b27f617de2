"""environments: a line's venv is refused before it would fill the disk, cleaning removes only the venvs (and
the uv cache only with all of them), and vLLM's caches never land beside a venv."""

import sys
from pathlib import Path

import pytest
from packaging.version import Version

from ministream.checks import environments
from ministream.fork.release import cpu_lines

NEWEST = max(cpu_lines(), key=Version)


def test_a_line_that_would_fill_the_disk_is_refused_before_it_starts(tmp_path):
    with pytest.raises(environments.StageFailed, match=r"needs about 100000 GiB of disk.*GiB free.*matrix --clean"):
        environments._check_disk(tmp_path, 100000, "the environment of vLLM 0.19.1")
    environments._check_disk(tmp_path, 0.001, "a tiny thing")


def test_clean_removes_the_venvs_and_only_with_all_the_uv_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(environments, "LINES", tmp_path)
    monkeypatch.setattr(environments, "UV_CACHE", tmp_path / "uv-cache")
    for p in ["0.19.1/venv/bin", "0.8.5.post1/venv/bin", "uv-cache/archive-v0", "0.19.1/result.json.d"]:
        (tmp_path / p).mkdir(parents=True)
    assert environments.remove_environments(["0.19.1"]) == [tmp_path / "0.19.1" / "venv"]
    assert (tmp_path / "uv-cache").exists() and (tmp_path / "0.8.5.post1" / "venv").exists()
    assert set(environments.remove_environments()) == {tmp_path / "0.8.5.post1" / "venv", tmp_path / "uv-cache"}
    assert (tmp_path / "0.19.1" / "result.json.d").exists()


def test_caches_go_to_the_runs_folder_never_beside_the_venv(tmp_path):
    """The project line's venv is .venv: caches beside it would land in the checkout."""
    env = environments._run_env(cpu_lines()[NEWEST], Path(sys.prefix), tmp_path / "cache")
    assert env["VLLM_CACHE_ROOT"] == str((tmp_path / "cache").resolve())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache" / "inductor").resolve())


def test_the_package_copy_is_swapped_in_whole_while_other_runs_use_it(tmp_path):
    """Four processes make the copy at once, over the folder an earlier copy left: each finds the package
    whole, one copy is made, and a process that imported from it goes on importing (nothing removed under it)."""
    import subprocess

    pkg = tmp_path / "pkg"
    (pkg / "ministream").mkdir(parents=True)
    (pkg / "ministream" / "stale.py").write_text("")  # the earlier layout: a plain folder
    code = (
        "import sys; from pathlib import Path; from ministream.checks import environments as e; "
        f"e.PACKAGE_COPY = Path({str(pkg)!r}); e.package_copy(); "
        f"sys.path.insert(0, {str(pkg)!r}); sys.modules.pop('ministream', None); import ministream; "
        "import ministream.checks.report; print(ministream.__file__)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    said = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), said
    copies = [p for p in pkg.iterdir() if p.name.startswith("ministream-")]
    assert len(copies) == 1 and (pkg / "ministream").resolve() == copies[0], list(pkg.iterdir())
    assert all(Path(s).resolve().parent == copies[0] for s in said), said
    assert not (copies[0] / "stale.py").exists() and not list(pkg.glob(".*"))  # no staging left behind
    assert (copies[0] / "checks" / "lines.py").is_file() and not (copies[0] / "fork" / "patches").exists()
