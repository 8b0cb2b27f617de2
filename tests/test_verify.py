"""`ministream verify`: the golden file, the rule for the dtype, and the diagnosis of each classic bug.

Each bug is injected into a copy of a converted folder, as a broken converter would leave it. The
layer-by-layer diagnosis is checked for every bug with the reference model reading the broken copy in
place of vLLM (the same config and tensors, no engine start); `ministream verify` runs the real engine
on the clean folder in fp32 and bf16 and on two of the bugs end to end.
"""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ministream import MiniStreamError
from ministream.run.generate import DEFAULT_PROMPTS, tokenize
from ministream.run.verify import (
    THRESHOLDS,
    compare,
    first_divergence,
    folder_findings,
    layer_table,
    make_golden,
    read_golden,
    read_prompts,
    reference_states,
)


def _scale_q(t, cfg):
    for k in t:
        if k.endswith("q_proj.weight"):
            t[k] = t[k] * math.sqrt(cfg["head_dim"] / cfg["hidden_size"])


def _swap(t, layer, a, b):
    pa, pb = f"model.layers.{layer}.{a}.weight", f"model.layers.{layer}.{b}.weight"
    t[pa], t[pb] = t[pb], t[pa]


def _set_config(cfg, **values):
    cfg.update(values)
    if "rope_theta" in values:
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_theta": values["rope_theta"]}


def _untie_with_zeros(t, cfg):
    cfg["tie_word_embeddings"] = False
    t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])


# bug: (what it does to the tensors t and config c, the stage the diagnosis must name, words a finding must hold)
BUGS = {
    "attention_scale": (_scale_q, "layer 0", "attention scaled by 1/sqrt(d_model)"),
    # x10 (1e-6 -> 1e-5) changes no greedy token of the tiny model; x1000 does (see the test below)
    "eps_x1000": (lambda t, c: _set_config(c, rms_norm_eps=c["rms_norm_eps"] * 1000), "layer 0", "rms_norm_eps"),
    "rope_theta": (lambda t, c: _set_config(c, rope_theta=100.0), "layer 0", "rope_theta"),
    "gate_up_swapped": (lambda t, c: _swap(t, 1, "mlp.gate_proj", "mlp.up_proj"), "layer 1", "swapped"),
    "q_k_swapped": (lambda t, c: _swap(t, 1, "self_attn.q_proj", "self_attn.k_proj"), "layer 1", "swapped"),
    "untied_head_zeros": (_untie_with_zeros, "logits", "lm_head.weight is in the folder and all zeros"),
}


def inject(folder: Path, bug: str, out: Path) -> Path:
    """A copy of the converted folder with one bug in its config or weights."""
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    BUGS[bug][0](tensors, cfg)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def test_prompt_file_is_one_prompt_a_line_or_a_json_list(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond one\n")
    (tmp_path / "p.json").write_text(json.dumps(["a", "b c"]))
    assert read_prompts(tmp_path / "p.txt") == ["first prompt", "second one"]
    assert read_prompts(tmp_path / "p.json") == ["a", "b c"]


def test_golden_file_records_prompts_ids_outputs_and_the_reference_source(tiny, tiny_hf, tmp_path):
    golden = make_golden(tiny_hf, tiny, DEFAULT_PROMPTS[:2], "float32", max_tokens=4, top_k=3)
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(golden))
    g = read_golden(path)
    assert g["golden_version"] == 1 and g["format_version"] == 1 and g["dtype"] == "float32"
    assert g["prompt_ids"] == tokenize(tiny_hf, DEFAULT_PROMPTS[:2])
    assert [len(o["ids"]) for o in g["outputs"]] == [4, 4] and len(g["outputs"][0]["logprobs"][0]) == 3
    assert g["reference"]["kind"] == "training checkpoint" and len(g["reference"]["sha256"]["model.pt"]) == 64


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_injected_bug_is_named_by_layer_and_by_setting_or_tensor(bug, tiny, tiny_hf, tmp_path, monkeypatch):
    broken = inject(tiny_hf, bug, tmp_path / bug)
    # the reference model stands in for vLLM, which reads a folder the folder check refuses (an all-zero head)
    monkeypatch.setattr("ministream.checkpoint.weights.checked", lambda folder: None)
    ids = tokenize(tiny_hf, DEFAULT_PROMPTS)
    golden = make_golden(tiny_hf, tiny, DEFAULT_PROMPTS, "float32", max_tokens=16)
    served = make_golden(broken, broken, DEFAULT_PROMPTS, "float32", max_tokens=16)  # stands in for vLLM
    passed, _ = compare(golden["outputs"], served["outputs"], exact=True)
    assert not passed, f"{bug} left every greedy token unchanged: the injection is too weak to test"
    stages = layer_table(reference_states(tiny, "float32", ids), reference_states(broken, "float32", ids))
    first = first_divergence(stages, THRESHOLDS["float32"])
    _, want_stage, want_words = BUGS[bug]
    assert first is not None and first.name == want_stage, stages
    findings = folder_findings(broken, tiny)
    assert any(want_words in f for f in findings), findings


