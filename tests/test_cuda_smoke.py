"""`make cuda-smoke` and `make gpu-proof`: the patched CUDA wheel where no GPU answers, and the prepared proof for
the day one does (ministream/checks/cuda_smoke.py, gpu_proof.py).

The smoke runs for real (marked full: each release downloads ~2 GB into build/cache/uv once and makes a ~10 GiB
environment under build/cuda-smoke/): on the default release and on the newest supported one, where vLLM 0.34.0
pins a flashinfer-python nobody published, so it runs with --nearest-pins and says so.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from ministream import MiniStreamError
from ministream.checks import cuda_smoke, gpu_probe, gpu_proof
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
    assert lora["dtype"] == "bfloat16" and lora["rule"] == "bfloat16"  # vLLM's CUDA LoRA kernels take no fp32
    assert (tmp_path / "models" / "gqa-untied" / "lora" / "peft" / "adapter_config.json").is_file()
    with_adapter = gpu_proof.golden(tmp_path / "models" / "gqa-untied", "float32", lora=True)
    without = gpu_proof.golden(tmp_path / "models" / "gqa-untied", "float32")
    assert lora["prompt_ids"] == without["prompt_ids"]
    assert [o["ids"] for o in with_adapter["outputs"]] != [o["ids"] for o in without["outputs"]]  # it changes them


def _proof_tree(tmp_path, monkeypatch) -> dict:
    """A prepared proof as --prepare-only leaves it, without training: folders, the twin's links, the golden
    outputs of one model, and jobs.json (one job skipped, one with an adapter, one the twin of another)."""
    monkeypatch.chdir(tmp_path)  # the repository root: OUT is relative to it, as the jobs' folders must be
    monkeypatch.setattr(gpu_proof, "OUT", Path("gpu-proof"))
    monkeypatch.setattr(gpu_proof, "MODELS", Path("gpu-proof") / "models")
    model = gpu_proof.MODELS / "gqa-untied"
    for part in ("hf", "raw", "lora/peft", "lora/raw"):
        (model / part).mkdir(parents=True)
    (model / "hf" / "config.json").write_text("{}")
    (model / "hf" / "model.safetensors").write_bytes(b"weights")
    (model / "raw" / "model.pt").write_bytes(b"a training checkpoint")
    (model / "lora" / "peft" / "adapter_config.json").write_text("{}")
    gpu_proof.twin(model)
    gold = {"prompt_ids": [[1, 2]], "outputs": [{"ids": [5, 6], "logprobs": [{5: -0.1}, {6: -0.2}]}]}
    (model / "golden-float32-1.json").write_text(json.dumps(gold))
    common = dict(
        dtype="float32",
        tp=1,
        prompt_ids=[[1, 2]],
        max_tokens=2,
        top_k=1,
        golden=["gqa-untied", "float32", 1, False],
        rule="float32",
    )
    jobs = [
        dict(common, part="golden", name="ours", folder=str((model / "hf").resolve())),
        dict(common, part="twin", name="twin", folder=str((model / "llama").resolve()), same_as="ours"),
        dict(common, part="tp2", name="tp2", folder=str((model / "hf").resolve()), tp=2, skip="TP=2 needs two GPUs"),
        dict(
            common,
            part="lora",
            name="lora",
            folder=str((model / "hf").resolve()),
            lora={"name": "p", "path": str((model / "lora" / "peft").resolve()), "rank": 8},
        ),
    ]
    (gpu_proof.OUT / "9.9.9").mkdir(parents=True)
    (gpu_proof.OUT / "9.9.9" / "jobs.json").write_text(json.dumps(jobs))
    return gold


def test_the_export_carries_the_jobs_a_gpu_machine_runs_and_only_the_files_they_read(tmp_path, monkeypatch):
    _proof_tree(tmp_path, monkeypatch)
    dest = gpu_proof.export("9.9.9", log=lambda *a: None)
    jobs = json.loads((dest / "jobs.json").read_text())
    assert [j["name"] for j in jobs] == ["ours", "twin", "lora"]  # the skipped one is not sent
    carried = dest / "models" / "gqa-untied"
    assert jobs[0]["folder"] == str(carried / "hf") and not Path(jobs[0]["folder"]).is_absolute()
    assert jobs[2]["lora"]["path"] == str(carried / "lora" / "peft")
    assert not (carried / "raw").exists()  # no training checkpoint travels
    link = carried / "llama" / "model.safetensors"
    assert link.is_symlink() and not Path(link.readlink()).is_absolute() and link.read_bytes() == b"weights"
    assert json.loads((carried / "llama" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_outputs_run_elsewhere_are_judged_by_the_proofs_rules(tmp_path, monkeypatch):
    gold = _proof_tree(tmp_path, monkeypatch)
    jobs = json.loads((gpu_proof.export("9.9.9", log=lambda *a: None) / "jobs.json").read_text())
    graphs = {"enforce_eager": False, "cudagraph_mode": "FULL_AND_PIECEWISE"}
    right = {"outputs": gold["outputs"], **graphs}
    wrong = {"outputs": [{"ids": [5, 7], "logprobs": [{5: -0.1}, {7: -0.2}]}], **graphs}
    outputs = tmp_path / "outputs.json"

    def made(*results: dict) -> Path:  # as gpu_probe writes them: each with its job's identity, in any order
        outputs.write_text(json.dumps([{"job": gpu_probe.identity(j), **r} for j, r in zip(jobs, results)][::-1]))
        return outputs

    assert gpu_proof.judge_run("9.9.9", made(right, right, right), log=lambda *a: None) == 0
    report = json.loads((gpu_proof.OUT / "9.9.9" / "report.json").read_text())
    assert [c["ok"] for c in report["cases"]] == [True, True, True] and report["image"]["ok"] is None
    assert gpu_proof.judge_run("9.9.9", made(right, wrong, {**right, "cudagraph_mode": "NONE"}), log=print) == 1
    report = json.loads((gpu_proof.OUT / "9.9.9" / "report.json").read_text())
    assert [c["ok"] for c in report["cases"]] == [True, False, False] and not report["cases"][2]["cuda_graphs"]
    with pytest.raises(MiniStreamError, match=r"no outputs for 1 of the 3 jobs .*\(lora\)"):
        gpu_proof.judge_run("9.9.9", made(right, right))
    jobs[0]["prompt_ids"] = [[1, 3]]  # outputs of another run's prompts, under the same name: never judged
    with pytest.raises(MiniStreamError, match="the outputs named ours were made from another folder, dtype or prompts"):
        gpu_proof.judge_run("9.9.9", made(right, right, right))


@pytest.mark.full  # ~25 s of vLLM imports; judge_run's quick tests above read the probes' outputs
def test_parallel_probes_return_every_jobs_outputs_in_the_jobs_order(tmp_path):
    """Real probe processes (the installed vLLM imported in each); every job fails at once on a folder that
    is not there, so each output names its own job's folder."""
    jobs = [
        {"name": f"job {i}", "folder": str(tmp_path / f"missing-{i}"), "dtype": "float32", "tp": 1} for i in range(5)
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "ministream.checks.gpu_probe", tmp_path / "jobs.json", tmp_path / "out.json"]
    subprocess.run([str(c) for c in [*cmd, "--parallel", "2"]], check=True, timeout=600)
    got = json.loads((tmp_path / "out.json").read_text())
    assert [f"missing-{i}" in g["error"] and g["job"]["name"] == f"job {i}" for i, g in enumerate(got)] == [True] * 5
    assert sorted(p.name for p in (tmp_path / "out.parts").glob("jobs-*.json")) == ["jobs-0.json", "jobs-1.json"]


def test_judging_without_an_export_or_on_a_file_not_json_is_refused_naming_what_to_run(tmp_path, monkeypatch):
    _proof_tree(tmp_path, monkeypatch)
    with pytest.raises(
        MiniStreamError, match=r"jobs.json is missing: export the jobs first \(gpu-proof 9.9.9 --export\)"
    ):
        gpu_proof.judge_run("9.9.9", tmp_path / "outputs.json")
    gpu_proof.export("9.9.9", log=lambda *a: None)
    (tmp_path / "outputs.json").write_text("<html>")
    with pytest.raises(MiniStreamError, match="outputs.json: not the outputs of a gpu_probe run"):
        gpu_proof.judge_run("9.9.9", tmp_path / "outputs.json")
    assert not (gpu_proof.OUT / "9.9.9" / "report.json").exists()
