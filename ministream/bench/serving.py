"""bench-serve: how much serving load each system sustains, measured with vLLM's own benchmark client.

Four servers on the same converted folder, one after another, each alone on the machine:

  ministream  `ministream serve` on the patched vLLM: the server `make serve` starts, its engine settings
  llama       the same safetensors under LLaMA's names (offline.prepare_model's twin folder), same vLLM server
  reference   the reference model behind a minimal OpenAI server that generates for one request at a time
              (refserver.py), the "before" system: the team's single-request script
  llamacpp    llama.cpp's own llama-server (llamacpp.py) on a `ministream gguf` export of the folder in the
              same dtype: LLAMACPP_SLOTS parallel slots with continuous batching, the engine's threads

Each server is started and warmed (one short request), then, for each offered request rate, vLLM's benchmark
client (`vllm bench serve`, from the installed release) sends N streaming completions with Poisson
arrivals (N about a minute of arrivals). Prompts: a set made from the held-in corpus (ministream/data/
corpus.txt), deterministic by seed, of mixed lengths, some opening with one of a few long shared passages
(as system prompts do), each asking its own output length (EOS ignored, greedy). Every other passage opens
unlike any other, so vLLM's prefix cache can serve the shared passages and nothing else.

A system sustains a rate when it completed every request, kept up (request throughput >= 0.9 x the offered
rate), p99 time to first token <= the TTFT target (5 s) and median time per output token <= the TPOT target
(0.5 s). A system that missed the latency targets at two rates in a row is not run at higher ones. After the grid,
the ceiling is searched: 2.5x the highest rate while everything was sustained (the lowest over 2.5 while
nothing was, down to servereport.MIN_RATE), then the geometric middle of
the highest sustained and the lowest failing rate, again and again, until the two are within 10% of each
other (BISECT_WITHIN), at most `bisect_steps` runs.
Writes OUT/serve.json (the client's figures for every system and rate, the machine, the prompt set's
lengths), OUT/serve.png, and prints a table; the client's own result files go to OUT/serve-runs/.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import write_json
from ..paths import CORPUS
from ..run import engine
from ..run.prompts import PREFIX_TOKENS, PROMPT_TOKENS, build_prompts, dataset_stats, write_jsonl
from ..run.serve import served_name
from ..run.server import HOST, START_TIMEOUT, ServerFailed, call, free_port, greedy, running, wait_ready
from . import offline, widths
from .reporting import new_result, read_result
from .servereport import KEEP_UP, judge, next_rate, report, run_line, summarize
from .vllm_client import check_client, client_args, run_client
from .workers import engine_threads

DEFAULT_OUT = offline.DEFAULT_OUT
SCHEMA = 1

SYSTEMS = {
    "ministream": "MiniStream, patched vLLM (ministream serve)",
    "llama": "same weights as LLaMA, same vLLM server",
    "reference": "reference model, one request at a time",
    "llamacpp": "llama.cpp's llama-server, GGUF of the same weights",
}
# at a quantized width (widths.py): vLLM on the `ministream quantize` folder, llama.cpp on its own quantized GGUF
QUANTIZED_SYSTEMS = ("ministream", "llamacpp")
# llama-server's parallel slots: requests it decodes together (continuous batching); each holds the model's
# whole context, so 16 of the reference shape's 2048 tokens are 16 x 2048 tokens of KV cache
LLAMACPP_SLOTS = 16

# N per rate: about `seconds_per_rate` of arrivals, within [min_prompts, max_prompts]. A run far shorter than
# a minute would count the last requests' own latency against the throughput (duration = arrivals + the
# last request): at 64 requests and 8 req/s, 2 s of it already make request throughput 0.8 x the rate.
FULL = dict(
    preset="reference",
    dtype="bfloat16",
    rates=[0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8],
    num_prompts=None,
    seconds_per_rate=60,
    min_prompts=8,
    max_prompts=512,
    ttft_target_s=5.0,
    tpot_target_s=0.5,
    prompt_tokens=list(PROMPT_TOKENS),
    output_tokens=[16, 128],
    prefix_groups=4,
    prefix_tokens=list(PREFIX_TOKENS),
    shared_fraction=0.5,
    seed=0,
    bisect_steps=6,  # the ceiling searched after the grid: from a 2.5x step, 4 geometric halvings reach 1.1x
)
QUICK = dict(FULL, rates=[0.5, 2], num_prompts=4, output_tokens=[8, 24], prefix_groups=2, bisect_steps=0)
BISECT_WITHIN = 1.1  # the searched ceiling: highest sustained and lowest failing rate within 10%
WARM_PROMPT = "Warm-up: the river runs through"
# the vLLM client's figures kept in serve.json (its whole result stays in OUT/serve-runs/)
FIGURES = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "total_input_tokens",
    "total_output_tokens",
    "max_concurrent_requests",
    "max_output_tokens_per_s",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p50", "p99")),
)


def prompts_for(rate: float, s: dict) -> int:
    return s["num_prompts"] or min(s["max_prompts"], max(s["min_prompts"], round(rate * s["seconds_per_rate"])))


# ---------------------------------------------------------------- servers


def server_command(system: str, model: dict, dtype: str, port: int) -> tuple[list[str], str, str]:
    """(command, served name, folder) of a system's server on `port`. The vLLM servers are the one
    `ministream serve` starts (engine.server_command, tp 1, the model's own length, no extra options)."""
    if system == "reference":
        folder = model["hf"]
        return (
            [
                sys.executable,
                "-m",
                "ministream.bench.refserver",
                folder,
                "--host",
                HOST,
                "--port",
                str(port),
                "--dtype",
                dtype,
            ],
            served_name(folder),
            folder,
        )
    if system == "llamacpp":
        return _llamacpp_command(model, dtype, port)
    folder = widths.vllm_folder(model["hf"], dtype) if system == "ministream" else Path(model["llama"])
    name = served_name(folder)
    settings = engine.EngineSettings(dtype=widths.width(dtype).dtype)
    return engine.server_command(folder, HOST, port, name, settings), name, str(folder)


def _llamacpp_command(model: dict, dtype: str, port: int) -> tuple[list[str], str, str]:
    from . import llamacpp

    folder = model["hf"]
    gguf = widths.gguf_file(folder, dtype)
    name = served_name(folder)
    context = json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]
    threads = engine_threads()
    with llamacpp.server(gguf, free_port(), threads, 1, 256):  # a first start: where it dies, NO_AMX says so
        pass
    cmd = llamacpp.server_command(llamacpp.build(), gguf, port, threads, LLAMACPP_SLOTS, context, ("--alias", name))
    return cmd, name, folder


