"""The fingerprint: what a folder's model computes for one fixed prompt, recorded when the folder is written, and
serve's "ready" (and `ministream ready`) only once a running server computes it.

Engines: `ministream serve` of the test folder in float32 (the session's tiny server, test_serve_faults.py's too)
and in bfloat16 (make test-full), both of which must say ready, and in bfloat16 a folder whose config.json changed
after its fingerprint was recorded, which must stop with one line; started together (one engine start's wait).
The check itself is run against the float32 server with fingerprints planted from other models (a fingerprint of
another model is what an engine computing another model gives), and against real HTTP servers on 127.0.0.1 that
answer /v1/models and then fail.
"""

import http.server
import json
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ministream import MiniStreamError
from ministream.checkpoint import fingerprint
from ministream.checkpoint.quantize import quantize
from ministream.run.fingerprint import check_server, unchecked
from ministream.run.generate import reference_generate, tokenize
from ministream.run.server import free_port, stop_all

from conftest import one_line_error

START_TIMEOUT = 900  # s for three engines starting at once on 2 loaded cores to answer, or a refusal to end serve


def planted(tiny_hf: Path, out: Path, change) -> Path:
    """A copy of the test folder, changed by `change(folder)` after its fingerprint was recorded (the file kept)."""
    shutil.copytree(tiny_hf, out)
    change(out)
    return out


def set_config(**values):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(values)
        if "rope_theta" in values:  # the RoPE base, where vLLM reads it too
            config["rope_parameters"]["rope_theta"] = values["rope_theta"]
        (folder / "config.json").write_text(json.dumps(config, indent=2))

    return change


def random_weights(folder: Path) -> None:
    """Every matrix replaced by random values of its own shape and spread (what --load-format dummy loads)."""
    state = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * v.std() if v.dim() == 2 else v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


WRONG = {  # the wrong models of issue 52, each as a folder that computes it
    "random weights": random_weights,
    "an hf override of rms_norm_eps": set_config(rms_norm_eps=0.5),
    "a wrong RoPE base": set_config(rope_theta=100.0),
}


# ---------------------------------------------------------------- without an engine


def test_convert_records_the_reference_models_greedy_tokens_for_the_fixed_prompt(tiny_hf):
    fp = json.loads((tiny_hf / fingerprint.FILE).read_text())
    ids = tokenize(tiny_hf, [fingerprint.PROMPT])
    want = reference_generate(tiny_hf, ids, fingerprint.NEW_TOKENS, "float32", logprobs=fingerprint.TOP_K)[0]
    assert fp["prompt_ids"] == ids[0] and fp["ids"] == want["ids"]
    assert [{int(t): lp for t, lp in step.items()} for step in fp["logprobs"]] == want["logprobs"]
    assert fp["computed_in"] == "float32" and fp["weights"] == fingerprint.weights_digest(tiny_hf)


def test_quantize_records_the_fingerprint_of_the_weights_vllm_multiplies_by(tiny_hf, tmp_path):
    out = quantize(tiny_hf, tmp_path / "w8a8", "w8a8", log=lambda *a: None)
    fp = fingerprint.read(out)
    want = reference_generate(out, [fp["prompt_ids"]], fingerprint.NEW_TOKENS, "float32")[0]  # dequantized
    assert fp["quantized"] == "w8a8" and fp["ids"] == want["ids"]
    assert fp["weights"] == fingerprint.weights_digest(out) != fingerprint.read(tiny_hf)["weights"]


def test_the_fingerprint_command_records_a_folder_written_before_fingerprints(cli, tiny_hf, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_hf, old)
    (old / fingerprint.FILE).unlink()
    r = cli("fingerprint", old)
    assert r.returncode == 0, r.stderr
    got, want = (json.loads((f / fingerprint.FILE).read_text()) for f in (old, tiny_hf))
    # nothing in it depends on when or how fast it was made; float32 logprobs of two processes agree to ~1e-6
    # (their threads sum in another order), so they are held to a bound and everything else to equality
    logprobs = got.pop("logprobs"), want.pop("logprobs")
    assert got == want and logprobs[0]  # steps to compare below
    for a, b in zip(*logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a), (a, b)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "old"]  # no temporary left beside it


