"""Shared fixtures: real format-1 checkpoints made by `ministream checkpoint`, once per test session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ministream.checkpoint.demo import make_checkpoint
from ministream.checkpoint.convert import convert

# Engines started by tests stay lean (a user's setting, which wins over engine.py's quarter of the memory):
# the tiny models need little KV cache, and the suite shares the machine with whatever else runs.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """Trained MHA model, tied embeddings, head_dim = d_model / n_heads."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(out, "tiny", log=quiet)
    return out


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    """Trained GQA model (4 query heads, 2 kv heads), untied head, head_dim 64 != d_model / n_heads = 32."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-gqa"
    make_checkpoint(out, "tiny-gqa", log=quiet)
    return out


@pytest.fixture(scope="session")
def tiny_hf(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny"
    convert(tiny, out, log=quiet)
    return out


@pytest.fixture(scope="session")
def tiny_gqa_hf(tiny_gqa, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-gqa"
    convert(tiny_gqa, out, log=quiet)
    return out


@pytest.fixture(scope="session")
def cli():
    """Run the `ministream` console command as a user would: cli("convert", raw, out) -> CompletedProcess."""
    exe = Path(sys.executable).parent / "ministream"

    def run(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)

    return run