def server_env(kv_cache_gib: int) -> dict:
    """`ministream serve`'s environment (engine.engine_env: the user's settings win), with the KV cache
    chosen once for the whole run, so both vLLM systems get the same."""
    return engine.engine_env(1, {engine.KV_CACHE: str(kv_cache_gib), **os.environ})


def warm(url: str, name: str, timeout: float = 900) -> float:
    """One short completion, so first-request costs stay out of the first rate's figures; its seconds."""
    t = time.monotonic()
    try:
        status, body = call(f"{url}/v1/completions", greedy(name, WARM_PROMPT, 8), timeout=timeout)
    except (OSError, ValueError) as e:
        raise ServerFailed(f"the warm-up request to {url} failed: {e}") from None
    if status != 200:
        raise ServerFailed(f"the warm-up request to {url} failed: HTTP {status}: {body}")
    return time.monotonic() - t


# ---------------------------------------------------------------- the run


def figures(raw: dict, rows: list[dict]) -> dict:
    """The client's figures serve.json keeps, its first errors, and whether every request got the output
    length its row asked (the client's order is the file's: --disable-shuffle)."""
    kept = {k: raw.get(k) for k in FIGURES if k in raw}
    errors = [e for e in raw.get("errors") or [] if e]
    if errors:
        kept["errors"] = [e.strip().splitlines()[-1][:300] for e in errors[:3]]
    lens = raw.get("output_lens")
    if lens is not None:
        kept["output_tokens_as_asked"] = lens == [r["output_tokens"] for r in rows[: len(lens)]]
    return kept


