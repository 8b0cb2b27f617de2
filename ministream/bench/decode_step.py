"""bench-step: one decode step at batch 1 taken apart, for the patched vLLM, its LLaMA twin and llama.cpp.

vLLM: timers wrapped around the worker's model runner (collective_rpc, in the engine's own process), then
one request of PROMPT tokens + NEW tokens and one of PROMPT + 1, the difference over NEW tokens: per decode
step, the time in (each part under its name in the runner's era, fork/internals.py RUNNER_PARTS: the V1
runner's first, then the V2 runner's, the only one from vLLM 0.34)
  forward        the model's forward (the compiled graph), model_runner._model_forward; V2: model.forward
  logits         the head's matmul, model.compute_logits
  inputs         preparing the step's inputs, model_runner._prepare_inputs; V2: prepare_inputs
  sample         sampling (greedy), model_runner._sample; V2: sample, less the logits it computes
  runner, other  the rest of execute_model and sample_tokens (bookkeeping around the parts above)
  engine, other  the step's wall time less all of the runner: the scheduler, the output processing, the
                 hop between the engine core and this process
and beside them the time the weights take to read at the machine's read bandwidth (at a quantized width, the
file each engine runs: widths.read_bytes). llama.cpp: llama-bench's decode (the graph alone) against
llama-server's time per predicted token (with sampling and the server).
Variants (VARIANTS) run the same request with one vLLM setting changed, each its own engine in the same run;
"a+b" runs a and b together.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import write_json
from ..fork import cpu
from ..run import engine
from ..run.server import free_port
from . import offline, widths
from .machine import machine, machine_line, read_bandwidth
from .workers import engine_threads, exit_note, prompts

PROMPT, NEW, REPEATS = 32, 128, 3
PARTS = ["forward", "logits", "inputs", "sample"]
# name -> (what it changes, the engine's environment, LLM() overrides): what vLLM offers a CPU against the
# non-forward part of a step
VARIANTS: dict[str, tuple[str, dict, dict]] = {
    "default": ("the engine default (engine.py)", {}, {}),
    "in_process": (
        "engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        {engine.IN_PROCESS: "0"},
        {},
    ),
    "kv_per_call": (
        f"vLLM's own KV-cache view and chunk at every attention call, the CPU part's fix undone ({cpu.ATTN_ENV}=0)",
        {cpu.ATTN_ENV: "0"},
        {},
    ),
    # vLLM 0.32's CPU platform turns async scheduling off whatever is asked (platforms/cpu.py), so it is no variant
    "bfloat16": (
        "computes in bfloat16 (a quantized folder's activations and its float head)",
        {},
        {"dtype": "bfloat16"},
    ),
}


def variant_settings(variant: str) -> tuple[str, dict, dict]:
    """VARIANTS' entry, or for "a+b" theirs together."""
    parts = variant.split("+")
    unknown = [p for p in parts if p not in VARIANTS]
    if unknown:
        raise MiniStreamError(f"bench-step: unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}, or a+b")
    chosen = [VARIANTS[p] for p in parts]
    env = {k: v for _, e, _ in chosen for k, v in e.items()}
    overrides = {k: v for _, _, o in chosen for k, v in o.items()}
    return "; ".join(what for what, _, _ in chosen), env, overrides


