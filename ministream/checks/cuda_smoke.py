"""cuda-smoke: the patched CUDA wheel in a fresh environment, checked as far as a machine without a GPU can.

    ministream cuda-smoke 0.32.0
    ministream cuda-smoke 0.34.0 --nearest-pins      (0.34.0 pins flashinfer-python==0.7.3, never published)

Everything goes under build/cuda-smoke/<v>/, reused when intact; report.json there holds every stage:
  wheel        the release's source (its sdist) + the patch set for cuda, in a tree of its own (vllm-<v>/; the
               project's build/vllm-<v> is not touched), and our CUDA wheel from it (dist/)
  environment  venv/: this Python with that wheel and its requirements, by uv from the package index (PyPI: the
               CUDA torch, never a local +cpu build), uv's cache in build/cache/uv hardlinked into it; pytest and
               tblib for vLLM's tests, this package's own requirements for gpu-proof's probe. A requirement no
               index publishes is refused by name (fork/pins.py), or with --nearest-pins replaced by the nearest
               published version, recorded (venv/ministream-pins.json)
  checks       cuda_smoke_probe.py in that environment, no device needed: `import vllm` says our labelled version;
               vLLM's own subprocess inspection of MiniStreamForCausalLM gives every field LlamaForCausalLM's;
               the model module imported, with LLaMA's interfaces (LoRA, PP, generation); get_config maps
               model_type ministream to MiniStreamConfig; EngineArgs(model=folder).create_model_config() resolves a
               converted folder; `vllm --version` (VLLM_TARGET_DEVICE=cpu: without a device vLLM cannot infer one)
  vllm tests   vLLM's own tests/models/test_registry.py cases that concern MiniStream, from the patched tree
  negative     the same probe and tests with the stock release wheel first on PYTHONPATH: every MiniStream check
               must fail there and the LLaMA sanity checks pass, or the checks above prove nothing
What no machine without a GPU can prove is printed and kept in the report (NOT_PROVEN); `make gpu-proof` does it.
"""

import functools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import lock, write_json
from ..fork import pins
from ..fork.patch import patch_tree
from ..fork.patchset import patch_set_dir
from ..fork.release import file_sha256, release_wheel
from ..fork.wheel import build_wheel, patched_version
from ..paths import BUILD, CACHE
from ..spec import ARCH
from .environments import BASE_PYTHON, StageFailed, _check_disk, _run, _tail, _uv, package_requirements
from .vllm_tests import counts, example_models, hf_cache, pytest_run

ROOT = BUILD / "cuda-smoke"
PROBE = Path(__file__).with_name("cuda_smoke_probe.py")
UV_CACHE = CACHE / "uv"  # hardlinked into each venv: one copy of each package on disk
ENV_GIB = 12  # seen: 9.4 GiB for 0.34.0 (torch 2.14.0+cu130 and its nvidia libraries)
TEST_REQUIREMENTS = ("pytest>=8,<9.2", "tblib")  # what vLLM's test files need beside vLLM
REGISTRY_TESTS = "tests/models/test_registry.py"
SELECT = f"{ARCH} or ministream or test_hf_registry_coverage"
TESTS_OURS = f"test_registry_imports[{ARCH}]"  # the case that exists only because of the patch
EXAMPLE = "ministream/ministream-tiny-gqa"  # the example model whose folder the probe converts to a ModelConfig
NOT_PROVEN = (
    "the model's forward pass on CUDA: weights in GPU memory, vLLM's CUDA kernels, the attention backends "
    "(FlashAttention, FlashInfer), torch.compile and CUDA graphs",
    "golden outputs (fp32 identical, bf16 top-k) on a GPU; tensor parallelism over NCCL; fp8; LoRA on GPU",
    "that the compiled extensions (vllm/*.abi3.so) load and run: they need the NVIDIA driver's libcuda.so.1",
    "an engine at all: LLM(...) and `vllm serve` stop at the device; `vllm --version` needs VLLM_TARGET_DEVICE=cpu",
)
GPU_PROOF = "make gpu-proof VLLM_VERSION={v} on a machine with a GPU proves these"


def root(version: str) -> Path:
    return ROOT / version


# --- the wheel and its environment ---------------------------------------------------------------------------


def wheel(version: str) -> Path:
    """Our CUDA wheel of `version`, from a tree of the smoke's own (the project's build/vllm-<v> may be patched
    for the CPU, and another run may be using it)."""
    tree = patch_tree(version, out=root(version) / f"vllm-{version}", device="cuda")
    return build_wheel(version, "cuda", tree, root(version) / "dist", quiet=True)