def run_system(system: str, result: dict, out: Path, files: dict, sets: dict, env: dict, make_set=None) -> None:
    """Start one system's server, warm it, run the client at every rate (the ones after two latency misses
    in a row skipped), then search its ceiling between the grid's rates (make_set(rate) -> (file, rows): the
    prompt set of a rate off the grid), stop it; everything into result["systems"][system], saved after
    every rate."""
    s, model = result["settings"], result["model"]
    port = free_port()
    cmd, name, folder = server_command(system, model, s["dtype"], port)
    url, log = f"http://{HOST}:{port}", out / "logs" / f"serve-{system}.log"
    entry: dict[str, Any] = {
        "label": SYSTEMS[system],
        "runs": [],
        "server": {"command": " ".join(cmd), "url": url, "log": str(log)},
    }
    result["systems"][system] = entry
    print(f"bench-serve: {system}: starting {' '.join(cmd[:4])} ... (log {log})", flush=True)
    try:
        with running(cmd, log, env if system != "reference" else {**os.environ, **engine.NO_USAGE_STATS}) as proc:
            entry["server"]["start_s"] = wait_ready(url, proc, log)
            entry["server"]["warm_s"] = warm(url, name)
            print(
                f"bench-serve: {system}: ready in {entry['server']['start_s']:.0f}s, warm-up "
                f"{entry['server']['warm_s']:.1f}s",
                flush=True,
            )
            misses_in_row: list[float] = []
            for rate in s["rates"]:
                n = prompts_for(rate, s)
                run = {"rate": rate, "num_prompts": n}
                if len(misses_in_row) >= 2:
                    run["skipped"] = (
                        f"missed the latency targets at {misses_in_row[-2]:g} and {misses_in_row[-1]:g} req/s"
                    )
                    entry["runs"].append(run)
                    continue
                run_rate(run, system, entry, proc, (url, name, folder), files[rate], sets[rate], s, out)
                misses_in_row = misses_in_row + [rate] if run["missed_latency"] else []
                entry["runs"].append(run)
                print(f"{run['wall_s']:.0f}s: " + run_line(run), flush=True)
                save(result, out, partial=True)
            for _ in range(s.get("bisect_steps", 0) if make_set else 0):
                rate = next_rate(entry["runs"], BISECT_WITHIN)
                if rate is None or "error" in entry["server"]:
                    break
                dataset, rows = make_set(rate)
                run = {"rate": rate, "num_prompts": len(rows), "bisect": True}
                run_rate(run, system, entry, proc, (url, name, folder), dataset, rows, s, out)
                entry["runs"].append(run)
                print(f"{run['wall_s']:.0f}s: (ceiling search) " + run_line(run), flush=True)
                save(result, out, partial=True)
    except ServerFailed as e:
        entry["server"]["error"] = str(e)
        print(f"bench-serve: {system}: FAILED: {e}", file=sys.stderr, flush=True)


def run_rate(
    run: dict,
    system: str,
    entry: dict,
    proc,
    served: tuple[str, str, str],
    dataset: Path,
    rows: list[dict],
    s: dict,
    out: Path,
) -> None:
    """vLLM's client at run["rate"] against the running server `proc` (served: its URL, model name and
    folder); its figures, wall time and verdict into `run`, a server that died into entry["server"]."""
    rate, n = run["rate"], run["num_prompts"]
    raw_file = out / "serve-runs" / f"{system}-{rate:g}.json"
    run.update(dataset=str(dataset), client_result=str(raw_file), load_average=os.getloadavg())
    print(f"bench-serve: {system} at {rate:g} req/s, {n} requests ...", end=" ", flush=True)
    t = time.monotonic()
    try:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited ({proc.returncode}); {entry['server']['log']}")
        args = client_args(*served, dataset, n, rate, s["seed"], raw_file)
        raw = run_client(
            args, raw_file, out / "logs" / f"client-{system}-{rate:g}.log", timeout=n / rate + START_TIMEOUT
        )
        run.update(figures(raw, rows))
    except MiniStreamError as e:
        run["error"] = str(e)
        if isinstance(e, ServerFailed):
            entry["server"]["error"] = str(e)
    run["wall_s"] = time.monotonic() - t
    run.update(judge(run, rate, s["ttft_target_s"], s["tpot_target_s"]))


