"""Far from position 0 (issue 33): verify's prompts that fill the model's context, and verify on them.

Position bugs (RoPE at large positions, the KV cache's later blocks, long attention) show only on long
sequences. verify's built-in set ends with four prompts of corpus text (prompts.context_prompts) reaching a
quarter, two thirds and the end of the model's own max_position_embeddings less the new tokens, the last
two sharing their first two thirds; the golden file records them. Without an engine: the prompts, their
lengths for any context, the golden file. With one (make test-full): `ministream verify` on both test
models and the format's reference shape, fp32 (identical) and bf16 (vLLM's rule), on the patched wheel
and on the plugin route; test_verify.py runs the MHA model on the patched wheel in make test.

Beyond 512 positions on trained weights: the reference shape is untrained (near-uniform attention, where a
RoPE or late-block bug barely moves the logits), so the trained GQA test model is also given the reference
shape's 2048 positions (the same weights), and verify holds vLLM to it there, fp32 and bf16; a wrong
rope_theta in the served config fails it.
"""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ministream import MiniStreamError
from ministream.checkpoint.convert import convert
from ministream.checkpoint.demo import make_checkpoint
from ministream.checkpoint.format import load, save_checkpoint
from ministream.paths import CORPUS
from ministream.run.generate import DEFAULT_PROMPTS, folder_tokenizer
from ministream.run.prompts import SHARING, THE_END, context_prompts
from ministream.run.verify import builtin_prompts, compare, make_golden

from conftest import made_once, quiet

NEW = 32  # verify's default --max-tokens


def tok_of(folder: Path):
    return folder_tokenizer(folder.resolve() / "tokenizer.json")


@pytest.mark.parametrize("positions", [100, 512, 2048, 8192])
def test_context_prompts_reach_a_quarter_two_thirds_and_the_end_of_any_context(tiny_hf, positions):
    tok = tok_of(tiny_hf)
    rows = context_prompts(tok, positions, NEW)
    room = positions - NEW
    assert [r["label"] for r in rows] == ["a quarter", "two thirds", THE_END, SHARING]
    assert [r["tokens"] for r in rows] == [round(positions / 4), min(room, round(positions * 2 / 3)), room, room]
    assert [len(tok.encode(r["prompt"]).ids) for r in rows] == [r["tokens"] for r in rows]  # as recorded
    end, sharer = (tok.encode(r["prompt"]).ids for r in rows[2:])
    shared = rows[3]["shared_tokens"]
    assert rows[3]["shares_prefix_with"] == THE_END and shared >= round(room * 2 / 3) - 2
    assert sharer[:shared] == end[:shared] and sharer[shared:] != end[shared : len(sharer)]
    assert len({r["prompt"] for r in rows}) == 4


def test_context_prompts_are_corpus_text_and_the_same_on_every_run(tiny_hf):
    tok = tok_of(tiny_hf)
    rows = context_prompts(tok, 512, NEW)
    assert rows == context_prompts(tok, 512, NEW)
    corpus = CORPUS.read_text()
    for r in rows:
        for part in r["prompt"].split("\n\n"):  # paragraphs of the corpus, the last one cut at a word's end
            assert part and part in corpus, part[:80]


