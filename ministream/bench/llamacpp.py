"""llama.cpp, the peer a CPU user picks first: built from the registry's llama-cpp-python sdist (which carries
llama.cpp's whole source) into build/llamacpp/<version>/, then run as its own `llama-server` (parallel
slots, continuous batching) and `llama-bench`, on GGUF files from `ministream gguf`.

The build is recorded beside the binaries (build.json: the version, llama.cpp's commit, the CMake flags,
the compiler, the seconds it took, the CPU it was built for) and reused while that record matches. Where its
AMX kernels die (llama.cpp #20824), a second build without them (build/llamacpp/<version>-no-amx/) runs instead.
"""

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import MiniStreamError
from ..atomic import lock, sweep, temp_folder, write_json
from ..fork.release import release_sdist
from ..net import open_url, parse_json, read_url
from ..paths import BUILD
from .machine import cpu_model

VERSION = "0.3.36"  # llama-cpp-python, pinned in releases.json; its vendor/llama.cpp is what is built
HOME = BUILD / "llamacpp"
TARGETS = ["llama-server", "llama-bench", "llama-tokenize", "llama-perplexity"]
# Release, tuned for this CPU (-march=native: what a user building llama.cpp here gets), static binaries,
# nothing that reaches the network
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_CCACHE=OFF",
]


# llama.cpp's AMX kernels die of SIGSEGV on some Xeons with AMX (llama.cpp #20824, open): at `ldtilecfg` in
# ggml_backend_amx_mul_mat on any batch of 2+ tokens, on one thread too, and with the kernel's AMX permission asked
# for before main (arch_prctl ARCH_REQ_XCOMP_PERM, preloaded): llama-server at every start, llama-bench and
# llama-perplexity at their first prompt (docs/bench.md). What runs there at its best is the same sources built
# without AMX (its AVX-512 repacking kept: faster than the AMX build's --no-repack), so
# where a tool dies of SIGSEGV that build is made (once, recorded) and every llama.cpp tool after it runs from
# it; results say so (bench: llamacpp_no_amx). Not the default: where AMX works it is llama.cpp's fastest.
NO_AMX_FLAGS = [f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX")]
NO_AMX = False  # set by the first SIGSEGV (_amx_died), for this process


def flags(amx: bool) -> list[str]:
    return CMAKE_FLAGS if amx else CMAKE_FLAGS + NO_AMX_FLAGS


def build_home(version: str = VERSION, amx: bool = True) -> Path:
    """Where the build of `version` lives, with its AMX kernels or without."""
    return HOME / (version if amx else f"{version}-no-amx")


def build(version: str = VERSION, log=print) -> Path:
    """The folder whose bin/ holds llama.cpp's server and tools for `version`, built once and recorded: without
    its AMX kernels once they have died here (NO_AMX)."""
    home = build_home(version, amx=not NO_AMX)
    record = home / "build.json"
    cmake_flags = flags(amx=not NO_AMX)
    with lock(home, f"building llama.cpp {version}"):
        if _current(record, cmake_flags):
            return home
        for tool in ("cmake", "c++"):
            if not shutil.which(tool):
                raise MiniStreamError(f"building llama.cpp needs {tool}: install it (Debian: apt install cmake g++)")
        sdist = release_sdist(version, dist="llama-cpp-python")
        sweep(home)
        tmp = temp_folder(home, "tmp")
        try:
            log(f"llama.cpp: building {sdist.name} (vendor/llama.cpp) with {' '.join(cmake_flags)}")
            started = time.monotonic()
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp / "sdist", filter="data")
            src = next((tmp / "sdist").glob("*/vendor/llama.cpp"))
            _run(["cmake", "-S", src, "-B", tmp / "cmake", *cmake_flags], "configure", tmp / "configure.log")
            _run(
                ["cmake", "--build", tmp / "cmake", "-j", str(os.cpu_count() or 1), "--target", *TARGETS],
                "build",
                tmp / "build.log",
            )
            (tmp / "bin").mkdir()
            for tool in TARGETS:
                shutil.copy2(tmp / "cmake" / "bin" / tool, tmp / "bin" / tool)
            commit = re.search(r"ggml commit:\s+(\S+)", (tmp / "configure.log").read_text())
            write_json(
                tmp / "build.json",
                {
                    "llama-cpp-python": version,
                    "sdist": sdist.name,
                    "llama.cpp commit": commit.group(1) if commit else None,
                    "cmake flags": cmake_flags,
                    "amx": not NO_AMX,
                    "compiler": subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.split("\n")[
                        0
                    ],
                    "seconds": round(time.monotonic() - started),
                    "cpu": cpu_model(),
                    "machine": platform.machine(),
                    "targets": TARGETS,
                },
            )
            shutil.rmtree(tmp / "sdist")
            shutil.rmtree(tmp / "cmake")
            if home.exists():
                shutil.rmtree(home)
            tmp.rename(home)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"llama.cpp: built in {json.loads(record.read_text())['seconds']} s -> {home}/bin")
        return home


