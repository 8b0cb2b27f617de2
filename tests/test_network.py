"""Every network read within a deadline a server cannot stretch, and every malformed answer in one line (net.py).

Real HTTP servers on 127.0.0.1, run by this process: one that dribbles its answer a byte every 2 s (urllib's
timeout is per socket read, so before net.py a 5 s timeout never fired), ones that answer a package index's
page malformed in each way a page can be, and ones that send slowly but steadily (a download, a stream), which
must not be cut. The commands run as a user runs them (the `cli` fixture).
"""

import http.server
import json
import re
import socket
import threading
import time
import urllib.error

import pytest

from ministream.net import BadAnswer, Deadline, open_url
from ministream.run.server import Stream, call, event

from conftest import JSON_TYPE, file_entry

DRIBBLE = 2  # s between two bytes of the dribbling server's answer
SLACK = 40  # s a command may take beyond its deadline (the CLI's start on a loaded 2-core box): a hang takes minutes


class Serving:
    """A real HTTP server on a loopback port, `answer(handler)` writing each answer; `url`, and `stop` for the
    answers that loop."""

    def __init__(self, answer):
        self.stop = threading.Event()
        serving = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))  # unread, closing would reset
                try:
                    answer(self, serving.stop)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what the tests want
                    pass

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def raw_answer(body: bytes, kind: str = "application/json") -> bytes:
    return b"HTTP/1.0 200 OK\r\nContent-Type: " + kind.encode() + b"\r\n\r\n" + body


def dribble(handler, stop: threading.Event) -> None:
    """A whole, valid answer, status line and all, one byte every DRIBBLE s: minutes to the end."""
    page = {"meta": {"api-version": "1.0"}, "data": [{"id": "m"}], "files": []}
    for byte in raw_answer(json.dumps(page).encode(), JSON_TYPE):
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        if stop.wait(DRIBBLE):
            return


@pytest.fixture
def dribbler():
    server = Serving(dribble)
    yield server.url
    server.close()


def one_line(r, status: int, prefix: str = "error: ") -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == status and len(lines) == 1 and lines[0].startswith(prefix), r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


# --- a dribbling server: each command ends at its deadline, naming the URL -----------------------------------


def test_ready_against_a_dribbling_server_is_not_ready_at_its_timeout(cli, dribbler):
    start = time.monotonic()
    r = cli("ready", "--url", dribbler, "--timeout", 5, timeout=5 + SLACK)  # before: ran on for minutes
    line = one_line(r, 1, "not ready: ")
    assert f"{dribbler}/v1/models" in line and "within 5 s" in line, line
    assert time.monotonic() - start < 5 + SLACK


@pytest.mark.parametrize("command", [["releases"], ["port", "--missing"]], ids=["releases", "port-missing"])
def test_a_dribbling_package_index_ends_at_the_timeout_naming_the_page(cli, dribbler, command):
    r = cli(*command, "--index-url", f"{dribbler}/simple", "--timeout", 3, timeout=3 + SLACK)
    line = one_line(r, 2)
    assert f"{dribbler}/simple/vllm/" in line and "within 3 s" in line, line


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(cli, value):
    r = cli("ready", "--url", "http://127.0.0.1:9", "--timeout", value, timeout=120)
    assert r.returncode == 2 and f"--timeout: {value!r} is not a positive number of seconds" in r.stderr, r.stderr


# --- a package index's page, malformed: one line naming the page, never a traceback ------------------------

