"""One engine-settings object (run/engine.py: EngineSettings, add_engine_options): every command that starts an
engine or judges one reads its options into it, and gives vLLM exactly what that command line gave it before the
object (2ca2772: loose arguments, each command's own argparse block). Over many command lines per command: parse
with the real parser, run the command, and catch what it hands vLLM where vLLM would start (its LLM(...) and the
server's process stood in for); the expected side is the old code's arithmetic, written out. No engine starts.
"""

import dataclasses
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, strategies as st

from ministream.bench import decode_step, offline, serving, workers
from ministream.cli import build_parser, parse_args
from ministream.run import doctor, serve
from ministream.run.engine import OFFLINE_MAX_MODEL_LEN, SEED, EngineSettings
from ministream.run.server import free_port
from ministream.run.verify import STEP_TOKENS
from ministream.spec import DTYPES

from conftest import fuzz_settings

EXAMPLES = 25
# tensor parallel sizes this machine runs (engine.check_tp refuses the others before any engine)
MOST = torch.cuda.device_count() if torch.cuda.is_available() else len(os.sched_getaffinity(0))
SIZES = [None, *range(1, min(MOST, 2) + 1)]  # None: the option left out


class Started(BaseException):
    """Raised where a command would start vLLM, with what it would have handed it; a BaseException, so that no
    command's `except Exception` (verify's: "vLLM could not serve") takes it for vLLM's own failure."""


@pytest.fixture
def no_engine(monkeypatch):
    """vLLM's LLM (a module standing in for vllm) and the server's process (Popen) raise Started; the engine
    defaults generate writes into this process's environment go with the test."""

    def llm(**kwargs):
        raise Started(kwargs)

    def popen(cmd, **kwargs):
        raise Started(cmd)

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # serve asks find_spec("vllm")
    vllm.LLM = llm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(serve, "subprocess", types.SimpleNamespace(Popen=popen))  # serve's alone
    monkeypatch.setattr(os, "environ", dict(os.environ))


def started(*argv) -> object:
    """What `ministream ARGV` hands vLLM: LLM(...)'s keyword arguments, or the server's command line."""
    args = parse_args([str(a) for a in argv])
    with pytest.raises(Started) as caught:
        args.func(args)
    return caught.value.args[0]


def opt(flag: str, value) -> list[str]:
    """A command line's option, or nothing for a value left out (None)."""
    return [] if value is None else [flag, str(value)]


def context(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["max_position_embeddings"]


@fuzz_settings(EXAMPLES)
@given(dtype=st.sampled_from([None, *DTYPES]), tp=st.sampled_from(SIZES), eager=st.booleans())
def test_generate_hands_vllm_what_its_options_always_did(dtype, tp, eager, tiny_hf, no_engine):
    got = started(
        "generate", tiny_hf, "--engine", "vllm", *opt("--dtype", dtype), *opt("--tp", tp), *["--enforce-eager"] * eager
    )
    # before: vllm_engine(model, a.dtype, a.tp, **({"enforce_eager": True} if a.enforce_eager else {}))
    assert got == {
        "model": str(tiny_hf),
        "dtype": dtype or "float32",
        "tensor_parallel_size": tp or 1,
        "max_model_len": min(context(tiny_hf), OFFLINE_MAX_MODEL_LEN),
        "seed": SEED,
        "enforce_eager": eager,
    }


@fuzz_settings(EXAMPLES)
@given(
    dtype=st.sampled_from([None, "float32", "bfloat16", "auto"]),  # serve passes any dtype on to vLLM
    tp=st.sampled_from(SIZES),
    pp=st.sampled_from(SIZES),
    max_model_len=st.sampled_from([None, 1, 64]),
    eager=st.booleans(),
    name=st.sampled_from([None, "mini"]),
    extra=st.sampled_from(["", "--max-num-seqs 8"]),
)
def test_serve_starts_the_server_command_its_options_always_did(
    dtype, tp, pp, max_model_len, eager, name, extra, tiny_hf, no_engine
):
    assume((tp or 1) * (pp or 1) <= MOST)
    port = free_port()
    engine = [*opt("--dtype", dtype), *opt("--tp", tp), *opt("--pp", pp), *opt("--max-model-len", max_model_len)]
    asked = [*opt("--name", name), *engine, *["--enforce-eager"] * eager, *(["--vllm-args", extra] if extra else [])]
    got = started("serve", tiny_hf, "--port", port, *asked)
    # before: engine.server_command(model, host, port, name, dtype, tp, max_model_len, extra, enforce_eager),
    # then --pipeline-parallel-size for more than one stage
    assert got == [
        sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_hf.resolve())),
        *("--served-model-name", name or tiny_hf.resolve().name, "--host", "127.0.0.1", "--port", str(port)),
        *("--tensor-parallel-size", str(tp or 1), "--seed", str(SEED)),
        *opt("--dtype", dtype),
        *opt("--max-model-len", max_model_len),
        *["--enforce-eager"] * eager,
        *extra.split(),
        *("--shutdown-timeout", "25"),  # since issue 37: vLLM drains on SIGTERM, --stop-timeout (30 s) less 5
        *(["--pipeline-parallel-size", str(pp)] if (pp or 1) > 1 else []),
    ]