def _current(record: Path, cmake_flags: list[str]) -> bool:
    """A finished build of these flags for this CPU (-march=native binaries are the CPU's)."""
    try:
        got = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    bins = record.parent / "bin"
    return (
        got.get("cmake flags") == cmake_flags
        and got.get("cpu") == cpu_model()
        and all((bins / t).is_file() for t in TARGETS)
    )


def _run(cmd: list, stage: str, log: Path) -> None:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise MiniStreamError(f"llama.cpp {stage} failed (exit {done.returncode}): {tail[-800:]}")


def info(version: str = VERSION) -> dict:
    """The build record of `version` that runs here (build() first)."""
    return json.loads((build(version) / "build.json").read_text())


def server_command(
    home: Path, gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int, extra: tuple = ()
) -> list[str]:
    """llama-server on 127.0.0.1:`port` with `parallel` slots of `ctx_per_slot` tokens each."""
    return [
        str(c)
        for c in [
            home / "bin" / "llama-server",
            *("-m", gguf, "--host", "127.0.0.1", "--port", port),
            *("-t", threads, "-tb", threads, "-np", parallel),
            *("-c", ctx_per_slot * parallel),  # the context is shared out among the slots
            "--no-webui",
            *extra,
        ]
    ]


@contextmanager
def server(
    gguf: Path,
    port: int,
    threads: int,
    parallel: int = 1,
    ctx_per_slot: int = 1024,
    log_file: Path | None = None,
    extra: tuple = (),
) -> Iterator[str]:
    """llama-server on 127.0.0.1:`port` serving `gguf` with `parallel` slots (continuous batching across
    them) of `ctx_per_slot` tokens each; yields its base URL once /health answers, stops it after. Where it
    dies of SIGSEGV before serving, it starts once more from the build without AMX (NO_AMX)."""
    cmd = server_command(build(), gguf, port, threads, parallel, ctx_per_slot, extra)
    out = open(log_file, "w") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                if proc.returncode == -signal.SIGSEGV and not NO_AMX:
                    _amx_died(gguf, "llama-server")
                    break
                said = Path(log_file).read_text()[-1500:] if log_file else ""
                raise MiniStreamError(f"llama-server exited ({proc.returncode}) before it served {gguf}: {said}")
            try:
                with open_url(f"{url}/health", deadline=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise MiniStreamError(f"llama-server did not answer on {url}/health within 120 s")
            time.sleep(0.3)
        if proc.returncode is None:
            yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_file:
            out.close()  # type: ignore[union-attr]
    if NO_AMX and proc.returncode == -signal.SIGSEGV:  # the first start died: the second, from the build NO_AMX says
        with server(gguf, port, threads, parallel, ctx_per_slot, log_file, extra) as again:
            yield again


def run_tool(tool: str, args: list, gguf: Path) -> subprocess.CompletedProcess:
    """A llama.cpp tool (bin/`tool`) run to its end on `args` (output captured); where it dies of SIGSEGV, once
    more from the build without AMX (NO_AMX), as llama-server is started again."""

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in [build() / "bin" / tool, *args]], capture_output=True, text=True)

    done = run()
    if done.returncode == -signal.SIGSEGV and not NO_AMX:
        _amx_died(gguf, tool)
        done = run()
    return done


