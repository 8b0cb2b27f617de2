"""server: one server process's life, and the HTTP a client on this machine speaks to it.

Every server this project starts for a while and then stops (bench-serve's three systems, the tests'
`ministream serve`, the reference server) goes through here: `start` runs its command in a session of its
own (it and whatever it starts share one process group) that gets SIGTERM when this process dies, even by
SIGKILL, its output in a log file; `wait_ready` waits until it answers /health and lists a model on
/v1/models, and raises ServerFailed with the log's tail if it exits first or the time runs out; `stop` sends
SIGTERM to its group, SIGKILL after a bound, and leaves nothing of the group behind; `running` is start..stop.

The HTTP helpers talk to 127.0.0.1 (or any base URL) with the API key a server asks for: JSON GET/POST
(`call`, `complete`) and a streamed completion's server-sent events (`stream`). Each reads through net.py: a
`timeout` is the request's whole deadline (a server dribbling bytes cannot stretch it), a stream's is the most
time between two of its lines.
"""

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import MiniStreamError
from ..net import open_url, parse_json

HOST = "127.0.0.1"
API_KEY = "VLLM_API_KEY"  # vLLM's own: every /v1 request must then carry "Authorization: Bearer <key>"
START_TIMEOUT = 1800  # s for a server to answer (vLLM's engine start is minutes on a loaded machine with few cores)
STOP_TIMEOUT = 60  # s from SIGTERM to SIGKILL
REAP_GRACE = 10  # s the rest of a stopped server's group has to exit before SIGKILL


class ServerFailed(MiniStreamError):
    pass


# ---------------------------------------------------------------- processes


def _parent_death_signal() -> None:
    """In a child before exec: SIGTERM when the thread that started it dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def die_with_parent() -> None:
    """In the child before exec: its own process group (signals reach all of vLLM's processes), and
    SIGTERM when this process dies, even by SIGKILL, so no server outlives `ministream serve`."""
    os.setpgrp()
    _parent_death_signal()


def pgroup_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reap_process_group(pgid: int, grace: float) -> None:
    """The engine processes share the server's process group: give them the grace period, then kill."""
    deadline = time.monotonic() + grace
    while pgroup_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_group(pgid)


def kill_group(pgid: int) -> None:
    """SIGKILL to a process group, if anything of it is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start(cmd: list[str], log: Path | None, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """`cmd` in a session of its own (its process group is its pid; what it starts joins the group), that
    gets SIGTERM when this process dies; its output in `log` (None: this process's stderr)."""
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") if log is not None else contextlib.nullcontext(sys.stderr) as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_parent_death_signal,
        )


def log_tail(log: Path | None, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:]) if log and log.is_file() else ""


def answers(url: str, timeout: float = 5, key: str | None = None, models: bool = True) -> bool:
    """Whether the server at `url` answers /health and (models) lists a model on /v1/models, with the key."""
    try:
        with get(f"{url}/health", timeout, key) as r:
            if r.status != 200:
                return False
        if not models:
            return True
        with get(f"{url}/v1/models", timeout, key) as m:
            return bool(json.loads(m.read())["data"])
    except (OSError, ValueError, KeyError, TypeError):  # TypeError: JSON of another shape
        return False


def wait_ready(
    url: str,
    proc: subprocess.Popen,
    log: Path | None,
    timeout: float = START_TIMEOUT,
    key: str | None = None,
    models: bool = True,
) -> float:
    """Seconds until the server answers (`answers`); ServerFailed with the log's tail if it exits or the
    time runs out."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited ({proc.returncode}) before answering; {log}:\n{log_tail(log)}")
        if answers(url, 5, key, models):
            return time.monotonic() - t
        time.sleep(1)
    raise ServerFailed(f"no answer on {url}/health in {timeout:.0f}s; {log}:\n{log_tail(log)}")


def stop(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM to the server's process group, SIGKILL after `timeout`; nothing of the group is left."""
    stop_all([proc], timeout)


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = STOP_TIMEOUT) -> None:
    """stop() of several servers at once: each drains while the others do (a vLLM server takes ~7 s)."""
    procs = list(procs)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
    deadline = time.monotonic() + REAP_GRACE
    for proc in procs:
        reap_process_group(proc.pid, grace=max(deadline - time.monotonic(), 0))


