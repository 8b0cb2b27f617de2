"""nodes: the nodes of one multi-node server agree before vLLM starts, and watch each other while it serves.

vLLM's multiprocessing executor spreads the ranks over `--nnodes` machines (vLLM PR #23691, from 0.11.1):
rank 0 serves the API, the others run headless. vLLM itself waits without a word for a node that never
comes, hangs or serves wrong tokens when the nodes hold different folders or versions, and leaves rank 0
hanging when a node dies. So before vLLM starts, every node shows rank 0 its card (model digest, dtype,
parallel sizes, vLLM and ministream versions) over one TCP connection to MASTER_ADDR:RENDEZVOUS_PORT
(default master port + 1); rank 0 refuses a card that differs, by name, and gives up on a node that has not
come within --node-timeout seconds. The connections stay open while serving: when one closes (its node's
process died or its machine went away), the nodes on the other end stop their server and exit non-zero,
naming the lost node.

The ports accept anyone who reaches them (vLLM's too): keep the nodes on a private network.
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import MiniStreamError, __version__
from .engine import EngineSettings, has_gpu

FIRST_RELEASE = "0.11.1"  # vLLM's first with --nnodes for its multiprocessing executor (PR #23691)
# ... and on a CPU: 0.11 and 0.12 size a node's shared-memory broadcaster by torch.cuda.device_count(), 0 there
# (distributed/device_communicators/shm_broadcast.py, create_from_process_group_single_reader): every worker
# dies with ZeroDivisionError at start (seen on 0.11.2); 0.13 asks current_platform.device_count()
FIRST_CPU_RELEASE = "0.13"
DEFAULT_TIMEOUT = 600.0  # seconds rank 0 waits for the others, and they for rank 0
HEARTBEAT = 2.0  # seconds between the watchers' keep-alive bytes


@dataclass(frozen=True)
class Plan:
    nnodes: int
    rank: int
    master_addr: str
    master_port: int
    rendezvous_port: int
    timeout: float = DEFAULT_TIMEOUT

    @property
    def where(self) -> str:
        return f"{self.master_addr}:{self.rendezvous_port}"


def check_release(installed: tuple[str, str] | None, gpu: bool | None = None) -> None:
    """Refuse a vLLM older than the multi-node multiprocessing executor (on a CPU: than the first whose
    executor runs there), before anything starts. gpu: whether this machine has one (default: ask torch)."""
    from packaging.version import Version

    if not installed:
        return
    release = Version(Version(installed[0]).base_version)
    if release < Version(FIRST_RELEASE):
        raise MiniStreamError(
            f"vLLM {installed[0]} has no multi-node multiprocessing executor (--nnodes, from {FIRST_RELEASE}, vLLM "
            f"PR #23691): install a patched vLLM {FIRST_RELEASE} or later, or use Ray (docs/routes.md, multi-node)"
        )
    if release < Version(FIRST_CPU_RELEASE) and not (has_gpu() if gpu is None else gpu):
        raise MiniStreamError(
            f"vLLM {installed[0]}'s multi-node executor cannot run on a CPU: its shared-memory broadcaster sizes a "
            f"node by torch.cuda.device_count(), 0 here, and every worker dies at start (ZeroDivisionError); "
            f"install a patched vLLM {FIRST_CPU_RELEASE} or later for CPU nodes"
        )


def model_digest(model: Path) -> str:
    """sha256 over config.json and every safetensors file: two folders serve the same model only if equal."""
    h = hashlib.sha256()
    for path in [Path(model) / "config.json", *sorted(Path(model).glob("*.safetensors"))]:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def card(model: Path, settings: EngineSettings, nnodes: int, vllm_version: str | None) -> dict:
    """What every node of one server must agree on."""
    return {
        "model": model_digest(model),
        "dtype": settings.dtype or "auto",
        "tensor_parallel_size": settings.tp,
        "pipeline_parallel_size": settings.pp,
        "nnodes": nnodes,
        "vllm": vllm_version,
        "ministream": __version__,
    }


def differences(mine: dict, theirs: dict) -> list[str]:
    return [f"{k} {theirs.get(k)!r} (node 0: {mine[k]!r})" for k in mine if theirs.get(k) != mine[k]]


def local_address(master_addr: str) -> str:
    """The address of this machine on the route to rank 0: what vLLM advertises (VLLM_HOST_IP) for the other
    nodes to reach this one (a UDP socket "connected" sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(master_addr), 9))
            return s.getsockname()[0]
        except OSError as e:
            raise MiniStreamError(f"--master-addr {master_addr}: no route to it from this machine ({e})") from None


def _send(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _receive(sock: socket.socket, deadline: float) -> dict | None:
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, OSError):
            return None
        if not chunk:
            return None
        data += chunk
    try:
        said = json.loads(data)
    except ValueError:
        return None
    return said if isinstance(said, dict) else None  # JSON of another shape: as malformed as none


def say(text: str) -> None:
    print(f"ministream serve: {text}", file=sys.stderr, flush=True)


