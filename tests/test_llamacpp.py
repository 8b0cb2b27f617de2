"""llama.cpp, built from the registry's llama-cpp-python sdist, runs `ministream gguf` files: its greedy tokens
are the reference model's in f32 on both test models (a third implementation of the format's math), and its
tokenizer gives tokenizer.json's ids on the training corpus, for each pre-tokenizer the export names.

make test-full: the first run builds llama.cpp (about 10 minutes on 2 cores), later runs reuse the build."""

import json
import shutil
import socket

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ministream.bench import llamacpp
from ministream.bench.accuracy import SYSTEMS, near_tie, run_accuracy
from ministream.bench.widths import refusal
from ministream.checkpoint.gguf import LLAMA3_SPLIT
from ministream.paths import CORPUS
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.server import free_port
from ministream.run.verify import compare

from conftest import NEEDS_INT4_GEMM

pytestmark = pytest.mark.full
MAX_TOKENS = 32
# what a corpus of prose misses: digits in runs, contractions, runs of spaces and newlines, other scripts
EDGES = ["I'll pay 1234567 or 3.14159!", "  two  spaces\n\n\nthree newlines\t tab", "naïve café — 東京 😀", "x" * 300]


@pytest.fixture(scope="module")
def home():
    return llamacpp.build()


def texts() -> list[str]:
    return [p for p in CORPUS.read_text().split("\n\n") if p.strip()] + EDGES


@pytest.mark.parametrize("folder", ["tiny_hf", "tiny_gqa_hf"])
def test_llama_cpp_gives_the_reference_models_greedy_tokens_in_f32(folder, request, home, cli, tmp_path):
    hf = request.getfixturevalue(folder)
    assert cli("gguf", hf, tmp_path / "m.gguf").returncode == 0
    prompts = tokenize(hf, DEFAULT_PROMPTS)
    want = reference_generate(hf, prompts, MAX_TOKENS, "float32", logprobs=5)
    f32 = ("-ctk", "f32", "-ctv", "f32")  # its KV cache in f32 too (llama-server's default is f16)
    with llamacpp.server(tmp_path / "m.gguf", free_port(), 2, log_file=tmp_path / "server.log", extra=f32) as url:
        got = [llamacpp.greedy(url, ids, MAX_TOKENS) for ids in prompts]
        tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
        ids = [(llamacpp.tokenize(url, t), tok.encode(t, add_special_tokens=False).ids) for t in texts()]
    # the same ids, or parted only where the reference's first and second choices all but tie (llama.cpp's own
    # float32 reduction order; seen once, tiny-gqa trained on the Intel Xeon here: a gap of 5e-4 at token 12)
    _, results = compare(want, [{"ids": g} for g in got], exact=True, names=("reference", "llama.cpp"))
    for r, g, w in zip(results, got, want, strict=True):
        assert r.identical or near_tie(w, g, r.first_difference), (r.detail, g, w["ids"])
    differ = [i for i, (a, b) in enumerate(ids) if a != b]
    assert not differ, f"{len(differ)} of {len(ids)} texts tokenize differently, first: {ids[differ[0]]}"


@pytest.mark.parametrize("folder", ["tiny_hf", "tiny_gqa_hf"])
def test_every_width_on_both_engines_passes_its_rule_and_f32_scores_the_reference_models_perplexity(
    folder, request, home, tmp_path
):
    """bench-accuracy on both test models: each system against the full-precision reference model by its width's
    rule (verify.RULES), and the methods agree: vLLM in float32 scores the held-out text as the reference model
    does (to 1e-5 of it), llama-perplexity on the f32 file within its own arithmetic of it (seen: 8e-5 of it on
    the same token ids, with its KV cache in f32: llama.cpp's float32 RoPE and norms)."""
    result = run_accuracy(request.getfixturevalue(folder), tmp_path / "acc", list(SYSTEMS), log=print)
    rows = {r["system"]: r for r in result["rows"]}
    reference = rows["reference float32"]["perplexity"]
    assert rows["vllm float32"]["perplexity"] == pytest.approx(reference, rel=1e-5)
    assert rows["llama.cpp f32"]["perplexity"] == pytest.approx(reference, rel=5e-4)
    assert rows["vllm float32"]["exact"] == result["prompts"]
    # llama.cpp's float32 is its own arithmetic: a prompt may part from the reference only where the reference's
    # first and second choices all but tie (accuracy.NEAR_TIE), which bench-accuracy counts and its rule does not
    f32 = rows["llama.cpp f32"]
    assert f32["exact"] + f32["near_ties"] == result["prompts"], f32
    failed = {n: r for n, r in rows.items() if "rule" in r and not r["rule"]}
    assert set(failed) <= ({"llama.cpp f32"} if f32["near_ties"] else set()), failed
    # a row not run only where this machine's vLLM cannot run the width (on a CPU with AMX: w8a8 in float32)
    not_run = {n for n, r in rows.items() if "not_run" in r}
    assert not_run == {n for n, (engine, w) in SYSTEMS.items() if engine == "vllm" and refusal(w)}
    passed = len(SYSTEMS) - len(not_run) - len(failed)
    assert (tmp_path / "acc" / "accuracy.md").read_text().count("PASS") == passed


