"""gpu-proof: what only a GPU can show about the patched CUDA wheel, as one prepared command for the day one is lent.

    ministream gpu-proof 0.32.0                     (make gpu-proof VLLM_VERSION=0.32.0)
    ministream gpu-proof 0.34.0 --nearest-pins
    ministream gpu-proof 0.32.0 --prepare-only      what needs no GPU (make test-full runs it)

Where no GPU answers (`nvidia-smi -L`) it stops in one line, before anything is made. On a GPU, everything under
build/gpu-proof/<v>/, the result in report.json there:
  environment  the CUDA wheel in a fresh environment: cuda-smoke's (build/cuda-smoke/<v>/venv), made or reused
  golden       both test models (GQA + untied head + padded vocabulary; MHA + tied head, rope_theta and
               rms_norm_eps unlike LLaMA's defaults) and the reference shape (8 layers, d_model 768, vocab 32000):
               fp32 must give the reference model's token ids, bf16 pass vLLM's top-k rule; compiled, with CUDA
               graphs on (each engine's own config must say so, not only our settings)
  twin         the reference shape under LlamaForCausalLM's names (the same safetensors) at batch 1, 8 and 64, bf16:
               the same token ids as MiniStream's at each batch size, and both throughputs
  tp2          TP=2, fp32, the GQA model: the reference's token ids; where two GPUs answer (else: skipped, said)
  fp8          the demo shape (trained; its dimensions multiples of 16) with quantization="fp8", and its
               `quantize --scheme fp8` folder (compressed-tensors FP8_DYNAMIC): vLLM's top-k rule against the
               reference in bf16
  lora         the GQA model with a LoRA adapter (checkpoint --adapter, convert-lora), vLLM's LoRARequest: bf16
               (vLLM's CUDA LoRA kernels take no fp32), the top-k rule against the reference with the adapter merged
  image        `make image DEVICE=cuda` where a Docker engine runs, the image serving the GQA model: its completion
               at temperature 0 has the reference's token ids (vLLM's image is pulled from Docker Hub)
Each engine runs in a process of its own (gpu_probe.py), so one that fails or holds GPU memory stops no other.
"""

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import new_folder, write_json
from ..checkpoint.convert import convert, llama_twin
from ..checkpoint.demo import make_adapter, make_checkpoint
from ..checkpoint.lora import convert_lora
from ..checkpoint.quantize import quantize
from ..fork.patchset import patch_set_dir
from ..fork.wheel import build_wheel
from ..paths import BUILD, CACHE, DIST
from ..run.verify import compare, make_golden
from . import cuda_smoke, gpu_probe
from .environments import PACKAGE_COPY, StageFailed, _run_env, _tail, package_copy, package_python
from .lines import PROMPTS, TEST_MODELS

OUT = BUILD / "gpu-proof"
MODELS = OUT / "models"  # shared by every release's proof
MAX_TOKENS, TOP_K = 24, 5
BATCHES = (1, 8, 64)
LORA_RANK = 8
# name -> (checkpoint preset, overrides): the two test models of `matrix --run`, the reference shape, the demo shape
PROOF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    **TEST_MODELS,
    "reference": ("reference", {}),
    "demo": ("demo", {}),
}
ENGINE_TIMEOUT = 1800  # seconds for one engine's job: import, load, compile, capture, generate twice


# --- the one-line stop -------------------------------------------------------------------------------------------


def gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists; none where it is missing or answers nothing."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in done.stdout.splitlines() if ln.startswith("GPU ")] if done.returncode == 0 else []


def require_gpu(version: str) -> list[str]:
    found = gpus()
    if not found:
        raise MiniStreamError(
            f"no GPU answers here (`nvidia-smi -L` lists none): gpu-proof {version} ran nothing; run it where a GPU "
            f"is lent, and `make cuda-smoke VLLM_VERSION={version}` for what this machine can check"
        )
    return found


# --- what needs no GPU -----------------------------------------------------------------------------------------


def models(root: Path = MODELS, log=print) -> dict[str, Path]:
    """name -> folder holding raw/ (the training checkpoint) and hf/ (converted), made once; the reference shape
    also llama/ (its LLaMA-named twin: the same safetensors, config.json naming LlamaForCausalLM)."""
    made = {}
    for name, (preset, overrides) in PROOF_MODELS.items():
        folder = root / name
        if not (folder / "hf" / "config.json").is_file():
            log(f"making the proof model {name} (preset {preset}) in {folder}")
            with new_folder(folder, force=True) as tmp:
                make_checkpoint(tmp / "raw", preset, log=lambda *a, **k: None, cache=CACHE, **overrides)
                convert(tmp / "raw", tmp / "hf", log=lambda *a, **k: None)
        made[name] = folder
    twin(made["reference"])
    adapter(made["gqa-untied"])
    fp8(made["demo"])
    return made


