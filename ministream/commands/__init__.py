"""The `ministream` subcommands, one class each (as vLLM's entrypoints/cli/ keeps them: `subparser_init` builds
the command's parser, `cmd` runs it), grouped by the floor of their jobs: training.py (the training side),
building.py (vLLM releases, patched and built), checking.py (across releases), running.py (an engine) and
measuring.py (the benchmarks). cli.py lists them in one table.

A command's job module is imported inside its methods, never at the top of these modules: cli.py imports them all
to list every command, and `ministream doctor` should not pay for the torch (or the HTTP client) another command's
job needs. At the top only what is cheap and shared: paths, spec, the engine's settings.
"""

import argparse
import math
from pathlib import Path
from typing import Any, ClassVar, Protocol


class Subparsers(Protocol):
    """What a command needs of argparse's subparsers action (add_subparsers' return)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class Command:
    """One subcommand: its name and its line in `ministream --help` (known without importing its job), the
    parser it builds, and what it runs with the options parsed. `cmd` gives its job the options by name and
    returns the exit status."""

    name: ClassVar[str]
    help: ClassVar[str]

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        raise NotImplementedError

    def cmd(self, a: argparse.Namespace) -> int:
        raise NotImplementedError

    def parser(
        self, sub: Subparsers, description: str | None, raw: bool = True, **kwargs: Any
    ) -> argparse.ArgumentParser:
        """This command's parser in `sub`, whose parsed options run `cmd`. raw: the description as written (a
        module docstring's own line breaks), else argparse fills its lines."""
        if raw:
            kwargs["formatter_class"] = argparse.RawDescriptionHelpFormatter
        p = sub.add_parser(self.name, help=self.help, description=description, **kwargs)
        p.set_defaults(func=self.cmd)
        return p


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that keeps each option string it is given with whether it takes a value (argparse lists
    them in no public attribute): serve's command line is split into serve's options and vLLM's by them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.takes: dict[str, bool] = {}  # before argparse adds -h
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        self.takes.update({o: action.nargs != 0 for o in action.option_strings})
        return action


def options(a: argparse.Namespace, *same: str, **renamed: str) -> dict[str, Any]:
    """A job's keywords from the parsed options: each of `same` under its own name, each of `renamed` as
    parameter=option (a job's parameter named otherwise than its option's dest)."""
    return {name: getattr(a, name) for name in same} | {param: getattr(a, dest) for param, dest in renamed.items()}


# --- option values and options that several commands share ------------------------------------


def seconds(text: str) -> float:
    """A deadline option's value: seconds, positive and finite (0 or nan would end every request at once, inf never)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def listed(kind):
    """An option's comma-separated values, each read by `kind`."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def src_out(p, src: str, out: str, force: str = "replace a non-empty output folder") -> None:
    """The positional SRC and OUT of a command that writes one output from one input, and its --force."""
    p.add_argument("src", type=Path, help=src)
    p.add_argument("out", type=Path, help=out)
    p.add_argument("--force", action="store_true", help=force)


def for_release(p) -> None:
    """The version argument of a subcommand about one vLLM release."""
    p.add_argument("version", help="vLLM release, e.g. 0.32.0")


def heldout_text(p) -> None:
    p.add_argument(
        "--text",
        type=Path,
        help="held-out text for the perplexity the quantized widths are held to: text of the model's own kind it "
        "never trained on (default: ministream/data/heldout.txt, of the demo corpus's kind)",
    )
