"""Nothing lost, nothing trusted blindly (issue 13): faults and hostile inputs, end to end.

A real `ministream serve` on loopback (real vLLM, the tiny model at its own context of 512 tokens, no
--max-model-len; the session's, which test_fingerprint.py holds to the folder's fingerprint) answers each
hostile request with a 4xx and a message and goes on serving; survives a client that vanishes mid-stream;
streams 64 requests at once. A second server has its engine core killed and must exit non-zero, promptly,
leaving no process behind (~1 min on 2 cores). Without an engine: `serve`, `generate` and `verify` refuse a
machine or folder they cannot use in one line before vLLM starts. (That `verify --out` and `wheel --dist` never
write into an input is tested with their jobs, in test_verify.py and test_wheel.py.)
"""

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from ministream import MiniStreamError
from ministream.run.folder import check_servable
from ministream.run.generate import DEFAULT_PROMPTS, tokenize
from ministream.run.server import call, complete as any_complete, greedy, stop, stream as any_stream, wait_ready

from conftest import HeldEngine, engine_core

CONTEXT = 512  # the tiny preset's max_position_embeddings: the servers' limit
# the vanishing client's request: sequences to generate, each to the context's end. Work for the engine of half a
# minute and more: a slice the loaded test overslept let it run free, and 64 x 496 tokens took it 5 s (6400 tok/s)
SEQUENCES = 512
START_TIMEOUT = 600  # s for each server to answer
PROMPTS = DEFAULT_PROMPTS[:8]
STREAMS = 64
KILL_DEADLINE = 60  # seconds from the engine's SIGKILL to the server's exit


# ---------------------------------------------------------------- two real servers


@pytest.fixture(scope="module")
def doomed(tiny_hf, start_serve, tmp_path_factory):
    """The server whose engine gets killed: started first, so that it boots while the other does where that one
    is not up yet."""
    log = tmp_path_factory.mktemp("doomed") / "server.log"
    proc, url = start_serve(tiny_hf, log, "--dtype", "float32", "--enforce-eager")  # the faults are the subject
    yield proc, url, log
    stop(proc)


@pytest.fixture(scope="module")
def server(doomed, tiny_server):
    """The session's tiny float32 server (conftest.py; test_fingerprint.py's too), with request logging: it tells
    when a vanished client's request was aborted."""
    wait_ready(tiny_server["url"], tiny_server["proc"], tiny_server["log"], START_TIMEOUT)
    return {**tiny_server, "model": tiny_server["folder"]}


def complete(server, prompt, max_tokens=16, **extra) -> tuple[int, dict]:
    return any_complete(server["url"], server["name"], prompt, max_tokens, **extra)


@pytest.fixture(scope="module")
def answers(server) -> dict:
    """Each of PROMPTS' greedy completion, asked one at a time before any fault."""
    got = {p: complete(server, p) for p in PROMPTS}
    assert all(status == 200 for status, _ in got.values())
    return {p: body["choices"][0]["text"] for p, (_, body) in got.items()}


def message(body: dict, what: str, status: int) -> str:
    """The error's text: vLLM's OpenAI-style {"error": {"message"}}, or FastAPI's {"detail"} for a body
    it could not decode at all; printed (pytest -s) for the record of what each fault got."""
    text = (body.get("error") or {}).get("message") or body.get("detail")
    print(f"\n{what}: HTTP {status}: {str(text)[:160]!r}")
    return text


def still_serves(server, answers) -> None:
    status, body = complete(server, PROMPTS[0])
    assert status == 200, body
    assert body["choices"][0]["text"] == answers[PROMPTS[0]]


@pytest.mark.vllm
def test_prompt_longer_than_the_models_context_gets_4xx_naming_the_limit(server, answers):
    prompt = "the river runs " * 200
    assert len(tokenize(server["model"], [prompt])[0]) > CONTEXT
    status, body = complete(server, prompt, 4)
    assert 400 <= status < 500, body
    assert str(CONTEXT) in message(body, "prompt longer than the context", status), body
    still_serves(server, answers)


MALFORMED = {
    "truncated_json": b'{"model": "tiny", "prompt": ',
    "not_json": b"\xff\xfe\x00 not json at all",
    "json_array": b"[1, 2, 3]",
    "max_tokens_a_string": b'{"model": "tiny", "prompt": "Once", "max_tokens": "ten"}',
    "prompt_a_dict": b'{"model": "tiny", "prompt": {"a": 1}, "max_tokens": 4}',
}