def gather(plan: Plan, mine: dict) -> dict[int, socket.socket]:
    """Rank 0: wait for nodes 1..N-1, each with a card equal to `mine`; their open connections by rank."""
    server = socket.create_server((plan.master_addr, plan.rendezvous_port), reuse_port=False)
    server.settimeout(1.0)
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + plan.timeout
    said = 0.0
    try:
        while len(joined) < plan.nnodes - 1:
            missing = [r for r in range(1, plan.nnodes) if r not in joined]
            if time.monotonic() > deadline:
                raise MiniStreamError(
                    f"node(s) {', '.join(map(str, missing))} of {plan.nnodes} did not join at {plan.where} within "
                    f"{plan.timeout:.0f} s: start them (ministream serve MODEL --nnodes {plan.nnodes} --node-rank "
                    f"{missing[0]} --master-addr {plan.master_addr} --master-port {plan.master_port}), check that "
                    f"they reach {plan.where}, or give --node-timeout more seconds"
                )
            if time.monotonic() - said > 15:
                say(f"waiting for node(s) {', '.join(map(str, missing))} at {plan.where} (up to {plan.timeout:.0f} s)")
                said = time.monotonic()
            try:
                conn, addr = server.accept()
            except TimeoutError:
                continue
            theirs = _receive(conn, time.monotonic() + 30) or {}
            rank = theirs.get("rank") if isinstance(theirs, dict) else None
            if not isinstance(rank, int) or not 0 < rank < plan.nnodes or rank in joined:
                _send(conn, {"ok": False, "why": f"rank {rank!r} is not one node 0 waits for"})
                conn.close()
                say(f"refused a connection from {addr[0]}: not a node of this server (rank {rank!r})")
                continue
            wrong = differences(mine, theirs.get("card", {}))
            if wrong:
                why = f"node {rank} at {addr[0]} differs from node 0: {'; '.join(wrong)}"
                _send(conn, {"ok": False, "why": why})
                conn.close()
                raise MiniStreamError(
                    f"{why}. Every node needs the same model folder, dtype, parallel sizes and patched vLLM"
                )
            joined[rank] = conn
            say(f"node {rank} joined from {addr[0]}")
        for conn in joined.values():
            _send(conn, {"ok": True})
        return joined
    except BaseException:
        for conn in joined.values():
            conn.close()
        raise
    finally:
        server.close()


def join(plan: Plan, mine: dict) -> socket.socket:
    """Rank > 0: show node 0 this node's card; the open connection once node 0 accepted it."""
    deadline = time.monotonic() + plan.timeout
    said = 0.0
    while True:
        try:
            sock = socket.create_connection((plan.master_addr, plan.rendezvous_port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise MiniStreamError(
                    f"node 0 did not answer at {plan.where} within {plan.timeout:.0f} s: start it (ministream "
                    f"serve MODEL --nnodes {plan.nnodes} --node-rank 0 --master-addr {plan.master_addr}), check "
                    f"that this machine reaches {plan.where}, or give --node-timeout more seconds"
                ) from None
            if time.monotonic() - said > 15:
                say(f"waiting for node 0 at {plan.where} (up to {plan.timeout:.0f} s)")
                said = time.monotonic()
            time.sleep(1)
    _send(sock, {"rank": plan.rank, "card": mine})
    answer = _receive(sock, deadline + 60)
    if not answer or not answer.get("ok"):
        sock.close()
        why = answer.get("why") if answer else f"node 0 at {plan.where} closed the connection"
        raise MiniStreamError(f"{why}; this node (rank {plan.rank}) does not start")
    return sock


def watch(peers: dict[int, socket.socket], lost: Callable[[int], None]) -> None:
    """Call `lost(rank)` once, from a daemon thread, when the connection to any of `peers` closes; each side
    sends a byte every HEARTBEAT seconds so that a peer whose machine vanished is found within ~3 of them."""

    def run() -> None:
        while True:
            for rank, sock in peers.items():
                try:
                    sock.sendall(b".")
                    sock.settimeout(HEARTBEAT * 3)
                    if not sock.recv(4096):
                        raise ConnectionError
                except OSError:
                    lost(rank)
                    return
            time.sleep(HEARTBEAT)

    threading.Thread(target=run, daemon=True).start()


# --- two nodes on one machine: what the tests and `make bench` run -------------------------------------


def isolated(cmd: list[str], cpus: str) -> list[str]:
    """`cmd` as a node of its own on this machine: a mount namespace with a private /dev/shm (so vLLM's
    shared-memory channels cannot reach the other node) on the cores `cpus`; root only (`can_isolate`)."""
    inner = f'mount -t tmpfs tmpfs /dev/shm && exec taskset -c {cpus} "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, "node", *cmd]


def start_here(
    serve: list, nnodes: int, master_port: int, logs: Path, env: dict, wrap: Callable | None = None, cwd=None
) -> list:
    """`serve` (a `ministream serve` command line) as every node of an `nnodes` cluster on this machine, each
    `isolated` on a core of its own in turn, rank 0 at 127.0.0.1:master_port; wrap: what each node's command
    runs inside (a line's userland). The node processes, rank 0 first, their output in logs/node<R>.log; if
    one cannot start, those started are stopped."""
    from .server import start, stop

    cores = sorted(os.sched_getaffinity(0))
    procs: list = []
    try:
        for rank in range(nnodes):
            cmd = [*serve, "--nnodes", nnodes, "--node-rank", rank, "--master-addr", "127.0.0.1"]
            cmd = [str(a) for a in (wrap or list)([*cmd, "--master-port", master_port])]
            procs.append(start(isolated(cmd, str(cores[rank % len(cores)])), logs / f"node{rank}.log", env, cwd))
    except BaseException:
        for proc in procs:
            stop(proc)
        raise
    return procs


def can_isolate() -> bool:
    """Whether `isolated` works here: root, unshare, and a tmpfs mount inside a new mount namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("taskset"):
        return False
    probe = subprocess.run(isolated(["true"], "0"), capture_output=True)
    return probe.returncode == 0