def fp8(folder: Path) -> Path:
    """folder/fp8: `ministream quantize --scheme fp8` of the converted folder (compressed-tensors FP8_DYNAMIC)."""
    if not (folder / "fp8" / "config.json").is_file():
        quantize(folder / "hf", folder / "fp8", "fp8", force=True, log=lambda *a, **k: None)
    return folder / "fp8"


def twin(folder: Path) -> Path:
    """folder/llama: the converted folder's files linked, its config.json naming LLaMA's architecture and type."""
    llama = folder / "llama"
    return llama if (llama / "config.json").is_file() else llama_twin(folder / "hf", llama)


def adapter(folder: Path) -> Path:
    """folder/lora: a LoRA adapter for the model (the trainer's adapter.pt, and its PEFT folder in peft/)."""
    raw, peft = folder / "lora" / "raw", folder / "lora" / "peft"
    if not (raw / "adapter.pt").is_file():
        make_adapter(folder / "raw", raw, rank=LORA_RANK, force=True, log=lambda *a, **k: None)
    if not (peft / "adapter_config.json").is_file():
        convert_lora(raw, peft, folder / "hf", force=True, log=lambda *a, **k: None)
    return folder / "lora"


def prompts(n: int) -> list[str]:
    """n prompts: the proof's four, then numbered variations of them (a batch of distinct sequences)."""
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" {i}") for i in range(n)]


def golden(folder: Path, dtype: str, n: int = len(PROMPTS), lora: bool = False) -> dict:
    """The reference model's outputs for n prompts (with the LoRA adapter merged, if asked), cached beside it."""
    path = folder / f"golden-{dtype}-{n}{'-lora' if lora else ''}.json"
    if not path.is_file():
        texts = prompts(n)
        made = (
            _lora_golden(folder, dtype, texts)
            if lora
            else make_golden(folder / "hf", folder / "raw", texts, dtype, MAX_TOKENS, TOP_K)
        )
        write_json(path, made)  # whole or not at all: a run killed half-way leaves no broken golden file
    return json.loads(path.read_text())


def _lora_golden(folder: Path, dtype: str, texts: list[str]) -> dict:
    import torch

    from ..checkpoint.reference import MiniStream
    from ..run.generate import tokenize

    ids = tokenize(folder / "hf", texts)
    model = MiniStream.from_checkpoint(folder / "raw", getattr(torch, dtype), adapter=folder / "lora" / "raw")
    return {"prompt_ids": ids, "outputs": model.generate(ids, MAX_TOKENS, logprobs=TOP_K)}


def jobs(made: dict[str, Path], n_gpus: int) -> list[dict]:
    """Every engine the proof runs: its part, what it runs, and what it is judged against: `golden` (model,
    dtype, prompts, lora) names the reference outputs, `rule` how (float32: identical ids; bfloat16: the top-k
    rule), `same_as` another job whose token ids it must repeat (the LLaMA twin: MiniStream's at its batch)."""
    out: list[dict] = []

    def job(part: str, name: str, model: str, folder: str, dtype: str, n: int = len(PROMPTS), **extra) -> dict:
        lora = "lora" in extra
        reference = "float32" if dtype == "float32" else "bfloat16"
        gold = golden(made[model], reference, n, lora)
        out.append(
            dict(
                part=part,
                name=name,
                folder=str((made[model] / folder).resolve()),
                dtype=dtype,
                tp=extra.pop("tp", 1),
                prompt_ids=gold["prompt_ids"],
                max_tokens=MAX_TOKENS,
                top_k=TOP_K,
                golden=[model, reference, n, lora],
                rule=reference,
                **extra,
            )
        )
        return out[-1]

    for model in ("gqa-untied", "mha-tied", "reference"):
        for dtype in ("float32", "bfloat16"):
            job("golden", f"{model} {dtype}", model, "hf", dtype)
    for batch in BATCHES:
        ours = job("twin", f"reference bfloat16 batch {batch}: MiniStream", "reference", "hf", "bfloat16", batch)
        job(
            "twin",
            f"reference bfloat16 batch {batch}: LLaMA twin",
            "reference",
            "llama",
            "bfloat16",
            batch,
            same_as=ours["name"],
        )
    tp2 = job("tp2", "gqa-untied float32 TP=2", "gqa-untied", "hf", "float32", tp=2)
    if n_gpus < 2:
        tp2["skip"] = f"TP=2 needs two GPUs; {n_gpus} answer(s) here"
    job("fp8", "demo fp8 (vs the reference in bfloat16)", "demo", "hf", "bfloat16", quantization="fp8")
    job("fp8", "demo quantize --scheme fp8 folder (vs the reference in bfloat16)", "demo", "fp8", "bfloat16")
    peft = str((made["gqa-untied"] / "lora" / "peft").resolve())
    # bf16: vLLM's CUDA LoRA kernels take fp16/bf16 weights only (lora/ops/triton_ops, an assert on fp32, seen
    # on an H200 with 0.26.0); the CPU's run fp32 (features.md)
    job(
        "lora",
        "gqa-untied bfloat16 + LoRA",
        "gqa-untied",
        "hf",
        "bfloat16",
        lora={"name": "proof", "path": peft, "rank": LORA_RANK},
    )
    return out


