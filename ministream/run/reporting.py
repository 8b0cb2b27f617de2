"""reporting: what the benchmarks' reports share (bench's bench.json, bench-serve's serve.json): a saved
result read again (--report), matplotlib for the chart, and the line that says how long the run took."""

import json
import sys
from pathlib import Path


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