def environment(version: str, built: Path, nearest_pins: bool) -> tuple[Path, list[dict]]:
    """venv/ with `built` and its requirements; reused when it holds this wheel, asked the same way. The pins
    replaced (pins.Unresolvable as dicts), if any."""
    venv = root(version) / "venv"
    python = venv / "bin" / "python"
    found, unread = pins.check(built, pins.uv_sources())
    if unread:
        print(f"note: could not check every requirement against the index ({'; '.join(unread[:3])}); uv decides")
    if found and not nearest_pins:
        name, full, _ = pins.wheel_requirements(built)
        raise StageFailed(
            "environment",
            pins.refusal(name, full, found, pins.uv_sources(), "--nearest-pins (make cuda-smoke NEAREST_PINS=1)"),
        )
    subs = pins.substitutes(found, *pins.wheel_requirements(built)[:2]) if found else {}
    marker = venv / ".ministream-smoke.json"
    extra = [*TEST_REQUIREMENTS, *package_requirements()]
    want = {"wheel": built.name, "sha256": file_sha256(built), "overrides": sorted(subs.values()), "extra": extra}
    replaced = [dict(vars(u), installed=subs[u.name], published=u.published[-8:]) for u in found]  # as pins.record
    if python.exists() and marker.is_file() and json.loads(marker.read_text()) == want:
        print(f"environment: {venv} already holds {built.name} (reused)")
        return venv, replaced
    marker.unlink(missing_ok=True)
    uv = _uv()
    if not python.exists():
        _check_disk(root(version), ENV_GIB, f"the CUDA environment of vLLM {version}")
        _run("environment", [uv, "venv", "-q", "--python", BASE_PYTHON, venv])
    env = dict(os.environ, UV_LINK_MODE="hardlink", UV_PYTHON_DOWNLOADS="never")
    env.setdefault("UV_CACHE_DIR", str(UV_CACHE))
    overrides = venv / "overrides.txt"
    overrides.write_text("".join(f"{s}\n" for s in subs.values()))
    print(f"environment: {built.name} and its requirements into {venv} (uv, cache {env['UV_CACHE_DIR']})", flush=True)
    _run(
        "environment",
        [uv, "pip", "install", "-q", "--python", python, "--override", overrides]
        + ["--reinstall-package", "vllm", built, *extra],
        env=env,
        timeout=7200,
    )
    name, full, _ = pins.wheel_requirements(built)
    pins.record(venv, name, full, found)
    write_json(marker, want)
    return venv, replaced


def stock(version: str) -> Path:
    """The stock release wheel of `version`, unpacked (once): first on PYTHONPATH it shadows our vllm/."""
    folder = root(version) / "stock"
    wheel = release_wheel(version, "cuda")
    done = folder / ".ministream-unpacked"
    if done.is_file() and done.read_text() == wheel.name:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".stock-", dir=root(version)))
    try:
        shutil.unpack_archive(wheel, tmp, "zip")
        (tmp / done.name).write_text(wheel.name)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# --- the checks ------------------------------------------------------------------------------------------------


