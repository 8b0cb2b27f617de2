"""servereport: bench-serve's verdicts and what it shows of them: whether a run sustained its rate, the
summary (the highest rate each system sustained), the table and the chart (OUT/serve.png).

A system sustains a rate when it completed every request, kept up (request throughput >= KEEP_UP x the
offered rate), and kept the p99 time to first token and the median time per output token within the targets.
"""

from pathlib import Path

from .machine import machine_line
from .reporting import pyplot, save_figure, title, took

KEEP_UP = 0.9  # request throughput over the offered rate below which a system fell behind


def judge(run: dict, rate: float, ttft_target_s: float, tpot_target_s: float) -> dict:
    """Whether a run sustained its rate, and why not: every request completed, kept up, the latency targets."""
    misses, latency = [], False
    asked, done = run["num_prompts"], run.get("completed") or 0
    if "error" in run:
        misses.append(run["error"].splitlines()[0])
        latency = True
    elif not done:
        misses.append(f"none of {asked} requests completed")
        latency = True
    else:
        if run.get("failed") or done < asked:
            misses.append(f"{asked - done} of {asked} requests failed")
        if (run.get("request_throughput") or 0) < KEEP_UP * rate:
            misses.append(f"fell behind: {run.get('request_throughput') or 0:.3g} req/s < {KEEP_UP} x {rate:g}")
        if (run.get("p99_ttft_ms") or 0) > ttft_target_s * 1e3:
            misses.append(f"p99 TTFT {_ms(run.get('p99_ttft_ms'))} > {ttft_target_s:g}s")
            latency = True
        if (run.get("median_tpot_ms") or 0) > tpot_target_s * 1e3:
            misses.append(f"median TPOT {_ms(run.get('median_tpot_ms'))} > {tpot_target_s:g}s")
            latency = True
    return {"sustained": not misses, "misses": misses, "missed_latency": latency}


def run_line(run: dict) -> str:
    """One run in a line: its figures and its verdict."""
    if "error" in run:
        return f"FAILED: {run['error'].splitlines()[0]}"
    return (
        f"{run.get('request_throughput', 0):.3g} req/s, {run.get('output_throughput', 0):.0f} output tok/s, "
        f"TTFT p99 {_ms(run.get('p99_ttft_ms'))}, TPOT median {_ms(run.get('median_tpot_ms'))}: "
        + ("sustained" if run["sustained"] else "not sustained (" + "; ".join(run["misses"]) + ")")
    )


MIN_RATE = 0.01  # req/s: the search looks no lower (a request every 100 s)


def bracket(runs: list[dict]) -> tuple[float | None, float | None]:
    """(the highest rate sustained, the lowest rate above it not sustained): the ceiling lies between."""
    sustained = [r["rate"] for r in runs if r.get("sustained")]
    high = max(sustained) if sustained else None
    failing = [r["rate"] for r in runs if r.get("sustained") is False and (high is None or r["rate"] > high)]
    return high, min(failing) if failing else None


def next_rate(runs: list[dict], within: float, step_up: float = 2.5, floor: float = MIN_RATE) -> float | None:
    """The rate to try next when searching the ceiling: `step_up` times the highest sustained while nothing
    above it failed (the ceiling lies above the grid), the lowest failing over `step_up` while nothing was
    sustained (it lies below), down to `floor`; then the geometric middle of the bracket until its ends are
    within `within` (1.1: 10%) of each other; None when the bracket is that narrow or nothing ran."""
    high, low_fail = bracket(runs)
    if high is None:
        below = float(f"{low_fail / step_up:.3g}") if low_fail else None
        return below if below and below >= floor else None
    if low_fail is None:
        return float(f"{high * step_up:.3g}")
    if low_fail <= high * within:
        return None
    return float(f"{(high * low_fail) ** 0.5:.3g}")


def summarize(result: dict) -> dict:
    """Per system: the highest rate it sustained (None: none), the lowest failing one above it, and whether it
    failed to start."""
    summary = {}
    for system, entry in result["systems"].items():
        sustained = [r["rate"] for r in entry["runs"] if r.get("sustained")]
        summary[system] = {
            "sustained_rate": max(sustained) if sustained else None,
            "lowest_failing_rate": bracket(entry["runs"])[1],
            "runs": sum(1 for r in entry["runs"] if "skipped" not in r),
            "skipped": [r["rate"] for r in entry["runs"] if "skipped" in r],
            "error": entry["server"].get("error"),
        }
    return {"systems": summary}


def _ms(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e3:.1f}s" if x >= 1e4 else f"{x / 1e3:.2f}s" if x >= 1e3 else f"{x:.0f}ms"