def test_a_fingerprint_with_no_new_token_is_refused_as_damaged(tiny_hf, tmp_path):
    """serve's check holds the server to the fingerprint's new tokens: with none it would compare nothing."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_hf, folder)
    fp = json.loads((folder / fingerprint.FILE).read_text())
    (folder / fingerprint.FILE).write_text(json.dumps({**fp, "ids": [], "logprobs": []}))
    with pytest.raises(MiniStreamError, match=r"is damaged \(its ids or logprobs\): record it again"):
        fingerprint.read(folder)


def test_the_fingerprint_command_refuses_a_folder_the_folder_check_refuses(cli, tiny_hf, tmp_path):
    broken = planted(tiny_hf, tmp_path / "broken", set_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    (broken / fingerprint.FILE).unlink()
    assert "rope_scaling" in one_line_error(cli("fingerprint", broken))
    assert not (broken / fingerprint.FILE).exists()


def test_serve_refuses_another_folders_fingerprint_before_vllm_starts(cli, tiny_hf, tmp_path):
    other = planted(tiny_hf, tmp_path / "other", lambda f: None)
    fp = json.loads((other / fingerprint.FILE).read_text())
    fp["weights"]["model.safetensors"]["size"] += 2  # recorded for other weights
    (other / fingerprint.FILE).write_text(json.dumps(fp))
    r = cli("serve", other, "--port", free_port(), timeout=120)  # a hang bound: an engine start takes minutes here
    line = one_line_error(r)
    assert "was recorded for other weights" in line and f"ministream fingerprint {other}" in line, line
    assert "ministream serve: " not in r.stdout, r.stdout  # serve never showed the vLLM command: it never ran it


def test_a_context_too_short_for_the_fingerprint_or_no_fingerprint_is_served_with_a_warning(tiny_hf, tmp_path):
    fp = fingerprint.read(tiny_hf)
    need = len(fp["prompt_ids"]) + len(fp["ids"])
    assert unchecked(tiny_hf, fp, None) is None and unchecked(tiny_hf, fp, need) is None
    assert f"shorter than the fingerprint's {need} tokens" in unchecked(tiny_hf, fp, need - 1)
    assert f"ministream fingerprint {tmp_path}" in unchecked(tmp_path, None, None)


@contextmanager
def http_server(routes: dict[str, tuple[int, bytes]]):
    """A real HTTP server on 127.0.0.1 answering each path with (status, body); its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            status, body = routes.get(self.path, (404, b"{}"))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.answer()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("answer", [b"[]", b'{"data": null}', b'{"data": 5}', b'{"data": [5]}', b"not json"], ids=str)
def test_ready_names_a_malformed_models_answer_in_one_line(cli, answer):
    with http_server({"/v1/models": (200, answer)}) as url:
        r = cli("ready", "--url", url)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"not ready: {url}/v1/models answered "), lines


def test_a_kernel_that_fails_on_the_first_request_is_not_ready(cli, tiny_hf):
    card = {"id": "tiny", "object": "model", "root": str(tiny_hf.resolve())}
    failing = (500, b'{"error": {"message": "avx512fp16 is required", "code": 500}}')
    with http_server({"/v1/models": (200, json.dumps({"data": [card]}).encode()), "/v1/completions": failing}) as url:
        why = check_server(url, "tiny", tiny_hf, fingerprint.read(tiny_hf), "bfloat16")
        r = cli("ready", "--url", url)
    assert why is not None and "answered HTTP 500" in why and "avx512fp16" in why, why
    assert r.returncode == 1 and r.stderr.startswith("not ready: ") and "HTTP 500" in r.stderr, r.stderr


# ---------------------------------------------------------------- real engines


