"""bench-nodes: what spreading the ranks over nodes costs: TP=1, TP=2 on one node (shared memory), TP=2 over
two nodes (gloo over TCP, vLLM's multiprocessing executor), on one converted folder.

The two nodes run on this machine, each in its own mount namespace with a private /dev/shm and its own
core (nodes.isolated; root only, else the row is skipped and says why), so they share nothing but TCP on
127.0.0.1: the transport two machines would use, minus a real network's latency. Each server is started,
warmed (one short request) and measured with vLLM's own benchmark client at concurrency 1 and 32 (random
prompts of 32 tokens, each asking the same output length, EOS ignored, greedy): request and output
throughput, and time to first token. Writes OUT/nodes.json (with the machine) and prints a table.
"""

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import MiniStreamError
from ..atomic import write_json
from ..run import nodes
from ..run.server import START_TIMEOUT, call, free_port, greedy, log_tail, start, stop, wait_ready
from . import offline
from .machine import machine, machine_line
from .vllm_client import check_client, client_common, run_client

SYSTEMS = {
    "tp1": "TP=1, one node",
    "tp2": "TP=2, one node (shared memory)",
    "tp2-2nodes": "TP=2 over two nodes (gloo over TCP on 127.0.0.1)",
}
FULL: dict[str, Any] = dict(
    preset="reference", dtype="bfloat16", concurrency=[1, 32], prompts={1: 8, 32: 64}, output_tokens=64
)
QUICK: dict[str, Any] = dict(FULL, preset="tiny", dtype="float32", prompts={1: 2, 32: 32}, output_tokens=16)
FIGURES = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms")


def _exe() -> list[str]:
    return [str(Path(sys.executable).parent / "ministream")]


def _servers(system: str, model: Path, dtype: str, logs: Path) -> tuple[list, str]:
    """The processes of one system's server and its URL (not yet ready)."""
    port = free_port()
    common = [str(model), "--dtype", dtype, "--max-model-len", "512", "--port", str(port)]
    env = {**os.environ}
    if system == "tp1":
        return [start([*_exe(), "serve", *common], logs / "tp1.log", env)], f"http://127.0.0.1:{port}"
    if system == "tp2":
        return [start([*_exe(), "serve", *common, "--tp", "2"], logs / "tp2.log", env)], f"http://127.0.0.1:{port}"
    return nodes.start_here(
        [*_exe(), "serve", *common, "--tp", "2"], 2, free_port(), logs, env
    ), f"http://127.0.0.1:{port}"


def measure(system: str, model: Path, settings: dict, out: Path) -> dict:
    """One system: start, warm, the client at each concurrency, stop."""
    if system == "tp2-2nodes" and not nodes.can_isolate():
        return {"skipped": "two isolated nodes need root and mount namespaces (unshare) on this machine"}
    if system != "tp1" and len(os.sched_getaffinity(0)) < 2:
        return {"skipped": "TP=2 needs two cores"}
    logs = out / "nodes-runs" / system
    logs.mkdir(parents=True, exist_ok=True)
    procs, url = _servers(system, model, settings["dtype"], logs)
    row: dict = {}
    try:
        t = time.monotonic()
        wait_ready(url, procs[0], logs / ("node0.log" if len(procs) > 1 else f"{system}.log"), START_TIMEOUT)
        row["start_s"] = round(time.monotonic() - t, 1)
        call(f"{url}/v1/completions", greedy(model.name, "Warm-up: the river runs through", 8), timeout=300)
        for c in settings["concurrency"]:
            with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
                result = Path(tmp) / "result.json"
                args = [
                    *client_common(url, model.name, str(model), 0, result),
                    *f"--num-prompts {settings['prompts'][c]} --max-concurrency {c} --request-rate inf".split(),
                    *"--dataset-name random --random-input-len 32".split(),
                    *["--random-output-len", str(settings["output_tokens"])],
                ]
                raw = run_client(args, result, logs / f"client-{c}.log", timeout=3600)
            row[f"concurrency_{c}"] = {k: raw.get(k) for k in FIGURES}
    except MiniStreamError as e:
        row["error"] = f"{e}: {log_tail(logs / (f'{system}.log' if len(procs) == 1 else 'node1.log'), 5)}"
    finally:
        for p in procs:
            stop(p)
    return row


def table(result: dict) -> str:
    lines = [
        "| system | concurrency | req/s | output tok/s | TTFT median (ms) | TTFT mean (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for system, row in result["systems"].items():
        if "skipped" in row or "error" in row:
            lines.append(f"| {SYSTEMS[system]} | — | {row.get('skipped') or row.get('error')} | | | |")
            continue
        for c in result["settings"]["concurrency"]:
            f = row[f"concurrency_{c}"]
            lines.append(
                f"| {SYSTEMS[system]} | {c} | {f['request_throughput']:.2f} | {f['output_throughput']:.1f} | "
                f"{f['median_ttft_ms']:.0f} | {f['mean_ttft_ms']:.0f} |"
            )
    return "\n".join(lines)


def bench_nodes(out: Path = offline.DEFAULT_OUT, quick: bool = False, systems: list[str] | None = None) -> int:
    """`ministream bench-nodes`: the three systems one after another; OUT/nodes.json and the table."""
    check_client()
    settings = QUICK if quick else FULL
    unknown = [s for s in systems or [] if s not in SYSTEMS]
    if unknown:
        raise MiniStreamError(f"--systems {','.join(unknown)}: choose from {', '.join(SYSTEMS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(offline.prepare_model(settings["preset"], out / "models")["hf"])
    result: dict[str, Any] = {"machine": machine(), "settings": settings, "model": str(model), "systems": {}}
    for system in systems or list(SYSTEMS):
        print(f"bench-nodes: {SYSTEMS[system]} ...", file=sys.stderr, flush=True)
        result["systems"][system] = measure(system, model, settings, out)
        write_json(out / "nodes.json", result)  # an interrupted run keeps what it measured
    print(machine_line(result["machine"]))
    print(table(result))
    return 1 if any("error" in r for r in result["systems"].values()) else 0
