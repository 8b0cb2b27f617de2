"""`make cuda-smoke` and `make gpu-proof`: the patched CUDA wheel where no GPU answers, and the prepared proof for
the day one does (ministream/checks/cuda_smoke.py, gpu_proof.py).

The smoke runs for real (marked full: each release downloads ~2 GB into build/cache/uv once and makes a ~10 GiB
environment under build/cuda-smoke/): on the default release and on the newest supported one, where vLLM 0.34.0
pins a flashinfer-python nobody published, so it runs with --nearest-pins and says so.
"""

import json
from pathlib import Path

import pytest
from packaging.version import Version

from ministream import MiniStreamError
from ministream.checks import cuda_smoke, gpu_proof
from ministream.fork.patchset import supported_versions

from conftest import one_line_error

DEFAULT = "0.32.0"
NEWEST = max(supported_versions(), key=Version)
CHECKS = ["import", "registered", "llama inspected", "inspection", "llama module", "module", "interfaces", "config"]
CHECKS += ["model config", "vllm --version"]


def report(version: str) -> dict:
    return json.loads((cuda_smoke.root(version) / "report.json").read_text())


@pytest.mark.full
def test_a_pin_nobody_published_stops_the_smoke_by_name_unless_asked(cli):
    """vLLM 0.34.0's own flashinfer-python==0.7.3: named, with its neighbours and the option that installs 0.7.4
    (first: the passing run below leaves its report in build/cuda-smoke/0.34.0)."""
    if Version(NEWEST) < Version("0.34.0"):
        pytest.skip("no supported release pins an unpublished version")
    run = cli("cuda-smoke", "0.34.0", timeout=3600)
    assert run.returncode == 1
    got = report("0.34.0")
    assert got["stage"] == "environment"
    for said in ("flashinfer-python==0.7.3", "0.7.2.post1 below, 0.7.4 above", "--nearest-pins", "no upstream issue"):
        assert said in got["error"]
    assert "replaced pin: flashinfer-python==0.7.3 -> flashinfer-python==0.7.4" not in run.stdout


@pytest.mark.full
@pytest.mark.parametrize("version", sorted({DEFAULT, NEWEST}, key=Version))
def test_the_cuda_wheel_passes_every_check_and_the_stock_wheel_fails_them(cli, version):
    run = cli("cuda-smoke", version, "--nearest-pins", timeout=7200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    got = report(version)
    assert [k for k, c in got["checks"].items() if c["ok"]] == CHECKS
    assert "every field equal to LlamaForCausalLM's" in got["checks"]["inspection"]["detail"]
    assert "in vLLM's subprocess" in got["checks"]["inspection"]["detail"]
    assert got["environment"]["vllm"] == f"{version}+ministream.0.1.0"
    assert got["environment"]["torch"] and "+cpu" not in got["environment"]["torch"]  # PyPI's CUDA torch
    assert got["vllm_tests"] and set(got["vllm_tests"].values()) == {"passed"}
    assert any(f"test_registry_imports[{cuda_smoke.ARCH}]" in t for t in got["vllm_tests"])
    negative = got["negative"]
    assert negative["ok"] and not negative["passed_on_stock"] and not negative["sanity_failed"]
    assert negative["failed_as_they_must"] == sorted(k for k, c in got["checks"].items() if not c["sanity"])
    assert "not proven without a GPU" in run.stdout and "make gpu-proof" in run.stdout


def test_the_negative_control_passes_only_when_every_ministream_check_fails_and_llama_works():
    fails = {"import": {"ok": False, "sanity": False}, "llama inspected": {"ok": True, "sanity": True}}
    assert cuda_smoke.judge_negative(fails, {"x::test_hf_registry_coverage": "passed"})["ok"]
    leaked = {**fails, "config": {"ok": True, "sanity": False}}
    assert cuda_smoke.judge_negative(leaked, {})["passed_on_stock"] == ["config"]
    broken = {**fails, "llama inspected": {"ok": False, "sanity": True}}
    assert cuda_smoke.judge_negative(broken, {})["sanity_failed"] == ["llama inspected"]
    ours = f"tests/models/test_registry.py::test_registry_imports[{cuda_smoke.ARCH}]"
    assert not cuda_smoke.judge_negative(fails, {ours: "passed"})["ok"]


def test_a_release_without_a_patch_set_is_refused_in_one_line_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_smoke, "ROOT", tmp_path / "cuda-smoke")
    monkeypatch.setattr(gpu_proof, "OUT", tmp_path / "gpu-proof")
    said = r"no MiniStream patch set for vLLM 9\.9\.9 .*make port FROM=<nearest> TO=9\.9\.9"
    with pytest.raises(MiniStreamError, match=said):
        cuda_smoke.run_smoke("9.9.9")
    with pytest.raises(MiniStreamError, match=said):
        gpu_proof.run_proof("9.9.9", prepare_only=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(bool(gpu_proof.gpus()), reason="a GPU answers here: gpu-proof runs")
def test_gpu_proof_stops_in_one_line_where_no_gpu_answers(cli):
    run = cli("gpu-proof", DEFAULT)
    line = one_line_error(run)
    assert "no GPU answers here" in line and f"make cuda-smoke VLLM_VERSION={DEFAULT}" in line


@pytest.mark.full
def test_gpu_proof_prepares_every_job_that_needs_no_gpu(tmp_path):
    planned = gpu_proof.prepare(tmp_path / "models", n_gpus=1, log=lambda *a, **k: None)
    parts = [j["part"] for j in planned]
    assert parts.count("golden") == 6 and parts.count("twin") == 2 * len(gpu_proof.BATCHES)
    assert {"tp2", "fp8", "lora"} <= set(parts)
    twin = [j for j in planned if j["part"] == "twin"]
    assert sorted({len(j["prompt_ids"]) for j in twin}) == list(gpu_proof.BATCHES)
    assert all(j["same_as"] in {t["name"] for t in twin} for j in twin if "same_as" in j)
    llama = json.loads((tmp_path / "models" / "reference" / "llama" / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["model_type"] == "llama"
    assert next(j for j in planned if j["part"] == "tp2")["skip"].startswith("TP=2 needs two GPUs")
    dynamic, folder = (j for j in planned if j["part"] == "fp8")
    assert dynamic["quantization"] == "fp8" and "quantization" not in folder  # vLLM reads the folder's own
    config = json.loads((Path(folder["folder"]) / "config.json").read_text())
    assert folder["folder"].endswith("demo/fp8") and config["quantization_config"]["format"] == "float-quantized"
    lora = next(j for j in planned if j["part"] == "lora")
    assert (tmp_path / "models" / "gqa-untied" / "lora" / "peft" / "adapter_config.json").is_file()
    with_adapter = gpu_proof.golden(tmp_path / "models" / "gqa-untied", "float32", lora=True)
    without = gpu_proof.golden(tmp_path / "models" / "gqa-untied", "float32")
    assert lora["prompt_ids"] == without["prompt_ids"]
    assert [o["ids"] for o in with_adapter["outputs"]] != [o["ids"] for o in without["outputs"]]  # it changes them
