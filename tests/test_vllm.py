"""The patched vLLM, installed in this environment by `make install`, against the reference model.

Real engines in their own processes (`ministream generate --engine vllm`), real converted folders;
nothing of vLLM is replaced. Each engine start costs ~30-45 s on 2 cores, so each runs once.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ministream.bench.workers import AOT_SAVED, compiled_model
from ministream.fork.release import release_wheel
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.verify import compare

from conftest import generate_args, pip_target

pytestmark = pytest.mark.vllm
MAX_TOKENS = 32
TOP_K = 5


def vllm_run(cli, folder: Path, out: Path, dtype="float32", tp=1, *extra, log: list | None = None) -> list[dict]:
    r = cli(*generate_args(folder, out, dtype, tp, TOP_K, MAX_TOKENS), *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    if log is not None:
        log.append(r.stdout + r.stderr)
    return json.loads(out.read_text())["vllm"]


def reference_run(folder: Path, dtype: str) -> list[dict]:
    return reference_generate(folder, tokenize(folder, DEFAULT_PROMPTS), MAX_TOKENS, dtype, logprobs=TOP_K)


def ran_compiled(log: str) -> bool:
    """Whether the engine ran torch.compile's model: saved on a first compile, loaded from the cache after."""
    return compiled_model(log) is not None


@pytest.fixture(scope="module")
def runs(cli, tmp_path_factory, request):
    """(folder fixture, dtype, mode) -> (outputs, log) of one real engine, started once for the module: each
    start costs 35 s eager and 90-110 s compiled on 2 cores. fp32 runs both ways (the compiled default is
    the subject there); bf16 runs eager, which compilation does not change the subject of."""
    done: dict = {}

    def run(folder: str, dtype: str, mode: str):
        if (folder, dtype, mode) not in done:
            log: list = []
            extra = ["--enforce-eager"] if mode == "eager" else []
            out = tmp_path_factory.mktemp("vllm") / f"{folder}-{dtype}-{mode}.json"
            done[folder, dtype, mode] = (
                vllm_run(cli, request.getfixturevalue(folder), out, dtype, 1, *extra, log=log),
                log[0],
            )
        return done[folder, dtype, mode]

    return run


# MHA tied; GQA untied head_dim != d/n. The MHA model in make test-full: in make test, verify (test_verify.py) and
# the sampling engine (test_sampling.py) hold it to the reference in fp32; the GQA model has every variant here
@pytest.mark.parametrize(
    "folder, dtype",
    [
        pytest.param("tiny_hf", "float32", marks=pytest.mark.full),
        ("tiny_gqa_hf", "float32"),
        # bf16 in make test-full: make test's `make vllm-tests` holds this model in bf16 through vLLM already
        # (test_models_bfloat16[ministream-tiny-gqa], against transformers' LLaMA twin)
        pytest.param("tiny_gqa_hf", "bfloat16", marks=pytest.mark.full),
        pytest.param("tiny_hf", "bfloat16", marks=pytest.mark.full),
    ],
)
def test_vllm_matches_the_reference_model(folder, dtype, request, runs):
    hf = request.getfixturevalue(folder)
    got, log = runs(folder, dtype, "compiled" if dtype == "float32" else "eager")
    assert ran_compiled(log) == (dtype == "float32"), "fp32 runs the compiled default here, bf16 eager"
    want = reference_run(hf, dtype)
    assert len(got) == len(DEFAULT_PROMPTS) >= 8
    assert all(len(g["ids"]) == MAX_TOKENS for g in got)
    passed, rows = compare(want, got, exact=(dtype == "float32"))
    report = "\n".join(f"prompt {r.prompt}: identical={r.identical} {r.detail}" for r in rows)
    assert passed, report
    # the greedy tokens are not a degenerate agreement: the model's distributions are peaked, not flat
    assert max(r.max_logprob_diff for r in rows) < (1e-3 if dtype == "float32" else 0.5), report


