"""gpu_probe: what `gpu-proof` runs inside the CUDA environment, on a GPU, with this package on PYTHONPATH.

    python -m ministream.checks.gpu_probe JOBS.json OUTPUTS.json [--parallel N]

Each job ({name, folder, dtype, tp, prompt_ids, max_tokens, top_k, quantization, lora}) is one engine with the
engine settings of every other engine here (run/engine.py: compiled, so CUDA graphs on a GPU), asked for greedy
tokens with their top-k logprobs, then once more for a timing of the warm engine. Each output carries its job's
identity (identity(): name, folder, dtype, a hash of the prompts), so outputs are judged against the job that
made them. OUTPUTS.json is rewritten after each job, so what finished survives a crash of a later one.
--parallel N: N processes share the GPU, each running every Nth job with 1/N of the memory vLLM would take
(compiling is CPU work: a lent machine's minutes go N times as far; the throughputs then are not one engine's).
"""

import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .probe import _reset_dynamo, compilation


def cuda_graphs(llm) -> dict:
    """How the engine's config says it runs: its CUDA graph mode and the batch sizes it captures."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return {}
    cc = config.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    sizes = getattr(cc, "cudagraph_capture_sizes", None) or []
    return {"cudagraph_mode": str(getattr(mode, "name", mode)), "cudagraph_sizes": len(sizes)}


def generate(llm, job: dict, lora) -> tuple[list[dict], float]:
    """Greedy ids and top-k logprobs for every prompt of the job, and the seconds the call took."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=job["top_k"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompt_ids"]]
    start = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    took = time.monotonic() - start
    results = []
    for o in outputs:
        c = o.outputs[0]
        steps = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (c.logprobs or [])]
        results.append({"ids": list(c.token_ids), "logprobs": steps})
    return results, took


def identity(job: dict) -> dict:
    """What names a job's outputs: its name, folder, dtype and prompts."""
    prompts = hashlib.sha256(json.dumps(job.get("prompt_ids")).encode()).hexdigest()[:16]
    return {"name": job.get("name"), "folder": job.get("folder"), "dtype": job.get("dtype"), "prompts": prompts}


def run_job(job: dict) -> dict:
    from ..run.engine import EngineSettings, lora_settings
    from ..run.generate import vllm_engine

    overrides: dict = {}
    for key in ("quantization", "gpu_memory_utilization", "kv_cache_memory_bytes"):
        if job.get(key):
            overrides[key] = job[key]
    lora = None
    if job.get("lora"):
        from vllm.lora.request import LoRARequest

        overrides.update(lora_settings([job["lora"]["rank"]]))  # the settings every LoRA engine here gets
        lora = LoRARequest(job["lora"]["name"], 1, job["lora"]["path"])
    start = time.monotonic()
    llm = vllm_engine(Path(job["folder"]), EngineSettings(dtype=job["dtype"], tp=job["tp"]), **overrides)
    try:
        ready = time.monotonic() - start
        outputs, _ = generate(llm, job, lora)
        _, warm = generate(llm, job, lora)  # the same batch again: the engine warm, its graphs captured
        tokens = sum(len(o["ids"]) for o in outputs)
        return {
            "outputs": outputs,
            "engine_seconds": round(ready, 1),
            "seconds": round(warm, 3),
            "tokens_per_s": round(tokens / warm, 1) if warm > 0 else None,
            **compilation(llm),
            **cuda_graphs(llm),
        }
    finally:
        del llm


def main(jobs_file: str, out_file: str) -> None:
    # vLLM's engine process must be spawned: forked, it failed to start on an H200 ("Cannot re-initialize CUDA in
    # forked subprocess"), once this process had touched CUDA
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    done = []
    for job in json.loads(Path(jobs_file).read_text()):
        try:
            done.append({"job": identity(job), **run_job(job)})
        except Exception as e:  # recorded per job: the next job still runs
            traceback.print_exc()
            done.append({"job": identity(job), "error": f"{type(e).__name__}: {e}"[:1000]})
        finally:
            gc.collect()
            _reset_dynamo()
        Path(out_file).write_text(json.dumps(done))


GPU_SHARE = 0.85  # of the GPU's memory, split among --parallel processes (vLLM's own default is 0.9)
# a fixed KV cache: vLLM otherwise sizes it from how the GPU's free memory moved while it profiled, which the
# other processes' allocations move too (vLLM's kv_cache_memory_bytes, since 0.11)
SHARED_KV_CACHE = 2 << 30


def main_parallel(jobs_file: str, out_file: str, n: int) -> None:
    """Every nth job in each of n processes at once; the outputs merged back into the jobs' order."""
    jobs = json.loads(Path(jobs_file).read_text())
    n = max(1, min(n, len(jobs)))
    work = Path(out_file).with_suffix(".parts")
    work.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for i in range(n):
        share = dict(gpu_memory_utilization=round(GPU_SHARE / n, 3), kv_cache_memory_bytes=SHARED_KV_CACHE)
        mine = [dict(j, **share) for j in jobs[i::n]]
        (work / f"jobs-{i}.json").write_text(json.dumps(mine))
        logs.append(open(work / f"probe-{i}.log", "w"))
        cmd = [sys.executable, "-m", "ministream.checks.gpu_probe", work / f"jobs-{i}.json", work / f"out-{i}.json"]
        procs.append(subprocess.Popen([str(c) for c in cmd], stdout=logs[-1], stderr=subprocess.STDOUT))
    for proc, log in zip(procs, logs, strict=True):
        proc.wait()
        log.close()
    merged = [{"job": identity(j), "error": "its process ended before it ran (see its probe log)"} for j in jobs]
    for i in range(n):
        part = work / f"out-{i}.json"
        for k, got in enumerate(json.loads(part.read_text()) if part.is_file() else []):
            merged[i + k * n] = got
    Path(out_file).write_text(json.dumps(merged))


if __name__ == "__main__":
    if "--parallel" in sys.argv:
        at = sys.argv.index("--parallel")
        main_parallel(sys.argv[1], sys.argv[2], int(sys.argv[at + 1]))
    else:
        main(*sys.argv[1:3])
