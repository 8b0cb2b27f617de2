"""`ministream gguf`: the file read back with llama.cpp's own `gguf` package, tensor by tensor and key by key,
against the converted folder it came from. llama.cpp itself runs the files in test_llamacpp.py (make test-full)."""

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file

from ministream import spec
from ministream.checkpoint.gguf import CONTROL, NORMAL, UNUSED
from ministream.checkpoint.weights import read_folder

from conftest import quiet


def export(cli, src, out, *args):
    r = cli("gguf", src, out, *args)
    assert r.returncode == 0, r.stderr
    return GGUFReader(str(out))


def field(reader, key):
    f = reader.fields[key]
    values = [f.parts[i] for i in f.data]
    if f.types[0].name == "STRING":
        return bytes(values[0]).decode()
    if f.types[0].name == "ARRAY":
        return [bytes(v).decode() if f.types[-1].name == "STRING" else v[0].item() for v in values]
    return values[0][0].item()


def unpermute(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's pair order back to the format's halves (the inverse of spec.gguf_tensors' reorder)."""
    return t.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(t.shape)


def tensors(reader) -> dict[str, torch.Tensor]:
    out = {}
    for t in reader.tensors:
        data = np.array(t.data)
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the innermost dimension first
        if t.tensor_type.name == "BF16":
            out[t.name] = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
        else:
            out[t.name] = torch.from_numpy(data.copy()).reshape(shape)
    return out


@pytest.mark.parametrize("folder", ["tiny_hf", "tiny_gqa_hf"])
def test_the_file_holds_the_folders_tensors_bit_exactly_under_llama_cpps_names(folder, request, cli, tmp_path):
    hf = request.getfixturevalue(folder)
    reader = export(cli, hf, tmp_path / "m.gguf")
    cfg, _ = read_folder(hf)
    want = load_file(hf / "model.safetensors")
    got = tensors(reader)
    names = {spec.GGUF_NAMES[t].format(i=i): t.format(i=i) for t in spec.GGUF_NAMES for i in range(cfg.n_layers)}
    assert set(got) == {g for g, h in names.items() if h in want}, "one GGUF tensor per folder tensor, no more"
    assert ("output.weight" in got) == (not cfg.tie_embeddings)  # tied: llama.cpp reads the head from token_embd
    for name, t in got.items():
        expected = want[names[name]]
        heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(name.split(".")[-2])
        if heads:
            assert not torch.equal(t, expected), f"{name}: rows must be reordered for llama.cpp's RoPE"
            t = unpermute(t, heads, cfg.head_dim)
        assert torch.equal(t, expected), name


def test_the_config_and_tokenizer_are_stated_in_llama_cpps_keys(cli, tiny_gqa_hf, tmp_path):
    reader = export(cli, tiny_gqa_hf, tmp_path / "m.gguf")
    config = json.loads((tiny_gqa_hf / "config.json").read_text())
    tok = json.loads((tiny_gqa_hf / "tokenizer.json").read_text())
    assert field(reader, "general.architecture") == "llama"
    for key, hf in [
        ("llama.block_count", "num_hidden_layers"),
        ("llama.embedding_length", "hidden_size"),
        ("llama.feed_forward_length", "intermediate_size"),
        ("llama.attention.head_count", "num_attention_heads"),
        ("llama.attention.head_count_kv", "num_key_value_heads"),
        ("llama.attention.key_length", "head_dim"),
        ("llama.attention.value_length", "head_dim"),
        ("llama.rope.dimension_count", "head_dim"),
        ("llama.context_length", "max_position_embeddings"),
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ]:
        assert field(reader, key) == config[hf], key
    assert field(reader, "llama.rope.freq_base") == pytest.approx(config["rope_theta"])
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    # the padded vocabulary (576 rows, 512 tokens): one entry a row, the padding never produced
    assert len(tokens) == len(types) == config["vocab_size"] > len(tok["model"]["vocab"])
    for text, i in tok["model"]["vocab"].items():
        assert tokens[i] == text and types[i] in (NORMAL, CONTROL)
    assert all(types[i] == UNUSED for i in range(len(tok["model"]["vocab"]), config["vocab_size"]))
    assert [types[a["id"]] for a in tok["added_tokens"]] == [CONTROL] * len(tok["added_tokens"])
    assert field(reader, "tokenizer.ggml.merges") == [
        " ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]
    ]
    assert field(reader, "tokenizer.ggml.add_bos_token") is True  # the post-processor puts <|bos|> first
    assert field(reader, "tokenizer.ggml.add_eos_token") is False


def test_a_training_checkpoint_exports_the_same_file_as_its_converted_folder(cli, tiny_gqa, tiny_gqa_hf, tmp_path):
    from_raw = tensors(export(cli, tiny_gqa, tmp_path / "raw.gguf"))
    from_hf = tensors(export(cli, tiny_gqa_hf, tmp_path / "hf.gguf"))
    assert from_raw.keys() == from_hf.keys() and all(torch.equal(from_raw[k], from_hf[k]) for k in from_raw)


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_half_types_cast_the_matrices_and_keep_the_norms_f32(dtype, torch_dtype, cli, tiny_hf, tmp_path):
    reader = export(cli, tiny_hf, tmp_path / "m.gguf", "--dtype", dtype)
    want = load_file(tiny_hf / "model.safetensors")
    got = tensors(reader)
    assert got["token_embd.weight"].dtype == torch_dtype
    assert torch.equal(got["token_embd.weight"], want["model.embed_tokens.weight"].to(torch_dtype))
    assert got["output_norm.weight"].dtype == torch.float32 and got["blk.0.attn_norm.weight"].dtype == torch.float32


# llama.cpp's block types: (values per block, the levels the block's largest |value| spans, the most a value
# may move, in steps): q8_0 steps by amax/127 and rounds to the nearest; q4_0 steps by amax/8 with 16 levels
# (-8..7), so the side opposite the block's largest value loses its top level: up to a whole step there
BLOCKS = {"q8_0": (32, 127, 0.5), "q4_0": (32, 8, 1.0)}
# and the step is stored in fp16, off by up to 2^-11 of itself: times a level of up to `levels`


@pytest.mark.parametrize("dtype", BLOCKS)
def test_block_quantized_types_hold_each_value_within_its_step_and_keep_the_norms_f32(
    dtype, cli, tiny_gqa_hf, tmp_path
):
    from gguf.quants import dequantize

    exact = tensors(export(cli, tiny_gqa_hf, tmp_path / "f32.gguf"))
    reader = export(cli, tiny_gqa_hf, tmp_path / "q.gguf", "--dtype", dtype)
    assert field(reader, "general.file_type") == {"q8_0": 7, "q4_0": 2}[dtype]
    size, levels, most = BLOCKS[dtype]
    seen = set()
    for t in reader.tensors:
        want = exact[t.name]
        if want.dim() == 1:
            assert t.tensor_type.name == "F32" and torch.equal(torch.from_numpy(np.array(t.data).copy()), want)
            continue
        assert t.tensor_type.name == dtype.upper(), t.name
        got = torch.from_numpy(dequantize(np.array(t.data), t.tensor_type)).reshape(want.shape)
        blocks, err = want.reshape(-1, size), (got - want).reshape(-1, size).abs()
        steps, fp16 = blocks.abs().amax(1, keepdim=True) / levels, levels * 2**-11
        assert bool((err <= steps * (most + fp16) + 1e-7).all()), (t.name, float((err / steps).max()))
        assert float((err <= steps * (0.5 + fp16) + 1e-7).float().mean()) > 0.95, t.name  # rounded, mostly
        seen.add(t.name)
    assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"} <= seen
    assert (tmp_path / "q.gguf").stat().st_size < (tmp_path / "f32.gguf").stat().st_size / {"q8_0": 3, "q4_0": 5}[dtype]


def test_a_tokenizer_llama_cpp_would_split_differently_is_refused_by_name(cli, tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    tok = json.loads((hf / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Whitespace"}
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    r = cli("gguf", hf, tmp_path / "m.gguf")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "tokenizer.json" in r.stderr and "Whitespace" in r.stderr and "pre-tokenizer" in r.stderr
    tok["pre_tokenizer"] = json.loads((tiny_hf / "tokenizer.json").read_text())["pre_tokenizer"]
    tok["normalizer"] = {"type": "NFKC"}
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    r = cli("gguf", hf, tmp_path / "m.gguf")
    assert r.returncode == 2 and "NFKC" in r.stderr
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".m.gguf*")), "nothing half-written"


def test_an_existing_file_and_a_path_inside_the_source_are_refused(cli, tiny_hf, tmp_path):
    (tmp_path / "m.gguf").write_text("mine")
    r = cli("gguf", tiny_hf, tmp_path / "m.gguf")
    assert r.returncode == 2 and "--force" in r.stderr and (tmp_path / "m.gguf").read_text() == "mine"
    r = cli("gguf", tiny_hf, tiny_hf / "model.safetensors", "--force")
    assert r.returncode == 2 and "lies inside" in r.stderr
    (tmp_path / "empty").mkdir()
    r = cli("gguf", tmp_path / "empty", tmp_path / "x.gguf")
    assert r.returncode == 2 and "neither a converted folder" in r.stderr


def test_a_folder_whose_weights_contradict_its_config_is_refused_and_nothing_is_left(tiny_hf, tmp_path):
    from ministream import MiniStreamError
    from ministream.checkpoint.gguf import export as gguf_export

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] += 64
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(MiniStreamError, match=r"mlp\.down_proj\.weight is \[128, 384\], config.json makes it"):
        gguf_export(hf, tmp_path / "m.gguf", log=quiet)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