def test_builtin_set_follows_the_folders_own_max_position_embeddings(tiny_hf, tmp_path):
    """Any checkpoint: the context is config.json's, not the demo's; the new tokens come off the end."""
    folder = tmp_path / "short-context"
    shutil.copytree(tiny_hf, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    prompts, context = builtin_prompts(folder, 16)
    assert prompts[: len(DEFAULT_PROMPTS)] == DEFAULT_PROMPTS and len(prompts) == len(DEFAULT_PROMPTS) + 4
    assert context["positions"] == 256 and context["new_tokens"] == 16
    assert [c["tokens"] for c in context["prompts"]] == [64, 171, 240, 240]


def test_a_context_without_room_for_a_prompt_is_refused_saying_what_to_do(tiny_hf):
    with pytest.raises(MiniStreamError, match=r"leaves 8 tokens for a prompt after 56 new ones: ask for fewer"):
        context_prompts(tok_of(tiny_hf), 64, 56)


def test_golden_file_records_the_prompts_far_from_position_0(tiny, tiny_hf, tmp_path):
    prompts, context = builtin_prompts(tiny_hf, 4)
    golden = json.loads(json.dumps(make_golden(tiny_hf, tiny, prompts, "float32", 4, 3, context)))  # as written
    assert_far_from_position_0(golden, tiny_hf)
    long = [c["index"] for c in golden["context"]["prompts"]]
    assert [len(golden["outputs"][i]["ids"]) for i in long] == [4] * 4


def assert_far_from_position_0(golden: dict, folder: Path, got: list[dict] | None = None) -> None:
    """The golden file holds the four prompts far from position 0 of the folder's context, as recorded, and
    (with vLLM's outputs `got`) vLLM gives their tokens: fp32 identical with logprobs within 1e-3, bf16 by
    the rule for the dtype."""
    positions = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    context = golden["context"]
    assert context["positions"] == positions and context["new_tokens"] == golden["max_tokens"]
    rows = context["prompts"]
    assert [c["label"] for c in rows] == ["a quarter", "two thirds", THE_END, SHARING]
    ids = [golden["prompt_ids"][c["index"]] for c in rows]
    assert [c["tokens"] for c in rows] == [len(p) for p in ids]
    assert len(ids[2]) + golden["max_tokens"] == positions  # the last new token takes the last position
    shared = rows[3]["shared_tokens"]
    assert rows[3]["shares_prefix_with"] == rows[2]["index"] and ids[3][:shared] == ids[2][:shared]
    assert shared > positions / 2
    if got is None:
        return
    want, have = [golden["outputs"][c["index"]] for c in rows], [got[c["index"]] for c in rows]
    passed, results = compare(want, have, exact=golden["dtype"] == "float32")
    report = "\n".join(f"{c['label']}: identical={r.identical} {r.detail}" for c, r in zip(rows, results))
    assert passed, report
    if golden["dtype"] == "float32":
        assert max(r.max_logprob_diff for r in results) < 1e-3, report


# --- the real engine, both routes, three shapes ------------------------------------------------------


@pytest.fixture(scope="session")
def reference_shape(tmp_path_factory) -> tuple[Path, Path]:
    """The format's reference shape (docs/format.md): 8 layers, d_model 768, 12 heads, d_ff 2048, vocab 32000,
    2048 positions, tied; untrained (the preset's default). (training checkpoint, converted folder)."""
    raw = made_once(tmp_path_factory, "ckpt", "reference", lambda out: make_checkpoint(out, "reference", log=quiet))
    return raw, made_once(tmp_path_factory, "hf", "reference", lambda out: convert(raw, out, log=quiet))


LONG = 2048  # the reference shape's context


@pytest.fixture(scope="session")
def trained_long(tiny_gqa, tmp_path_factory) -> tuple[Path, Path]:
    """The trained GQA test model with the reference shape's 2048 positions in its config: the same weights (RoPE
    holds no tensor, and training reads 64-token windows whatever the context), far from position 0.
    (checkpoint, folder)."""

    def longer(out: Path) -> None:
        cfg, ckpt = load(tiny_gqa)
        out.mkdir(parents=True)
        save_checkpoint(out / "model.pt", ckpt.state, dataclasses.replace(cfg, max_seq_len=LONG))
        shutil.copy(tiny_gqa / "tokenizer.json", out / "tokenizer.json")

    raw = made_once(tmp_path_factory, "ckpt", f"tiny-gqa-{LONG}", longer)
    return raw, made_once(tmp_path_factory, "hf", f"tiny-gqa-{LONG}", lambda out: convert(raw, out, log=quiet))


# model: its fixtures, (checkpoint, folder) or one giving both
MODELS = {
    "tiny": ("tiny", "tiny_hf"),
    "tiny-gqa": ("tiny_gqa", "tiny_gqa_hf"),
    "reference shape": ("reference_shape",),
    "trained, 2048 positions": ("trained_long",),
}
# test_verify.py runs the MHA model on the patched wheel (fp32 in make test, bf16 in make test-full); the
# trained 2048-position model runs on the patched wheel (the plugin route computes the same model file)
CASES = [
    (route, model, dtype)
    for route in ("patched wheel", "plugin")
    for model in MODELS
    for dtype in ("float32", "bfloat16")
    if (route, model) not in {("patched wheel", "tiny"), ("plugin", "trained, 2048 positions")}
]


def model_of(request, model: str) -> tuple[Path, Path]:
    names = MODELS[model]
    return request.getfixturevalue(names[0]) if len(names) == 1 else tuple(map(request.getfixturevalue, names))


def verify_run(python, env, hf: Path, raw: Path, dtype: str, out: Path) -> subprocess.CompletedProcess:
    command = [python, "-m", "ministream.cli", "verify", hf, "--raw", raw, "--dtype", dtype, "--out", out]
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, timeout=3600)


@pytest.mark.vllm
@pytest.mark.full
@pytest.mark.parametrize("route, model, dtype", CASES)
def test_verify_passes_far_from_position_0(route, model, dtype, route_python, request, tmp_path):
    raw, hf = model_of(request, model)
    python, env = route_python(route)
    r = verify_run(python, env, hf, raw, dtype, tmp_path)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    assert f"rule for {dtype}" in r.stdout and "PASS" in r.stdout
    golden = json.loads((tmp_path / f"golden-{dtype}.json").read_text())
    got = json.loads((tmp_path / f"vllm-{dtype}.json").read_text())["outputs"]
    assert_far_from_position_0(golden, hf, got)


@pytest.mark.vllm
@pytest.mark.full
def test_a_wrong_rope_theta_in_the_served_config_fails_verify_on_trained_weights_far_from_position_0(
    trained_long, route_python, tmp_path
):
    """The proof above can fail: the folder vLLM serves says rope_theta 10% above the checkpoint's, and verify
    (fp32) fails with the long prompts among those that part from the reference."""
    raw, hf = trained_long
    folder = tmp_path / "theta"
    shutil.copytree(hf, folder)
    config = json.loads((folder / "config.json").read_text())
    theta = config["rope_theta"] * 1.1  # both keys: transformers >= 5 reads rope_parameters, older rope_theta
    config.update(rope_theta=theta, rope_parameters={**config["rope_parameters"], "rope_theta": theta})
    (folder / "config.json").write_text(json.dumps(config))
    python, env = route_python("patched wheel")
    r = verify_run(python, env, folder, raw, "float32", tmp_path / "verify")
    assert r.returncode != 0 and "FAIL" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    golden = json.loads((tmp_path / "verify" / "golden-float32.json").read_text())
    got = json.loads((tmp_path / "verify" / "vllm-float32.json").read_text())["outputs"]
    rows = golden["context"]["prompts"]
    _, results = compare([golden["outputs"][c["index"]] for c in rows], [got[c["index"]] for c in rows], exact=True)
    assert not all(r.identical for r in results), "the long prompts kept the reference's tokens"
