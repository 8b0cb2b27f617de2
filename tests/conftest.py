"""Shared fixtures: real format-1 checkpoints made by `ministream checkpoint`, once per test session."""

import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from packaging.version import Version

from ministream.atomic import lock
from ministream.checkpoint.convert import convert
from ministream.checkpoint.demo import make_checkpoint
from ministream.run import server

# Engines started by tests stay lean (a user's setting, which wins over engine.py's quarter of the memory):
# the tiny models need little KV cache, and the suite shares the machine with whatever else runs.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test's workers share the cores: each one's own torch work (training the test models, the reference
    # model) gets its share, or two workers' threads contend and each runs at a third of its speed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def quiet(*args, **kwargs):
    pass


def fuzz_settings(examples: int):
    """The settings every property test here runs under: derandomized with no example database (CI runs the
    same cases each time), `examples` of them unless FUZZ_EXAMPLES=N asks for more or fewer."""
    return settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES", examples)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def one_line_error(run: subprocess.CompletedProcess, rc: int = 2) -> str:
    """The single `error: ...` line a failed command printed, with no traceback."""
    assert run.returncode == rc, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr + run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """`make test` runs on two workers (pytest-xdist, --dist loadgroup). The modules that start vLLM engines
    (those with a test marked vllm) are one group, so one engine runs at a time, beside the tests that start
    none; every other module is a group of its own, so its module fixtures are made once."""
    engines = {item.module.__name__ for item in items if item.get_closest_marker("vllm")}
    for item in items:
        name = item.module.__name__
        item.add_marker(pytest.mark.xdist_group("engines" if name in engines else name))


def pytest_configure(config):
    """Refuses --dist loadgroup where it would ignore the groups: pytest 9.2's structured node ids drop the
    "@group" suffix pytest-xdist (to 3.8.0 at least) writes, and nothing else says so (pytest-xdist #1386, fix
    open as PR #1388). Every test would be its own unit: engines on both workers at once, a module's server
    started once per worker."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    have = {d: Version(metadata.version(d)) for d in ("pytest", "pytest-xdist")}
    if have["pytest"] >= Version("9.2.dev0") and have["pytest-xdist"] <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {have['pytest']} with pytest-xdist {have['pytest-xdist']} ignores --dist loadgroup's groups "
            "(pytest-xdist issue #1386): `make setup` installs the pytest pyproject.toml allows (<9.2), "
            "or run on one process with TEST_WORKERS=0"
        )


def made_once(tmp_path_factory, kind: str, name: str, make) -> Path:
    """KIND/NAME under the run's temp root, made by make(path) in the first pytest-xdist worker that asks
    and reused by the others, which wait on its lock: the trained test models are the suite's costliest
    fixtures, and each worker would otherwise train its own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # popen-gwN's parent: the run's root, shared by its workers
    out = root / "made-once" / kind / name
    done = out.with_name(f".{name}.done")  # beside it: the folder holds only what `make` wrote
    # a lock of its own: `make` takes the folder's (atomic.new_folder), which flock would refuse a second time
    with lock(out, f"making the test fixture {kind}/{name}", path=out.with_name(f".{name}.fixture.lock")):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """Trained MHA model, tied embeddings, head_dim = d_model / n_heads."""
    return made_once(tmp_path_factory, "ckpt", "tiny", lambda out: make_checkpoint(out, "tiny", log=quiet))


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    """Trained GQA model (4 query heads, 2 kv heads), untied head, head_dim 64 != d_model / n_heads = 32."""
    return made_once(tmp_path_factory, "ckpt", "tiny-gqa", lambda out: make_checkpoint(out, "tiny-gqa", log=quiet))


@pytest.fixture(scope="session")
def tiny_hf(tiny, tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "hf", "tiny", lambda out: convert(tiny, out, log=quiet))


@pytest.fixture(scope="session")
def tiny_gqa_hf(tiny_gqa, tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "hf", "tiny-gqa", lambda out: convert(tiny_gqa, out, log=quiet))


@pytest.fixture(scope="session")
def cli():
    """Run the `ministream` console command as a user would: cli("convert", raw, out) -> CompletedProcess."""
    exe = Path(sys.executable).parent / "ministream"

    def run(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def start_serve():
    """Start `ministream serve MODEL ARGS` as a user would, on a free loopback port (run.server.start: a session
    of its own, its output in `log`): start_serve(model, log, *args, python=None, env=None, **extra) ->
    (process, base URL). python: another environment's interpreter, which runs `python -m ministream.cli`;
    env: the whole environment (default: this one, with the lean KV cache); extra: variables added to it."""

    def start(model: Path, log: Path, *args, python=None, env=None, **extra):
        port = server.free_port()
        exe = [str(python), "-m", "ministream.cli"] if python else [str(Path(sys.executable).parent / "ministream")]
        env = {**(env or {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}), **extra}
        proc = server.start([*exe, "serve", str(model), "--port", str(port), *map(str, args)], log, env)
        return proc, f"http://127.0.0.1:{port}"

    return start


@pytest.fixture(scope="session")
def tree():
    """tree(path): every file under `path` with its size and mtime: equal before and after means nothing was
    touched."""

    def files(path: Path) -> dict:
        return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}

    return files


def generate_args(folder: Path, out: Path, dtype: str, tp: int, logprobs: int, max_tokens: int) -> list:
    """`ministream generate`'s arguments for the installed vLLM alone, its outputs (ids, logprobs) into `out`."""
    engine = f"--engine vllm --dtype {dtype} --tp {tp} --logprobs {logprobs} --max-tokens {max_tokens}".split()
    return ["generate", folder, *engine, "--json", out]


def pip_target(wheel: Path, target: Path, *options: str) -> None:
    """`wheel` installed by pip into the folder `target` alone (--target, no dependencies)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *options]
    r = subprocess.run([*pip, "--target", str(target), str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
