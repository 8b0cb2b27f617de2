"""`ministream vllm-tests`: its parts. The whole command runs in `make test` (make vllm-tests), on the
patched 0.32.0 source tree against the installed patched vLLM."""

import os
import subprocess
import sys
from pathlib import Path

import git
import pytest

from ministream import MiniStreamError
from ministream.checks import vllm_tests
from ministream.checks.vllm_tests import _environment, example_models, hf_cache, outcomes
from ministream.run.engine import IN_PROCESS

ENTRY = """
    "MiniMaxM3SparseForCausalLM": _HfExamplesInfo(
        "MiniMaxAI/MiniMax-M3",
    ),
    "MiniStreamForCausalLM": _HfExamplesInfo(
        "ministream/ministream-tiny-gqa",
        extras={{"tied-mha": "{extra}"}},
        max_model_len=512,
    ),
    "MistralForCausalLM": _HfExamplesInfo("mistralai/Mistral-7B-Instruct-v0.1"),
"""


def examples_tree(where: Path, extra: str = "ministream/ministream-tiny") -> Path:
    (where / "tests" / "models").mkdir(parents=True)
    (where / "tests" / "models" / "registry.py").write_text(ENTRY.format(extra=extra))
    return where


def test_the_quick_run_puts_each_engine_in_the_tests_process_unless_the_user_said_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv(IN_PROCESS, raising=False)
    assert _environment(tmp_path, "cpu", quick=True)[IN_PROCESS] == "0"
    assert IN_PROCESS not in _environment(tmp_path, "cpu")  # the full run: vLLM's own layout
    monkeypatch.setenv(IN_PROCESS, "1")
    assert _environment(tmp_path, "cpu", quick=True)[IN_PROCESS] == "1"


def test_example_models_are_read_from_the_trees_registry(tmp_path):
    assert example_models(examples_tree(tmp_path)) == ["ministream/ministream-tiny-gqa", "ministream/ministream-tiny"]


def test_an_example_model_that_no_preset_makes_is_refused(tmp_path):
    with pytest.raises(MiniStreamError, match=r"example model someone/llama-7b is not ministream/ministream-<preset>"):
        example_models(examples_tree(tmp_path, extra="someone/llama-7b"))


def test_a_registry_without_our_entry_says_to_patch_a_source_tree(tmp_path):
    (tmp_path / "tests" / "models").mkdir(parents=True)
    (tmp_path / "tests" / "models" / "registry.py").write_text("HF_EXAMPLE_MODELS = {}\n")
    with pytest.raises(MiniStreamError, match=r"has no MiniStreamForCausalLM entry.*make patch"):
        example_models(tmp_path)


# make test's `make vllm-tests` step serves vLLM's own tests from this cache offline; this one names the parts
@pytest.mark.full
def test_the_hf_cache_serves_the_example_model_offline(tmp_path):
    home = hf_cache(["ministream/ministream-tiny"], tmp_path / "hf-home", log=lambda *a: None)
    probe = (
        "from huggingface_hub import snapshot_download; from transformers import AutoTokenizer; "
        "import sys; p = snapshot_download('ministream/ministream-tiny'); "
        "AutoTokenizer.from_pretrained('ministream/ministream-tiny'); print(p)"
    )
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    snapshot = Path(run.stdout.strip().splitlines()[-1])
    assert snapshot.is_relative_to(home) and {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in snapshot.iterdir()
    }
    # made once: a second call finds it and changes nothing
    before = {p: p.stat().st_mtime_ns for p in home.rglob("*")}
    hf_cache(["ministream/ministream-tiny"], home, log=lambda *a: pytest.fail("remade"))
    assert {p: p.stat().st_mtime_ns for p in home.rglob("*")} == before


def test_outcomes_are_read_from_a_real_pytest_report(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\ndef test_ok(): pass\ndef test_bad(): assert False\ndef test_skip(): pytest.skip('no')\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={tmp_path / 'r.xml'}",
            str(tmp_path / "test_x.py"),
        ],
        capture_output=True,
        cwd=tmp_path,
    )
    assert outcomes(tmp_path / "r.xml") == {
        "test_x::test_ok": "passed",
        "test_x::test_bad": "failed",
        "test_x::test_skip": "skipped",
    }


def test_a_bare_vllm_package_is_not_a_source_tree(tmp_path):
    (tmp_path / "vllm").mkdir()
    with pytest.raises(
        MiniStreamError, match=r"is not a vLLM source tree \(no tests/\).*make patch VLLM_VERSION=0\.32\.0"
    ):
        vllm_tests.run_vllm_tests("0.32.0", tmp_path, out=tmp_path / "out")


def test_an_unpatched_tree_is_refused(tmp_path):
    tree = examples_tree(tmp_path / "vllm")
    repo = git.Repo.init(tree)
    repo.git.add("-A")
    repo.git.commit(
        "-q",
        "-m",
        "vLLM",
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        },
    )
    with pytest.raises(MiniStreamError, match=r"is not patched .*make patch VLLM_VERSION=0\.32\.0"):
        vllm_tests.run_vllm_tests("0.32.0", tree, out=tmp_path / "out")


def test_another_installed_version_is_refused(tmp_path):
    with pytest.raises(
        MiniStreamError,
        match=r"against the installed patched vLLM 0\.31\.0, but the installed vLLM is "
        r"0\.32\.0\+ministream.*make install VLLM_VERSION=0\.31\.0",
    ):
        vllm_tests.run_vllm_tests("0.31.0", examples_tree(tmp_path), out=tmp_path / "out")
