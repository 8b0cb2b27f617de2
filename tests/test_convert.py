"""The converter: training checkpoint -> HF-style folder, every variant of the format, and every bad input."""

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import ministream.checkpoint.hf  # noqa: F401  registers MiniStreamForCausalLM with the Auto classes
from ministream import MiniStreamError
from ministream.checkpoint.convert import convert
from ministream.checkpoint.demo import make_checkpoint
from ministream.checkpoint.format import load
from ministream.checkpoint.reference import MiniStream
from ministream.checkpoint.weights import read_folder

from conftest import quiet

IDS = torch.tensor([[0, 40, 41, 300, 7, 99, 250, 12, 13, 14]])


def notes():
    seen = []
    return seen, seen.append


def untrained(tmp_path, name="raw", **kw):
    out = tmp_path / name
    make_checkpoint(out, kw.pop("preset", "tiny"), steps=0, log=quiet, **kw)
    return out


# --- round trip and equality -----------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny", "tiny_gqa"])
def test_raw_to_hf_to_raw_is_bit_exact(fixture, request, tmp_path):
    raw = request.getfixturevalue(fixture)
    convert(raw, tmp_path / "hf", log=quiet)
    cfg0, ckpt = load(raw)
    cfg1, state = read_folder(tmp_path / "hf")
    assert cfg1 == cfg0
    assert state.keys() == ckpt.state.keys()
    for k in state:
        assert torch.equal(state[k], ckpt.state[k]), k


def test_bfloat16_checkpoint_round_trips_bit_exactly_in_bfloat16(tmp_path):
    raw = untrained(tmp_path, dtype="bfloat16", preset="tiny-gqa")
    convert(raw, tmp_path / "hf", dtype="bfloat16", log=quiet)
    _, ckpt = load(raw)
    _, state = read_folder(tmp_path / "hf")
    assert state.keys() == ckpt.state.keys()  # every tensor: the loop below holds each one
    assert all(torch.equal(state[k], ckpt.state[k]) and state[k].dtype == torch.bfloat16 for k in state)


@pytest.mark.parametrize("raw_fixture,hf_fixture", [("tiny", "tiny_hf"), ("tiny_gqa", "tiny_gqa_hf")])
def test_transformers_on_the_folder_gives_the_reference_logits(raw_fixture, hf_fixture, request):
    raw, hf = request.getfixturevalue(raw_fixture), request.getfixturevalue(hf_fixture)
    ref = MiniStream.from_checkpoint(raw)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "MiniStreamForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref(IDS), rtol=1e-5, atol=1e-4)


def test_untied_head_is_written_and_used(tiny_gqa_hf, tiny_gqa):
    tensors = load_file(tiny_gqa_hf / "model.safetensors")
    _, ckpt = load(tiny_gqa)
    assert torch.equal(tensors["lm_head.weight"], ckpt.state["lm_head.weight"])
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert json.loads((tiny_gqa_hf / "config.json").read_text())["tie_word_embeddings"] is False


def test_tied_folder_has_no_lm_head(tiny_hf):
    assert "lm_head.weight" not in load_file(tiny_hf / "model.safetensors")


def test_wqkv_and_w12_rows_go_to_q_k_v_and_gate_up_in_order(tiny_gqa, tiny_gqa_hf):
    cfg, ckpt = load(tiny_gqa)
    t = load_file(tiny_gqa_hf / "model.safetensors")
    W = ckpt.state["blocks.1.attn.Wqkv.weight"]
    nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    assert torch.equal(t["model.layers.1.self_attn.q_proj.weight"], W[:nq])
    assert torch.equal(t["model.layers.1.self_attn.k_proj.weight"], W[nq : nq + nk])
    assert torch.equal(t["model.layers.1.self_attn.v_proj.weight"], W[nq + nk :])
    W12 = ckpt.state["blocks.1.mlp.w12.weight"]
    assert torch.equal(t["model.layers.1.mlp.gate_proj.weight"], W12[: cfg.d_ff])
    assert torch.equal(t["model.layers.1.mlp.up_proj.weight"], W12[cfg.d_ff :])


# --- the folder's files ------------------------------------------------------------------------


