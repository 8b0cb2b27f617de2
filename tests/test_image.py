"""The serving images (docker/): what the CUDA one installs and runs, checked statically (it cannot be
built without vLLM's image and a GPU); the CPU one built and run for real by `make test-image`."""

import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from ministream import MiniStreamError
from ministream.fork.image import (
    DOCKER,
    MODEL_MOUNT,
    build_args,
    container_env,
    container_tool,
    dockerfile,
    run_command,
    tag,
)
from ministream.fork.wheel import built_wheel, wheel_name
from ministream.fork.zentorch import zen_cpu
from ministream.run.engine import NO_USAGE_STATS
from ministream.run.server import call, free_port, json_headers, start as start_process, wait_ready

ROOT = Path(__file__).resolve().parent.parent  # the checkout
VERSION = re.search(r"^VLLM_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def arg_default(text: str, name: str) -> str:
    """The default of the last `ARG name=...` of a Dockerfile (the one its RUN steps see)."""
    return re.findall(rf"^ARG {name}=(\S+)$", text, re.M)[-1]


def instructions(text: str, keyword: str) -> list[str]:
    """Every `keyword` instruction of a Dockerfile, continuation lines joined."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    return [line[len(keyword) + 1 :].strip() for line in joined.splitlines() if line.startswith(keyword + " ")]


# ---------------------------------------------------------------- static: both Dockerfiles


def test_cuda_image_starts_from_vllms_openai_image_of_the_same_version():
    text = dockerfile("cuda").read_text()
    assert instructions(text, "FROM") == ["docker.io/vllm/vllm-openai:v${VLLM_VERSION}"]
    assert arg_default(text, "VLLM_VERSION") == VERSION
    assert build_args(VERSION, "cuda")["VLLM_VERSION"] == VERSION


def test_a_cuda_base_that_cannot_be_pulled_stops_the_build_saying_how_to_bring_it(monkeypatch, tmp_path):
    """A machine without Docker Hub (the CI kind): a real pull from a registry nobody listens on fails, and the
    error names the image, the tool's reason and the commands, with the build context kept."""
    from ministream.fork import image

    try:
        tool = image.container_tool()
    except MiniStreamError as e:
        pytest.skip(str(e))  # make test-full installs podman (make image-prereqs)
    monkeypatch.setattr(image, "cuda_base", lambda version: f"127.0.0.1:9/vllm/vllm-openai:v{version}")
    with pytest.raises(MiniStreamError) as e:
        image.ensure_cuda_base(tool, VERSION, tmp_path)
    said = str(e.value)
    assert f"FROM 127.0.0.1:9/vllm/vllm-openai:v{VERSION}" in said and f"{tool[0]} pull " in said
    assert "refused" in said.lower() or "connect" in said.lower(), said  # the tool's own reason
    assert f"make image VLLM_VERSION={VERSION} DEVICE=cuda" in said and str(tmp_path) in said


def test_cuda_wheel_argument_is_the_file_make_wheel_writes():
    name = wheel_name(VERSION, "cuda")  # what `ministream wheel VERSION --device cuda` names its output
    assert name.startswith(f"vllm-{VERSION}+ministream.") and name.endswith(".whl")
    assert arg_default(dockerfile("cuda").read_text(), "WHEEL") == name == build_args(VERSION, "cuda")["WHEEL"]


def test_cpu_wheel_argument_is_the_file_make_wheel_wrote():
    wrote = built_wheel(VERSION, "cpu").name  # `make test` installs it first
    assert arg_default(dockerfile("cpu").read_text(), "WHEEL") == wrote == build_args(VERSION, "cpu")["WHEEL"]


def test_cuda_installs_our_wheel_with_no_deps_by_the_script_the_cpu_image_runs():
    cuda, cpu = (instructions(dockerfile(d).read_text(), "RUN") for d in ("cuda", "cpu"))
    mount = "--mount=type=bind,source=wheelhouse,target=/tmp/wheelhouse"
    assert cuda == [f'{mount} install.sh --no-deps "${{WHEEL}}"']
    assert cpu[0].startswith(mount) and cpu[0].endswith('install.sh "${WHEEL}"')
    assert cpu[1:] == ["useradd --create-home --uid 1000 --shell /usr/sbin/nologin ministream"]
    script = (DOCKER / "install.sh").read_text()
    assert '$pip $nodeps "$house/$wheel"' in script and "--no-index" in script
    assert subprocess.run(["sh", "-n", DOCKER / "install.sh"]).returncode == 0


def test_both_images_serve_through_the_same_entrypoint():
    for device in ("cuda", "cpu"):
        text = dockerfile(device).read_text()
        assert instructions(text, "COPY") == ["install.sh entrypoint.sh /usr/local/bin/"]
        assert instructions(text, "ENTRYPOINT") == ['["/usr/local/bin/entrypoint.sh"]']
        assert instructions(text, "EXPOSE") == ["8000"]
        assert instructions(text, "ENV")[-1] == "GIT_PYTHON_REFRESH=quiet"  # no git in the image


def health_command(device: str) -> str:
    """The Python the HEALTHCHECK of `device`'s Dockerfile runs (its exec form is JSON)."""
    import json

    line = instructions(dockerfile(device).read_text(), "HEALTHCHECK")
    assert len(line) == 1, line
    cmd = json.loads(line[0].split(" CMD ", 1)[1])
    assert cmd[:2] == ["python3", "-c"]
    return cmd[2]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_both_images_have_a_health_check_on_vllms_health_where_the_server_listens(device, tmp_path):
    """Run against a real /health on loopback: 0 when it answers 200, non-zero when nothing listens."""
    import http.server
    import sys
    import threading

    code = health_command(device)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "PORT": str(port), "HOST": "0.0.0.0"}
        assert subprocess.run([sys.executable, "-c", code], env=env, timeout=30).returncode == 0
    finally:
        server.shutdown()
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30).returncode != 0


