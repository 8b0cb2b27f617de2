"""The `ministream` command: one subcommand per stage, each defined in the module of that name."""

import argparse
import importlib
import sys

from . import MiniStreamError

# One module per stage; each defines `register(subparsers)`, adding its subcommands with `func` set.
COMMANDS = [
    "ministream.checkpoint",  # checkpoint: write a format-1 training checkpoint (tests, demo)
    "ministream.convert",  # convert: training checkpoint -> HF-style folder
    "ministream.generate",  # generate: text from the reference model and the installed vLLM
    "ministream.patch",  # patch: pristine vLLM tree + our patch set, in git
    "ministream.port",  # port: carry a patch set to another vLLM release (three-way merge)
    "ministream.matrix",  # matrix: every supported vLLM version's patch set, checked statically
    "ministream.wheel",  # wheel, install: release wheel + patched Python files
    "ministream.verify",  # verify: golden outputs vs the installed vLLM, layer by layer on failure
    "ministream.doctor",  # doctor: a converted folder and the installed vLLM, checked without an engine
    "ministream.bench",  # bench: patched vLLM vs LLaMA, the reference model, core binding; tooling costs
    "ministream.serve",  # serve, serve-bench: OpenAI-compatible server (vllm serve) on a converted folder
    "ministream.image",  # image: the serving container image (docker/), docker or podman
]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ministream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except MiniStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