def run_bench_serve(out: Path, systems: list[str], note: str = "", **settings) -> dict:
    """Prepare the model and the prompt set, then every system in turn; the result (also in OUT/serve.json)."""
    check_client()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    kv = os.environ.get(engine.KV_CACHE) or str(engine.kv_cache_gib())  # as bench: chosen once, for both vLLMs
    env = server_env(int(float(kv)))
    result: dict[str, Any] = {
        **new_result(SCHEMA, started, note),
        "settings": {**settings, "systems": systems, "keep_up": KEEP_UP},
        "engine_env": {k: env.get(k) for k in (engine.BIND, engine.KV_CACHE)},
        "systems": {},
    }
    s = result["settings"]
    print(f"bench-serve: preparing the {s['preset']} model", flush=True)
    result["model"] = model = offline.prepare_model(s["preset"], out / "models")
    from ..run.generate import folder_tokenizer

    tok = folder_tokenizer(Path(model["hf"]).resolve() / "tokenizer.json")
    max_len = json.loads((Path(model["hf"]) / "config.json").read_text())["max_position_embeddings"]

    def build(counts: list[int]) -> dict:
        return build_prompts(
            tok,
            counts,
            s["seed"],
            s["prompt_tokens"],
            s["output_tokens"],
            s["prefix_groups"],
            s["prefix_tokens"],
            s["shared_fraction"],
            max_len,
        )

    built = build([prompts_for(rate, s) for rate in s["rates"]])
    sets = dict(zip(s["rates"], built["sets"]))
    files = {rate: write_jsonl(rows, out / "serve-prompts" / f"rate-{rate:g}.jsonl") for rate, rows in sets.items()}

    def make_set(rate: float) -> tuple[Path, list[dict]]:
        """A rate off the grid: its own set of the same kind, by the same seed."""
        rows = build([prompts_for(rate, s)])["sets"][0]
        return write_jsonl(rows, out / "serve-prompts" / f"rate-{rate:g}.jsonl"), rows

    every = [r for rows in built["sets"] for r in rows]
    result["dataset"] = {
        "corpus": str(CORPUS),
        "folder": str(out / "serve-prompts"),
        "prefix_tokens": built["prefix_tokens"],
        "all": dataset_stats(every),
        "per_rate": {f"{rate:g}": dataset_stats(rows) for rate, rows in sets.items()},
    }
    d = result["dataset"]["all"]
    print(
        f"bench-serve: {d['requests']} prompts in {len(files)} sets: prompt tokens {d['prompt_tokens']['min']}-"
        f"{d['prompt_tokens']['max']} (median {d['prompt_tokens']['median']:g}), output tokens "
        f"{d['output_tokens']['min']}-{d['output_tokens']['max']}, {d['shared_prefix_requests']} open with one of "
        f"{len(built['prefix_tokens'])} shared passages",
        flush=True,
    )
    if widths.width(s["dtype"]).scheme:  # a quantized width: the two engines that run one
        systems = [x for x in systems if x in QUANTIZED_SYSTEMS]
        result["settings"]["systems"] = systems
    for system in systems:
        run_system(system, result, out, files, sets, env, make_set)
        save(result, out, partial=True)
    result["load_average_end"] = os.getloadavg()
    result["seconds"] = time.time() - started
    save(result, out)
    return result


def save(result: dict, out: Path, partial: bool = False) -> Path:
    """serve.json whole or not at all: a temporary file, then a rename."""
    result["partial"] = partial
    result["summary"] = summarize(result)
    return write_json(out / "serve.json", result)


# ---------------------------------------------------------------- command line


def bench_serve(
    out: Path, quick=False, report_only=False, systems: list[str] | None = None, note="", **settings
) -> int:
    """`ministream bench-serve`: the FULL (or QUICK) settings with the given ones (not None) in their place;
    with report_only, the table and the chart again from OUT/serve.json. 1 if a system or a run failed."""
    if report_only:
        return report(read_result(out / "serve.json", f"ministream bench-serve --out {out}"), out)
    chosen: dict[str, Any] = dict(QUICK if quick else FULL)
    chosen.update({k: v for k, v in settings.items() if v is not None})
    systems = systems or list(SYSTEMS)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise MiniStreamError(f"unknown --systems {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    if "ministream" in systems:  # a (quantized) width this machine's vLLM cannot run, before anything runs
        widths.vllm_width(chosen["dtype"])
    if not chosen["rates"] or min(chosen["rates"]) <= 0:
        raise MiniStreamError(f"--rates must be request rates above 0, e.g. 0.5,1,2; got {chosen['rates']}")
    return report(run_bench_serve(out, systems, note, **chosen), out)