@pytest.mark.parametrize("dtype", [None, *DTYPES])
def test_verify_hands_vllm_what_its_dtype_always_did(dtype, tiny_hf, no_engine, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The river runs through\n")
    out = tmp_path / "out"
    got = started("verify", tiny_hf, "--prompts", prompts, "--max-tokens", 2, "--out", out, *opt("--dtype", dtype))
    ids = json.loads((out / f"golden-{dtype or 'float32'}.json").read_text())["prompt_ids"]
    # before: vllm_engine(model, golden["dtype"], max_model_len=max(longest + max_tokens, 2048), enforce_eager=True,
    # enable_prefix_caching=False, max_num_batched_tokens=max(all prompt tokens, STEP_TOKENS))
    assert got == {
        "model": str(tiny_hf),
        "dtype": dtype or "float32",
        "tensor_parallel_size": 1,
        "max_model_len": min(context(tiny_hf), max(max(map(len, ids)) + 2, OFFLINE_MAX_MODEL_LEN)),
        "seed": SEED,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": max(sum(map(len, ids)), STEP_TOKENS),
    }


@fuzz_settings(EXAMPLES)
@given(
    dtype=st.sampled_from([None, *DTYPES]),
    max_model_len=st.sampled_from([None, 64, 512]),
    kv=st.sampled_from([None, 0.5, 2.0]),
    memory=st.sampled_from([None, 4.0]),
)
def test_doctor_judges_the_engine_serve_gets_with_the_same_options(
    dtype, max_model_len, kv, memory, tiny_hf, no_engine, monkeypatch
):
    def judged(folder, cfg, settings, memory_gib):
        raise Started((settings, memory_gib))

    monkeypatch.setattr(doctor, "installed_vllm_findings", lambda config, vllm_dir: [])
    monkeypatch.setattr(doctor, "check_memory", judged)
    shared = [*opt("--dtype", dtype), *opt("--max-model-len", max_model_len)]
    settings, memory_gib = started("doctor", tiny_hf, *shared, *opt("--kv-cache-gib", kv), *opt("--memory-gib", memory))
    # before: check_memory(folder, cfg, a.dtype, a.max_model_len, a.memory_gib, a.kv_cache_gib)
    assert (settings.dtype, settings.max_model_len, settings.kv_cache_gib, memory_gib) == (
        dtype,
        max_model_len,
        kv,
        memory,
    )
    served = EngineSettings.from_args(build_parser().parse_args(["serve", str(tiny_hf), *shared]))
    assert settings == dataclasses.replace(served, kv_cache_gib=kv)


@pytest.mark.parametrize("kv", [None, 3])
def test_bench_runs_every_engine_on_the_kv_cache_its_option_always_gave(kv, no_engine, monkeypatch):
    def run_bench(out, **chosen):
        raise Started(chosen)

    monkeypatch.setattr(offline, "run_bench", run_bench)
    got = started("bench", "--quick", *opt("--kv-cache-gib", kv))
    assert got["kv_cache_gib"] == kv and type(got["kv_cache_gib"]) is type(kv)  # whole GiB, as vLLM reads them


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_bench_serve_serves_the_dtype_its_option_always_did(dtype, tiny_hf, monkeypatch):
    def bench_serve(out, quick, report_only, systems, note, **settings):
        raise Started(settings)

    monkeypatch.setattr(serving, "bench_serve", bench_serve)
    assert started("bench-serve", *opt("--dtype", dtype))["dtype"] == dtype  # None: the benchmark's (FULL)
    chosen = dtype or serving.FULL["dtype"]
    port, folder = free_port(), str(tiny_hf)
    cmd, name, _ = serving.server_command("ministream", {"hf": folder}, chosen, port)
    # before: engine.server_command(Path(folder), HOST, port, name, dtype, 1, None, [])
    assert cmd == [
        sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(folder).resolve())),
        *("--served-model-name", name, "--host", serving.HOST, "--port", str(port)),
        *("--tensor-parallel-size", "1", "--seed", str(SEED), "--dtype", chosen),
    ]


