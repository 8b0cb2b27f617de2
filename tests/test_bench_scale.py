"""bench-scale (issue 56): the sizes are the shapes they are named for, the checkpoint is written in bfloat16 as
the trainer saves it, a tool's peak is its own, a failed tool is a row saying why, and the report is written from
the results. No engine: the run itself is `make bench-scale`."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ministream import MiniStreamError
from ministream.bench import scale, widths
from ministream.checkpoint.format import load
from ministream.run.kernels import installed_vllm_dir, int8_needs_16_bits


@pytest.mark.parametrize(
    "size, low, high",
    [
        ("reference", 80e6, 82e6),  # demo.REFERENCE, tied
        ("1.2b", 1.19e9, 1.21e9),  # issue 56's table: 11.2 GiB of model.pt at 10 bytes a parameter
        ("3b", 2.8e9, 3.1e9),
        ("7b", 6_738_415_616, 6_738_415_616),  # LLaMA-2-7B's own count: its shape, untied head
    ],
)
def test_each_size_has_the_parameters_it_is_named_for(size, low, high):
    assert low <= scale.model_bytes(size)["parameters"] <= high


def test_the_checkpoint_is_bfloat16_weights_with_float32_moments(tmp_path, monkeypatch):
    monkeypatch.setitem(scale.SIZES, "test", scale.Size(dict(d_model=64, n_layers=2, n_heads=2, d_ff=128), True, ""))
    scale.write_checkpoint(tmp_path, "test", log=lambda *a: None)
    cfg, ckpt = load(tmp_path)
    assert (cfg.d_model, cfg.n_layers, cfg.vocab_size) == (64, 2, 32000)
    assert {t.dtype for t in ckpt.state.values()} == {torch.bfloat16}
    assert 0.015 < ckpt.state["blocks.0.mlp.w3.weight"].float().std() < 0.025  # random, not zeros
    moments = torch.load(tmp_path / "model.pt", weights_only=True)["optimizer"]["state"]
    assert len(moments) == len(ckpt.state)
    assert {m["exp_avg"].dtype for m in moments.values()} == {torch.float32}
    assert not list(tmp_path.glob("scale-tensors-*"))  # the scratch files are gone


def test_a_tools_peak_memory_is_its_own_not_this_process(tmp_path):
    # this process has imported torch (hundreds of MB): getrusage at exec would carry that into the child's peak
    ballast = torch.ones(2**27)  # 512 MB, held while the tool runs
    row = scale.run_tool("noop", "weights", [sys.executable, "-c", "pass"], {"weights": 2**20})
    assert ballast.sum() > 0
    assert "error" not in row and row["peak_rss_mib"] < 100  # a bare Python: ~10 MB


def test_a_failed_tool_is_a_row_saying_why():
    row = scale.run_tool("doomed", "weights", [sys.executable, "-c", "raise SystemExit('no room')"], {})
    assert row["tool"] == "doomed" and "no room" in row["error"]
    missing = scale.run_tool("absent", "weights", ["/nonexistent/ministream"], {})
    assert "error" in missing


def _result(size: str, tools: list[dict]) -> dict:
    return {
        "size": size,
        "note": "planted",
        **scale.model_bytes(size),
        "settings": scale.FULL,
        "optimizer_state": True,
        "checkpoint": {"model_pt_bytes": 12 * 2**30, "seconds": 60.0},
        "tools": tools,
        "engines": [
            {
                "system": "vllm",
                "width": "bfloat16",
                "start_s": 80.0,
                "first_token_s": 0.5,
                "decode": {"1": {"best_tok_s": 10.2}, "32": {"best_tok_s": 95.0}},
                "peak_rss_mib": 4096,
                "compiled_model": "loaded",
            },
            {"system": "llamacpp", "width": "w8a8", "error": "would need 28.0 GB, 20.0 GB available"},
        ],  # fmt: skip
        "seconds": 1800,
    }


def test_an_engine_that_failed_is_a_row_with_the_last_thing_its_worker_said():
    """A worker that raised: its row gives the error's own line (the last of its log), not a cut through the
    traceback above it (a 7B run's row read "exit 1: m(d.itemsize * s.numel() ...")."""
    tail = 'Traceback (most recent call last):\n  File "x.py", line 9, in export\n    check_space(' + "x" * 500
    tail += "\nministream.MiniStreamError: exporting A to B needs about 8 GB free in C, which has 1 GB\n\n"
    row = scale.summarize_worker({"error": "exit 1", "log_tail": tail, "log": "L"})
    assert row == {
        "error": "exit 1: ministream.MiniStreamError: exporting A to B needs about 8 GB free in C, which has 1 GB",
        "log": "L",
    }


def test_the_report_is_a_table_from_the_results(tmp_path):
    convert = {"tool": "convert", "seconds": 10.6, "peak_rss_mib": 2861, "holds": "weights", "rss_over_held": 1.25}
    failed = {"tool": "verify --raw", "seconds": 3.0, "peak_rss_mib": 20, "error": "exit 2: error: no room"}
    (tmp_path / "scale-1.2b.json").write_text(json.dumps(_result("1.2b", [convert, failed])))
    (tmp_path / "scale-reference.json").write_text(json.dumps(_result("reference", [convert])))
    assert scale.report(tmp_path) == 1  # a failed row
    text = (tmp_path / "scale.md").read_text()
    assert text.index("### reference") < text.index("### 1.2b")  # smallest first
    assert "| convert | 10.6 | 3.00 |" in text and "1.25x" in text
    assert "| verify --raw |" in text and "exit 2: error: no room" in text
    assert "| vllm | bfloat16 | 80.0 | 0.50 | 10.2 | 95.0 | 4.29 | start: its compiled model loaded |" in text
    assert "would need 28.0 GB" in text


def test_a_size_measured_already_is_kept_and_an_interrupted_one_measured_again(tmp_path):
    (tmp_path / "scale-1.2b.json").write_text(json.dumps(_result("1.2b", [])))
    (tmp_path / "scale-3b.json").write_text(json.dumps({**_result("3b", []), "partial": True}))
    assert scale.to_measure(tmp_path, ["reference", "1.2b", "3b"], force=False) == ["reference", "3b"]
    assert scale.to_measure(tmp_path, ["1.2b"], force=True) == ["1.2b"]


def test_an_engine_that_would_not_fit_or_has_no_folder_is_a_row_saying_so(tiny_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf)
    rows = list(scale.engine_rows(hf, scale.FULL, tmp_path / "logs", 100, kv_gib=10**6))  # a 1 PiB KV cache
    by = {(r["system"], r["width"]): r["error"] for r in rows}
    # w8a8 as this machine's vLLM runs it: w8a8-bf16 on a CPU with AMX (its int8 kernel takes 16-bit activations)
    int8 = widths.runnable("w8a8")
    assert int8 == ("w8a8-bf16" if int8_needs_16_bits(installed_vllm_dir()) else "w8a8")
    assert by.keys() == {(s, w) for s in scale.SYSTEMS for w in ("bfloat16", int8)}
    assert "would need" in by["vllm", "bfloat16"] and "would need" in by["llamacpp", "bfloat16"]
    assert "quantize row failed" in by["vllm", int8]  # no hf-w8a8 beside the folder
    assert not (tmp_path / "logs").exists()  # no engine started
    # the weights counted as the pre-flight counts them (Folder.held_bytes); a folder it cannot read says so
    assert scale.would_not_fit(hf, "float32", 0) is None
    (hf / "model.safetensors").write_bytes(b"\0" * 1024)
    assert "cannot be read" in (scale.would_not_fit(hf, "bfloat16", 0) or "")


def test_an_unknown_size_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(MiniStreamError, match="--sizes 13b: unknown size; choose from reference, 1.2b"):
        scale.scale_command(tmp_path / "out", ["reference", "13b"])
    assert not (tmp_path / "out").exists()


def test_tools_runs_convert_and_the_named_tools_only_and_refuses_an_unknown_one(tmp_path, monkeypatch):
    ran = []

    def checkpoint(command):  # the size's checkpoint, as the write step leaves it
        raw = Path(command[-2])
        raw.mkdir(parents=True)
        (raw / "model.pt").write_bytes(b"\0")
        return {"seconds": 0.1}

    monkeypatch.setattr(scale, "measured", checkpoint)
    monkeypatch.setattr(scale, "run_tool", lambda name, holds, command, sizes: ran.append(name) or {"tool": name})
    assert scale.scale_command(tmp_path, ["reference"], tools=["doctor", "verify"]) == 1  # the engines: no folder
    assert ran == ["convert", "doctor", "verify --raw"]
    assert json.loads((tmp_path / "scale-reference.json").read_text())["settings"]["tools"] == ["doctor", "verify"]
    with pytest.raises(MiniStreamError, match="--tools gguf-q8: no such tool; choose from gguf, doctor, quantize"):
        scale.scale_command(tmp_path / "out", ["reference"], tools=["gguf-q8"])
    assert not (tmp_path / "out").exists()
