"""serve: vLLM's OpenAI-compatible server (what `vllm serve` runs) with the patched vLLM of this environment.

The model is served under the folder's name (`out/demo/hf` -> "hf"; --name to choose another), so
clients name the same model whatever path the server was started with. The engine settings are this
machine's (engine.py): without a GPU, every core for the model and a KV cache of a quarter of the memory
available (1 to 64 GiB, split among --tp ranks), unless the environment already sets them; with a GPU,
vLLM's own defaults. SIGTERM and SIGINT are passed to the server, which shuts down its engine processes;
whatever of its process group is left after --stop-timeout seconds is killed. Stopped so, it exits 0; a
server that ends unasked (its engine died) exits non-zero, whatever status vLLM gave it.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .. import MiniStreamError
from ..fork.install import installed_vllm
from . import engine, nodes
from .folder import check_servable
from .server import API_KEY, START_TIMEOUT, die_with_parent, kill_group, local_url, reap_process_group, wait_ready

SHOWN = (engine.BIND, engine.KV_CACHE)  # the settings the start line shows


def served_name(model: Path) -> str:
    return Path(model).resolve().name


def _announce_when_ready(url: str, name: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT):
    try:
        wait_ready(url, proc, None, timeout, models=False)  # /health: it asks no key, whoever set one
    except MiniStreamError:  # it exited, or never answered: the server's own log says why
        return
    body = json.dumps({"model": name, "prompt": "The river runs through", "max_tokens": 16, "temperature": 0})
    print(
        f"\nministream serve: ready at {url}/v1 (model {name!r}); try:\n"
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n",
        flush=True,
    )


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def exposure_warning(host: str, env: dict) -> str | None:
    """A warning when the server would answer anyone who reaches `host` with no key asked of them."""
    if host in LOOPBACK or env.get(API_KEY):
        return None
    return (
        f"ministream serve: WARNING: listening on {host} without an API key: anyone who reaches this port "
        f"can use the model. Set {API_KEY}=<key> (or --api-key) so that requests must carry it."
    )


def serve(
    model: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    name: str | None = None,
    dtype: str | None = None,
    tp: int = 1,
    max_model_len: int | None = None,
    extra: Sequence[str] = (),
    stop_timeout: float = 60,
    api_key: str | None = None,
    enforce_eager: bool = False,
    pp: int = 1,
    cluster: nodes.Plan | None = None,
) -> int:
    """Run the server until it exits or this process gets SIGTERM/SIGINT; its exit status.

    cluster: this process is one node of a server over cluster.nnodes machines (nodes.py); rank 0 serves
    the API, the others run headless. api_key goes to vLLM through its environment (VLLM_API_KEY), never
    on a command line `ps` shows."""
    check_servable(model)  # a folder vLLM can read, and ranks this machine has, before minutes of engine start
    nnodes = cluster.nnodes if cluster else 1
    if pp < 1 or (tp * pp) % nnodes:
        raise MiniStreamError(
            f"--tp {tp} x --pp {pp} = {tp * pp} ranks cannot be spread evenly over --nnodes {nnodes}: "
            f"give a --tp or --pp whose product is a multiple of {nnodes}"
        )
    local = tp * pp // nnodes  # the ranks this node runs
    engine.check_tp(local)
    if importlib.util.find_spec("vllm") is None:
        raise MiniStreamError(f"vllm is not installed in {sys.prefix}: run `make install` first") from None
    name = name or served_name(model)
    installed = installed_vllm()
    release = installed[0] if installed else None
    if cluster:
        nodes.check_release(installed)
        env = engine.node_env(local, nodes.local_address(cluster.master_addr), nnodes=nnodes, release=release)
    else:
        env = engine.engine_env(local)
    if api_key:
        env[API_KEY] = api_key
    headless = cluster is not None and cluster.rank > 0
    if not headless and (warning := exposure_warning(host, env)):
        print(warning, file=sys.stderr, flush=True)
    cmd = engine.server_command(model, host, port, name, dtype, tp, max_model_len, list(extra), enforce_eager)
    if cluster:
        cmd = engine.node_command(cmd, pp, nnodes, cluster.rank, cluster.master_addr, cluster.master_port)
    elif pp > 1:
        cmd += ["--pipeline-parallel-size", str(pp)]
    url = local_url(host, port)
    shown = " ".join(f"{k}={env[k]}" for k in (*SHOWN, "VLLM_HOST_IP") if k in env)
    print(f"ministream serve: {shown} {' '.join(cmd)}", flush=True)
    peers: dict = {}
    if cluster:
        mine = nodes.card(model, dtype, tp, pp, nnodes, release)
        peers = nodes.gather(cluster, mine) if cluster.rank == 0 else {0: nodes.join(cluster, mine)}
    if headless and cluster:
        print(f"ministream serve: node {cluster.rank} of {nnodes}, headless: node 0 serves the API", flush=True)
    else:
        print(
            f"ministream serve: will listen on {url} once loaded (model {name!r}); Ctrl-C or SIGTERM stops it",
            flush=True,
        )
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
    lost: list[int] = []
    if peers:
        nodes.watch(peers, lambda rank: _node_lost(rank, proc, lost))
    if not headless:
        threading.Thread(target=_announce_when_ready, args=(url, name, proc), daemon=True).start()
    stopping: list[float] = []  # when the first stop signal came
    rc = _wait_forwarding_signals(proc, stopping, stop_timeout)
    if lost and not stopping:
        print(
            f"ministream serve: node {lost[0]} was lost (its process ended or its machine is gone); this node "
            f"stopped its server: restart every node",
            file=sys.stderr,
            flush=True,
        )
        return 3
    if stopping and rc in (0, -signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM):
        print("ministream serve: stopped", flush=True)
        return 0
    if not stopping:  # nobody asked it to stop: vLLM ends its server with status 0 when the engine dies
        print(
            f"ministream serve: the server stopped unasked (status {rc}): its engine died or it could not "
            "start; the reason is in the log above",
            file=sys.stderr,
            flush=True,
        )
    return 1 if rc == 0 else rc if rc > 0 else 128 - rc


def _node_lost(rank: int, proc: subprocess.Popen, lost: list[int]) -> None:
    """A watcher found node `rank` gone: vLLM would hang on its collective, so stop it now."""
    lost.append(rank)
    kill_group(proc.pid)


def _wait_forwarding_signals(proc: subprocess.Popen, stopping: list, stop_timeout: float) -> int:
    """The server's exit status; SIGTERM/SIGINT meanwhile go to it (a second one as SIGKILL), and its
    process group is killed if it has not exited stop_timeout seconds after the first; whatever of the
    group is left when it exits, too."""

    def forward(signum, _frame):
        stopping.append(time.monotonic())
        try:
            os.kill(proc.pid, signum if len(stopping) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                return proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > stop_timeout:
                    print(
                        f"ministream serve: no exit {stop_timeout:.0f}s after the signal; killing it", file=sys.stderr
                    )
                    kill_group(proc.pid)
    finally:
        reap_process_group(proc.pid, grace=10 if stopping else 0)
        for s, h in old.items():
            signal.signal(s, h)