def test_a_second_start_loads_the_compiled_model_and_gives_its_tokens(runs, cli, tiny_gqa_hf, tmp_path):
    """vLLM saves the compiled model and loads it at the next start. On a CPU that load failed at every start, and
    the model was compiled again, most of a start (the CPU part's fix: fork/cpu.py AOT_HELPER; docs/bench.md)."""
    first, log = runs("tiny_gqa_hf", "float32", "compiled")  # saved here, or loaded from an earlier run's cache
    assert ran_compiled(log)
    again_log: list = []
    again = vllm_run(cli, tiny_gqa_hf, tmp_path / "again.json", "float32", 1, log=again_log)
    assert compiled_model(again_log[0]) == "loaded" and AOT_SAVED not in again_log[0], again_log[0][-3000:]
    assert "Compiling model again" not in again_log[0]
    assert [r["ids"] for r in again] == [r["ids"] for r in first]


# make test-full: in make test the compiled fp32 run equals the reference model (above, its log showing the
# compiled path), and so do eager engines (the MHA model: test_verify.py, test_sampling.py; the GQA model:
# test_plugin.py)
@pytest.mark.full
@pytest.mark.parametrize("folder", ["tiny_hf", "tiny_gqa_hf"])
def test_the_compiled_default_gives_the_eager_tokens_in_fp32(folder, request, runs):
    hf = request.getfixturevalue(folder)
    (compiled, compiled_log), (eager, eager_log) = runs(folder, "float32", "compiled"), runs(folder, "float32", "eager")
    assert ran_compiled(compiled_log) and not ran_compiled(eager_log), "the default runs compiled, --enforce-eager not"
    assert [r["ids"] for r in compiled] == [r["ids"] for r in eager]
    assert [r["ids"] for r in compiled] == [r["ids"] for r in reference_run(hf, "float32")]


@pytest.mark.full  # make test holds TP=2 to TP=1 across two nodes (test_nodes.py), the same ranks over TCP
def test_tensor_parallel_2_equals_tp_1(tiny_gqa_hf, cli, tmp_path):
    tp1 = reference_run(tiny_gqa_hf, "float32")
    tp2 = vllm_run(cli, tiny_gqa_hf, tmp_path / "tp2.json", "float32", 2, "--enforce-eager")
    assert [r["ids"] for r in tp2] == [r["ids"] for r in tp1]


@pytest.fixture(scope="module")
def plain_vllm(tmp_path_factory) -> Path:
    """The unpatched vLLM CPU release, installed beside ours; PYTHONPATH puts it first."""
    target = tmp_path_factory.mktemp("plain-vllm")
    pip_target(release_wheel("0.32.0", "cpu"), target)
    yield target
    shutil.rmtree(target)  # CI's disk is shared by the whole suite


def load_in(plain: Path | None, folder: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys, vllm\n"
        "print('vllm from', vllm.__file__, flush=True)\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"EngineArgs(model={str(folder)!r}, max_model_len=256).create_model_config()\n"
        "print('LOADED')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(plain)} if plain else None
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_unpatched_vllm_refuses_the_folder_and_patched_accepts_it(plain_vllm, tiny_hf):
    r = load_in(plain_vllm, tiny_hf)
    assert str(plain_vllm) in r.stdout  # really the plain release
    assert r.returncode != 0 and "LOADED" not in r.stdout
    # the folder's config names its own code (auto_map): stock vLLM asks for trust_remote_code before it would
    # say that neither it nor transformers knows the architecture; the patched vLLM knows it and asks nothing
    refusals = ("does not recognize this architecture", "not supported", "trust_remote_code=True")
    assert any(words in r.stderr for words in refusals), r.stderr[-2000:]
    ours = load_in(None, tiny_hf)
    assert ours.returncode == 0 and "LOADED" in ours.stdout, ours.stderr[-2000:]


def test_unpatched_vllm_does_not_know_the_architecture(plain_vllm, tiny_hf, tmp_path):
    """Even with a model_type transformers knows, the architecture name alone is what the patch adds."""
    folder = tmp_path / "llama-typed"
    folder.mkdir()
    for f in tiny_hf.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((tiny_hf / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    r = load_in(plain_vllm, folder)
    assert r.returncode != 0
    assert "MiniStreamForCausalLM" in r.stderr and "not supported" in r.stderr, r.stderr[-2000:]
