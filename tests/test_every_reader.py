"""Every command that reads a converted folder runs the one folder check (checkpoint/folder.py), and every writer
that narrows a dtype runs the one cast check (checkpoint/cast.py) (issue 52, cases 3-5): folders planted with what
the check refuses, given to each command as a user would; weights planted beyond what a width holds, given to
each writer. Refusals are one line, exit 2, before anything is written or any engine starts; the platform's
float16 rule is held as a function of the CPU's flags and zentorch, and on this machine as it is.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ministream.checkpoint.demo import make_adapter
from ministream.run.doctor import doctor
from ministream.run.engine import EngineSettings
from ministream.run.folder import check_servable
from ministream.run.generate import DEFAULT_PROMPTS, reference_generate, tokenize
from ministream.run.kernels import ZEN_PLATFORM, float16_fails, installed_vllm_dir
from ministream.run.verify import compare

from conftest import generate_args, one_line_error, quiet

DOWN = "model.layers.0.mlp.down_proj.weight"


def planted(tiny_hf: Path, where: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    """A copy of the converted folder with config.json keys set and weights changed ({name: (index, value)})."""
    shutil.copytree(tiny_hf, where)
    if config:
        path = where / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=2))
    if weights:
        state = load_file(where / "model.safetensors")
        for name, (index, value) in weights.items():
            state[name][index] = value
        save_file(state, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


@pytest.fixture(scope="module")
def folders(tiny_hf, tmp_path_factory) -> dict[str, Path]:
    """Folders the one check refuses (doctor: an error; serve: a refusal), each a way to a wrong model."""
    root = tmp_path_factory.mktemp("planted")
    # the GGUF would carry rope_theta's base, the server rope_parameters': two models of one folder
    rope = planted(tiny_hf, root / "rope", config={"rope_theta": 500000.0})
    # a stale shard beside the weights: the loader would read one of its two copies, quantize copied it
    stale = planted(tiny_hf, root / "stale")
    norm = load_file(stale / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": norm * 2}, str(stale / "model-old.safetensors"), metadata={"format": "pt"})
    return {"rope": rope, "stale": stale}


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adapter") / "a"
    make_adapter(tiny, out, log=quiet)
    return out


# command -> its arguments: the folder, an output that must not appear, the adapter
COMMANDS = {
    "quantize": lambda f, out, a: ["quantize", f, out, "--scheme", "w8a8"],
    "gguf": lambda f, out, a: ["gguf", f, out],
    "convert-lora": lambda f, out, a: ["convert-lora", a, out, "--base", f],
    "bench-accuracy": lambda f, out, a: ["bench-accuracy", f, "--out", out, "--systems", "vllm float32"],
    "generate": lambda f, out, a: ["generate", f, "--engine", "vllm", "--json", out],
    "verify": lambda f, out, a: ["verify", f, "--out", out, "--golden", out / "golden.json"],
    "doctor": lambda f, out, a: ["doctor", f],
}
WORDS = {"rope": ("rope_parameters", "rope_theta"), "stale": ("model.norm.weight", "model-old.safetensors")}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("fault", list(WORDS))
def test_every_command_that_reads_a_folder_refuses_what_the_one_check_refuses(
    command, fault, folders, adapter, cli, tmp_path, tree
):
    before = tree(folders[fault])
    out = tmp_path / "out"
    run = cli(*COMMANDS[command](folders[fault], out, adapter))
    if run.returncode == 1 and command == "doctor":  # every finding, the check's error among them
        assert "Traceback" not in run.stderr, run.stderr
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith("error") and WORDS[fault][0] in ln)
    else:  # doctor too, where the folder cannot be read at all
        line = one_line_error(run)
    assert all(w in line for w in WORDS[fault]), line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    assert tree(folders[fault]) == before


# --- one writer's cast check ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, value, width",
    # make test: the cheapest width that can overflow; the others in the full tier
    [
        pytest.param("f16", 1e5, "float16", marks=pytest.mark.full),
        ("q8_0", 2e7, "q8_0"),
        pytest.param("q4_0", 2e7, "q4_0", marks=pytest.mark.full),
    ],
)
def test_gguf_refuses_a_weight_its_width_cannot_hold_by_name_and_writes_nothing(
    dtype, value, width, tiny_hf, cli, tmp_path
):
    src = planted(tiny_hf, tmp_path / "hf", weights={DOWN: ((0, 0), value)})
    line = one_line_error(cli("gguf", src, tmp_path / "m.gguf", "--dtype", dtype))
    assert "blk.0.ffn_down.weight" in line and f"{width} overflows" in line and "--dtype bf16 or f32" in line, line
    assert not (tmp_path / "m.gguf").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_gguf_writes_a_large_weight_where_the_width_holds_it(dtype, tiny_hf, cli, tmp_path):
    src = planted(tiny_hf, tmp_path / "hf", weights={DOWN: ((0, 0), 1e5)})
    r = cli("gguf", src, tmp_path / "m.gguf", "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    t = next(t for t in GGUFReader(str(tmp_path / "m.gguf")).tensors if t.name == "blk.0.ffn_down.weight")
    data = np.array(t.data)
    values = dequantize(data, t.tensor_type) if dtype == "q8_0" else data.view(np.int16).astype(np.int32) << 16
    got = np.asarray(values).reshape(-1).view(np.float32) if dtype == "bf16" else np.asarray(values).reshape(-1)
    assert np.isfinite(got).all() and math.isclose(float(np.abs(got).max()), 1e5, rel_tol=1e-2)


@pytest.mark.parametrize(
    "scheme", ["w8a8", pytest.param("w4a16", marks=pytest.mark.full), pytest.param("fp8", marks=pytest.mark.full)]
)
def test_quantize_refuses_a_weight_that_makes_non_finite_scales_by_name_and_writes_nothing(
    scheme, tiny_hf, cli, tmp_path
):
    src = planted(tiny_hf, tmp_path / "hf", weights={DOWN: ((0, 0), math.inf)})
    line = one_line_error(cli("quantize", src, tmp_path / "q", "--scheme", scheme))
    assert f"{DOWN} holds NaN or Inf" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# --- the platform question: can this machine's vLLM compute in float16 ------------------------------------------


def cpu(tmp_path: Path, vendor: str, *flags: str) -> Path:
    """A /proc/cpuinfo of one core, as the kernel writes it."""
    path = tmp_path / f"cpuinfo-{vendor}-{'-'.join(flags)}"
    path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: a CPU\nflags\t\t: {' '.join(flags)}\n")
    return path


@pytest.mark.parametrize(
    "vendor, flags, zentorch, fails",
    [
        ("AuthenticAMD", ("avx2", "avx512f", "avx512_bf16"), True, True),  # zentorch's fp16 linear needs the flag
        ("AuthenticAMD", ("avx2", "avx512f", "avx512_bf16", "avx512_fp16"), True, False),
        ("AuthenticAMD", ("avx2", "avx512f", "avx512_bf16"), False, False),  # no zentorch: CpuPlatform runs fp16
        ("AuthenticAMD", ("avx2",), True, False),  # vLLM picks ZenCpuPlatform only with AVX-512
        ("GenuineIntel", ("avx2", "avx512f", "amx_tile"), True, False),  # nor on Intel
    ],
)
def test_float16_fails_exactly_where_zentorch_runs_the_linears_without_avx512_fp16(
    vendor, flags, zentorch, fails, tmp_path
):
    vllm = tmp_path / "vllm"
    (vllm / ZEN_PLATFORM).parent.mkdir(parents=True)
    (vllm / ZEN_PLATFORM).write_text("class ZenCpuPlatform: ...\n")
    info = cpu(tmp_path, vendor, *flags)
    assert float16_fails(vllm, info, zentorch) is fails
    (vllm / ZEN_PLATFORM).unlink()  # a vLLM without the platform runs float16 everywhere on the CPU
    assert float16_fails(vllm, info, zentorch) is False


def test_float16_is_refused_before_vllm_starts_where_this_machine_cannot_run_it_and_runs_where_it_can(
    tiny_hf, cli, tmp_path
):
    settings = EngineSettings(max_model_len=64, kv_cache_gib=1, dtype="float16")  # doctor's memory check held still
    refused = [f for f in doctor(tiny_hf, settings=settings, memory_gib=64) if f.level == "error"]
    if not float16_fails(installed_vllm_dir()):
        assert refused == [] and check_servable(tiny_hf, "float16")["dtype"] == "float32"
        pytest.skip("this machine's vLLM computes in float16 (no zentorch on an AMD CPU with AVX-512)")
    assert [f.topic for f in refused] == ["dtype"] and "avx512_fp16" in refused[0].text
    line = one_line_error(cli("generate", tiny_hf, "--engine", "vllm", "--dtype", "float16"))
    assert "avx512_fp16" in line and "--dtype bfloat16" in line, line


@pytest.mark.vllm
@pytest.mark.full  # an engine start (~60-90 s here); make test holds the rule above on this machine without one
def test_float16_runs_where_the_rule_lets_it_and_gives_the_references_tokens(tiny_hf, cli, tmp_path):
    if float16_fails(installed_vllm_dir()):
        pytest.skip("this machine's vLLM cannot compute in float16: the refusal is tested above")
    out = tmp_path / "fp16.json"
    r = cli(*generate_args(tiny_hf, out, "float16", 1, 5, 16), "--enforce-eager")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())["vllm"]
    want = reference_generate(tiny_hf, tokenize(tiny_hf, DEFAULT_PROMPTS), 16, "float16", logprobs=5)
    passed, rows = compare(want, got, exact=False)  # the 16-bit rule: vLLM's check_logprobs_close
    assert passed, "\n".join(f"prompt {r.prompt}: identical={r.identical} {r.detail}" for r in rows)


# --- small things ------------------------------------------------------------------------------------------------


def test_gguf_on_one_safetensors_file_names_the_folder_to_give_and_no_flags_it_lacks(tiny_hf, cli, tmp_path):
    line = one_line_error(cli("gguf", tiny_hf / "model.safetensors", tmp_path / "m.gguf"))
    assert f"give the folder, {tiny_hf}" in line and "--d-model" not in line, line


def test_gguf_on_a_bare_state_dict_says_to_convert_it_with_the_settings_first(tiny, cli, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    torch.save(torch.load(tiny / "model.pt", weights_only=True)["model"], raw / "model.pt")
    shutil.copy(tiny / "tokenizer.json", raw)
    line = one_line_error(cli("gguf", raw, tmp_path / "m.gguf"))
    assert "bare state dict" in line and f"ministream convert {raw} DIR" in line and "pass them" not in line, line


def test_a_float16_adapter_is_converted_exactly_to_float32(tiny, tiny_hf, cli, tmp_path):
    make_adapter(tiny, tmp_path / "a", log=quiet)
    saved = torch.load(tmp_path / "a" / "adapter.pt", weights_only=True)
    saved["lora"] = {k: v.half() for k, v in saved["lora"].items()}
    torch.save(saved, tmp_path / "a" / "adapter.pt")
    r = cli("convert-lora", tmp_path / "a", tmp_path / "peft", "--base", tiny_hf)
    assert r.returncode == 0, r.stderr
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert dtypes == {"F32"}
    a = "blocks.0.attn.out_proj.lora_A.weight"
    peft_a = next(v for k, v in written.items() if "layers.0.self_attn.o_proj.lora_A" in k)
    assert torch.equal(peft_a, saved["lora"][a].float())


@pytest.mark.parametrize("alpha", ["nan", "inf", "-inf"])
def test_checkpoint_refuses_an_adapter_alpha_convert_lora_would_refuse(alpha, tiny, cli, tmp_path):
    line = one_line_error(cli("checkpoint", "--adapter", tiny, "--out", tmp_path / "a", f"--alpha={alpha}"))
    assert f"alpha={alpha}: must be a finite number" in line, line
    assert not (tmp_path / "a").exists()
