"""PEFT both ways (issue 53, point 3), with the real peft and transformers packages and real vLLM engines.

From us to PEFT: the adapters `ministream convert-lora` writes load with `PeftModel.from_pretrained` on the
folder's transformers model (GQA with an untied head and head_dim != d_model / n_heads; MHA in make test-full)
and give the reference model with the trainer's adapter merged: float32 greedy ids identical, logprobs within
PEFT_LOGPROBS; so does `merge_and_unload()`. From PEFT to us, the loop users run: an adapter trained with PEFT on
the transformers model (a few seeded AdamW steps here, on the bundled held-out text), saved by `save_pretrained`,
is served by vLLM with LoRA on (the patched wheel's offline engine, `LoRARequest`, as tests/test_lora.py runs it,
and `ministream serve --lora`: both in make test-full, where make test has test_lora.py's engine) and gives PEFT's
own greedy ids in float32; serve's pre-flight check accepts it as PEFT saved it.

Controls, else a comparison could pass with the adapter ignored: each adapter changes the base model's greedy ids.
"""

import json
import math
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_lora import MAX_TOKENS, OFFLINE, ids, logprob_difference
from transformers import AutoModelForCausalLM, AutoTokenizer

import ministream.checkpoint.hf  # noqa: F401  (registers MiniStream with the Auto classes: no remote code)
from ministream.checkpoint.demo import make_adapter
from ministream.checkpoint.lora import PEFT_CONFIG, PEFT_WEIGHTS, convert_lora
from ministream.checkpoint.reference import MiniStream
from ministream.paths import HELDOUT
from ministream.run import engine, serve
from ministream.run.generate import DEFAULT_PROMPTS, tokenize
from ministream.run.server import complete, stop, wait_ready
from ministream.spec import LORA_TABLE

from conftest import quiet

# float32 in another order of sums: PEFT adds scaling * (x @ A^T) @ B^T beside x @ W^T, the reference merges
# W + scaling * B @ A first (and merge_and_unload merges in its own order). Measured at most 8.1e-6 between their
# logprobs of the chosen tokens (both test models, DEFAULT_PROMPTS, 24 new tokens: PEFT 5.5e-6, merged 8.1e-6);
# about six times that
PEFT_LOGPROBS = 5e-5
# vLLM's float32 kernels (its CPU LoRA ops, its attention) against PEFT's: measured at most 7.3e-6 on the AVX2-only
# EPYC (the adapter's rows; the base rows 5.0e-6); vLLM picks its CPU kernels by ISA, so more room than for PEFT
VLLM_LOGPROBS = 1e-4
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all of LLaMA's
RANK = 8


def greedy(model, prompts: list[list[int]]) -> list[dict]:
    """transformers' generate, greedy (do_sample=False), as the reference's generate gives it: per prompt the new
    ids and, per new token, the top-2 {id: float32 logprob}; past EOS, as vLLM's ignore_eos and the reference."""
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            x = torch.tensor([prompt])
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),  # BOS is id 0: never let a pad id mask it
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
            steps = [torch.log_softmax(s[0].float(), -1).topk(2) for s in out.logits]
            logprobs = [dict(zip(i.tolist(), v.tolist())) for v, i in steps]
            outputs.append({"ids": out.sequences[0, len(prompt) :].tolist(), "logprobs": logprobs})
    return outputs


def logprob_gap(got: list[dict], want: list[dict]) -> float:
    """The largest difference between two runs' logprobs of the tokens `want` chose (both keyed by int); infinite
    where `got` did not rank the token in its top 2."""
    pairs = (step for go, wo in zip(got, want) for step in zip(go["logprobs"], wo["logprobs"], wo["ids"]))
    return max(abs(g.get(t, -math.inf) - w[t]) for g, w, t in pairs)


