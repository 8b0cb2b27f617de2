"""workers: each system measured in a process of its own, `python -m ministream.bench.workers SPEC RESULT`
(started by run_worker, which samples the process tree's memory meanwhile): the prompts, the timings, and
one kind of worker per system: the patched vLLM, the reference model, llama.cpp, the machine's bandwidth.

One process per (model, dtype, binding), reused for every batch size, with its own environment (the core
binding, zentorch hidden); it writes its figures as JSON, and the log beside them keeps vLLM's own words.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..atomic import write_json
from ..run import engine
from . import widths
from .machine import copy_bandwidth, read_bandwidth
from .memory import TreeMemory


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids: <|bos|> (id 0), then random ordinary tokens.

    Every system gets the same ids for the same seed; each timed run gets fresh ones, so vLLM's prefix
    cache never serves a repeat."""
    import torch

    g = torch.Generator().manual_seed(seed)
    body = torch.randint(3, vocab, (n, length - 1), generator=g)  # 0-2 are bos, eos, pad
    return [[0] + row.tolist() for row in body]


def measure(generate, spec: dict, serial: bool = False) -> list[dict]:
    """tokens/s and time to first token for each batch size; generate(prompt_ids, max_tokens) -> [{"ids"}].

    Time to first token is the wall time of the same batch with max_tokens=1: every request's first token.
    serial: requests go one at a time, so throughput does not depend on the batch: it is measured on
    `serial_requests` requests once and a batch of n costs n times one request; time to first token is
    that of the first request (request k also waits for the k-1 before it)."""
    length, vocab, new = spec["prompt_len"], spec["vocab"], spec["new_tokens"]
    generate(prompts(2, length, vocab, seed=7), 4)  # warm-up: first-call costs out of the timings
    rows, serial_row = [], None
    for n in spec["batches"]:
        if serial and serial_row is not None:
            rows.append({**serial_row, "batch": n})
            continue
        requests = min(n, spec["serial_requests"]) if serial else n
        t = time.perf_counter()
        generate(prompts(1 if serial else n, length, vocab, seed=1000 * n + 999), 1)
        ttft = time.perf_counter() - t
        seconds, tokens = [], 0
        for r in range(1 if serial else spec["repeats"]):
            ids = prompts(requests, length, vocab, seed=1000 * n + r)
            t = time.perf_counter()
            out = generate(ids, new)
            seconds.append(time.perf_counter() - t)
            tokens = sum(len(o["ids"]) for o in out)
            if tokens != requests * new:
                raise RuntimeError(f"asked for {requests}x{new} tokens, got {tokens}")
        row = {
            "batch": n,
            "measured_requests": requests,
            "output_tokens": tokens,
            "seconds": seconds,
            # the median repeat, and the range of all: a ratio means something where ranges do not overlap
            "tokens_per_s": tokens / statistics.median(seconds),
            "tokens_per_s_range": [tokens / max(seconds), tokens / min(seconds)],
            "ttft_s": ttft,
        }
        rows.append(row)
        if serial:
            serial_row = row
    return rows