@pytest.mark.parametrize("eager", [None, False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_benchmark_workers_hand_vllm_what_they_always_did(dtype, eager, tiny_hf, no_engine):
    spec = {"kind": "vllm", "model_dir": str(tiny_hf), "dtype": dtype, "prompt_len": 32, "new_tokens": 128}
    with pytest.raises(Started) as caught:
        workers._worker({**spec, "eager": eager})
    # before: vllm_engine(dir, dtype, max_model_len=prompt_len + new_tokens, enforce_eager=eager or the default)
    want = {"model": str(tiny_hf), "dtype": dtype, "tensor_parallel_size": 1, "seed": SEED}
    length = min(context(tiny_hf), 32 + 128)
    assert caught.value.args[0] == {**want, "max_model_len": length, "enforce_eager": bool(eager)}
    for _, _, overrides in decode_step.VARIANTS.values():
        with pytest.raises(Started) as caught:
            decode_step._vllm_worker({"model_dir": str(tiny_hf), "dtype": dtype, "overrides": overrides})
        # before: vllm_engine(dir, dtype, max_model_len=PROMPT + NEW + 8, **overrides)
        length = min(context(tiny_hf), decode_step.PROMPT + decode_step.NEW + 8)
        assert caught.value.args[0] == {**want, "max_model_len": length, "enforce_eager": False, **overrides}


# Each engine option as users know it (2ca2772): command, flag -> default, choices, type, help.
EAGER = "vLLM without torch.compile (default: compiled, see docs/bench.md, 'Compiled or eager')"
OPTIONS = {
    ("generate", "--dtype"): ("float32", list(DTYPES), None, None),
    ("generate", "--tp"): (1, None, int, "vLLM tensor_parallel_size"),
    ("generate", "--enforce-eager"): (False, None, None, EAGER),
    ("verify", "--dtype"): ("float32", list(DTYPES), None, None),
    ("doctor", "--dtype"): (
        None,
        ["float32", "bfloat16", "float16"],
        None,
        "dtype to serve in (default: config.json's)",
    ),
    ("doctor", "--max-model-len"): (None, None, int, "context to serve (default: max_position_embeddings)"),
    ("doctor", "--kv-cache-gib"): (
        None,
        None,
        float,
        "KV cache size (default on CPU: VLLM_CPU_KVCACHE_SPACE, else what `ministream serve` would choose now)",
    ),
    ("serve", "--dtype"): (
        None,
        None,
        None,
        "weights/activations dtype (default: vLLM's auto, the folder's torch_dtype)",
    ),
    ("serve", "--tp"): (1, None, int, "tensor_parallel_size"),
    ("serve", "--pp"): (1, None, int, "pipeline_parallel_size (with --nnodes: over the nodes)"),
    ("serve", "--max-model-len"): (None, None, int, "longest prompt + output, in tokens (default: the model's)"),
    ("serve", "--enforce-eager"): (False, None, None, EAGER),
    ("bench", "--kv-cache-gib"): (
        None,
        None,
        int,
        "VLLM_CPU_KVCACHE_SPACE for every engine (default: what `ministream serve` would choose)",
    ),
    ("bench-serve", "--dtype"): (
        None,
        ["float32", "bfloat16", "float16", "w8a8", "w8a8-bf16", "w8a8-bf16-head", "w4a16", "w4a16-head", "fp8"]
        + ["w4a16-gptq"],
        None,
        "weight width; default: bfloat16",
    ),
}


@pytest.mark.parametrize("command, flag", list(OPTIONS))
def test_each_engine_option_keeps_its_name_default_and_help(command, flag):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    action = sub.choices[command]._option_string_actions[flag]
    assert (action.default, action.choices, action.type, action.help) == OPTIONS[command, flag]


def test_a_command_kind_without_an_option_is_refused_by_name():
    from argparse import ArgumentParser

    from ministream.run.engine import add_engine_options

    with pytest.raises(ValueError, match="a judge command has no --tp"):
        add_engine_options(ArgumentParser(), "judge", ["tp"])


def test_a_failure_of_vllm_s_own_is_one_line_naming_the_folder_and_the_doctor_ours_pass_unchanged():
    """verify and generate start vLLM inside engine.vllm_failures: its exception (an engine that died, a folder it
    refused) becomes the one-line error; the tool's own errors are not rewrapped."""
    from ministream import MiniStreamError
    from ministream.run.engine import vllm_failures

    with pytest.raises(MiniStreamError) as e:
        with vllm_failures(Path("out/m")):
            raise RuntimeError("Engine core initialization failed. See root cause above.\n")
    assert str(e.value) == (
        "vLLM could not serve out/m (RuntimeError: Engine core initialization failed. See root cause above.); "
        "run `ministream doctor out/m`"
    )
    ours = MiniStreamError("x")
    with pytest.raises(MiniStreamError) as again:
        with vllm_failures(Path("out/m")):
            raise ours
    assert again.value is ours