def changed(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# --- from us to PEFT: convert-lora's adapters ---------------------------------------------------------


# the GQA model in make test (every odd shape: q, k and v of three sizes, an untied head, head_dim != d / h), the
# MHA model (tied head) in make test-full
MODELS = [
    pytest.param(("tiny", "tiny_hf"), id="mha", marks=pytest.mark.full),
    pytest.param(("tiny_gqa", "tiny_gqa_hf"), id="gqa"),
]


@pytest.fixture(scope="module", params=MODELS)
def converted(request, tmp_path_factory) -> dict:
    """The trainer's adapter on every target (`ministream checkpoint --adapter`'s, seeded), converted, in PEFT on
    the folder's transformers model, beside the reference model with it merged and without it."""
    raw, folder = (request.getfixturevalue(name) for name in request.param)
    tmp = tmp_path_factory.mktemp("converted")
    make_adapter(raw, tmp / "trainer", targets=tuple(LORA_TABLE), seed=0, dtype="float32", prefix="none", log=quiet)
    convert_lora(tmp / "trainer", tmp / "peft", folder, log=quiet)
    prompts = tokenize(folder, DEFAULT_PROMPTS)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load(folder), tmp / "peft").eval()
    got = greedy(model, prompts)
    return dict(
        said=[str(w.message) for w in said],
        got=got,
        merged=greedy(model.merge_and_unload(), prompts),
        want=MiniStream.from_checkpoint(raw, adapter=tmp / "trainer").generate(prompts, MAX_TOKENS, logprobs=2),
        base=MiniStream.from_checkpoint(raw).generate(prompts, MAX_TOKENS),
    )


def test_peft_loads_a_converted_adapter_without_a_warning(converted):
    """PEFT warns of any key its LoraConfig lacks, telling the user to upgrade PEFT: convert-lora writes none."""
    assert not [w for w in converted["said"] if "LoraConfig" in w or "adapter" in w.lower()], converted["said"]


def test_a_converted_adapter_in_peft_gives_the_reference_merged_greedy_ids_in_fp32(converted):
    assert ids(converted["got"]) == ids(converted["want"])


def test_a_converted_adapter_in_peft_gives_the_reference_merged_logprobs(converted):
    assert logprob_gap(converted["got"], converted["want"]) < PEFT_LOGPROBS


def test_merge_and_unload_gives_the_same_greedy_ids_and_logprobs(converted):
    assert ids(converted["merged"]) == ids(converted["want"])
    assert logprob_gap(converted["merged"], converted["want"]) < PEFT_LOGPROBS


def test_the_converted_adapter_changes_the_base_models_greedy_ids(converted):
    """Else the comparisons above would pass with PEFT ignoring the adapter."""
    assert changed(ids(converted["got"]), ids(converted["base"])) >= len(DEFAULT_PROMPTS) - 1


# --- from PEFT to us: an adapter trained with PEFT, served by vLLM ------------------------------------

STEPS, LR = 8, 1e-2  # enough that the greedy ids change (a test proves it), few enough to take seconds