def _probe_env(venv: Path, home: Path, cache: Path, shadow: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH"))}
    env.update(
        PATH=f"{venv.resolve() / 'bin'}:{env.get('PATH', '')}",
        VLLM_CACHE_ROOT=str(cache.resolve()),  # empty: vLLM's model-info cache cannot answer for its subprocess
        HF_HOME=str(home.resolve()),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if shadow is not None:
        env["PYTHONPATH"] = str(shadow.resolve())
    return env


def probe(venv: Path, version: str, folder: Path, home: Path, work: Path, shadow: Path | None = None) -> dict:
    """cuda_smoke_probe.py's checks, and `vllm --version`, in the environment (`shadow` first on PYTHONPATH)."""
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "vllm-cache"
    shutil.rmtree(cache, ignore_errors=True)
    env = _probe_env(venv, home, cache, shadow)
    out, log = work / "probe.json", work / "probe.log"
    out.unlink(missing_ok=True)
    want = patched_version(version)
    cmd = [(venv / "bin" / "python").absolute(), "-P", PROBE.resolve(), want, folder.resolve(), out.resolve()]
    with open(log, "w") as f:
        done = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if not out.is_file():
        raise StageFailed("checks", f"the probe ended ({done.returncode}) without a result: {_tail(log.read_text())}")
    results = json.loads(out.read_text())
    results["vllm --version"] = _vllm_version(venv, env, want)
    return results


def _vllm_version(venv: Path, env: dict, want: str) -> dict:
    """`vllm --version` from the environment's console script: with VLLM_TARGET_DEVICE=cpu (without a device
    vLLM cannot tell which it is) it must print our labelled version; what it does without is recorded."""
    script = (venv / "bin" / "vllm").absolute()
    runs = {}
    for label, extra in (("cpu", {"VLLM_TARGET_DEVICE": "cpu"}), ("unset", {})):
        try:
            done = subprocess.run(
                [str(script), "--version"], capture_output=True, text=True, env={**env, **extra}, timeout=600
            )
            said = (done.stdout.strip().splitlines() or [""])[-1]
            runs[label] = (done.returncode, said, _tail(done.stderr, 2) if done.returncode else "")
        except (OSError, subprocess.TimeoutExpired) as e:
            runs[label] = (-1, "", str(e))
    code, said, err = runs["cpu"]
    bare = runs["unset"]
    without = f"exit {bare[0]}: {bare[2][-200:]}" if bare[0] else f"printed {bare[1]!r}"
    return {
        "ok": code == 0 and said == want,
        "detail": f"VLLM_TARGET_DEVICE=cpu vllm --version -> {said!r} (exit {code}{': ' + err if err else ''}); "
        f"without VLLM_TARGET_DEVICE: {without}",
        "sanity": False,
    }


def registry_tests(venv: Path, tree: Path, home: Path, work: Path, shadow: Path | None = None) -> dict[str, str]:
    """vLLM's own test_registry.py cases that concern MiniStream, from the patched tree, in the environment."""
    work.mkdir(parents=True, exist_ok=True)
    env = _probe_env(venv, home, work / "vllm-cache", shadow)
    return pytest_run(
        tree.resolve(),
        [REGISTRY_TESTS, "-k", SELECT],
        env,
        work.resolve() / "tests.xml",
        python=(venv / "bin" / "python").absolute(),  # not resolved: the venv's own link, or it is not the venv
    )


def judge_negative(results: dict, tests: dict[str, str]) -> dict:
    """The negative control's verdict: every MiniStream check failed (where it must) and every sanity check
    passed (the environment itself works); our test case absent or failing."""
    ours = {k: r["ok"] for k, r in results.items() if not r.get("sanity")}
    sanity = {k: r["ok"] for k, r in results.items() if r.get("sanity")}
    case = [o for t, o in tests.items() if TESTS_OURS in t]
    passed_wrongly = sorted(k for k, ok in ours.items() if ok) + (
        ["vllm tests: " + TESTS_OURS] if "passed" in case else []
    )
    broken = sorted(k for k, ok in sanity.items() if not ok)
    return {
        "ok": not passed_wrongly and not broken,
        "failed_as_they_must": sorted(k for k, ok in ours.items() if not ok),
        "passed_on_stock": passed_wrongly,
        "sanity_failed": broken,
        "test_case": case[0] if case else "not collected (stock vLLM does not register the architecture)",
    }


# --- the whole smoke -------------------------------------------------------------------------------------------


def du(*paths: Path) -> int:
    """Bytes on disk of `paths` together, each hardlinked file counted once (du -s)."""
    existing = [str(p) for p in paths if p.exists()]
    if not existing:
        return 0
    out = subprocess.run(["du", "-s", "-B1", "-c", *existing], capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def run_smoke(version: str, nearest_pins: bool = False, log=print) -> int:
    """`ministream cuda-smoke VERSION`: 0 when every check passes and the negative control fails where it must."""
    patch_set_dir(version)  # a release without a patch set: one line naming the `make port` to run, nothing made
    started = time.monotonic()
    if log is print:  # each stage said as it starts, also where stdout is a file
        log = functools.partial(print, flush=True)
    base = root(version)
    base.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    report: dict[str, Any] = {"version": version, "ok": False, "seconds": seconds, "not_proven": list(NOT_PROVEN)}
    stage, t = "wheel", time.monotonic()
    try:
        log(f"cuda-smoke {version}: wheel")
        built = wheel(version)
        report["wheel"] = str(built)
        seconds[stage], stage, t = round(time.monotonic() - t), "environment", time.monotonic()
        log(f"cuda-smoke {version}: environment")
        venv, replaced = environment(version, built, nearest_pins)
        report["replaced_pins"] = replaced
        report["environment"] = _describe(venv)
        seconds[stage], stage, t = round(time.monotonic() - t), "checks", time.monotonic()
        tree = base / f"vllm-{version}"
        with lock(ROOT / "hf-home", "making the example models"):  # one maker at a time, another release's too
            home = hf_cache(example_models(tree), ROOT / "hf-home", log=log)
        folder = _example_folder(home, EXAMPLE)
        log(f"cuda-smoke {version}: checks (cuda_smoke_probe.py in {venv})")
        report["checks"] = probe(venv, version, folder, home, base / "patched")
        seconds[stage], stage, t = round(time.monotonic() - t), "vllm tests", time.monotonic()
        log(f"cuda-smoke {version}: vLLM's own {REGISTRY_TESTS} from {tree}")
        report["vllm_tests"] = registry_tests(venv, tree, home, base / "patched")
        seconds[stage], stage, t = round(time.monotonic() - t), "negative", time.monotonic()
        log(f"cuda-smoke {version}: negative control (the stock release wheel first on PYTHONPATH)")
        shadow = stock(version)
        negative = probe(venv, version, folder, home, base / "stock-run", shadow)
        negative_tests = registry_tests(venv, tree, home, base / "stock-run", shadow)
        report["negative"] = {
            "checks": negative,
            "vllm_tests": negative_tests,
            **judge_negative(negative, negative_tests),
        }
        seconds[stage] = round(time.monotonic() - t)
        tests_ok = bool(report["vllm_tests"]) and all(o == "passed" for o in report["vllm_tests"].values())
        tests_ok = tests_ok and any(TESTS_OURS in k for k in report["vllm_tests"])
        report["ok"] = all(c["ok"] for c in report["checks"].values()) and tests_ok and report["negative"]["ok"]
    except StageFailed as e:
        report.update(stage=e.stage, error=e.error)
    except (MiniStreamError, OSError, subprocess.SubprocessError) as e:
        report.update(stage=stage, error=str(e))
    seconds["total"] = round(time.monotonic() - started)
    report["disk"] = {
        "venv": du(base / "venv"),
        "uv_cache": du(Path(os.environ.get("UV_CACHE_DIR") or UV_CACHE)),
        "venv_and_uv_cache": du(base / "venv", Path(os.environ.get("UV_CACHE_DIR") or UV_CACHE)),
        "smoke_folder": du(base),
    }
    write_json(base / "report.json", report)
    _print(report, log)
    return 0 if report["ok"] else 1


def _example_folder(home: Path, repo: str) -> Path:
    entry = home / "hub" / f"models--{repo.replace('/', '--')}"
    return entry / "snapshots" / (entry / "refs" / "main").read_text().strip()


def _describe(venv: Path) -> dict:
    code = (
        "import json, platform, importlib.metadata as m\n"
        "d = {'python': platform.python_version()}\n"
        "for n in ('vllm', 'torch', 'transformers', 'flashinfer-python'):\n"
        "    try: d[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: d[n] = None\n"
        "print(json.dumps(d))"
    )
    return json.loads(_run("environment", [venv / "bin" / "python", "-c", code]).strip().splitlines()[-1])


def _print(report: dict, log) -> None:
    v = report["version"]
    env = report.get("environment", {})
    log(f"\ncuda-smoke vLLM {v}: {report.get('wheel', 'no wheel')}")
    if env:
        log(
            f"  environment: python {env['python']}, vllm {env['vllm']}, torch {env['torch']}, "
            f"transformers {env['transformers']}, flashinfer-python {env['flashinfer-python']}"
        )
    for r in report.get("replaced_pins", []):
        issue = r["upstream"] or "no upstream issue found"
        log(f"  replaced pin: {r['requirement']} -> {r['installed']} (never published; {issue})")
    for name, c in report.get("checks", {}).items():
        log(f"  {'ok  ' if c['ok'] else 'FAIL'} {name:<16} {c['detail']}")
    tests = report.get("vllm_tests")
    if tests is not None:
        log(f"  vLLM's tests ({REGISTRY_TESTS}, -k '{SELECT}'): {counts(tests)}")
        for t, o in tests.items():
            log(f"       {o}: {t}")
    neg = report.get("negative")
    if neg:
        log(
            f"  negative control (stock vllm {v} first on PYTHONPATH): {'as it must' if neg['ok'] else 'WRONG'}: "
            f"failed {neg['failed_as_they_must']}; passed on stock {neg['passed_on_stock'] or 'none'}; "
            f"sanity failed {neg['sanity_failed'] or 'none'}; {TESTS_OURS}: {neg['test_case']}"
        )
    if report.get("error"):
        log(f"  error at {report.get('stage')}: {report['error']}")
    log("  not proven without a GPU (" + GPU_PROOF.format(v=v) + "):")
    for line in report["not_proven"]:
        log(f"    - {line}")
    disk = report["disk"]
    log(
        f"  time: {', '.join(f'{k} {s} s' for k, s in report['seconds'].items())}; disk: venv {_gib(disk['venv'])}, "
        f"uv cache {_gib(disk['uv_cache'])}, both {_gib(disk['venv_and_uv_cache'])} (hardlinks counted once), "
        f"{ROOT}/{v} {_gib(disk['smoke_folder'])}"
    )
    log(f"cuda-smoke {v}: {'passed' if report['ok'] else 'FAILED'} ({ROOT / v / 'report.json'})")