def _install_timers(worker) -> None:
    """Timers around each part of RUNNER_PARTS, on the name the worker's runner has; a part timed inside another
    (the V2 runner's sample() computes the logits) counts only in the innermost."""
    import collections
    import time as t

    from ministream.fork.internals import RUNNER_PARTS  # absolute: this function is pickled to the engine

    runner = worker.model_runner
    spent: dict = collections.defaultdict(float)
    calls: dict = collections.defaultdict(int)
    inside: list = []  # the parts running now, outermost first: [key, start, time of the parts inside it]

    def wrap(obj, name, key):
        inner = getattr(obj, name)
        nested = key in PARTS

        def timed(*args, **kwargs):
            start = t.perf_counter()
            if nested:
                inside.append([key, start, 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                took = t.perf_counter() - start
                if nested:
                    _, _, within = inside.pop()
                    if inside:
                        inside[-1][2] += took
                    took -= within
                spent[key] += took
                calls[key] += 1

        setattr(obj, name, timed)

    for key, names in RUNNER_PARTS.items():
        # "model.x": the loaded model's x; else the runner's
        owners = [(runner.model, n[6:]) if n.startswith("model.") else (runner, n) for n in names]
        found = [(o, n) for o, n in owners if hasattr(o, n)]
        if not found:
            raise RuntimeError(
                f"bench-step: this vLLM's model runner {type(runner).__name__} has none of {', '.join(names)} "
                f"(part {key!r}): `make matrix` names what moved; mend RUNNER_PARTS in ministream/fork/internals.py"
            )
        wrap(*found[0], key)
    runner._ministream_timers = (spent, calls)


def _read_timers(worker) -> dict:
    spent, calls = worker.model_runner._ministream_timers
    got = {k: [spent[k], calls[k]] for k in spent}
    spent.clear()
    calls.clear()
    return got


def _vllm_worker(spec: dict) -> dict:
    """In its own process: the engine, the timers, then REPEATS pairs of (PROMPT + NEW, PROMPT + 1) requests."""
    from ..run.generate import vllm_engine, vllm_generate

    settings = engine.EngineSettings(dtype=spec["dtype"], max_model_len=PROMPT + NEW + 8)
    llm = vllm_engine(Path(spec["model_dir"]), settings, **spec["overrides"])
    from vllm.platforms import current_platform

    llm.collective_rpc(_install_timers)
    ids = prompts(1, PROMPT, spec["vocab"], seed=11)
    vllm_generate(llm, ids, 8)  # warm-up
    llm.collective_rpc(_read_timers)
    samples = []
    for _ in range(REPEATS):
        sample: dict[int, Any] = {}
        for n in (NEW + 1, 1):
            t = time.perf_counter()
            vllm_generate(llm, ids, n)
            sample[n] = {"wall": time.perf_counter() - t, "timers": llm.collective_rpc(_read_timers)[0]}
        samples.append(_per_step(sample[NEW + 1], sample[1], NEW))
    return {"platform": type(current_platform).__name__, "samples": samples, "per_step_ms": _median(samples)}


def _per_step(long: dict, short: dict, steps: int) -> dict:
    """ms per decode step of each part: the long request less the prefill-only one, over the decode steps."""

    def spent(key):
        return (long["timers"].get(key, [0, 0])[0] - short["timers"].get(key, [0, 0])[0]) / steps * 1e3

    step = (long["wall"] - short["wall"]) / steps * 1e3
    parts = {k: spent(k) for k in PARTS}
    runner = spent("execute_model") + spent("sample_tokens")
    return {**parts, "runner_other": runner - sum(parts.values()), "engine_other": step - runner, "step": step}


def _median(samples: list[dict]) -> dict:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def _llamacpp(model: dict, dtype: str, threads: int, out: Path) -> dict:
    from . import llamacpp

    gguf = widths.gguf_file(model["hf"], dtype)
    ids = prompts(1, PROMPT, model["vocab"], seed=11)[0]
    served = []
    with llamacpp.server(gguf, free_port(), threads, 1, PROMPT + NEW + 8, out / "llama-server.log") as url:
        for _ in range(REPEATS + 1):
            served.append(llamacpp.complete(url, ids, NEW)["timings"])
    per_token = statistics.median(t["predicted_per_token_ms"] for t in served[1:])
    # after the server: where it ran from the build without AMX (NO_AMX), the graph is timed from it too
    args = ["-m", gguf, "-t", threads, "-p", 0, "-n", NEW, "-r", REPEATS, "-o", "json"]
    run = llamacpp.run_tool("llama-bench", args, gguf)
    if run.returncode != 0:
        raise MiniStreamError(f"llama-bench on {gguf} failed (exit {run.returncode}): {run.stderr[-800:]}")
    graph = 1e3 / json.loads(run.stdout)[0]["avg_ts"]
    step = {"forward": graph, "server_other": per_token - graph, "step": per_token}
    return {"per_step_ms": step, "weights_file_bytes": gguf.stat().st_size, "llamacpp_no_amx": llamacpp.NO_AMX}


def bench_step(out: Path, presets: list[str], dtypes: list[str], variants: list[str], note: str = "") -> int:
    """`ministream bench-step`: every (preset, dtype) x (MiniStream under each variant, the LLaMA twin, llama.cpp)."""
    for variant in variants:  # an unknown one refused before any engine starts
        variant_settings(variant)
    for dtype in dtypes:  # and a width this machine's vLLM cannot run
        widths.vllm_width(dtype)
    out.mkdir(parents=True, exist_ok=True)
    threads = engine_threads()
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "note": note,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "read_bandwidth": read_bandwidth(threads=threads),
        "settings": {"prompt": PROMPT, "new": NEW, "repeats": REPEATS, "threads": threads},
        "rows": [],
    }
    # the timers go to the engine core's process as a function: vLLM sends those with pickle only when told
    kv = {engine.KV_CACHE: os.environ.get(engine.KV_CACHE, "2"), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    for preset in presets:
        model = offline.prepare_model(preset, out / "models")
        for dtype in dtypes:  # a width (widths.py): at a quantized one, no LLaMA twin
            w = widths.width(dtype)
            vllm_dir = str(widths.vllm_folder(model["hf"], dtype))  # quantized once, for every variant
            gb_s = result["read_bandwidth"]["gb_per_s"]
            systems = [(f"ministream {v}", vllm_dir, v) for v in variants]
            systems += [] if w.scheme else [("llama default", model["llama"], "default")]
            for name, folder, variant in systems:
                what, env, overrides = variant_settings(variant)
                spec = {"model_dir": folder, "dtype": w.dtype, "vocab": model["vocab"], "overrides": overrides}
                print(f"bench-step: {preset} {dtype} {name} ({what}) ...", flush=True)
                got = _run(spec, {**kv, **env}, out / f"{preset}-{dtype}-{name.replace(' ', '-')}")
                result["rows"].append(
                    {
                        "model": preset,
                        "dtype": dtype,
                        "system": name,
                        "variant": what,
                        "weights_read_ms": _read_ms(model, dtype, widths.folder_bytes(folder), gb_s),
                        **got,
                    }
                )
                write_json(out / "step.json", result)
            got = _llamacpp(model, dtype, threads, out)
            read_ms = _read_ms(model, dtype, got["weights_file_bytes"], gb_s)
            result["rows"].append(
                {
                    "model": preset,
                    "dtype": dtype,
                    "system": "llama.cpp without AMX" if got["llamacpp_no_amx"] else "llama.cpp",
                    "weights_read_ms": read_ms,
                    **got,
                }
            )
            write_json(out / "step.json", result)
    print(table(result))
    return 0


def _read_ms(model: dict, width: str, file_bytes: int, gb_per_s: float) -> float:
    """The time the bytes a decode step reads (widths.read_bytes: the file's, at a quantized width) take at the
    machine's read bandwidth."""
    weights = widths.read_bytes(model["parameters"], width, file_bytes)
    assert weights is not None  # None only where a file's size is not known: it is given here
    return weights / (gb_per_s * 1e9) * 1e3


def _run(spec: dict, env: dict, stem: Path) -> dict:
    spec_file, result_file = stem.with_suffix(".spec.json"), stem.with_suffix(".result.json")
    write_json(spec_file, spec)
    result_file.unlink(missing_ok=True)  # an earlier run's into the same folder
    run = subprocess.run(
        [sys.executable, "-m", "ministream.bench.decode_step", str(spec_file), str(result_file)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if not result_file.is_file():
        return {"error": ((run.stderr or run.stdout).strip().splitlines() or [f"exit {run.returncode}"])[-1][:400]}
    note = exit_note(run.returncode)
    return {**json.loads(result_file.read_text()), **({"exit_note": note} if note else {})}


def table(result: dict) -> str:
    cols = ["forward", "logits", "inputs", "sample", "runner_other", "engine_other", "server_other", "step"]
    header = {"model": "model", "dtype": "dtype", "system": "system"}
    # the first three columns as wide as their longest entry (a width's name: w8a8-bf16-head)
    m, d, n = (max(len(str(r[k])) for r in [header, *result["rows"]]) + 2 for k in header)

    def first(r: dict) -> str:
        return f"{r['model']:<{m}}{r['dtype']:<{d}}{r['system']:<{n}}"

    lines = [
        machine_line(result.get("machine", {})),
        "ms per decode step at batch 1 ({prompt}-token prompt, {new} new tokens, median of {repeats}); ".format(
            **result["settings"]
        )
        + f"weights at {result['read_bandwidth']['gb_per_s']:.1f} GB/s read",
        first(header) + "".join(f"{c:>13}" for c in cols) + f"{'weights':>9}{'tok/s':>7}",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{first(r)} FAILED {r['error']}")
            continue
        p = r["per_step_ms"]
        lines.append(
            first(r)
            + "".join(f"{p[c]:>13.2f}" if c in p else f"{'-':>13}" for c in cols)
            + f"{r['weights_read_ms']:>9.2f}{1e3 / p['step']:>7.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    write_json(Path(sys.argv[2]), _vllm_worker(spec))
