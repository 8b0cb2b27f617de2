"""refserver: the "before" system of bench-serve, served the way the team served it: the reference model
(reference.py) behind a minimal OpenAI-compatible HTTP server that generates for ONE request at a time.

Requests are accepted concurrently (so they can queue, as at a real endpoint) and wait for a first-come,
first-served lock around generation; nothing is batched. It answers what vLLM's benchmark client and a
curl user ask of vLLM's server: GET /health, GET /v1/models, POST /v1/completions (stream or not, SSE chunks
one per generated token, usage with stream_options.include_usage, max_tokens, temperature (0: greedy),
top_p, top_k, seed, ignore_eos, return_token_ids). Prompts are tokenized as vLLM's completions endpoint does
(the folder's tokenizer, special tokens added). Run: python -m ministream.bench.refserver FOLDER --port 8001
"""

import argparse
import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ..run.server import DONE, event, local_url

# fields of a completion request this server cannot honour, and the value that asks nothing of it: a request
# with another value gets 400, so no client is silently given something else than it asked for
NEUTRAL = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": None,
    "stop": None,
    "suffix": None,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}


class FifoLock:
    """A lock granted in arrival order (threading.Lock makes no promise of order): requests are served
    as a single-request script's accept loop serves them, the earliest first."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._serving = 0  # the next ticket to give, the ticket whose turn it is

    @property
    def queued(self) -> int:
        """Requests holding a ticket: the one generating and those waiting."""
        return self._next - self._serving

    def __enter__(self):
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc):
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class RefServer(ThreadingHTTPServer):
    """The model, its tokenizer and the lock; every handler thread shares them."""

    daemon_threads = True

    def __init__(self, address, folder: Path, name: str, dtype: str, quiet: bool = False):
        from transformers import AutoTokenizer

        from ..run.generate import load_reference

        self.folder, self.name, self.dtype, self.quiet = Path(folder).resolve(), name, dtype, quiet
        self.model = load_reference(self.folder, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        config = json.loads((self.folder / "config.json").read_text())
        self.eos = config.get("eos_token_id", self.tokenizer.eos_token_id)
        self.max_len = self.model.cfg.max_seq_len
        self.lock = FifoLock()
        self.ids = itertools.count()
        self.record: list[dict] = []  # per completion: id and monotonic received/started/finished times (tests read it)
        super().__init__(address, Handler)

    def log(self, text: str) -> None:
        if not self.quiet:
            print(f"refserver: {text}", file=sys.stderr, flush=True)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked streams (a client reuses its connections)
    server: RefServer

    def do_GET(self):
        if self.path == "/health":
            self._json(200, None)
        elif self.path == "/v1/models":
            s = self.server
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": s.name,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "ministream",
                            "root": str(s.folder),
                            "max_model_len": s.max_len,
                        }
                    ],
                },
            )
        else:
            self._error(
                BadRequest(f"no route {self.path}: this server answers /health, /v1/models and /v1/completions", 404)
            )

    def do_POST(self):
        if self.path != "/v1/completions":
            return self._error(BadRequest(f"no route {self.path}: this server answers /v1/completions only", 404))
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            request = self._parse(body)
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            return self._error(BadRequest(f"malformed request: {e}"))
        except BadRequest as e:
            return self._error(e)
        try:
            self._complete(**request)
        except (BrokenPipeError, ConnectionResetError):
            self.server.log(f"{request['rid']}: the client went away")
            self.close_connection = True

    def _parse(self, body) -> dict:
        s = self.server
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if body.get("model") not in (None, s.name):
            raise BadRequest(f"The model `{body['model']}` does not exist; this server has {s.name!r}", 404)
        for key, neutral in NEUTRAL.items():
            value = body.get(key)
            if value is not None and value != neutral and value != [] and not (key == "logprobs" and value == 0):
                raise BadRequest(f"{key}={value!r} is not supported by the reference server")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = s.tokenizer(prompt).input_ids  # special tokens (<|bos|>) added, as vLLM's endpoint does
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("prompt must be one string or one list of token ids")
        if not ids:
            raise BadRequest("the prompt is empty")
        max_tokens = body.get("max_tokens")
        max_tokens = s.max_len - len(ids) if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if len(ids) + max_tokens > s.max_len:
            raise BadRequest(
                f"This model's maximum context length is {s.max_len} tokens; the prompt has "
                f"{len(ids)} and max_tokens asks {max_tokens} more"
            )
        temperature = body.get("temperature")
        options = body.get("stream_options") or {}
        return {
            "rid": f"cmpl-{next(s.ids)}",
            "ids": ids,
            "max_tokens": max_tokens,
            "temperature": 1.0 if temperature is None else float(temperature),
            "top_p": float(body.get("top_p") or 1.0),
            "top_k": max(0, int(body.get("top_k") or 0)),
            "seed": body.get("seed"),
            "stop_ids": () if body.get("ignore_eos") else (s.eos,),
            "stream": bool(body.get("stream")),
            "usage_chunk": bool(options.get("include_usage")),
            "token_ids": bool(body.get("return_token_ids")),
        }

    def _complete(
        self, rid, ids, max_tokens, temperature, top_p, top_k, seed, stop_ids, stream, usage_chunk, token_ids
    ):
        s, tok = self.server, self.server.tokenizer
        created, received = int(time.time()), time.monotonic()
        head = {"id": rid, "object": "text_completion", "created": created, "model": s.name}
        out: list[int] = []
        text = ""
        first: float | None = None

        def delta(token: int) -> str:
            """The text the new token adds; a token that ends inside a character adds it later."""
            nonlocal text
            out.append(token)
            whole = tok.decode(out, skip_special_tokens=True)
            assert isinstance(whole, str)  # one sequence of ids decodes to one text
            if whole.endswith("\ufffd"):
                return ""
            added, text = whole[len(text) :], whole
            return added

        def on_token(_b: int, token: int):
            nonlocal first
            first = first or time.monotonic()
            piece = delta(token)
            finish = "stop" if token in stop_ids else "length" if len(out) == max_tokens else None
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
            if token_ids:
                choice["token_ids"] = [token]
            self._chunk(event({**head, "choices": [choice]}))

        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        with s.lock:  # one request at a time: the team's script, behind an HTTP front
            started = time.monotonic()
            result = s.model.generate(
                [ids], max_tokens, temperature, top_k, top_p, seed, stop_ids, on_token=on_token if stream else None
            )[0]
            finished = time.monotonic()
            s.record.append({"id": rid, "received": received, "started": started, "finished": finished})
        new = result["ids"]
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}
        if stream:
            if usage_chunk:
                self._chunk(event({**head, "choices": [], "usage": usage}))
            self._chunk(DONE)
            self._chunk(b"")  # the chunked body's end
        else:
            finish = "stop" if new and new[-1] in stop_ids else "length"
            choice = {
                "index": 0,
                "text": tok.decode(new, skip_special_tokens=True),
                "logprobs": None,
                "finish_reason": finish,
            }
            if token_ids:
                choice.update(token_ids=new, prompt_token_ids=ids)
            self._json(200, {**head, "choices": [choice], "usage": usage})
        s.log(
            f"{rid}: {len(ids)} prompt + {len(new)} new tokens; waited {started - received:.2f}s, "
            f"first token {(first or finished) - received:.2f}s, generated in {finished - started:.2f}s"
        )

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, body) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: BadRequest) -> None:
        kind = "NotFoundError" if e.status == 404 else "BadRequestError"
        self._json(e.status, {"error": {"message": str(e), "type": kind, "param": None, "code": e.status}})

    def log_message(self, *args):  # one line per completion (RefServer.log) instead of one per HTTP exchange
        pass


def start(
    folder: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str | None = None,
    dtype: str = "bfloat16",
    quiet: bool = False,
) -> RefServer:
    """The server, loaded and listening (port 0: any free one, server.server_address says which); not yet
    serving: call serve_forever (in a thread, for a test)."""
    return RefServer((host, port), folder, name or Path(folder).resolve().name, dtype, quiet)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ministream.bench.refserver",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", type=Path, help="converted HF-style folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--name", help="served model name (default: the folder's name)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    server = start(a.model, a.host, a.port, a.name, a.dtype)
    url = local_url(a.host, server.server_address[1])
    print(f"refserver: ready at {url}/v1 (model {server.name!r}, {a.dtype}, one request at a time)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
