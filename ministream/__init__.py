"""MiniStream on vLLM: training checkpoint -> HF folder -> patched vLLM tree -> wheel -> engine."""

__version__ = "0.1.0"


class MiniStreamError(Exception):
    """A problem with the user's input: the CLI prints it as one line and exits 2.

    The message names the file, key, shape or version and says what to do next.
    """