def prepare(root: Path = MODELS, n_gpus: int = 1, log=print) -> list[dict]:
    """What the proof needs that no GPU does: the models, the twin, the adapter, the golden outputs, the jobs."""
    return jobs(models(root, log), n_gpus)


# --- on the GPU ------------------------------------------------------------------------------------------------------


def run_job(venv: Path, job: dict, work: Path) -> dict:
    """One engine in a process of its own (gpu_probe.py) in the CUDA environment."""
    work.mkdir(parents=True, exist_ok=True)
    jobs_file, out_file, log = (work / "job.json").resolve(), (work / "out.json").resolve(), work / "probe.log"
    jobs_file.write_text(json.dumps([job]))
    out_file.unlink(missing_ok=True)
    package_copy()
    env = _run_env({"userland": "host"}, venv, work / "cache")
    with open(log, "w") as f:
        try:
            subprocess.run(
                [str(a) for a in [*package_python(venv), "ministream.checks.gpu_probe", jobs_file, out_file]],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=PACKAGE_COPY.resolve(),
                timeout=ENGINE_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"no result after {ENGINE_TIMEOUT} s (log: {log})"}
    got = json.loads(out_file.read_text()) if out_file.is_file() else []
    return got[0] if got else {"error": f"the probe ended without a result: {_tail(log.read_text())} (log: {log})"}


def judge(job: dict, got: dict, gold: dict | None, peer: dict | None = None) -> dict:
    """A job's verdict: its rule against the reference's outputs `gold` (or, with `same_as`, identical to the
    `peer` job's token ids), and compiled with CUDA graphs on, as the engine's own config says."""
    case: dict[str, Any] = {k: job[k] for k in ("part", "name", "dtype", "tp") if k in job}
    if "error" in got:
        return {**case, "ok": False, "error": got["error"]}
    graphs = not got.get("enforce_eager") and str(got.get("cudagraph_mode")) not in ("None", "NONE", "")
    if job.get("same_as"):
        if not peer or "outputs" not in peer:
            return {**case, "ok": False, "error": f"{job['same_as']} has no outputs to compare with"}
        ok, per = compare(peer["outputs"], got["outputs"], True, ("ministream", "llama"))
        rule = "identical to MiniStream's"
    else:
        assert gold is not None
        ok, per = compare(gold["outputs"], got["outputs"], job["rule"] == "float32")
        rule = "identical token ids" if job["rule"] == "float32" else "top-k rule"
    return {
        **case,
        "ok": ok and graphs,
        "rule": rule,
        "identical": sum(p.identical for p in per),
        "prompts": len(per),
        "cuda_graphs": graphs,
        **{k: got[k] for k in ("cudagraph_mode", "compilation", "tokens_per_s", "engine_seconds") if k in got},
        "detail": "; ".join(p.detail for p in per if p.detail)[:600],
    }