def test_eps_off_by_10x_is_named_by_the_folder_check_even_where_tokens_agree(tiny, tiny_hf, tmp_path):
    broken = tmp_path / "eps"
    shutil.copytree(tiny_hf, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 10}))
    findings = folder_findings(broken, tiny)
    assert len(findings) == 1 and findings[0].startswith("config.json rms_norm_eps="), findings


def test_clean_folder_has_no_findings_and_no_diverging_layer(tiny, tiny_hf):
    assert folder_findings(tiny_hf, tiny) == []
    ids = tokenize(tiny_hf, DEFAULT_PROMPTS[:3])
    stages = layer_table(reference_states(tiny, "float32", ids), reference_states(tiny_hf, "float32", ids))
    assert [s.name for s in stages] == ["embeddings", "layer 0", "layer 1", "logits"]
    assert first_divergence(stages, THRESHOLDS["float32"]) is None


# --- the real engine ------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.full)])
def test_verify_passes_on_the_converted_folder(dtype, cli, tiny, tiny_hf, tmp_path):
    """The built-in set's short prompts and those far from position 0 (test_long_context.py has the others)."""
    from test_long_context import assert_far_from_position_0

    r = cli("verify", tiny_hf, "--raw", tiny, "--dtype", dtype, "--out", tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"rule for {dtype}" in r.stdout and "PASS" in r.stdout
    golden = read_golden(tmp_path / f"golden-{dtype}.json")
    got = json.loads((tmp_path / f"vllm-{dtype}.json").read_text())["outputs"]
    assert golden["prompts"][: len(DEFAULT_PROMPTS)] == DEFAULT_PROMPTS
    assert_far_from_position_0(golden, tiny_hf, got)
    assert "[the end: 480 prompt tokens + 32 new of 512 positions] 'The river" in r.stdout, r.stdout[-3000:]


@pytest.mark.vllm
@pytest.mark.full
def test_verify_passes_in_bfloat16_where_onednn_makes_no_bfloat16_matmul(cli, tiny, tiny_hf, tmp_path):
    """On an x86 CPU with AVX2 alone vLLM multiplies bfloat16 weights in its fallback, where the CPU part puts its
    product (fork/cpu.py gemm_fix), and the prompts take both ways: widened for a prefill's hundreds of rows, its
    own kernel for a decode step's few. On a CPU with AVX-512 oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA) and
    refuses bfloat16 as there; not on one with AMX, whose vLLM attention then dies of SIGILL (cpu_attn_amx.hpp: the
    tiles' permission is oneDNN's to ask) and whose small weights take vLLM's AMX kernel, not the fallback."""
    from ministream.cpuinfo import flags
    from ministream.fork.cpu import GEMM_FILE
    from ministream.run.kernels import installed_vllm_dir

    have = flags()
    if "amx_tile" in have or "avx2" not in have:
        pytest.skip("an x86 CPU with AVX2 and without AMX runs vLLM's bfloat16 fallback, natively or held to AVX2")
    vllm_dir = installed_vllm_dir()
    assert vllm_dir is not None and "layer.cpu_linear = _ministream_linear" in (vllm_dir.parent / GEMM_FILE).read_text()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG"} | ({"ONEDNN_MAX_CPU_ISA": "AVX2"} if "avx512f" in have else {})
    r = cli("verify", tiny_hf, "--raw", tiny, "--dtype", "bfloat16", "--out", tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rule for bfloat16" in r.stdout and "PASS" in r.stdout, r.stdout[-3000:]
    assert "using torch.nn.functional.linear (fallback)" in r.stdout + r.stderr  # vLLM's own word: it was taken


@pytest.mark.vllm
@pytest.mark.parametrize("bug", [pytest.param("gate_up_swapped", marks=pytest.mark.full), "rope_theta"])
def test_verify_fails_on_a_bug_and_names_the_layer_and_the_cause(bug, cli, tiny, tiny_hf, tmp_path):
    broken = inject(tiny_hf, bug, tmp_path / bug)
    r = cli("verify", broken, "--raw", tiny, "--out", tmp_path / "out", "--max-tokens", 16)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    _, stage, words = BUGS[bug]
    assert "FAIL" in r.stdout and f"first diverging: {stage} " in r.stdout, r.stdout[-3000:]
    assert words in r.stdout, r.stdout[-3000:]


# --- outputs apart from inputs ----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.full
def test_verify_fails_a_folder_unlike_the_checkpoint_even_where_every_token_agrees(cli, tiny, tiny_hf, tmp_path):
    """rms_norm_eps x10 in config.json: no greedy token of these prompts moves (checked on the reference model
    first), so only the folder check against the checkpoint sees another model; verify used to say PASS and warn."""
    broken = tmp_path / "eps"
    shutil.copytree(tiny_hf, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 10}))
    prompts = DEFAULT_PROMPTS[:3]
    golden = make_golden(tiny_hf, tiny, prompts, "float32", max_tokens=16)
    served = make_golden(broken, broken, prompts, "float32", max_tokens=16)
    assert compare(golden["outputs"], served["outputs"], exact=True)[0], "eps x10 moved a token: too strong a plant"
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    r = cli(
        "verify",
        broken,
        "--raw",
        tiny,
        "--out",
        tmp_path / "out",
        "--max-tokens",
        16,
        "--prompts",
        tmp_path / "prompts.txt",
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FAIL: vLLM's tokens equal the reference model's" in r.stdout and "rms_norm_eps" in r.stdout, r.stdout[
        -3000:
    ]


