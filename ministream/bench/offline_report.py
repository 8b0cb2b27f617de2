"""offline_report: bench's result shown: the table (printed), the chart (OUT/bench.png: tokens/s by batch, one panel
per (model, dtype), one line per system) and the line that says where they are."""

import math
from pathlib import Path

from .machine import machine_line
from .reporting import pyplot, save_figure, title, took
from .summary import SYSTEMS, series


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def _r(row: dict, key: str, fmt: str) -> str:
    """A ratio, marked * where its two cells' ranges do not overlap (summary.beyond_spread)."""
    mark = "*" if row.get("beyond_spread", {}).get(key) else ""
    return _f(row.get(key), fmt) + mark


def spread_lines(result: dict) -> list[str]:
    """Each cell's median and range of tokens/s over the repeats."""
    repeats = result["settings"].get("repeats", "?")
    lines = [
        f"tokens/s per cell: the median [the range] of {repeats} repeats; a ratio marked * has cells whose "
        "ranges do not overlap (where unmarked, this run cannot tell the two apart)"
    ]
    for r in result["summary"]["rows"]:
        cells = [
            f"{name} {r['tokens_per_s'][name]:.0f} [{lo:.0f}-{hi:.0f}]"
            for name, spread in r.get("tokens_per_s_range", {}).items()
            if spread and r["tokens_per_s"].get(name)
            for lo, hi in [spread]
        ]
        if cells:
            lines.append(f"  {r['model']} {r['dtype']} batch {r['batch']}: " + ", ".join(cells))
    return lines


