"""MiniStream on vLLM: training checkpoint -> HF folder -> patched vLLM tree -> wheel -> engine."""

from pathlib import Path

__version__ = "0.1.0"

# The repository checkout this package runs from (installed editable by `make setup`).
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


class MiniStreamError(Exception):
    """A problem with the user's input: the CLI prints it as one line and exits 2.

    The message names the file, key, shape or version and says what to do next.
    """