def _worker(spec: dict) -> dict:
    """One system in this process: load it, measure it, return the figures."""
    import torch

    from ..run.generate import load_reference, vllm_engine, vllm_generate

    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    t = time.perf_counter()
    if spec["kind"] == "vllm":
        # "eager": True or False forces it; absent, the engine default (engine.py), recorded either way
        eager = spec["eager"] if spec.get("eager") is not None else engine.eager()
        result["enforce_eager"] = eager
        settings = engine.EngineSettings(
            dtype=spec["dtype"], max_model_len=spec["prompt_len"] + spec["new_tokens"], enforce_eager=eager
        )
        llm = vllm_engine(Path(spec["model_dir"]), settings, **spec.get("llm", {}))  # "llm": LLM(...)'s own
        # the class vLLM resolved: MiniStreamForCausalLM, or TransformersForCausalLM on the Transformers backend
        result["architecture"] = llm.llm_engine.model_config.architecture
        result["weights_file_bytes"] = widths.folder_bytes(spec["model_dir"])
        result["start_s"] = time.perf_counter() - t
        result["env"] = {k: os.environ.get(k) for k in (engine.BIND, engine.KV_CACHE, engine.IN_PROCESS)}
        # InprocClient: the core in this process; SyncMPClient: in its own (None: a vLLM before the V1 engine)
        core = getattr(llm.llm_engine, "engine_core", None)
        result["engine_core"] = None if core is None else type(core).__name__
        from vllm.platforms import current_platform

        result["vllm_platform"] = type(current_platform).__name__  # ZenCpuPlatform where zentorch is used
        result["rows"] = measure(lambda ids, n: vllm_generate(llm, ids, n), spec)
    elif spec["kind"] == "reference":
        model = load_reference(Path(spec["model_dir"]), spec["dtype"])
        result["start_s"] = time.perf_counter() - t
        result["batched"] = measure(lambda ids, n: model.generate(ids, n), {**spec, "repeats": 1})
        one = next((r for r in result["batched"] if r["batch"] == 1), None)
        if one:  # one request at a time is batch 1, n times over: the same call, reference_generate(batch=False)
            result["serial"] = [{**one, "batch": n, "derived_from_batch_1": True} for n in spec["batches"]]
        else:
            result["serial"] = measure(lambda ids, n: [model.generate([p], n)[0] for p in ids], spec, serial=True)
    elif spec["kind"] == "llamacpp":
        result.update(_llamacpp_worker(spec))
    elif spec["kind"] == "bandwidth":
        result.update(copy_bandwidth(spec["copy_mib"], threads=spec.get("threads")))
        result["read"] = read_bandwidth(threads=spec.get("threads"))
    else:
        raise ValueError(spec["kind"])
    return result


def engine_threads() -> int:
    """The threads a batch-1 engine runs, one per core it binds (engine.py): llama.cpp and the bandwidth get as many."""
    return len(_cores(engine.core_binding(1)))


def _cores(binding: str) -> list[int]:
    """The cores of a VLLM_CPU_OMP_THREADS_BIND value ("0-1", "3", "0-1|2-3")."""
    cores: list[int] = []
    for part in binding.replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def _llamacpp_worker(spec: dict) -> dict:
    """llama-server on a GGUF export of the folder, one slot per request of the largest batch (its continuous
    batching), requests sent at once; then llama-bench at batch 1 on the same file."""
    from concurrent.futures import ThreadPoolExecutor

    from . import llamacpp

    gguf = widths.gguf_file(spec["model_dir"], spec.get("width", spec["dtype"]))
    threads = engine_threads()
    slots = max(spec["batches"])
    llamacpp.build()  # a first build (minutes, once) is not the engine's start: vLLM's wheel is built before too
    t = time.perf_counter()
    with llamacpp.server(gguf, spec["port"], threads, slots, spec["prompt_len"] + spec["new_tokens"] + 8) as url:
        start = time.perf_counter() - t
        with ThreadPoolExecutor(slots) as pool:

            def generate(ids: list[list[int]], n: int) -> list[dict]:
                return [{"ids": got} for got in pool.map(lambda p: llamacpp.greedy(url, p, n), ids)]

            rows = measure(generate, spec)
    bench = llamacpp.run_tool(
        "llama-bench",
        ["-m", gguf, "-t", threads, "-p", spec["prompt_len"], "-n", spec["new_tokens"], "-r", 3, "-o", "json"],
        gguf,
    )
    figures = json.loads(bench.stdout) if bench.returncode == 0 else []
    return {
        "start_s": start,
        "rows": rows,
        "threads": threads,
        "slots": slots,
        "gguf": str(gguf),
        "weights_file_bytes": gguf.stat().st_size,
        "build": llamacpp.info(),
        "llamacpp_no_amx": llamacpp.NO_AMX,  # built without AMX: its AMX kernels crashed here
        # llama-bench: prompt processing (n_prompt) and decode (n_gen) tokens/s, its mean and spread of 3
        "llama_bench": [
            {k: f.get(k) for k in ("n_prompt", "n_gen", "avg_ts", "stddev_ts", "n_threads", "type_k")} for f in figures
        ],
        "llama_bench_error": None if bench.returncode == 0 else bench.stderr[-800:],
    }