def image_part(version: str, made: dict[str, Path], want: dict) -> dict:
    """The CUDA image (`make image DEVICE=cuda`) serving the GQA model where a Docker engine runs: its completions
    at temperature 0 must have the reference's fp32 token ids. ok None: not run here, and why."""
    from ..fork import image
    from ..run.serve import served_name
    from ..run.server import ServerFailed, complete, free_port, start, stop, wait_ready

    try:
        tool = image.container_tool()
    except MiniStreamError as e:
        return {"ok": None, "skipped": str(e)}
    if tool[0] != "docker":
        return {"ok": None, "skipped": f"{tool[0]} runs here, not Docker, which hands the GPU over (--gpus all)"}
    work = OUT / version / "image"
    try:
        build_wheel(version, "cuda", cuda_smoke.root(version) / f"vllm-{version}", DIST, quiet=True)
        name = image.build(version, "cuda")
        folder = (made["gqa-untied"] / "hf").resolve()
        port = free_port()
        cmd = image.run_command(tool, name, str(folder), port, "127.0.0.1", ("--dtype", "float32"))
        proc = start(cmd, work / "server.log", image.container_env())
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, work / "server.log", ENGINE_TIMEOUT)
            got = []
            for ids in want["prompt_ids"]:
                status, body = complete(
                    url, served_name(folder), ids, MAX_TOKENS, logprobs=TOP_K, return_tokens_as_token_ids=True
                )
                if status != 200:
                    return {"ok": False, "error": f"the image answered {status}: {str(body)[:300]}"}
                lp = body["choices"][0]["logprobs"]
                got.append(
                    {
                        "ids": [_token_id(t) for t in lp["tokens"]],
                        "logprobs": [{_token_id(t): v for t, v in step.items()} for step in lp["top_logprobs"]],
                    }
                )
        finally:
            stop(proc)
    except (MiniStreamError, ServerFailed) as e:
        return {"ok": False, "error": str(e)[:1000]}
    ok, per = compare(want["outputs"], got, True)
    return {
        "ok": ok,
        "image": name,
        "identical": sum(p.identical for p in per),
        "prompts": len(per),
        "detail": "; ".join(p.detail for p in per if p.detail)[:600],
    }


def judge_all(planned: list[dict], engine, made: dict[str, Path], log=print) -> list[dict]:
    """Every planned job's verdict; engine(i, job) gives its outputs (run now, or read from a run elsewhere)."""
    cases, outputs = [], {}
    for i, job in enumerate(planned):
        if job.get("skip"):
            cases.append({"part": job["part"], "name": job["name"], "ok": None, "skipped": job["skip"]})
            continue
        got = outputs[job["name"]] = engine(i, job)
        model, dtype, n, lora = job["golden"]
        case = judge(job, got, golden(made[model], dtype, n, lora), outputs.get(job.get("same_as", "")))
        cases.append(case)
        log(f"  {'ok  ' if case['ok'] else 'FAIL'} {case['name']}: {case.get('detail') or case.get('error', '')}")
    return cases


def passed(report: dict) -> bool:
    ran = [c for c in report["cases"] if c["ok"] is not None]
    return bool(ran) and all(c["ok"] for c in ran) and report.get("image", {}).get("ok") is not False


# --- on a lent GPU machine with no package index ----------------------------------------------------------------


def offline_dir(version: str) -> Path:
    return OUT / version / "offline"


def export(version: str, log=print) -> Path:
    """For a GPU machine that reaches no package index (a lent one, its own torch installed): offline/ under the
    release's proof folder, holding the prepared jobs it can run (those skipped here left out) with their folders
    relative to the repository root, and only the files they read (hf/, llama/ linked to hf/ as here, fp8/, the
    adapter's peft/; no training checkpoint). There, in a copy of the tree with the CUDA wheel on the path:
        python -m ministream.checks.gpu_probe build/gpu-proof/<v>/offline/jobs.json OUT.json --parallel N
    and here: ministream gpu-proof <v> --judge OUT.json."""
    planned = json.loads((OUT / version / "jobs.json").read_text())  # --prepare-only's, just written
    dest = offline_dir(version)
    with new_folder(dest, force=True) as tmp:
        ran = []
        for job in planned:
            if job.get("skip"):
                continue
            ran.append(dict(job, folder=_carry(Path(job["folder"]), tmp, dest)))
            if job.get("lora"):
                ran[-1]["lora"] = dict(job["lora"], path=_carry(Path(job["lora"]["path"]), tmp, dest))
        write_json(tmp / "jobs.json", ran)
    log(f"gpu-proof {version}: {len(ran)} engines' jobs and the folders they read in {dest}")
    return dest


def _carry(folder: Path, tmp: Path, dest: Path) -> str:
    """folder (under MODELS) copied into tmp/models; its path as a job there reads it: dest's, from the root.
    A link to a file of another folder of the same model stays a link, relative (the twin's weights)."""
    rel = folder.resolve().relative_to(MODELS.resolve())
    into = tmp / "models" / rel
    if not into.is_dir():
        into.mkdir(parents=True)
        for f in sorted(folder.iterdir()):
            target = f.resolve()
            if f.is_symlink() and target.is_relative_to(folder.parent.resolve()):
                (into / f.name).symlink_to(Path("..") / target.relative_to(folder.parent.resolve()))
                _carry(target.parent, tmp, dest)
            elif f.is_file():
                shutil.copy2(target, into / f.name)
    return str(dest / "models" / rel)


