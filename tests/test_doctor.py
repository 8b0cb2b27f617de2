"""`ministream doctor`: each broken folder gets its one-line finding with the fix; no engine starts."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ministream.checkpoint.folder import Tensor, check_vocab
from ministream.run.doctor import doctor
from ministream.run.engine import EngineSettings


def broken(tiny_hf: Path, where: Path, tensors=None, tokenizer=None, **config) -> Path:
    """A copy of the converted folder with config.json keys set (None: removed) and the tensors edited."""
    shutil.copytree(tiny_hf, where)
    cfg = json.loads((where / "config.json").read_text())
    cfg.update(config)
    (where / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    if tensors:
        t = load_file(where / "model.safetensors")
        tensors(t)
        save_file(t, where / "model.safetensors", metadata={"format": "pt"})
    if tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(where / "tokenizer.json"))
        tokenizer(tok)
        tok.save(str(where / "tokenizer.json"))
    return where


def errors(found) -> list[str]:
    return [str(f) for f in found if f.level == "error"]


def test_converted_folder_is_healthy_and_the_command_exits_0(cli, tiny_hf):
    r = cli("doctor", tiny_hf)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 error(s)" in r.stdout and "error" not in r.stdout.replace("0 error(s)", "")
    assert "MiniStream patch 0.32.0-" in r.stdout  # the installed vLLM is ours, and says which patch


def test_broken_folder_exits_nonzero_with_one_line_per_finding(cli, tiny_hf, tmp_path):
    folder = broken(tiny_hf, tmp_path / "f", architectures=["MinistreamForCausalLM"], rms_norm_eps=None)
    r = cli("doctor", folder)
    assert r.returncode == 1
    lines = [line for line in r.stdout.splitlines() if line.startswith("error")]
    assert len(lines) == 2 and all("; fix: " in line for line in lines), r.stdout


def test_architecture_in_the_wrong_case_is_named_with_the_exact_name(tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", architectures=["MinistreamForCausalLM"])))
    assert len(found) == 1 and "exact case" in found[0] and '["MiniStreamForCausalLM"]' in found[0]


def test_unknown_model_type_is_an_error(tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", model_type="mini_stream")))
    assert len(found) == 1 and "model_type='mini_stream': must be \"ministream\"" in found[0], found


def test_llama_model_type_is_known_to_transformers(tiny_hf, tmp_path):
    found = doctor(broken(tiny_hf, tmp_path / "f", model_type="llama"))
    assert not errors(found) and any("'llama' is known to the installed transformers" in str(f) for f in found)


def test_unpatched_vllm_is_named_with_make_install(tiny_hf, tmp_path):
    fake = tmp_path / "vllm"  # a release's files: the registry without our entry, no ministream.py
    (fake / "model_executor/models").mkdir(parents=True)
    (fake / "transformers_utils").mkdir()
    (fake / "model_executor/models/registry.py").write_text(
        '_TEXT_GENERATION_MODELS = {\n    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),\n}\n'
    )
    (fake / "transformers_utils/config.py").write_text(
        '_CONFIG_REGISTRY = LazyConfigDict(\n    eagle="EAGLEConfig",\n)\n'
    )
    (fake / "transformers_utils/configs").mkdir()
    (fake / "transformers_utils/configs/__init__.py").write_text('__all__ = ["EAGLEConfig"]\n')
    found = errors(doctor(tiny_hf, vllm_dir=fake))
    assert any("does not register MiniStreamForCausalLM; fix: install the patched vLLM" in f for f in found), found
    assert any("'ministream' is known to neither" in f for f in found), found
    assert any("is not patched" in f and "make install" in f for f in found), found


def test_head_dim_that_disagrees_with_the_weights_gives_the_right_value(tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", head_dim=32)))
    assert any(f.startswith("error head_dim: config.json head_dim=32") and '"head_dim": 64' in f for f in found), found


def test_untied_head_without_lm_head_is_an_error(tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", tie_word_embeddings=False)))
    assert any("tie_word_embeddings is false but there is no lm_head.weight" in f for f in found), found
    assert any("missing from the safetensors files: lm_head.weight" in f for f in found), found


def test_untied_head_left_at_zeros_is_an_error(tiny_hf, tmp_path):
    def zeros(t):
        t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])

    found = errors(doctor(broken(tiny_hf, tmp_path / "f", zeros, tie_word_embeddings=False)))
    assert len(found) == 1 and "lm_head.weight is all zeros" in found[0]


def test_tied_head_with_an_lm_head_tensor_is_a_warning(tiny_hf, tmp_path):
    def head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    found = doctor(broken(tiny_hf, tmp_path / "f", head))
    assert any(f.level == "warn" and "vLLM ignores the tensor" in str(f) for f in found)
    assert any("not parameters of MiniStreamForCausalLM: lm_head.weight" in f for f in errors(found))


def test_tokenizer_bigger_than_the_vocabulary_is_an_error(tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", tokenizer=lambda t: t.add_tokens(["<extra1>", "<extra2>"]))))
    assert len(found) == 1 and "the tokenizer has 514 tokens but the model only 512 rows" in found[0]


def test_vocabulary_padded_beyond_the_tokenizer_is_fine():
    f = check_vocab({"vocab_size": 576}, {"model.embed_tokens.weight": Tensor((576, 8), "F32", Path("x"))}, 514)
    assert f.level == "ok" and "62 padding rows" in str(f)


def test_vocab_size_that_disagrees_with_the_embeddings_is_an_error(tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", vocab_size=500)))
    assert any("vocab_size=500, but embed_tokens has 512 rows" in f for f in found), found


def test_tensor_names_are_compared_both_ways(tiny_hf, tmp_path):
    def rename(t):
        t["model.final_norm.weight"] = t.pop("model.norm.weight")

    found = errors(doctor(broken(tiny_hf, tmp_path / "f", rename)))
    assert any("missing from the safetensors files: model.norm.weight" in f for f in found), found
    assert any("not parameters of MiniStreamForCausalLM: model.final_norm.weight" in f for f in found), found


def test_kv_cache_too_small_for_max_model_len_says_what_fits(tiny_hf):
    # tiny: 2 layers x 2 kv heads x 64 x 2 (k and v) x 4 bytes = 2048 bytes a token
    found = errors(doctor(tiny_hf, settings=EngineSettings(kv_cache_gib=256 * 2048 / 2**30)))
    assert len(found) == 1 and "max_model_len 512 needs 1 MiB" in found[0] and "max_model_len <= 256" in found[0]


def test_kv_cache_judged_is_the_one_serve_would_choose(tiny_hf, monkeypatch):
    from ministream.run import engine

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(engine, "kv_cache_gib", lambda *a, **k: 3)
    assert any("cache 3072 MiB" in str(f) for f in doctor(tiny_hf) if f.topic == "memory")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # the user's setting wins, as it does for serve
    assert any("cache 2048 MiB" in str(f) for f in doctor(tiny_hf) if f.topic == "memory")


def test_weights_bigger_than_memory_is_an_error(tiny_hf):
    found = errors(doctor(tiny_hf, memory_gib=0.001))
    assert any(f.startswith("error memory:") and "use bfloat16" in f for f in found), found


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(rms_norm_eps=None), "lacks rms_norm_eps"),
        (dict(rope_theta=None, rope_parameters=None), "lacks rope_theta"),
        (dict(rope_theta=500000.0), '"rope_theta": 500000.0}: plain RoPE'),
    ],
)
def test_missing_or_inconsistent_rope_and_eps_are_errors(change, words, tiny_hf, tmp_path):
    found = errors(doctor(broken(tiny_hf, tmp_path / "f", **change)))
    assert len(found) == 1 and words in found[0], found


@pytest.mark.parametrize(
    "cpu, platform",
    [
        ("GenuineIntel avx512f amx_tile", "CpuPlatform"),
        ("AuthenticAMD avx2", "CpuPlatform"),
        ("AuthenticAMD avx512f", "zen"),
    ],
)
def test_the_platform_vllm_will_pick_is_named_by_its_own_rule(cpu, platform, tmp_path):
    import importlib.util

    from ministream.run.doctor import check_platform

    vllm = tmp_path / "vllm"
    (vllm / "platforms").mkdir(parents=True)
    (vllm / "platforms" / "cpu.py").write_text("")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"vendor_id : {cpu.split()[0]}\nflags : {' '.join(cpu.split()[1:])}\n")
    assert "no platform for a CPU library" in check_platform(vllm, cpuinfo).text  # a release before zen_cpu.py
    (vllm / "platforms" / "zen_cpu.py").write_text("")
    found = check_platform(vllm, cpuinfo)
    if platform == "CpuPlatform":
        assert found.level == "ok" and found.text.startswith("CpuPlatform")
    elif importlib.util.find_spec("zentorch"):  # make install put it there: this machine is such a CPU
        assert found.level == "ok" and found.text.startswith("ZenCpuPlatform")
    else:
        assert found.level == "warn" and "zentorch is not installed" in found.text and "make install" in found.fix


def test_a_bfloat16_folder_is_said_to_be_widened_by_the_cpu_part_or_slow_where_onednn_has_no_bfloat16(
    tiny_hf, tmp_path, monkeypatch
):
    """On an x86 CPU with AVX2 alone oneDNN makes no bfloat16 matmul: the installed (patched) vLLM's fallback is the
    CPU part's product (said, ok; a warning where no C compiler builds its decode kernel); a stock vLLM's is torch's
    F.linear (a warning naming make install and float32), as is MINISTREAM_CPU_BF16_GEMM=0. Nothing where the folder
    computes in float32 or is quantized, or on a CPU with AVX-512. Judged from the CPU's flags and the vLLM's own
    file."""
    from ministream.run import folder, kernels

    avx2, avx512 = tmp_path / "avx2", tmp_path / "avx512"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma\n")
    avx512.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n")
    patched = kernels.installed_vllm_dir()  # this checkout's install: the patched wheel
    stock = tmp_path / "stock"
    (stock / kernels.CPU_GEMM).parent.mkdir(parents=True)
    source = (patched / kernels.CPU_GEMM).read_text()
    (stock / kernels.CPU_GEMM).write_text(source.replace(kernels.CPU_GEMM_WIDENED, "layer.cpu_linear = lambda"))
    assert kernels.bf16_kernel(patched, avx2, {}) == "widened" and kernels.bf16_kernel(stock, avx2, {}) == "F.linear"
    assert kernels.bf16_kernel(patched, avx2, {kernels.BF16_GEMM_ENV: "0"}) == "F.linear"
    assert kernels.bf16_kernel(patched, avx512, {}) is None and kernels.bf16_kernel(None, avx2, {}) is None

    said = folder.bf16_products(None, "bfloat16", patched, avx2)
    assert said is not None and said.level == "ok" and "widens" in said.text and "own kernel" in said.text
    # where the CPU part cannot build its decode kernel, a decode step is F.linear's: said, with what to install
    no_cc = folder.bf16_products(None, "bfloat16", patched, avx2, {"PATH": str(tmp_path / "empty")})
    assert no_cc is not None and no_cc.level == "warn" and "no C compiler" in no_cc.text and "gcc" in no_cc.fix
    assert folder.bf16_products(None, "bfloat16", patched, avx2, {"PATH": "", "CC": "clang"}).level == "ok"
    slow = folder.bf16_products(None, "bfloat16", stock, avx2)
    assert slow is not None and slow.level == "warn" and "make install" in slow.fix and "--dtype float32" in slow.fix
    assert folder.bf16_products(None, "float32", stock, avx2) is None
    assert folder.bf16_products(("w8a8", False), "bfloat16", stock, avx2) is None

    # doctor on a bfloat16 folder says it, on this CPU read as AVX2's
    real = kernels.bf16_kernel
    monkeypatch.setattr(folder, "bf16_kernel", lambda vllm_dir, cpuinfo=None, env=None: real(vllm_dir, avx2, {}))
    found = doctor(tiny_hf, settings=EngineSettings(dtype="bfloat16"))
    assert [f.level for f in found if f.topic == "bfloat16 kernel"] == ["ok"], [str(f) for f in found]
    assert not [f for f in doctor(tiny_hf, settings=EngineSettings(dtype="float32")) if f.topic == "bfloat16 kernel"]