def table(result: dict) -> str:
    s = result["settings"]
    d = result.get("dataset", {}).get("all", {})
    median = {k: d.get(k, {}).get("median", "?") for k in ("prompt_tokens", "output_tokens")}
    lines = [
        machine_line(result.get("machine", {})),
        f"bench-serve: {s['preset']} {s['dtype']}; vLLM's client, Poisson arrivals, EOS ignored, greedy; "
        f"{d.get('requests', '?')} corpus prompts, prompt tokens median {median['prompt_tokens']}, "
        f"output tokens median {median['output_tokens']}",
        f"sustained = every request completed, >= {KEEP_UP} x the offered rate, "
        f"p99 TTFT <= {s['ttft_target_s']:g}s, median TPOT <= {s['tpot_target_s']:g}s",
        f"{'system':<11}{'rate/s':>7}{'reqs':>5}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>9}{'TTFT p99':>9}"
        f"{'TPOT p50':>9}{'TPOT p99':>9}{'failed':>7}  sustained",
    ]
    for system, entry in result["systems"].items():
        if entry["server"].get("error"):
            lines.append(f"{system:<11}server FAILED: {entry['server']['error'].splitlines()[0]}")
        for r in entry["runs"]:
            head = f"{system:<11}{r['rate']:>7g}{r['num_prompts']:>5}"
            if "skipped" in r:
                lines.append(f"{head}  skipped: {r['skipped']}")
            elif "error" in r:
                lines.append(f"{head}  FAILED: {r['error'].splitlines()[0]}")
            else:
                lines.append(
                    f"{head}{r['request_throughput']:>7.3g}{r['output_throughput']:>10.1f}"
                    f"{_ms(r.get('p50_ttft_ms')):>9}{_ms(r.get('p99_ttft_ms')):>9}{_ms(r.get('p50_tpot_ms')):>9}"
                    f"{_ms(r.get('p99_tpot_ms')):>9}{r.get('failed', 0):>7}  "
                    + ("yes" if r["sustained"] else "no: " + "; ".join(r["misses"]))
                )
    best = result["summary"]["systems"]
    lines.append(
        "highest sustained rate: "
        + ", ".join(
            f"{system} {'-' if b['sustained_rate'] is None else format(b['sustained_rate'], 'g') + ' req/s'}"
            + (f" (fails at {b['lowest_failing_rate']:g})" if b.get("lowest_failing_rate") else "")
            for system, b in best.items()
        )
    )
    rated = {k: b["sustained_rate"] for k, b in best.items() if b["sustained_rate"]}
    if "ministream" in rated and len(rated) > 1:
        lines.append(
            "ministream's ceiling over: "
            + ", ".join(f"{k} {rated['ministream'] / v:.2f}x" for k, v in rated.items() if k != "ministream")
        )
    return "\n".join(lines)


def chart(result: dict, path: Path) -> Path | None:
    """Output tokens/s and p99 TTFT by offered rate, one line per system; filled markers where sustained."""
    plt = pyplot("bench-serve")
    if plt is None:
        return None
    from matplotlib import ticker

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (system, entry) in enumerate(result["systems"].items()):
        # by rate, the searched ones among the grid's; log axes: no zeros
        runs = sorted((r for r in entry["runs"] if r.get("completed")), key=lambda r: r["rate"])
        if not runs:
            continue
        rates = [r["rate"] for r in runs]
        for ax, key, scale in ((tps, "output_throughput", 1), (ttft, "p99_ttft_ms", 1e-3)):
            ax.plot(rates, [r[key] * scale for r in runs], color=f"C{i}", label=entry.get("label", system))
            for r in runs:
                ax.plot(
                    r["rate"],
                    r[key] * scale,
                    "o",
                    color=f"C{i}",
                    markerfacecolor=f"C{i}" if r["sustained"] else "white",
                )
    ttft.axhline(result["settings"]["ttft_target_s"], color="gray", linestyle="--", linewidth=1, label="TTFT target")
    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, not 5 x 10^-1
    ran = [r["rate"] for e in result["systems"].values() for r in e["runs"] if r.get("completed")]
    rates = sorted({*result["settings"]["rates"], *([min(ran), max(ran)] if ran else [])})
    for ax, label in ((tps, "output tokens/s"), (ttft, "p99 time to first token (s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("offered request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    tps.legend(fontsize=8)
    ttft.legend(fontsize=8)
    s = result["settings"]
    title(
        fig, f"MiniStream bench-serve: {s['preset']} {s['dtype']}, vLLM's client; filled = sustained", result["machine"]
    )
    return save_figure(plt, fig, path)


def report(result: dict, out: Path) -> int:
    """The chart (OUT/serve.png) and the table of a result (summarized again); 1 if a system or a run failed."""
    result["summary"] = summarize(result)
    png = chart(result, out / "serve.png")
    print(table(result))
    print(f"bench-serve: {out / 'serve.json'}" + (f" and {png}" if png else "") + took(result))
    failed = [e for e in result["systems"].values() if e["server"].get("error") or any("error" in r for r in e["runs"])]
    return 1 if failed else 0
