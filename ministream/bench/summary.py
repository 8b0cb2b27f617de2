"""summary: bench's statistics, computed again from the runs whenever a result is saved or reported: per
(model, dtype, batch) each system's tokens/s and time to first token, the ratios between systems, their
geometric means, each run's peak memory, and the batch-1 decode rate against the machine's bandwidth."""

import math
from typing import Any

from . import widths

# system key -> label in the table and the chart
SYSTEMS = {
    "ministream": "MiniStream, patched vLLM",
    "ministream_compiled": "MiniStream, patched vLLM, compiled",
    "ministream_eager": "MiniStream, patched vLLM, eager",
    "llama": "same weights as LLaMA, same vLLM",
    "ministream_vllm_bind": "MiniStream, vLLM's own core binding",
    "reference_batched": "reference model, batched",
    "reference_serial": "reference model, one request at a time",
    "llamacpp": "llama.cpp (llama-server, GGUF of the same weights)",
    "ministream_no_zentorch": "MiniStream, patched vLLM, zentorch hidden (vLLM's plain CPU platform)",
    "transformers_backend": "MiniStream, stock vLLM's Transformers backend (the folder's own transformers files)",
}


def series(result: dict) -> dict:
    """(model, dtype) -> system -> batch -> row, with the reference worker split into its two systems."""
    out: dict[tuple[str, str], dict[str, dict[int, dict]]] = {}
    for run in result["runs"]:
        if "error" in run:
            continue
        parts = (
            {"reference_batched": run["batched"], "reference_serial": run["serial"]}
            if run["system"] == "reference"
            else {run["system"]: run["rows"]}
        )
        for system, rows in parts.items():
            for row in rows:
                row = {
                    **row,
                    "weights_file_bytes": run.get("weights_file_bytes"),
                    "peak_pss_mib": run["peak_pss_mib"],
                    "peak_rss_mib": run["peak_rss_mib"],
                    "enforce_eager": run.get("enforce_eager"),
                }
                out.setdefault((run["model"], run["dtype"]), {}).setdefault(system, {})[row["batch"]] = row
    return out


def _ratio(a, b):
    return a / b if a and b else None


def geomean(xs):
    """The geometric mean of the ratios there are (None, a system that did not run, left out); None if none."""
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


# ratio -> (numerator system, denominator system); compiled/eager has its own pair (_compiled_and_eager)
RATIOS = {
    "ministream_over_llama": ("ministream", "llama"),
    "compiled_over_eager": None,
    "ours_over_vllm_bind": ("ministream", "ministream_vllm_bind"),
    "vllm_over_reference_batched": ("ministream", "reference_batched"),
    "vllm_over_reference_serial": ("ministream", "reference_serial"),
    "vllm_over_llamacpp": ("ministream", "llamacpp"),
    "zentorch_over_plain": ("ministream", "ministream_no_zentorch"),
    # upstream says the backend is "as fast as native": the native model (patched vLLM) over it
    "native_over_transformers_backend": ("ministream", "transformers_backend"),
}


def beyond_spread(a: dict | None, b: dict | None) -> bool | None:
    """Whether two cells' ranges of tokens/s do not overlap: then the faster is faster on this machine, this
    run; where they overlap, the run cannot tell them apart. None where a cell or its range is missing."""
    ra, rb = (a or {}).get("tokens_per_s_range"), (b or {}).get("tokens_per_s_range")
    if not ra or not rb:
        return None
    return ra[0] > rb[1] or rb[0] > ra[1]


def summarize(result: dict) -> dict:
    """The ratios the issue asks for, per (model, dtype, batch), each with whether the two cells' ranges are
    apart (beyond_spread), their geometric means, and the ceiling."""
    rows, s = [], series(result)
    for (model, dtype), systems in s.items():
        for batch in result["settings"]["batches"]:
            cells = {name: systems.get(name, {}).get(batch) for name in SYSTEMS}
            tps = {name: (c or {}).get("tokens_per_s") for name, c in cells.items()}
            row: dict[str, Any] = {
                "model": model,
                "dtype": dtype,
                "batch": batch,
                "tokens_per_s": tps,
                "tokens_per_s_range": {name: (c or {}).get("tokens_per_s_range") for name, c in cells.items()},
                "ttft_s": {name: (c or {}).get("ttft_s") for name, c in cells.items()},
                "beyond_spread": {},
            }
            for key, pair in RATIOS.items():
                if pair is None:
                    row[key] = _ratio(*_compiled_and_eager(systems, batch))
                    continue
                row[key] = _ratio(tps[pair[0]], tps[pair[1]])
                row["beyond_spread"][key] = beyond_spread(cells[pair[0]], cells[pair[1]])
            rows.append(row)
    summary: dict[str, Any] = {"rows": rows}
    for key in RATIOS:
        summary[f"geomean_{key}"] = geomean(r[key] for r in rows)
    memory = {}
    for run in result["runs"]:
        memory[f"{run['model']} {run['dtype']} {run['system']}"] = {
            k: run.get(k) for k in ("peak_pss_mib", "peak_rss_mib", "start_s", "kv_cache_tokens", "error")
        }
    summary["memory"] = memory
    bw = result.get("bandwidth", {}).get("gb_per_s")
    read_bw = (result.get("bandwidth", {}).get("read") or {}).get("gb_per_s")
    ceiling = []
    for (model, dtype), systems in s.items():
        for name in ("ministream", "ministream_compiled", "ministream_eager", "llama", "llamacpp", "reference_batched"):
            one = systems.get(name, {}).get(1)
            params = result["models"][model]["parameters"]
            weight_bytes = one and widths.read_bytes(params, dtype, one.get("weights_file_bytes"))
            if one and bw and weight_bytes:
                decode = decode_rate(one)
                read = decode * weight_bytes / 1e9
                ceiling.append(
                    {
                        "model": model,
                        "dtype": dtype,
                        "system": name,
                        "weight_bytes": weight_bytes,
                        "decode_tokens_per_s": decode,
                        "weights_gb_per_s": read,
                        "copy_gb_per_s": bw,
                        "copy_threads": result["bandwidth"].get("threads"),
                        "fraction_of_copy_bandwidth": read / bw,
                        "ceiling_tokens_per_s": bw * 1e9 / weight_bytes,
                        "read_gb_per_s": read_bw,
                        "fraction_of_read_bandwidth": read / read_bw if read_bw else None,
                        "read_ceiling_tokens_per_s": read_bw * 1e9 / weight_bytes if read_bw else None,
                    }
                )
    summary["bandwidth_ceiling"] = ceiling
    return summary


def _compiled_and_eager(systems: dict, batch: int) -> tuple:
    """MiniStream's tokens/s compiled and eager at a batch: the forced systems, else the default's run
    where it ran that way (its worker records enforce_eager)."""

    def tps(name):
        return systems.get(name, {}).get(batch, {}).get("tokens_per_s")

    default = systems.get("ministream", {}).get(batch, {})
    eager = default.get("enforce_eager")
    return (
        tps("ministream_compiled") or (default.get("tokens_per_s") if eager is False else None),
        tps("ministream_eager") or (default.get("tokens_per_s") if eager is True else None),
    )


def decode_rate(row: dict) -> float:
    """Decode-only tokens/s of a batch-1 row: the tokens after the first, over the time after the first token
    (the whole run's rate where the two timings are too close to tell apart)."""
    tokens, seconds = row["output_tokens"], min(row["seconds"]) - row["ttft_s"]
    return (tokens - 1) / seconds if tokens > 1 and seconds > 0 else row["tokens_per_s"]