def _amx_died(gguf: Path, tool: str) -> None:
    global NO_AMX
    NO_AMX = True
    print(
        f"llama.cpp: {tool} died of SIGSEGV on {gguf.name}, as its AMX kernels do on some virtualized CPUs "
        f"(llama.cpp #20824); running it again from llama.cpp built without AMX ({build_home(amx=False)}, "
        "built once: minutes), and every llama.cpp tool after it",
        file=sys.stderr,
        flush=True,
    )


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    """llama-server's JSON answer, whole within `timeout` s (net.py)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return parse_json(read_url(req, timeout)[1], f"llama-server's answer from {url}")


def complete(url: str, ids: list[int], max_tokens: int, **extra) -> dict:
    """llama-server's whole answer (its "tokens" and "timings") for `max_tokens` greedy tokens after the
    prompt `ids` (given as ids, EOS ignored, its prompt cache not used); extra: more of /completion's fields."""
    body = {
        "prompt": ids,
        "n_predict": max_tokens,
        "temperature": 0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        **extra,
    }
    return _post(f"{url}/completion", body)


def greedy(url: str, ids: list[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy token ids after the prompt `ids`."""
    return complete(url, ids, max_tokens)["tokens"]


def tokenize(url: str, text: str) -> list[int]:
    """llama.cpp's ids of `text`, without the special tokens the model adds."""
    return _post(f"{url}/tokenize", {"content": text, "add_special": False})["tokens"]


def greedy_with_logprobs(url: str, ids: list[int], max_tokens: int, top_k: int) -> dict:
    """verify's shape of an answer: {"ids": greedy ids, "logprobs": per new token {id: logprob} of the top_k},
    the log-probabilities llama.cpp's sampler saw before sampling (post_sampling_probs false)."""
    answer = complete(url, ids, max_tokens, n_probs=top_k, post_sampling_probs=False)
    steps = answer.get("completion_probabilities") or []
    got: dict[str, list] = {
        "ids": [int(s["id"]) for s in steps],
        "logprobs": [{int(t["id"]): float(t["logprob"]) for t in s["top_logprobs"]} for s in steps],
    }
    if len(got["ids"]) != max_tokens:
        raise MiniStreamError(
            f"llama-server answered {len(got['ids'])} tokens with their log-probabilities, not {max_tokens}"
        )
    return got


PERPLEXITY_TRIES = 3


def perplexity(gguf: Path, text: Path, n_ctx: int, threads: int = 2, kv: str = "f16") -> float:
    """llama-perplexity on `text` with chunks of n_ctx tokens (checkpoint/perplexity.py's method), its KV cache in
    `kv`: its estimate over every chunk it announced (final_estimate), run again where its output lost it (exit 0);
    a run that failed is not run again."""
    args = ["-m", gguf, "-f", text, "-c", n_ctx, "-b", n_ctx, "-t", threads, "-ctk", kv, "-ctv", kv]
    for _ in range(PERPLEXITY_TRIES):
        done = run_tool("llama-perplexity", args, gguf)
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        if done.returncode != 0:  # a failure, not a lost line: running it again would fail again
            raise MiniStreamError(f"llama-perplexity on {gguf} failed (exit {done.returncode}): {tail[-800:]}")
        found = final_estimate(done.stdout, done.stderr)
        if found is not None:
            return found
    raise MiniStreamError(
        f"llama-perplexity on {gguf} gave no estimate over all its chunks in {PERPLEXITY_TRIES} runs: {tail[-800:]}"
    )


def final_estimate(stdout: str, stderr: str) -> float | None:
    """llama-perplexity's estimate over all N chunks it announced ("calculating perplexity over N chunks"): the
    running estimate it prints to stdout after chunk N ("[N]40.0750,"), else its "Final estimate: PPL = x" log
    line; None where it printed neither. Its output can stop after chunk N-1, with exit 0 and no Final line:
    that earlier estimate is no answer (it measured the text short of its end)."""
    announced = re.search(r"calculating perplexity over (\d+) chunks", stderr + stdout)
    running = dict(re.findall(r"\[(\d+)\]([0-9.]+|nan|inf),", stdout))
    if announced and announced.group(1) in running:
        return float(running[announced.group(1)])
    final = re.search(r"Final estimate: PPL = ([0-9.]+|nan|inf)", stderr + stdout)
    return float(final.group(1)) if final else None