@pytest.fixture(scope="module")
def trained(tiny_gqa, tiny_gqa_hf, tmp_path_factory) -> dict:
    """A LoRA adapter trained with PEFT on the GQA model's transformers classes (every odd shape: its q, k and v
    of three sizes, an untied head) over all of LLaMA's projections, seeded, on the first four paragraphs of the
    held-out text; saved with save_pretrained. Its greedy outputs as PEFT gives them from the saved folder, and
    the base model's."""
    folder = tmp_path_factory.mktemp("trained") / "adapter"
    tokenizer = AutoTokenizer.from_pretrained(tiny_gqa_hf)
    texts = [p for p in HELDOUT.read_text().split("\n\n") if p.strip()][:4]
    batches = [torch.tensor([tokenizer(t)["input_ids"][:96]]) for t in texts]
    torch.manual_seed(0)  # A's initial values (B starts at zero)
    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=PEFT_TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(load(tiny_gqa_hf).train(), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        loss = model(input_ids=batches[step % len(batches)], labels=batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    prompts = tokenize(tiny_gqa_hf, DEFAULT_PROMPTS)
    peft = greedy(PeftModel.from_pretrained(load(tiny_gqa_hf), folder).eval(), prompts)
    base = MiniStream.from_checkpoint(tiny_gqa).generate(prompts, MAX_TOKENS)  # = transformers' (test_transformers)
    return dict(folder=folder, prompts=prompts, peft=peft, base=base)


def test_the_peft_trained_adapter_changes_the_base_models_greedy_ids(trained):
    assert changed(ids(trained["peft"]), ids(trained["base"])) >= len(DEFAULT_PROMPTS) - 1


def test_the_peft_trained_model_is_peaked_so_fp32_comparisons_mean_something(trained):
    """The top token of every step leads the second by far more than float32 rounding moves a logprob."""
    margin = min(sorted(s.values())[-1] - sorted(s.values())[-2] for o in trained["peft"] for s in o["logprobs"])
    assert margin > 1e-4, margin


def test_serves_pre_flight_check_accepts_a_peft_trained_adapter(trained, tiny_gqa_hf):
    config = json.loads((tiny_gqa_hf / "config.json").read_text())
    assert {PEFT_CONFIG, PEFT_WEIGHTS} <= {p.name for p in trained["folder"].iterdir()}  # and PEFT's README.md
    assert serve.check_loras([f"mine={trained['folder']}"], config, tiny_gqa_hf, "base") == [
        ("mine", trained["folder"], RANK)
    ]


@pytest.fixture(scope="module")
def offline(tiny_gqa_hf, trained, tmp_path_factory) -> list[list[dict]]:
    """One offline engine (`LLM(enable_lora=True, ...)`, test_lora.py's script) in its own process, with the
    base model's prompts and the adapter's in one batch: the outputs of each group."""
    script = tmp_path_factory.mktemp("offline") / "lora_engine.py"
    script.write_text(OFFLINE)
    batches = [[None, str(trained["folder"])]]
    args = [json.dumps(x) for x in (trained["prompts"], engine.lora_settings([RANK]), batches)]
    r = subprocess.run([sys.executable, str(script), str(tiny_gqa_hf), *args], capture_output=True, text=True)
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and result, r.stderr[-5000:]
    out, n = json.loads(result[0][len("RESULT ") :])[0], len(trained["prompts"])
    return [out[:n], out[n:]]


@pytest.mark.vllm
@pytest.mark.full  # make test: vLLM's LoRA math (test_lora.py) and PEFT reading our adapters (above)
def test_vllm_serves_a_peft_trained_adapter_with_peft_greedy_ids_in_fp32(offline, trained):
    base, adapted = offline
    assert ids(adapted) == ids(trained["peft"])
    assert logprob_difference(adapted, trained["peft"]) < VLLM_LOGPROBS
    assert ids(base) == ids(trained["base"])  # the base rows in the same batch: the base model's, not PEFT's


@pytest.mark.vllm
@pytest.mark.full
def test_ministream_serve_lora_serves_a_peft_trained_adapter_with_peft_greedy_ids(
    trained, tiny_gqa_hf, start_serve, tmp_path
):
    """The server users run (`ministream serve BASE --lora NAME=DIR`: `vllm serve --enable-lora --lora-modules`),
    the PEFT-trained adapter asked for by name and the base model beside it, all requests at once."""
    log = tmp_path / "serve.log"
    args = ("--dtype", "float32", "--max-model-len", 256, "--name", "base", "--lora", f"mine={trained['folder']}")
    proc, url = start_serve(tiny_gqa_hf, log, *args)
    try:
        wait_ready(url, proc, log, 900)
        jobs = [(model, p) for model in ("mine", "base") for p in trained["prompts"]]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: served(url, *job), jobs))
    finally:
        stop(proc)
    n = len(trained["prompts"])
    assert got[:n] == ids(trained["peft"]) and got[n:] == ids(trained["base"])


def served(url: str, model: str, prompt: list[int]) -> list[int]:
    status, body = complete(url, model, prompt, MAX_TOKENS, timeout=600, return_token_ids=True)
    assert status == 200, body
    return body["choices"][0]["token_ids"]