def judge_run(version: str, outputs_file: Path, log=print) -> int:
    """`gpu-proof VERSION --judge OUT.json`: the outputs of export()'s jobs, run on a GPU elsewhere, judged here
    by the rules a full run uses; report.json as a full run writes it (the image part not run: said). Each output
    is matched to its job by name and must come from that job (gpu_probe.identity); else refused, naming it."""
    jobs_file = offline_dir(version) / "jobs.json"
    if not jobs_file.is_file():
        raise MiniStreamError(f"{jobs_file} is missing: export the jobs first (gpu-proof {version} --export)")
    try:
        got = json.loads(Path(outputs_file).read_text())
    except (OSError, ValueError) as e:
        raise MiniStreamError(f"{outputs_file}: not the outputs of a gpu_probe run ({e})") from None
    planned = json.loads(jobs_file.read_text())
    named = {o["job"]["name"]: o for o in got if isinstance(o, dict) and "job" in o} if isinstance(got, list) else {}
    missing = [job["name"] for job in planned if job["name"] not in named]
    if missing:
        raise MiniStreamError(
            f"{outputs_file} has no outputs for {len(missing)} of the {len(planned)} jobs of {jobs_file} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): judge the outputs of that export's run"
        )
    other = [job["name"] for job in planned if named[job["name"]]["job"] != gpu_probe.identity(job)]
    if other:
        raise MiniStreamError(
            f"{outputs_file}: the outputs named {', '.join(other[:3])} were made from another folder, dtype or "
            f"prompts than {jobs_file} holds now: run that export's jobs again, then judge"
        )
    report: dict[str, Any] = {"version": version, "where": f"engines run elsewhere; outputs {outputs_file}"}
    made = {name: MODELS / name for name in PROOF_MODELS}  # as the export found them: their golden outputs
    report["cases"] = judge_all(planned, lambda i, job: named[job["name"]], made, log)
    report["image"] = {"ok": None, "skipped": "not run: the engines ran on a machine of their own, offline"}
    report["ok"] = passed(report)
    write_json(OUT / version / "report.json", report)
    log(f"gpu-proof {version}: {'passed' if report['ok'] else 'FAILED'} ({OUT / version / 'report.json'})")
    return 0 if report["ok"] else 1


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))  # the server's name of a token with return_tokens_as_token_ids


def run_proof(version: str, nearest_pins: bool = False, prepare_only: bool = False, log=print) -> int:
    """`ministream gpu-proof VERSION`: 0 when every part that ran passed (a part skipped says why)."""
    patch_set_dir(version)  # a release without a patch set: one line naming the `make port` to run, nothing made
    if prepare_only:
        planned = prepare(n_gpus=len(gpus()), log=log)  # the jobs as this machine would run them
        write_json(OUT / version / "jobs.json", planned)
        log(f"gpu-proof {version}: prepared {len(planned)} engines' jobs and their golden outputs in {OUT}")
        return 0
    found = require_gpu(version)
    started = time.monotonic()
    report: dict[str, Any] = {"version": version, "gpus": found, "ok": False, "cases": []}
    try:
        made = models(log=log)
        planned = jobs(made, len(found))
        built = cuda_smoke.wheel(version)
        venv, replaced = cuda_smoke.environment(version, built, nearest_pins)
        report.update(wheel=str(built), replaced_pins=replaced)

        def engine(i: int, job: dict) -> dict:
            log(f"gpu-proof {version}: {job['part']}: {job['name']} ...")
            return run_job(venv, job, OUT / version / f"{i:02d}-{job['part']}")

        report["cases"] = judge_all(planned, engine, made, log)
        report["image"] = image_part(version, made, golden(made["gqa-untied"], "float32"))
        report["ok"] = passed(report)
    except StageFailed as e:  # cuda-smoke's environment: a pin nobody published, uv's own error
        report["error"] = f"{e.stage}: {e.error}"
    except (MiniStreamError, OSError, subprocess.SubprocessError) as e:
        report["error"] = str(e)
    report["seconds"] = round(time.monotonic() - started)
    write_json(OUT / version / "report.json", report)
    if report.get("error"):
        log(f"  error: {report['error']}")
    log(f"gpu-proof {version}: {'passed' if report['ok'] else 'FAILED'} ({OUT / version / 'report.json'})")
    return 0 if report["ok"] else 1