def test_both_images_serve_as_an_unprivileged_user_with_no_usage_reporting():
    for device, user in (("cpu", "ministream"), ("cuda", "vllm")):  # the CUDA one: vLLM's image made it
        text = dockerfile(device).read_text()
        assert instructions(text, "USER") == [user]
        # installed as root, served as the user: USER after the install, before the entry point
        assert text.index('"${WHEEL}"') < text.index(f"USER {user}") < text.index("ENTRYPOINT")
        env = dict(kv.split("=", 1) for line in instructions(text, "ENV") for kv in line.split())
        assert env["HOME"] == f"/home/{user}" and instructions(text, "WORKDIR") == [env["HOME"]]
        assert {k: env.get(k) for k in NO_USAGE_STATS} == NO_USAGE_STATS  # what engine.py gives every engine


def test_entrypoint_is_ministream_serve_on_the_mounted_folder():
    """Its dispatch runs in tests/test_deploy.py (a command, options, a folder); here what it serves by default."""
    script = (DOCKER / "entrypoint.sh").read_text()
    assert 'exec ministream serve "${MODEL:-/model}" --host "$host" --port "$port" "$@"' in script
    assert MODEL_MOUNT == "/model"
    assert subprocess.run(["sh", "-n", DOCKER / "entrypoint.sh"]).returncode == 0


def test_run_command_mounts_the_model_read_only_on_the_host_network():
    cmd = run_command(["podman"], "ministream-vllm:0.32.0-cpu", "/data/hf", 8123, "127.0.0.1", ("--dtype", "float32"))
    assert cmd[:5] == ["podman", "run", "--rm", "--network", "host"]
    assert "/data/hf:/models/hf:ro" in cmd and "MODEL=/models/hf" in cmd  # served as "hf", like `make serve`
    assert "PORT=8123" in cmd and "HOST=127.0.0.1" in cmd and cmd[cmd.index("--shm-size") + 1] == "2g"
    assert cmd[-3:] == ["ministream-vllm:0.32.0-cpu", "--dtype", "float32"]
    assert "--gpus" in run_command(["docker"], tag(VERSION, "cuda"), "/m")