AOT_LOADED, AOT_SAVED = "Directly load AOT compilation", "saved AOT compiled function"  # vLLM's log lines


def compiled_model(log: str) -> str | None:
    """How a vLLM start got its compiled model, from its log: "loaded" (vLLM's saved one; on a CPU, the CPU part's
    fix), "compiled"; None where it ran eager."""
    return "loaded" if AOT_LOADED in log else "compiled" if AOT_SAVED in log else None


def run_worker(name: str, spec: dict, out: Path, env: dict | None = None, timeout: float = 1800) -> dict:
    """Run _worker(spec) in `python -m ministream.bench.workers` with its own environment; figures + peak memory.
    spec["python"]: another environment's interpreter (the stock vLLM venv's), which sees this ministream."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    spec_file, result_file, log = (out / "logs" / f"{name}.{x}" for x in ("spec.json", "result.json", "log"))
    spec_file.write_text(json.dumps(spec))
    result_file.unlink(missing_ok=True)
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    print(f"bench: {name} ...", end=" ", flush=True)
    t = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [spec.get("python", sys.executable), "-m", "ministream.bench.workers", str(spec_file), str(result_file)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        mem = TreeMemory(proc.pid)
        stopped = False  # by us, at the timeout: not the kernel's OOM killer, whose SIGKILL reads the same
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, stopped = proc.wait(), True
        memory = mem.stop()
    wall = time.perf_counter() - t
    if not result_file.is_file():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-20:])
        error = f"ran past {timeout:.0f} s and was stopped" if stopped else f"exit {rc}"
        print(f"FAILED ({error}, {wall:.0f}s; log {log})")
        return {"error": error, "log": str(log), "log_tail": tail, "wall_s": wall, **memory}
    note = exit_note(rc)
    print(f"{wall:.0f}s" + (f" ({note}; log {log})" if note else ""))
    # vLLM's own count of KV cache tokens, so a reader can check that the largest batch fitted whole
    said = log.read_text(errors="replace")
    kv = re.search(r"KV cache size: ([\d,]+) tokens", said)
    extra: dict[str, Any] = {"kv_cache_tokens": int(kv.group(1).replace(",", ""))} if kv else {}
    # and how a compiled engine's start got its model, most of a start: a start figure means little without it
    if how := compiled_model(said):
        extra["compiled_model"] = how
    extra.update({"exit_note": note} if note else {})
    return {**json.loads(result_file.read_text()), "wall_s": wall, **memory, **extra}


def exit_note(rc: int) -> str | None:
    """For a child that wrote its result (atomically, as its last act) and yet exited non-zero: the note kept
    beside its figures, which stand. vLLM on zentorch's platform has aborted at exit after finishing its work
    ("terminate called without an active exception"; docs/faults.md row 127). None
    where it exited 0. A child without its result failed, whatever its exit."""
    return None if rc == 0 else f"exit {rc} after writing its result: at its end, not during its work"


def _worker_main(spec_file: str, result_file: str) -> int:
    result = _worker(json.loads(Path(spec_file).read_text()))
    write_json(Path(result_file), result)  # whole or not there: run_worker reads it whatever the exit
    return 0


if __name__ == "__main__":  # a worker, started by run_worker (vLLM's spawned processes need the guard)
    sys.exit(_worker_main(*sys.argv[1:]))