def table(result: dict) -> str:
    sm = result["summary"]
    lines = [
        machine_line(result.get("machine", {})),
        f"output tokens/s (batch x {result['settings']['new_tokens']} new tokens, EOS ignored); "
        "ratios of the patched vLLM (MiniStream)",
        f"{'model':<14}{'dtype':<9}{'batch':>5} {'vLLM MS':>8} {'vLLM LLaMA':>10} {'MS/LLaMA':>8} "
        f"{'MS comp':>8} {'MS eager':>8} {'comp/eager':>10} "
        f"{'vLLM bind':>9} {'ours/bind':>9} {'ref batch':>9} {'x':>6} {'ref 1-by-1':>10} {'x':>6} "
        f"{'TTFT MS':>8} {'TTFT ref':>8} {'llama.cpp':>9} {'MS/l.cpp':>8} {'TTFT l.cpp':>10} "
        f"{'no zentorch':>11} {'zen/plain':>9} {'HF backend':>10} {'MS/HF':>6}",
    ]
    for r in sm["rows"]:
        t, ttft = r["tokens_per_s"], r["ttft_s"]
        lines.append(
            f"{r['model']:<14}{r['dtype']:<9}{r['batch']:>5} {_f(t['ministream']):>8} {_f(t['llama']):>10} "
            f"{_r(r, 'ministream_over_llama', '{:.3f}'):>8} {_f(t['ministream_compiled']):>8} "
            f"{_f(t['ministream_eager']):>8} "
            f"{_f(r['compiled_over_eager'], '{:.2f}'):>10} {_f(t['ministream_vllm_bind']):>9} "
            f"{_r(r, 'ours_over_vllm_bind', '{:.2f}'):>9} {_f(t['reference_batched']):>9} "
            f"{_f(r['vllm_over_reference_batched'], '{:.1f}'):>6} {_f(t['reference_serial']):>10} "
            f"{_f(r['vllm_over_reference_serial'], '{:.1f}'):>6} "
            f"{_f(ttft['ministream'] and ttft['ministream'] * 1e3, '{:.0f}ms'):>8} "
            f"{_f(ttft['reference_batched'] and ttft['reference_batched'] * 1e3, '{:.0f}ms'):>8} "
            f"{_f(t['llamacpp']):>9} {_r(r, 'vllm_over_llamacpp', '{:.2f}'):>8} "
            f"{_f(ttft['llamacpp'] and ttft['llamacpp'] * 1e3, '{:.0f}ms'):>10} "
            f"{_f(t['ministream_no_zentorch']):>11} {_r(r, 'zentorch_over_plain', '{:.2f}'):>9} "
            f"{_f(t['transformers_backend']):>10} {_r(r, 'native_over_transformers_backend', '{:.2f}'):>6}"
        )
    lines.append(
        "geometric means: MS/LLaMA {}, compiled/eager {}, ours/vLLM bind {}, vLLM/ref batched {}, "
        "vLLM/ref one-by-one {}, vLLM/llama.cpp {}, zentorch/plain {}, native/Transformers backend {}".format(
            _f(sm["geomean_ministream_over_llama"], "{:.3f}"),
            _f(sm.get("geomean_compiled_over_eager"), "{:.2f}"),
            _f(sm["geomean_ours_over_vllm_bind"], "{:.2f}"),
            _f(sm["geomean_vllm_over_reference_batched"], "{:.1f}"),
            _f(sm["geomean_vllm_over_reference_serial"], "{:.1f}"),
            _f(sm.get("geomean_vllm_over_llamacpp"), "{:.2f}"),
            _f(sm.get("geomean_zentorch_over_plain"), "{:.2f}"),
            _f(sm.get("geomean_native_over_transformers_backend"), "{:.2f}"),
        )
    )
    lines += spread_lines(result)
    lines.append("peak memory (PSS of the process tree) / start:")
    for name, m in sm["memory"].items():
        lines.append(
            f"  {name:<44} {_f(m['peak_pss_mib']):>6} MiB  start {_f(m['start_s'], '{:.1f}')}s"
            + (f"  KV cache {m['kv_cache_tokens']} tokens" if m.get("kv_cache_tokens") else "")
            + (f"  FAILED {m['error']}" if m.get("error") else "")
        )
    read = result.get("bandwidth", {}).get("read") or {}
    if read:
        lines.append(
            f"read bandwidth: {read['gb_per_s']:.1f} GB/s, median of {read.get('samples', '?')} read-only passes over "
            f"{read.get('read_mib', '?')} MiB at {read.get('threads', '?')} threads (spread "
            f"{_f(read.get('gb_per_s_min'), '{:.1f}')}-{_f(read.get('gb_per_s_max'), '{:.1f}')}); copy "
            f"{_f(result['bandwidth'].get('gb_per_s'), '{:.1f}')} GB/s"
        )
    for c in sm["bandwidth_ceiling"]:
        basis, of = (
            ("read", c["read_gb_per_s"]) if c.get("read_gb_per_s") else ("copy", c["copy_gb_per_s"])
        )  # runs before the read pass have the copy only
        lines.append(
            f"decode ceiling {c['model']} {c['dtype']} {c['system']}: {c['decode_tokens_per_s']:.0f} tok/s x "
            f"{c['weight_bytes'] / 1e6:.0f} MB = {c['weights_gb_per_s']:.1f} GB/s of {of:.1f} GB/s {basis} "
            f"({100 * c['weights_gb_per_s'] / of:.0f}%; ceiling {of * 1e9 / c['weight_bytes']:.0f} tok/s)"
        )
    platforms = {
        f"{r['model']} {r['dtype']} {r['system']}": r["vllm_platform"] for r in result["runs"] if r.get("vllm_platform")
    }
    if platforms:
        lines.append("vLLM's platform: " + ", ".join(f"{k} {v}" for k, v in platforms.items()))
    no_amx = [f"{r['model']} {r['dtype']}" for r in result["runs"] if r.get("llamacpp_no_amx")]
    if no_amx:
        lines.append(
            "llama.cpp ran from its build without AMX (its AMX kernels died of SIGSEGV here, llama.cpp #20824): "
            + ", ".join(no_amx)
        )
    for run in result["runs"]:
        for f in run.get("llama_bench") or []:
            what = f"prompt processing {f['n_prompt']}" if f["n_prompt"] else f"decode {f['n_gen']}"
            lines.append(
                f"llama-bench {run['model']} {run['dtype']} {what} tokens: {f['avg_ts']:.1f} tok/s "
                f"(sd {f['stddev_ts']:.1f}, {f['n_threads']} threads)"
            )
    for name, t in result.get("tooling", {}).items():
        lines.append(
            f"tooling {name:<18} {t['seconds']:6.1f}s  peak RSS {t['peak_rss_mib']:.0f} MiB"
            + (f"  FAILED {t['error'][:200]}" if "error" in t else "")
        )
    return "\n".join(lines)


def chart(result: dict, path: Path) -> Path | None:
    """tokens/s by batch size, one panel per (model, dtype), one line per system."""
    plt = pyplot("bench")
    if plt is None:
        return None
    s = series(result)
    keys = sorted(s)
    cols = min(2, len(keys)) or 1
    rows = math.ceil(len(keys) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, (system, label) in enumerate(SYSTEMS.items()):  # one colour per system in every panel
            points = sorted(s[key].get(system, {}).items())
            if points:
                ax.plot(
                    [b for b, _ in points],
                    [r["tokens_per_s"] for _, r in points],
                    marker="o",
                    label=label,
                    color=f"C{i}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(result["settings"]["batches"], [str(b) for b in result["settings"]["batches"]])
        ax.set_title(f"{key[0]}, {key[1]}")
        ax.set_xlabel("batch (prompts)")
        ax.set_ylabel("output tokens/s")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    title(fig, f"MiniStream bench: {result['settings']['new_tokens']} new tokens per prompt", result["machine"])
    return save_figure(plt, fig, path)


def report(result: dict, out: Path) -> int:
    path = out / "bench.json"
    png = chart(result, out / "bench.png")
    print(table(result))
    print(f"bench: {path}" + (f" and {png}" if png else "") + took(result))
    failed = [r for r in result["runs"] if "error" in r]
    return 1 if failed else 0