@pytest.fixture(scope="module")
def servers(tiny_hf, tiny_server, start_serve, tmp_path_factory):
    """Servers by name: float32 (the session's tiny server, conftest.py; test_serve_faults.py's too) and bfloat16
    of the test folder, and a bfloat16 one of a folder whose RoPE base changed after its fingerprint was
    recorded. float32 and rope start together at once; bfloat16 (make test-full) when a test first asks for it."""
    root = tmp_path_factory.mktemp("fingerprint")
    rope = planted(tiny_hf, root / "rope", WRONG["a wrong RoPE base"])
    kinds = {"bfloat16": (tiny_hf, "bfloat16"), "rope": (rope, "bfloat16")}

    class Started(dict):
        def __missing__(self, name: str) -> dict:
            folder, dtype = kinds[name]
            log = root / f"{name}.log"
            # eager: the ready check is the subject; test_vllm.py proves the compiled default's tokens
            proc, url = start_serve(folder, log, "--dtype", dtype, "--max-model-len", 256, "--enforce-eager")
            self[name] = {"proc": proc, "url": url, "log": log, "name": folder.name, "folder": folder}
            return self[name]

    started = Started(float32=tiny_server)
    try:
        started["rope"]
        yield started
    finally:
        stop_all(s["proc"] for name, s in started.items() if name != "float32")  # the session's: it stops it


def said(server, text: str) -> bool:
    """Whether serve's log says `text` before it exits (or START_TIMEOUT runs out)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if text in server["log"].read_text():
            return True
        if server["proc"].poll() is not None:
            return text in server["log"].read_text()
        time.sleep(1)
    return False


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.full)])
def test_serve_says_ready_once_the_engine_computes_the_folders_fingerprint(servers, dtype):
    server = servers[dtype]
    assert said(server, f"ministream serve: ready at {server['url']}/v1"), server["log"].read_text()[-3000:]
    assert "not ready" not in server["log"].read_text()


@pytest.mark.vllm
def test_serve_of_a_folder_whose_rope_changed_after_its_fingerprint_stops_with_one_line(servers):
    server = servers["rope"]
    assert server["proc"].wait(START_TIMEOUT) == 2
    log = server["log"].read_text()
    lines = [line for line in log.splitlines() if line.startswith("ministream serve: not ready: ")]
    assert len(lines) == 1 and "is not" in lines[0] and "new token" in lines[0], log[-3000:]
    assert f"ministream fingerprint {server['folder']}" in lines[0] and "ready at" not in log


@pytest.fixture(scope="module")
def wrong(tiny_hf, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each wrong model's folder and its own fingerprint (what an engine computing that model answers)."""
    root = tmp_path_factory.mktemp("wrong")
    folders = {kind: planted(tiny_hf, root / kind.replace(" ", "-"), change) for kind, change in WRONG.items()}
    return {kind: (f, fingerprint.compute(f)) for kind, f in folders.items()}


@pytest.mark.vllm
@pytest.mark.parametrize("kind", WRONG)
def test_a_server_computing_another_model_than_the_fingerprints_is_not_the_folders(servers, wrong, kind):
    server = servers["float32"]
    assert said(server, "ready at")
    folder, fp = wrong[kind]
    why = check_server(server["url"], server["name"], folder, fp, "float32")
    assert why is not None and f"is not {folder}'s" in why and "new token" in why, why


@pytest.mark.vllm
def test_ready_holds_the_server_to_the_folders_fingerprint(servers, wrong, cli):
    server = servers["float32"]
    assert said(server, "ready at")
    r = cli("ready", "--url", server["url"], "--dtype", "float32")
    assert r.returncode == 0 and f"computes {server['folder'].resolve()}'s model" in r.stdout, r.stderr
    folder, fp = wrong["a wrong RoPE base"]
    (folder / fingerprint.FILE).write_text(json.dumps(fp))  # the folder's own, recorded after the change
    r = cli("ready", "--url", server["url"], "--folder", folder, "--dtype", "float32")
    assert r.returncode == 1 and r.stderr.startswith("not ready: ") and f"is not {folder}'s" in r.stderr, r.stderr