@NEEDS_INT4_GEMM
def test_bench_runs_each_quantized_width_on_both_engines_with_a_median_and_a_range(home, cli, tmp_path):
    """`make bench` at the quantized widths: vLLM on the quantize folder and llama.cpp on its own quantized file,
    each cell a median of 3 repeats within its range, the bytes each engine read recorded. int8 in float32, or
    in bfloat16 where this machine's vLLM takes its int8 weights in 16 bits only (a CPU with AMX)."""
    out, int8 = tmp_path / "bench", "w8a8-bf16" if refusal("w8a8") else "w8a8"
    r = cli(
        *("bench", "--quick", "--configs", f"tiny:{int8},tiny:w4a16", "--systems", "ministream,llamacpp"),
        *("--batches", "1,4", "--repeats", "3", "--no-tooling", "--out", out),
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    runs = {(run["dtype"], run["system"]): run for run in result["runs"]}
    assert set(runs) == {(w, s) for w in (int8, "w4a16") for s in ("ministream", "llamacpp")}
    assert runs[int8, "llamacpp"]["gguf"].endswith("-q8_0.gguf") and runs["w4a16", "llamacpp"]["gguf"].endswith(
        "-q4_0.gguf"
    )
    for run in result["runs"]:
        for row in run["rows"]:
            lo, hi = row["tokens_per_s_range"]
            assert len(row["seconds"]) == 3 and lo <= row["tokens_per_s"] <= hi
    # 4-bit files are smaller than 8-bit ones on both engines (scales and the float embedding beside them)
    assert runs["w4a16", "ministream"]["weights_file_bytes"] < runs[int8, "ministream"]["weights_file_bytes"]
    assert runs["w4a16", "llamacpp"]["weights_file_bytes"] < runs[int8, "llamacpp"]["weights_file_bytes"]
    assert f"tiny {int8} batch 4: ministream" in r.stdout


@NEEDS_INT4_GEMM
def test_bench_serve_loads_both_engines_at_a_quantized_width_and_nothing_else(home, cli, tmp_path):
    """`make bench-serve` at 4-bit: vLLM's server on the quantize folder, llama-server on the q4_0 file, vLLM's
    client against each; the LLaMA twin and the reference server have no quantized form and are left out."""
    out = tmp_path / "serve"
    r = cli("bench-serve", "--quick", "--dtype", "w4a16", "--preset", "tiny", "--out", out, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "serve.json").read_text())
    assert list(result["systems"]) == ["ministream", "llamacpp"]
    assert "-w4a16" in result["systems"]["ministream"]["server"]["command"]
    assert "-q4_0.gguf" in result["systems"]["llamacpp"]["server"]["command"]
    for system in result["systems"].values():
        assert [run["failed"] for run in system["runs"]] == [0, 0], system["runs"]


def test_llama_3s_split_is_exported_as_llama_bpe_and_tokenizes_alike(home, cli, tiny_hf, tmp_path):
    """A tokenizer trained with LLaMA 3's pre-tokenizer (a regex split, then bytes, merges ignored where a word
    is whole in the vocabulary): llama.cpp's llama-bpe gives its ids."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|bos|>", "<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts(), trainer)
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    tok.save(str(hf / "tokenizer.json"))
    r = cli("gguf", hf, tmp_path / "m.gguf")
    assert r.returncode == 0 and "'llama-bpe'" in r.stdout, r.stderr
    with llamacpp.server(tmp_path / "m.gguf", free_port(), 2, log_file=tmp_path / "server.log") as url:
        ids = [(llamacpp.tokenize(url, t), tok.encode(t, add_special_tokens=False).ids) for t in texts()]
    differ = [i for i, (a, b) in enumerate(ids) if a != b]
    assert not differ, f"{len(differ)} of {len(ids)} texts tokenize differently, first: {ids[differ[0]]}"


def test_the_build_is_recorded(home):
    record = json.loads((home / "build.json").read_text())
    assert record["llama-cpp-python"] == llamacpp.VERSION and record["cmake flags"] == llamacpp.CMAKE_FLAGS
    assert record["seconds"] > 0 and record["cpu"] and record["llama.cpp commit"]
    assert record.get("amx", True)  # a record from before 2026-12-04 does not say: it was built with
    # the build that runs here: without AMX where its AMX kernels died in a test before this one (llama.cpp #20824)
    assert llamacpp.info().get("amx", True) is not llamacpp.NO_AMX


def test_vllms_client_counts_llama_servers_tokens_as_asked(home, tiny_hf, tmp_path):
    """bench-serve's llamacpp system as it runs: llama-server on a bf16 export, warmed, vLLM's client at one
    rate; every request gets the output length its row asked, counted from llama-server's usage (which it
    sends beside the last token: vllm_client.usage_apart), and the server is gone afterwards."""
    import os

    from ministream.bench import serving
    from ministream.bench.serving import FULL
    from ministream.run.generate import folder_tokenizer
    from ministream.run.prompts import build_prompts, write_jsonl

    hf = tmp_path / "model" / "hf"
    shutil.copytree(tiny_hf, hf)
    tok = folder_tokenizer(hf / "tokenizer.json")
    rows = build_prompts(tok, [6], 0, (16, 64), (4, 40), 2, (24, 40), max_model_len=512)["sets"][0]
    settings = {**FULL, "dtype": "bfloat16", "rates": [8.0], "num_prompts": 6, "bisect_steps": 0}
    result = {"settings": settings, "model": {"hf": str(hf)}, "systems": {}}
    files = {8.0: write_jsonl(rows, tmp_path / "rate-8.jsonl")}
    serving.run_system("llamacpp", result, tmp_path, files, {8.0: rows}, dict(os.environ))

    entry = result["systems"]["llamacpp"]
    assert "error" not in entry["server"], entry["server"]
    (run,) = entry["runs"]
    assert run["completed"] == 6 and run["failed"] == 0, run
    raw = json.loads(open(run["client_result"]).read())
    assert raw["output_lens"] == [r["output_tokens"] for r in rows] and run["output_tokens_as_asked"] is True
    port = int(entry["server"]["url"].rsplit(":", 1)[1])
    with pytest.raises(OSError):  # stopped: nothing listens on its port any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