@pytest.mark.vllm
@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_body_gets_4xx_with_a_message(server, answers, case):
    status, body = call(f"{server['url']}/v1/completions", raw=MALFORMED[case])
    assert 400 <= status < 500, body
    assert message(body, case, status), body
    still_serves(server, answers)


@pytest.mark.vllm
@pytest.mark.parametrize("max_tokens", [10**9, 2**64, -1, 0])
def test_max_tokens_out_of_range_gets_4xx_with_a_message(server, answers, max_tokens):
    status, body = complete(server, PROMPTS[0], max_tokens)
    assert 400 <= status < 500, body
    assert message(body, f"max_tokens {max_tokens}", status), body
    still_serves(server, answers)


def metric(url: str, name: str) -> float:
    """One of vLLM's Prometheus figures from /metrics, summed over its labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


ABORTED = re.compile(r"Request \S+ aborted\.")  # vLLM's AsyncLLM, with --enable-log-requests


def _first_token_with_the_engine_held(engine: HeldEngine, sock: socket.socket) -> bytes:
    """What the server sent up to its first streamed token, the engine running only in short slices meanwhile
    and held once it is there."""
    seen = b""
    with engine.running_in_slices():
        sock.settimeout(120)
        while b"data: {" not in seen:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the stream: {seen[:200]!r}"
            seen += chunk
    sock.settimeout(60)
    return seen


def _finished(sock: socket.socket, seen: bytes) -> bool:
    """Whether the stream already holds its end ([DONE]), reading what the server sent within a second."""
    sock.settimeout(1)
    try:
        while b"data: [DONE]" not in seen:
            chunk = sock.recv(65536)
            if not chunk:
                break
            seen += chunk
    except TimeoutError:
        pass
    finally:
        sock.settimeout(60)
    return b"data: [DONE]" in seen


@pytest.mark.vllm
@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_that_vanishes_mid_stream_is_dropped_and_the_server_keeps_serving(server, answers, how):
    """The engine runs in short slices until the first token reaches the client, then is held (SIGSTOP)
    until the server has aborted the request: a free-running engine could finish before either."""
    asked = CONTEXT - 16
    body = json.dumps(
        {
            "model": server["name"],
            "prompt": PROMPTS[1],
            "max_tokens": asked,
            "n": SEQUENCES,  # work for seconds: a loaded machine can wake the test that long after a slice
            "temperature": 1.0,
            "seed": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    port = int(server["url"].rsplit(":", 1)[1])
    engine = HeldEngine(server["proc"])
    try:
        for _ in range(3):
            generated = metric(server["url"], "generation_tokens_total")
            aborted = len(ABORTED.findall(server["log"].read_text()))
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            engine.suspend()  # the engine runs only in short slices until the first token reaches us
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            seen = _first_token_with_the_engine_held(engine, sock)
            assert seen.startswith(b"HTTP/1.1 200")
            if not _finished(sock, seen):
                break
            # the engine finished every token in one slice: that request cannot vanish mid-stream
            engine.resume()
            sock.close()
        else:
            pytest.fail("the engine finished every request before it could be held, 3 times")
        if how == "reset":  # no goodbye: the kernel answers the server with RST
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        deadline = time.monotonic() + 30
        while len(ABORTED.findall(server["log"].read_text())) == aborted and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ABORTED.findall(server["log"].read_text())) > aborted, "the server never aborted the request"
    finally:
        engine.resume()
    deadline = time.monotonic() + 30
    while metric(server["url"], "num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server["url"], "num_requests_running") == 0
    spent = metric(server["url"], "generation_tokens_total") - generated
    print(f"\nclient gone ({how}) after the first token: {spent:.0f} of {asked * SEQUENCES} tokens generated")
    assert spent < asked * SEQUENCES  # aborted, not computed to the end for nobody
    still_serves(server, answers)


def stream(server, prompt: str) -> tuple[str, bool]:
    """(the streamed text, whether [DONE] came) of one streaming completion."""
    with any_stream(f"{server['url']}/v1/completions", greedy(server["name"], prompt, 16), timeout=300) as r:
        text = r.text()
    return text, r.done


@pytest.mark.vllm
def test_64_concurrent_streams_all_complete_with_their_answers(server, answers):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        got = list(pool.map(lambda p: stream(server, p), prompts))
    assert all(done for _, done in got)
    assert all(text for text, _ in got)
    assert [text for text, _ in got] == [answers[p] for p in prompts]


@pytest.mark.vllm
def test_engine_killed_makes_the_server_exit_non_zero_promptly_leaving_no_process(doomed):
    proc, url, log = doomed
    wait_ready(url, proc, log, START_TIMEOUT)
    family = psutil.Process(proc.pid).children(recursive=True)
    engine_core(proc.pid).send_signal(signal.SIGKILL)
    start = time.monotonic()
    try:
        rc = proc.wait(KILL_DEADLINE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {KILL_DEADLINE}s after its engine died:\n{log.read_text()[-3000:]}")
    took = time.monotonic() - start
    print(f"engine killed: the server exited {rc} after {took:.1f}s")
    assert rc != 0, log.read_text()[-3000:]
    assert "the server stopped unasked" in log.read_text()  # vLLM 0.32 itself ends with status 0
    deadline, left = time.monotonic() + 10, family
    while left and time.monotonic() < deadline:
        left = [p for p in family if alive(p)]
        time.sleep(0.2)
    assert not left, [p.pid for p in left]


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- refused before vLLM starts


def broken_copy(model: Path, tmp_path: Path, fault: str) -> Path:
    """A copy of the converted folder with one fault."""
    out = tmp_path / "model"
    shutil.copytree(model, out)
    config = out / "config.json"
    if fault == "config_not_json":
        config.write_text(config.read_text()[:-20])
    elif fault == "config_wrong_type":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "128"}))
    elif fault == "config_a_list":
        config.write_text("[1, 2]")
    elif fault == "no_tokenizer":
        (out / "tokenizer.json").unlink()
    elif fault == "tokenizer_not_json":
        (out / "tokenizer.json").write_text("{")
    return out


FAULTS = {  # fault: what the one-line error must hold
    "tp_beyond_the_cores": f"--tp {len(os.sched_getaffinity(0)) + 1} needs one core per rank",
    "config_not_json": "config.json cannot be read",
    "config_wrong_type": "hidden_size='128': must be a number, not str",
    "no_tokenizer": "tokenizer.json: no such file",
    # a KV cache no machine has: the engine could not start (run/folder.check_memory)
    "kv_beyond_the_memory": "the engine could not start",
}
COMMANDS = ["serve", "generate", "verify"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", COMMANDS)
def test_command_refuses_in_one_line_before_vllm_starts(cli, tiny_hf, tree, tmp_path, command, fault):
    if fault.startswith("tp_"):
        if command == "verify":
            pytest.skip("verify has no --tp: it runs one rank")
        model, extra = tiny_hf, ["--tp", len(os.sched_getaffinity(0)) + 1]
    elif fault == "kv_beyond_the_memory":
        model, extra = tiny_hf, []
    else:
        model, extra = broken_copy(tiny_hf, tmp_path, fault), []
    extra += {
        "serve": [],
        "generate": ["--engine", "vllm", "--max-tokens", 4],
        "verify": ["--out", tmp_path / "verify"],
    }[command]
    before = tree(model)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(2**20)} if fault == "kv_beyond_the_memory" else None
    r = cli(command, model, *extra, env=env, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and FAULTS[fault] in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "vllm" not in r.stdout.lower()  # vLLM never started
    assert tree(model) == before


@pytest.mark.parametrize("fault", ["config_a_list", "tokenizer_not_json"])
def test_folder_check_names_a_config_that_is_no_object_and_a_tokenizer_that_does_not_parse(tiny_hf, tmp_path, fault):
    model = broken_copy(tiny_hf, tmp_path, fault)
    want = {"config_a_list": "holds a JSON list, not an object", "tokenizer_not_json": "tokenizer.json cannot be read"}
    with pytest.raises(MiniStreamError, match=want[fault]):
        check_servable(model)


def test_converted_folder_passes_the_folder_check(tiny_hf):
    assert check_servable(tiny_hf)["max_position_embeddings"] == CONTEXT