@pytest.mark.parametrize(
    "where", ["the_model", "inside_the_model", "around_the_model", "inside_raw", "a_symlink_to_the_model"]
)
def test_verify_refuses_an_out_folder_that_overlaps_an_input(cli, tiny, tiny_hf, tree, tmp_path, where):
    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_hf, model)
    raw = tmp_path / "raw"
    shutil.copytree(tiny, raw)
    if where == "a_symlink_to_the_model":
        (tmp_path / "link").symlink_to(model)
    out, how = {
        "the_model": (model, "is"),
        "inside_the_model": (model / "verify", "lies inside"),
        "around_the_model": (model.parent, "holds"),
        "inside_raw": (raw / "verify", "lies inside"),
        "a_symlink_to_the_model": (tmp_path / "link", "is"),
    }[where]
    before = tree(tmp_path)
    r = cli("verify", model, "--raw", raw, "--out", out, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"the output {out} {how} the input" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert tree(tmp_path) == before


def test_verify_never_empties_a_dump_folder_holding_files_it_did_not_write(tiny_hf, tmp_path):
    from ministream import MiniStreamError
    from ministream.run.engine import EngineSettings
    from ministream.run.verify import vllm_outputs

    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "forward-1-0.pt").write_bytes(b"")  # a dump of an earlier run: may go
    (dump / "thesis.tex").write_text("weeks of work")  # not verify's
    with pytest.raises(MiniStreamError, match=r"holds files verify did not write \(thesis.tex\)"):
        vllm_outputs(tiny_hf, {}, dump, EngineSettings())
    assert (dump / "thesis.tex").read_text() == "weeks of work"


# --- the rule is applied to every token it names (issue 54): a comparison over nothing never passes ---------

REF = {"ids": [7, 8, 9], "logprobs": [{7: -0.1, 3: -2.0}, {8: -0.2, 4: -2.5}, {9: -0.3, 5: -3.0}]}


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param({"ids": [7, 8, 9], "logprobs": []}, id="vllm-gave-no-logprobs"),
        pytest.param({"ids": [7, 8, 9]}, id="vllm-answer-without-a-logprobs-key"),
        pytest.param({"ids": [7, 8, 9], "logprobs": [{7: -0.1}, {1: -0.2}, {9: -0.3}]}, id="chosen-token-missing"),
        pytest.param({"ids": [7, 8, 9], "logprobs": [{7: -0.1}]}, id="logprobs-shorter-than-the-ids"),
    ],
)
def test_the_top_k_rule_fails_where_a_token_it_names_has_no_logprob(plant):
    passed, rows = compare([REF], [plant], exact=False)
    assert not passed and not rows[0].within_top_k, rows
    assert "not compared" in rows[0].detail
    assert rows[0].max_logprob_diff == math.inf  # never a small number that vouches for what was not compared


def test_a_first_difference_past_the_other_side_s_logprobs_fails_in_one_verdict_not_a_traceback():
    passed, rows = compare([REF], [{"ids": [7, 8, 1], "logprobs": [{7: -0.1}, {8: -0.2}]}], exact=False)
    assert not passed and rows[0].first_difference == 2


@pytest.mark.parametrize("exact", [True, False], ids=["float32", "top-k"])
def test_no_prompts_or_a_reference_without_new_tokens_never_passes(exact):
    assert compare([], [], exact=exact) == (False, [])
    passed, rows = compare([{"ids": [], "logprobs": []}], [{"ids": [], "logprobs": []}], exact=exact)
    assert not passed and rows[0].compared == 0 and "nothing was compared" in rows[0].detail


def test_a_pass_counts_the_tokens_it_compared_and_their_logprob_differences():
    got = {"ids": [7, 8, 9], "logprobs": [{7: -0.1}, {8: -0.25}, {9: -0.3}]}
    passed, rows = compare([REF], [got], exact=True)
    assert passed and rows[0].compared == 3 and rows[0].max_logprob_diff == pytest.approx(0.05)
    passed, rows = compare([REF], [{"ids": [7, 8, 9]}], exact=True)  # ids alone: identical, no logprob vouched for
    assert passed and rows[0].max_logprob_diff == math.inf


def test_a_different_number_of_prompts_is_one_line_not_a_pairing():
    with pytest.raises(MiniStreamError, match="1 prompts' outputs, vllm 2"):
        compare([REF], [REF, REF], exact=True)
