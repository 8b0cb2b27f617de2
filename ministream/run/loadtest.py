"""serve-bench: load on a running OpenAI-compatible server (`ministream serve`): N streaming completions at
once, their time to first token and the output tokens per second."""

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def first_served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def stream_one(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> tuple[float | None, int, float]:
    """One streaming completion: (time to first token, output tokens, total time)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
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


def load_test(url: str, model: str, concurrency: int = 32, max_tokens: int = 128,
              prompt: str = "The river runs through", timeout: float = 600) -> dict:
    """`concurrency` streaming completions at once (distinct prompts): time to first token and output tokens/s."""
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: stream_one(url, model, f"{prompt} {i}", max_tokens, timeout),
                                range(concurrency)))
    wall = time.monotonic() - start
    ttft = sorted(r[0] for r in results)
    return {"requests": concurrency, "max_tokens": max_tokens, "wall_s": wall,
            "ttft_median_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
            "output_tokens": sum(r[1] for r in results),
            "output_tokens_per_s": sum(r[1] for r in results) / wall}


def serve_bench(url: str, model: str | None, concurrency: int, max_tokens: int) -> int:
    """`ministream serve-bench`: the figures as JSON on stdout; the model defaults to the first the server lists."""
    result = load_test(url, model or first_served_model(url), concurrency, max_tokens)
    print(json.dumps(result, indent=1))
    return 0