GOOD_PAGE = json.dumps(
    {"meta": {"api-version": "1.0"}, "name": "vllm", "files": [file_entry("vllm-0.32.0.tar.gz", "/f", "0" * 64)]}
).encode()
MALFORMED = {  # case: the page's body, served as PEP 691's JSON
    "not_json": b"<html><body>an error page</body></html>",
    "a_list_at_the_top": b'[{"filename": "vllm-0.32.0.tar.gz"}]',
    "no_files": b'{"meta": {"api-version": "1.0"}, "name": "vllm"}',
    "a_filename_that_is_a_number": b'{"files": [{"filename": 32, "url": "/f", "hashes": {}}]}',
    "truncated": GOOD_PAGE[: len(GOOD_PAGE) // 2],
}


@pytest.fixture(params=list(MALFORMED))
def malformed_index(request):
    body = MALFORMED[request.param]
    server = Serving(lambda handler, stop: handler.wfile.write(raw_answer(body, JSON_TYPE)))
    yield f"{server.url}/simple"
    server.close()


@pytest.mark.parametrize("command", [["releases"], ["port", "--missing"]], ids=["releases", "port-missing"])
def test_a_malformed_index_page_is_one_line_naming_it(cli, malformed_index, command):
    r = cli(*command, "--index-url", malformed_index, timeout=120)
    line = one_line(r, 2)
    assert f"{malformed_index}/vllm/" in line and "--index-url" in line, line


def test_an_answer_that_is_not_http_is_one_line_naming_the_url(cli):
    server = Serving(lambda handler, stop: handler.wfile.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"))
    try:
        line = one_line(cli("releases", "--index-url", server.url, timeout=120), 2)
    finally:
        server.close()
    assert f"{server.url}/vllm/" in line and "not an HTTP answer" in line, line


# --- slow but steady: a download and a stream are bounded by their progress, not cut ------------------------


def steady(handler, stop: threading.Event) -> None:
    """Twelve SSE events, one every 0.25 s (3 s in all), then the end."""
    handler.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    for i in range(12):
        handler.wfile.write(event({"choices": [{"text": f"{i} "}]}))
        handler.wfile.flush()
        if stop.wait(0.25):
            return
    handler.wfile.write(b"data: [DONE]\n\n")


def stall(handler, stop: threading.Event) -> None:
    """The headers and a first event, then nothing (the connection held open)."""
    handler.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
    handler.wfile.write(event({"choices": [{"text": "first "}]}))
    handler.wfile.flush()
    stop.wait(60)


def test_a_download_that_keeps_coming_outlasts_its_quiet_bound():
    server = Serving(steady)
    try:
        with open_url(server.url, deadline=60, quiet=1.5) as r:  # 3 s of answer: twice the quiet bound
            body = r.read()
    finally:
        server.close()
    assert body.count(b"data: ") == 13 and body.endswith(b"data: [DONE]\n\n")


def test_a_stalled_download_ends_at_its_quiet_bound_naming_the_url():
    server = Serving(stall)
    try:
        start = time.monotonic()
        said = rf"^{re.escape(server.url)}: nothing came for 1\.5 s \(\d+ bytes of its body came\)"
        with pytest.raises(Deadline, match=said):
            with open_url(server.url, deadline=60, quiet=1.5) as r:
                r.read()
        assert time.monotonic() - start < 30  # the 60 s deadline did not end it
    finally:
        server.close()


def test_a_stream_longer_than_its_timeout_streams_on():
    server = Serving(steady)
    try:
        with Stream(server.url, {"prompt": "x"}, timeout=1.5) as s:  # 3 s of events: twice the timeout
            text = s.text()
            done = s.done
    finally:
        server.close()
    assert text == "".join(f"{i} " for i in range(12)) and done


def test_a_stream_that_stops_ends_at_its_timeout():
    server = Serving(stall)
    try:
        with pytest.raises(Deadline, match=rf"^{re.escape(server.url)}: nothing came for 1 s"):
            with Stream(server.url, {"prompt": "x"}, timeout=1) as s:
                s.text()
    finally:
        server.close()


def test_an_error_status_keeps_its_json_body():
    def not_found(handler, stop):
        body = b'{"error": "no such model"}'
        handler.wfile.write(b"HTTP/1.0 404 Not Found\r\nContent-Type: application/json\r\n\r\n" + body)

    server = Serving(not_found)
    try:
        assert call(f"{server.url}/v1/models", timeout=10) == (404, {"error": "no such model"})
        with pytest.raises(urllib.error.HTTPError):
            open_url(server.url, deadline=10)
    finally:
        server.close()


def test_an_answer_shorter_than_its_length_is_refused_not_taken_whole():
    def short(handler, stop):
        handler.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 60)

    server = Serving(short)
    try:
        with pytest.raises(BadAnswer, match=r"broke off after 60 bytes, 40 short of its length"):
            with open_url(server.url, deadline=10) as r:
                r.read()
    finally:
        server.close()


def test_a_port_nothing_listens_on_is_refused_not_waited_for():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(urllib.error.URLError) as e:
        open_url(url, deadline=30)
    assert isinstance(e.value.reason, ConnectionRefusedError)