def test_config_json_states_every_value_explicitly(tiny_gqa_hf):
    c = json.loads((tiny_gqa_hf / "config.json").read_text())
    assert c["architectures"] == ["MiniStreamForCausalLM"] and c["model_type"] == "ministream"
    assert (c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]) == (64, 4, 2, 128)
    assert c["rope_theta"] == 10000.0 and c["rope_parameters"]["rope_theta"] == 10000.0
    assert c["rms_norm_eps"] == 1e-6 and c["vocab_size"] == 576  # 512 tokens, padded by 64 rows
    assert (c["bos_token_id"], c["eos_token_id"], c["dtype"]) == (0, 1, "float32")


def test_tokenizer_and_generation_config_are_written(tiny_hf, tiny):
    tc = json.loads((tiny_hf / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tc["bos_token"], tc["eos_token"]) == ("<|bos|>", "<|eos|>")
    assert "chat_template" not in tc
    assert (tiny_hf / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    gc = json.loads((tiny_hf / "generation_config.json").read_text())
    assert (gc["bos_token_id"], gc["eos_token_id"]) == (0, 1)
    tok = AutoTokenizer.from_pretrained(tiny_hf)
    assert tok("The river").input_ids[0] == 0 and tok.eos_token_id == 1


def test_chat_template_flag_lands_in_tokenizer_config(tiny, tmp_path, cli):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    r = cli("convert", tiny, tmp_path / "hf", "--chat-template", tmp_path / "chat.jinja")
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.chat_template == template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi\n"


def test_large_models_are_sharded_with_an_index(tiny_gqa, tmp_path):
    convert(tiny_gqa, tmp_path / "hf", max_shard_size=400_000, log=quiet)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "hf" / "model.safetensors").exists()
    assert all((tmp_path / "hf" / s).stat().st_size <= 400_000 + 200_000 for s in shards)
    _, state = read_folder(tmp_path / "hf")
    _, ckpt = load(tiny_gqa)
    assert state.keys() == ckpt.state.keys()  # across the shards, every tensor and no other
    assert all(torch.equal(state[k], ckpt.state[k]) for k in state)
    ref = MiniStream.from_checkpoint(tiny_gqa)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, ref(IDS), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_flag_casts_every_tensor(tiny, tmp_path, dtype):
    convert(tiny, tmp_path / "hf", dtype=dtype, log=quiet)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    _, ckpt = load(tiny)
    assert all(t.dtype == getattr(torch, dtype) for t in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], ckpt.state["norm_f.weight"].to(getattr(torch, dtype)))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == dtype


# --- what real checkpoints look like ----------------------------------------------------------


def test_ddp_and_compile_prefixes_are_stripped_and_said(tmp_path):
    raw = untrained(tmp_path, prefix="both")
    assert next(iter(torch.load(raw / "model.pt", weights_only=True)["model"])).startswith("module._orig_mod.")
    seen, log = notes()
    convert(raw, tmp_path / "hf", log=log)
    assert any("module." in s and "_orig_mod." in s for s in seen)


def test_blocks_numbered_from_one_are_renumbered_and_said(tmp_path):
    raw = untrained(tmp_path, one_based=True)
    keys = torch.load(raw / "model.pt", weights_only=True)["model"]
    assert "blocks.0.norm1.weight" not in keys and "blocks.2.norm1.weight" in keys
    seen, log = notes()
    convert(raw, tmp_path / "hf", log=log)
    assert any("renumbered" in s for s in seen)
    _, state = read_folder(tmp_path / "hf")
    assert torch.equal(state["blocks.0.norm1.weight"], keys["blocks.1.norm1.weight"])


def test_optimizer_state_and_step_are_ignored(tiny, tmp_path):
    assert "optimizer" in torch.load(tiny / "model.pt", weights_only=True)
    seen, log = notes()
    convert(tiny, tmp_path / "hf", log=log)
    assert any("optimizer" in s for s in seen)