# ---------------------------------------------------------------- the CPU image, built and run


@pytest.mark.full
@pytest.mark.skipif(
    os.environ.get("MINISTREAM_TEST_IMAGE") != "1", reason="builds and runs the CPU image (minutes): `make test-image`"
)
def test_cpu_image_serves_the_same_completion_as_make_serve(tiny_hf, cli, start_serve, tmp_path):
    """As users run it: a folder converted on the host by another uid than the image's (1000), mounted
    read-only, the API key handed in by `-e VLLM_API_KEY`, the server on loopback only; the health check
    turns healthy; SIGTERM (`stop`) ends it with status 0."""

    start = time.monotonic()
    r = cli("image", VERSION, "--device", "cpu", timeout=3600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    print(f"image build: {time.monotonic() - start:.0f}s; {r.stdout.strip().splitlines()[-2]}")
    shared = Path(tempfile.mkdtemp(prefix="ministream-image-", dir="/tmp"))  # /tmp: open to the container's uid
    shared.chmod(0o755)
    model = shared / tiny_hf.name
    shutil.copytree(tiny_hf, model)  # under the umask, as `ministream convert` writes (atomic.new_folder)
    for p in [model, *model.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
        os.chown(p, 65534, 65534)  # converted by another user than the image's

    tool = container_tool()
    name = f"ministream-test-{os.getpid()}"
    key = secrets.token_hex(16)
    keyed = {**container_env(), "VLLM_API_KEY": key}  # `-e VLLM_API_KEY`: from the caller's environment
    servers = {}
    for where in ("image", "host"):
        log = tmp_path / f"{where}.log"
        if where == "image":
            port = free_port()
            cmd = run_command(
                tool,
                tag(VERSION, "cpu"),
                str(model),
                port,
                "127.0.0.1",
                ("--dtype", "float32", "--max-model-len", "256"),
            )
            at = cmd.index("run") + 1
            cmd[at:at] = ["--name", name, "-e", "VLLM_CPU_KVCACHE_SPACE=1", "-e", "VLLM_API_KEY"]
            servers[where] = (start_process(cmd, log, keyed), f"http://127.0.0.1:{port}", log)
        else:  # what `VLLM_API_KEY=... make serve MODEL=... DTYPE=float32` runs
            serve = start_serve(tiny_hf, log, "--dtype", "float32", "--max-model-len", 256, VLLM_API_KEY=key)
            servers[where] = (*serve, log)
    try:
        t0 = time.monotonic()
        healthy = None
        while healthy is None and time.monotonic() - t0 < 900:
            if health(tool, name):
                healthy = time.monotonic() - t0
            elif servers["image"][0].poll() is not None:
                break
            else:
                time.sleep(1)
        assert healthy is not None, servers["image"][2].read_text()[-3000:]
        print(f"the image's health check: healthy {healthy:.0f}s after start")
        for proc, url, log in servers.values():
            wait_ready(url, proc, log, 900, key=key)
        answers = {}
        ask = {
            "model": tiny_hf.name,
            "prompt": "Once upon a time",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for where, (_, url, _) in servers.items():
            models = call(f"{url}/v1/models", headers=json_headers(key))[1]
            assert models["data"][0]["id"] == tiny_hf.name  # the folder's name in both
            status, body = call(f"{url}/v1/completions", ask, headers=json_headers(key))
            assert status == 200, body
            answers[where] = body["choices"][0]
        image_url = servers["image"][1]
        assert call(f"{image_url}/v1/completions", ask, headers={"Content-Type": "application/json"})[0] == 401
        assert call(f"{image_url}/health", headers={})[0] == 200  # what the health check asks, with no key
        port = int(image_url.rsplit(":", 1)[1])
        for address in other_addresses():  # HOST=127.0.0.1 on the host's network: nothing else reaches it
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=10).close()
        assert answers["image"]["token_ids"] == answers["host"]["token_ids"]
        assert answers["image"]["text"] == answers["host"]["text"]
        which = ["-c", "from vllm.platforms import current_platform as p; print(type(p).__name__)"]
        platforms = {
            where: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300).stdout.split()[-1]
            for where, cmd, env in (
                ("image", [*tool, "exec", name, "python3", *which], container_env()),
                ("host", [sys.executable, *which], None),
            )
        }
    finally:  # the container gets SIGTERM from `stop`, the host server from us: both must exit cleanly
        subprocess.run([*tool, "stop", "-t", "60", name], env=container_env(), capture_output=True, timeout=120)
        if servers["host"][0].poll() is None:
            os.kill(servers["host"][0].pid, signal.SIGTERM)
        for proc, _, _ in servers.values():
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        shutil.rmtree(shared, ignore_errors=True)
    print(f"both answered {answers['image']['text']!r}")
    # the image carries zentorch as .venv does (machine_library): where this host is an AMD CPU with AVX-512
    # both pick vLLM's ZenCpuPlatform, elsewhere its CpuPlatform
    want = "ZenCpuPlatform" if zen_cpu() and importlib.util.find_spec("zentorch") else "CpuPlatform"
    assert platforms == {"image": want, "host": want}, platforms
    for proc, _, log in servers.values():
        assert proc.returncode == 0 and "ministream serve: stopped" in log.read_text(), log.read_text()[-3000:]


@pytest.mark.full
@pytest.mark.skipif(
    os.environ.get("MINISTREAM_TEST_IMAGE") != "1", reason="builds and runs the CPU image (minutes): `make test-image`"
)
def test_vllms_own_command_runs_in_the_image_with_readiness_metrics_and_a_drain_at_stop(tiny_hf, cli, tmp_path):
    """The image as a drop-in for vllm/vllm-openai: the command vLLM's production-stack chart gives its container
    (`vllm serve MODEL --host --port ...`, deploy/production-stack-values.yaml's options), in the image as it is.
    It gives the reference model's tokens, `ministream ready` (the manifests' readiness probe) passes inside it,
    /metrics counts what it served, and `stop` (SIGTERM) with a stream in flight lets the stream finish."""
    from ministream.run.generate import reference_generate, tokenize
    from ministream.run.server import stream

    r = cli("image", VERSION, "--device", "cpu", timeout=3600)  # cached by the test above
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    shared = Path(tempfile.mkdtemp(prefix="ministream-image-", dir="/tmp"))
    shared.chmod(0o755)
    model = shared / tiny_hf.name
    shutil.copytree(tiny_hf, model)
    for p in [model, *model.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    tool, name, port = container_tool(), f"ministream-vllm-cmd-{os.getpid()}", free_port()
    mount = f"/models/{model.name}"
    vllm = ["vllm", "serve", mount, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    vllm += ["--max-model-len", "256", "--enforce-eager", "--shutdown-timeout", "25"]
    cmd = [*tool, "run", "--rm", "--name", name, "--network", "host", "--shm-size", "2g"]
    cmd += ["-v", f"{model}:{mount}:ro", "-e", "VLLM_CPU_KVCACHE_SPACE=1", tag(VERSION, "cpu"), *vllm]
    log = tmp_path / "vllm.log"
    proc = start_process(cmd, log, container_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log, 900)
        assert "non-default args" in log.read_text() and "ministream serve" not in log.read_text()  # vLLM's own
        prompts = tokenize(model, ["Once upon a time", "The river runs through"])
        want = [r["ids"] for r in reference_generate(model, prompts, 12)]
        got = []
        for ids in prompts:
            body = {"model": mount, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            status, answer = call(f"{url}/v1/completions", {**body, "return_token_ids": True}, headers=json_headers())
            assert status == 200, answer
            got.append(answer["choices"][0]["token_ids"])
        assert got == want
        ready = subprocess.run(
            [*tool, "exec", "-e", f"PORT={port}", name, "ministream", "ready"],
            env=container_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ready.returncode == 0 and f"serves '{mount}'" in ready.stdout, ready.stderr
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as m:
            metrics = m.read().decode()
        counted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:generation_tokens_total{")]
        assert counted and f'model_name="{mount}"' in counted[0] and float(counted[0].split()[-1]) >= 24
        # 48 sequences, so that the stream outlasts the signal's way in (test_serve's drain test says why)
        body = {"model": mount, "prompt": "The river", "max_tokens": 240, "n": 48, "seed": 0, "ignore_eos": True}
        with stream(f"{url}/v1/completions", {**body, "stream_options": {"include_usage": True}}) as s:
            events = iter(s)
            next(events)
            stopping = subprocess.Popen([*tool, "stop", "-t", "60", name], env=container_env())
            rest = list(events)
            assert s.done
        assert rest[-1]["usage"]["completion_tokens"] == 240 * 48
        assert stopping.wait(120) == 0 and proc.wait(120) == 0, log.read_text()[-3000:]
        assert "draining in-flight requests count=48 " in log.read_text()
    finally:
        subprocess.run([*tool, "rm", "-f", name], env=container_env(), capture_output=True, timeout=120)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(shared, ignore_errors=True)


def other_addresses() -> list[str]:
    """This machine's addresses other than loopback (`hostname -I`); the test needs one to show loopback-only."""
    said = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=30).stdout.split()
    others = [a for a in said if not a.startswith("127.") and a != "::1"]
    assert others, "this machine has no address but loopback: nothing to show the image's server is not on"
    return others


def health(tool: list[str], name: str) -> bool:
    """Whether the container's HEALTHCHECK passes now: podman runs it on demand, docker reports its state."""
    if tool[0] == "podman":
        cmd = [*tool, "healthcheck", "run", name]
        return subprocess.run(cmd, env=container_env(), capture_output=True, timeout=60).returncode == 0
    cmd = [*tool, "inspect", "--format", "{{.State.Health.Status}}", name]
    said = subprocess.run(cmd, env=container_env(), capture_output=True, text=True, timeout=60)
    return said.stdout.strip() == "healthy"


def test_the_cpu_image_adds_the_zentorch_paired_with_its_torch_and_nothing_unpaired(tmp_path):
    """machine_library reads the wheelhouse's torch: 2.13.0 gets zentorch 2.13.0.2 (its wheel already in
    the house: no pip), a torch with no pairing gets nothing."""
    from ministream.fork import zentorch
    from ministream.fork.image import machine_library

    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    (tmp_path / "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl").touch()  # a newer one beside it: not vLLM's
    (tmp_path / "zentorch-2.13.0.2-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert machine_library(tmp_path) == ["zentorch==2.13.0.2", *zentorch.EXTRA]
    other = tmp_path / "other"
    other.mkdir()
    (other / "torch-2.9.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert machine_library(other) == []
    assert 'EXTRA="${EXTRA}"' in dockerfile("cpu").read_text()


def test_plugin_image_is_vllms_own_image_with_our_plugin_wheel(monkeypatch, tmp_path):
    """ROUTE=plugin: the CUDA Dockerfile, installing the plugin wheel `make plugin` writes instead of our vLLM."""
    from ministream.fork import image
    from ministream.fork.plugin import wheel_name as plugin_wheel

    assert tag(VERSION, "cuda", "plugin") == f"ministream-vllm:{VERSION}-cuda-plugin"
    assert build_args(VERSION, "cuda", "plugin") == {"VLLM_VERSION": VERSION, "WHEEL": plugin_wheel(VERSION)}
    assert "FROM docker.io/vllm/vllm-openai:v${VLLM_VERSION}" in dockerfile("cuda").read_text()  # the stock image
    # the image's install check accepts either route: it asks vLLM's registry after loading the plugins
    check = (DOCKER / "install.sh").read_text()
    assert "load_general_plugins()" in check and "get_supported_archs()" in check
    with pytest.raises(MiniStreamError, match=r"no stock vLLM image to build on"):
        image.prepare_context(VERSION, "cpu", "plugin")
    with pytest.raises(MiniStreamError, match=r"unknown image route 'fork'"):
        image.build(VERSION, "cuda", route="fork")
    assert "--gpus" in run_command(["docker"], tag(VERSION, "cuda", "plugin"), str(tmp_path))
