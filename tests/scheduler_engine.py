"""vLLM engines and what their schedulers did, run in a process of their own by test_scheduler_paths.py.

`python scheduler_engine.py SPEC OUT`: SPEC (JSON) names the folder, the dtype, the new tokens and
top-k logprobs per prompt, and engines, each with its settings (`LLM(...)`'s keyword arguments over
ministream's own, engine.llm_kwargs) and batches of prompt ids. One engine after another (one process
saves each its imports), each runs its batches in turn, greedy, and OUT (JSON) gets per engine:
- "config": the settings vLLM resolved (step budget, max_num_seqs, chunked prefill, prefix caching, the
  KV cache's block size and blocks), read back from the engine, not what was asked;
- per batch, "outputs": each prompt's new token ids, top-k logprobs, prefix-cache hit (num_cached_tokens)
  and preemptions (vLLM's per-request stats), and when it was scheduled and gave its last token;
  "steps": each engine step as vLLM's own iteration log counts it (enable_logging_iteration_details):
  [context requests, context tokens, generation requests, generation tokens]; "counters": the change of
  vLLM's prefix-cache and preemption counters over the batch (LLM.get_metrics).

It runs in whichever environment's python starts it: this one (the patched wheel) or the plugin route's.
"""

import gc
import json
import logging
import sys
from pathlib import Path

COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
ITERATION = "Iteration(%d)"  # vLLM's iteration log line (v1/metrics/loggers.py, _log_iteration_details)
# eager: the scheduler is the subject, and an eager start costs a third of a compiled one; stats on
OBSERVED = {"enforce_eager": True, "disable_log_stats": False, "enable_logging_iteration_details": True}


class Steps(logging.Handler):
    """vLLM's per-step iteration records, their arguments taken as logged (no text parsed)."""

    def __init__(self):
        super().__init__()
        self.steps: list[list[int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if ITERATION in str(record.msg) and record.args:
            # args: prefix, index, context requests, context tokens, generation requests, generation tokens, ...
            self.steps.append([int(a) for a in record.args[2:6]])  # type: ignore[index]


def counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS}


def run_engine(spec: dict, engine: dict) -> dict:
    from vllm import SamplingParams

    from ministream.run.engine import EngineSettings
    from ministream.run.generate import vllm_engine

    llm = vllm_engine(Path(spec["model"]), EngineSettings(dtype=spec["dtype"]), **{**OBSERVED, **engine["settings"]})
    steps = Steps()  # after the engine's start, whose logging setup drops the handlers of vLLM's loggers
    logging.getLogger("vllm.v1.metrics.loggers").addHandler(steps)
    config = llm.llm_engine.vllm_config
    resolved = {
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "block_size": config.cache_config.block_size,
        "num_blocks": config.cache_config.num_gpu_blocks,
    }
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=spec["top_k"], ignore_eos=True)
    batches = []
    for batch in engine["batches"]:
        before, first = counters(llm), len(steps.steps)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        after = counters(llm)
        batches.append(
            {
                "outputs": [
                    {
                        "ids": list(o.outputs[0].token_ids),
                        "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []],
                        "cached": o.num_cached_tokens,
                        "preemptions": o.metrics.num_preemptions,
                        "scheduled": o.metrics.scheduled_ts,
                        "last_token": o.metrics.last_token_ts,
                    }
                    for o in outputs
                ],
                "steps": steps.steps[first:],
                "counters": {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS},
            }
        )
    logging.getLogger("vllm.v1.metrics.loggers").removeHandler(steps)
    llm.llm_engine.engine_core.shutdown()  # its processes go before the next engine's start
    del llm
    gc.collect()
    return {"config": resolved, "batches": batches}


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    spec_path, out_path = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps({e["name"]: run_engine(spec, e) for e in spec["engines"]}))