def test_a_shape_never_seen_converts_without_code_changes(tmp_path, cli):
    """30 layers, d_model 576, 9 heads over 3 kv heads, head_dim 64, vocab 49152, DDP prefix, optimizer state."""
    raw = tmp_path / "raw"
    r = cli("checkpoint", "--preset", "tiny", "--out", raw, "--steps", "0", "--dtype", "bfloat16", "--prefix", "ddp")
    assert r.returncode == 0, r.stderr
    cfg = dict(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        d_ff=1536,
        max_seq_len=2048,
        norm_eps=1e-5,
        rope_theta=100000.0,
        bos_id=0,
        eos_id=1,
        tie_embeddings=True,
    )
    from ministream.checkpoint.format import TrainConfig
    from ministream.checkpoint.reference import MiniStream as M

    model = M(TrainConfig(**cfg)).to(torch.bfloat16)
    state = {"module." + k: v for k, v in model.state_dict().items()}
    torch.save(
        {"model": state, "config": cfg, "step": 1000, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}},
        raw / "model.pt",
    )
    r = cli("convert", raw, tmp_path / "hf", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (30, 3, 64, 49152)
    _, back = read_folder(tmp_path / "hf")
    assert back.keys() == load(raw)[1].state.keys()  # every tensor the checkpoint holds (the tied head once)
    assert all(torch.equal(back[k], state["module." + k]) for k in back)


def test_checkpoint_without_config_needs_flags_and_says_which(tmp_path, cli):
    raw = untrained(tmp_path, bare=True)
    r = cli("convert", raw, tmp_path / "hf")
    assert r.returncode == 2
    assert "no config entry" in r.stderr and "--n-heads" in r.stderr and "d_model=128" in r.stderr
    assert not (tmp_path / "hf").exists()
    flags = [
        "--vocab-size",
        512,
        "--d-model",
        128,
        "--n-layers",
        2,
        "--n-heads",
        2,
        "--d-ff",
        384,
        "--max-seq-len",
        512,
        "--norm-eps",
        1e-6,
        "--rope-theta",
        10000,
        "--bos-id",
        0,
        "--eos-id",
        1,
    ]
    r = cli("convert", raw, tmp_path / "hf", *flags)
    assert r.returncode == 0, r.stderr
    r = cli("convert", raw, tmp_path / "hf2", *flags, "--d-ff", 512)
    assert r.returncode == 2 and "blocks.0.mlp.w12.weight" in r.stderr and "[768, 128]" in r.stderr, r.stderr
    assert "[1024, 128]" in r.stderr and not (tmp_path / "hf2").exists()


def test_flag_contradicting_the_checkpoint_config_is_refused(tiny, tmp_path, cli):
    r = cli("convert", tiny, tmp_path / "hf", "--rope-theta", "500000")
    assert r.returncode == 2 and "rope_theta" in r.stderr


# --- bad input: a clear error, exit != 0, nothing written ----------------------------------------


def assert_refused(cli, raw, out, *words):
    r = cli("convert", raw, out)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
    return r.stderr


def test_truncated_checkpoint(tiny, tmp_path, cli):
    (tmp_path / "raw").mkdir()
    data = (tiny / "model.pt").read_bytes()
    (tmp_path / "raw" / "model.pt").write_bytes(data[: len(data) // 2])
    assert_refused(cli, tmp_path / "raw", tmp_path / "hf", "model.pt", "truncated")


def test_file_that_is_not_a_checkpoint(tmp_path, cli):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "model.pt").write_text("this is a text file, not a checkpoint\n" * 10)
    assert_refused(cli, tmp_path / "raw", tmp_path / "hf", "model.pt", "not a readable torch checkpoint")


def test_missing_model_pt(tmp_path, cli):
    (tmp_path / "raw").mkdir()
    assert_refused(cli, tmp_path / "raw", tmp_path / "hf", "model.pt", "no such file")


class Payload:
    """Unpickling this would run code; weights_only loading must refuse it."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/ministream-pwned",))


def test_pickle_that_needs_code_execution_is_refused_never_run(tmp_path, cli):
    (tmp_path / "raw").mkdir()
    torch.save({"model": {"embedding.weight": torch.zeros(2, 2)}, "config": Payload()}, tmp_path / "raw" / "model.pt")
    if os.path.exists("/tmp/ministream-pwned"):
        os.remove("/tmp/ministream-pwned")
    err = assert_refused(cli, tmp_path / "raw", tmp_path / "hf", "code", "refused")
    assert "system" in err
    assert not os.path.exists("/tmp/ministream-pwned")


def rewrite(raw, fn):
    obj = torch.load(raw / "model.pt", weights_only=True)
    fn(obj)
    torch.save(obj, raw / "model.pt")


def test_missing_key(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["model"].pop("blocks.1.mlp.w3.weight"))
    assert_refused(cli, raw, tmp_path / "hf", "missing", "blocks.1.mlp.w3.weight")


def test_extra_key(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["model"].__setitem__("blocks.0.attn.Wqkv.bias", torch.zeros(384)))
    assert_refused(cli, raw, tmp_path / "hf", "unexpected", "blocks.0.attn.Wqkv.bias")


def test_shape_that_contradicts_the_config(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["config"].__setitem__("d_ff", 512))
    assert_refused(cli, raw, tmp_path / "hf", "blocks.0.mlp.w12.weight", "[768, 128]", "[1024, 128]")


def test_n_heads_not_divisible_by_n_kv_heads(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["config"].update(n_heads=3, n_kv_heads=2, head_dim=64))
    assert_refused(cli, raw, tmp_path / "hf", "n_heads=3", "n_kv_heads=2")


def test_untied_config_without_lm_head(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["config"].__setitem__("tie_embeddings", False))
    assert_refused(cli, raw, tmp_path / "hf", "lm_head.weight", "tie_embeddings")


def test_tokenizer_larger_than_the_vocabulary(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(
        raw,
        lambda o: (
            o["config"].__setitem__("vocab_size", 256),
            o["model"].__setitem__("embedding.weight", o["model"]["embedding.weight"][:256]),
        ),
    )
    assert_refused(cli, raw, tmp_path / "hf", "tokenizer.json", "512 tokens", "vocab_size=256")


def test_missing_tokenizer(tmp_path, cli):
    raw = untrained(tmp_path)
    (raw / "tokenizer.json").unlink()
    assert_refused(cli, raw, tmp_path / "hf", "tokenizer.json")


def test_non_empty_output_is_refused_without_force_and_left_alone(tiny, tmp_path, cli):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("user work")
    r = cli("convert", tiny, out)
    assert r.returncode == 2 and "--force" in r.stderr
    assert (out / "notes.txt").read_text() == "user work" and len(list(out.iterdir())) == 1
    r = cli("convert", tiny, out, "--force")
    assert r.returncode == 0, r.stderr
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_failed_forced_conversion_keeps_the_old_folder(tiny, tmp_path, cli):
    out = tmp_path / "hf"
    assert cli("convert", tiny, out).returncode == 0
    before = (out / "model.safetensors").read_bytes()
    raw = untrained(tmp_path)
    (raw / "tokenizer.json").write_text("{not json")
    r = cli("convert", raw, out, "--force")
    assert r.returncode == 2
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "raw"]


# --- outputs never destroy inputs ------------------------------------------------------------


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("where", ["parent", "same", "inside", "dot-dot", "symlink"])
def test_an_output_that_is_holds_or_lies_inside_the_checkpoint_is_refused_even_with_force(tiny, tmp_path, cli, where):
    """The reported bug: `convert run/raw run --force` deleted run/raw and said it succeeded."""
    run = tmp_path / "run"
    shutil.copytree(tiny, run / "raw")
    before = digest(run / "raw")
    (tmp_path / "link").symlink_to(run)
    out = {
        "parent": run,
        "same": run / "raw",
        "inside": run / "raw" / "hf",
        "dot-dot": run / "raw" / ".." / ".",
        "symlink": tmp_path / "link",
    }[where]
    r = cli("convert", run / "raw", out, "--force")
    assert r.returncode == 2 and "destroy what the command reads" in r.stderr, r.stderr
    assert digest(run / "raw") == before
    assert sorted(p.name for p in run.iterdir()) == ["raw"]


def test_a_checkpoint_reached_through_a_symlinked_model_pt_is_an_input_too(tiny, tmp_path, cli):
    store = tmp_path / "store"
    shutil.copytree(tiny, store)
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in ("model.pt", "tokenizer.json"):
        (raw / f).symlink_to(store / f)
    r = cli("convert", raw, store, "--force")
    assert r.returncode == 2 and "destroy what the command reads" in r.stderr
    assert digest(store) == digest(tiny)


def test_sigterm_mid_conversion_leaves_the_old_output_and_no_temporary_folder(tmp_path):
    raw = untrained(tmp_path, preset="reference")  # 81M parameters: seconds of writing, time to interrupt
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("the previous conversion")
    exe = Path(sys.executable).parent / "ministream"
    proc = subprocess.Popen(
        [str(exe), "convert", str(raw), str(out), "--force", "--max-shard-size", "1MB"],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".hf.tmp-*/*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "raw"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]


def test_an_output_that_appears_while_converting_is_left_alone_without_force(tiny, tmp_path, monkeypatch):
    from ministream.checkpoint import convert as module

    out = tmp_path / "hf"
    real = module.write_folder

    def slow(tmp, *args, **kwargs):
        real(tmp, *args, **kwargs)
        out.mkdir()
        (out / "theirs.txt").write_text("written by someone else meanwhile")

    monkeypatch.setattr(module, "write_folder", slow)
    with pytest.raises(MiniStreamError, match="exists and is not empty"):
        convert(tiny, out, log=quiet)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# --- hostile configs and weights -------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("d_model", "abc", "d_model='abc': must be a number"),
        ("n_layers", 10**9, "n_layers=1000000000: absurdly large"),
        ("norm_eps", float("nan"), "norm_eps=nan: must be finite"),
        ("tie_embeddings", "no", "tie_embeddings='no': must be true or false"),
        ("head_dim", 63.5, "head_dim=63.5: must be an integer"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_size_is_one_line_naming_the_key(tmp_path, cli, key, value, words):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["config"].__setitem__(key, value))
    err = assert_refused(cli, raw, tmp_path / "hf", words)
    assert len(err.strip().splitlines()) == 1


def test_nan_weights_are_refused_with_the_tensor_name_unless_allowed(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["model"]["blocks.1.mlp.w3.weight"].__setitem__((0, 0), float("inf")))
    assert_refused(cli, raw, tmp_path / "hf", "model.layers.1.mlp.down_proj.weight", "NaN or Inf", "--allow-nonfinite")
    r = cli("convert", raw, tmp_path / "hf", "--allow-nonfinite")
    assert r.returncode == 0, r.stderr


def test_a_float16_cast_that_overflows_is_refused(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(raw, lambda o: o["model"]["embedding.weight"].__setitem__((3, 1), 1e6))
    r = cli("convert", raw, tmp_path / "hf", "--dtype", "float16")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    for words in ("model.embed_tokens.weight", "overflows", "--dtype bfloat16"):
        assert words in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]
    assert cli("convert", raw, tmp_path / "hf", "--dtype", "bfloat16").returncode == 0  # bf16 holds 1e6


# --- dry run -----------------------------------------------------------------------------------


def test_dry_run_prints_the_table_and_writes_nothing(tiny_gqa, tmp_path, cli):
    r = cli("convert", tiny_gqa, tmp_path / "hf", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "blocks.0.attn.Wqkv.weight" in r.stdout and "model.layers.0.self_attn.k_proj.weight" in r.stdout
    assert "in the checkpoint, not in the mapping: none" in r.stdout
    assert "MiniStreamForCausalLM parameters not written: none" in r.stdout
    assert not (tmp_path / "hf").exists()


def test_dry_run_shows_the_key_differences(tmp_path, cli):
    raw = untrained(tmp_path)
    rewrite(
        raw, lambda o: (o["model"].pop("norm_f.weight"), o["model"].__setitem__("final_norm.weight", torch.ones(128)))
    )
    r = cli("convert", raw, "--dry-run")
    assert r.returncode == 1
    assert "in the checkpoint, not in the mapping: final_norm.weight" in r.stdout
    assert "in the mapping, not in the checkpoint: norm_f.weight" in r.stdout


def test_the_converted_folder_gets_the_mode_mkdir_would_give_under_the_umask(tiny, tmp_path):
    """A folder converted by one user and served by another (the image's unprivileged user) must be readable:
    the temporary folder's 0700 must not survive the rename."""
    old = os.umask(0o022)
    try:
        convert(tiny, tmp_path / "hf", log=lambda *a, **k: None)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()} == {0o644}