@contextmanager
def running(
    cmd: list[str], log: Path, env: dict | None = None, stop_timeout: float = STOP_TIMEOUT
) -> Iterator[subprocess.Popen]:
    """`start`, then `stop` however the block ends."""
    proc = start(cmd, log, env)
    try:
        yield proc
    finally:
        stop(proc, stop_timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server listening on `host`."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else '[::1]' if host == '::' else host}:{port}"


# ---------------------------------------------------------------- HTTP


def auth(key: str | None = None) -> dict:
    """The Authorization header a server started with a key asks for: `key`, else OPENAI_API_KEY (what vLLM's
    client sends), else VLLM_API_KEY (what `ministream serve` and bench-serve's vLLM servers inherit)."""
    key = key or os.environ.get("OPENAI_API_KEY") or os.environ.get(API_KEY)
    return {"Authorization": f"Bearer {key}"} if key else {}


def json_headers(key: str | None = None) -> dict:
    """A JSON request's headers, with the key (`auth`)."""
    return {"Content-Type": "application/json", **auth(key)}


def get(url: str, timeout: float, key: str | None = None):
    """The open response of a GET with the key, read within `timeout` s in all (net.open_url; HTTPError on a
    status >= 400, as urllib's)."""
    return open_url(urllib.request.Request(url, headers=auth(key)), deadline=timeout)


def call(
    url: str, body=None, raw: bytes | None = None, timeout: float = 120, headers: dict | None = None
) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a GET (no body) or POST, whatever the status, within `timeout` s in all;
    headers: JSON and the key (`auth`) unless given. A body that is not JSON: net.NotJSON (a ValueError)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data, json_headers() if headers is None else headers)
    try:
        with open_url(req, deadline=timeout) as r:
            status, answer = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, answer = e.code, e.read()
    return status, parse_json(answer or b"{}", f"{url}'s answer (HTTP {status})")  # /health answers with no body


def greedy(model: str | None, prompt, max_tokens: int, **extra) -> dict:
    """A completion request: temperature 0, EOS ignored, unless `extra` says otherwise."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def complete(
    url: str, model: str | None, prompt, max_tokens: int, timeout: float = 120, headers: dict | None = None, **extra
) -> tuple[int, dict]:
    """(HTTP status, JSON body) of one `greedy` completion from the server at base URL `url`."""
    return call(f"{url}/v1/completions", greedy(model, prompt, max_tokens, **extra), timeout=timeout, headers=headers)


DONE = b"data: [DONE]\n\n"  # the server-sent event that ends an OpenAI-style stream


def event(body: dict) -> bytes:
    """One server-sent event, as a server writes it: `data: JSON` and a blank line."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Stream:
    """A streaming POST, read as it arrives: `headers`, then iterate for each event's JSON (`data: {...}`
    lines); `done` once `data: [DONE]` came. A context manager that closes the connection.

    `timeout` bounds the wait for the headers and between two lines, not the whole stream: a generation of
    any length streams on; a server that stops, or takes longer than that over a line, ends in net.Deadline."""

    def __init__(self, url: str, body: dict, timeout: float = 120, headers: dict | None = None):
        data = json.dumps({**body, "stream": True}).encode()
        req = urllib.request.Request(url, data, json_headers() if headers is None else headers)
        self.response = open_url(req, quiet=timeout)
        self.headers = self.response.headers
        self.done = False

    def __iter__(self) -> Iterator[dict]:
        for line in self.response:
            text = line.decode().strip()
            if text == DONE.decode().strip():
                self.done = True
            elif text.startswith("data: "):
                yield parse_json(text[len("data: ") :], f"an event of {self.response.url}")

    def text(self) -> str:
        """The text of every choice of every event still to come, joined."""
        return "".join(c["text"] for chunk in self for c in chunk["choices"])

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.response.close()


def stream(url: str, body: dict, timeout: float = 120, headers: dict | None = None) -> Stream:
    return Stream(url, body, timeout, headers)
