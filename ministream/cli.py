"""The `ministream` command: the command line only; each subcommand delegates to the module of its stage."""

import signal
import sys

from . import MiniStreamError
from .commands import Parser, listed, seconds
from .commands.table import COMMANDS

__all__ = ["COMMANDS", "build_parser", "console", "listed", "exit_now", "main", "parse_args", "seconds"]


def _build(argv: list[str]) -> tuple[Parser, dict[str, Parser]]:
    """The parser and each subcommand's own parser by name: only the one argv names where it names one (each
    subcommand's job module is imported for its docstring, and torch or git with some: 1-2 s a call), every one for
    `--help` or a name it does not know (argparse then lists them)."""
    parser = Parser(prog="ministream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in {c.name for c in COMMANDS} else None
    built = {}
    for command in COMMANDS:
        if chosen in (None, command.name):
            p = command.subparser_init(sub)
            assert isinstance(p, Parser)  # the subparsers' class is the top parser's
            built[command.name] = p
    return parser, built


def build_parser(argv: list[str] | None = None) -> Parser:
    """The `ministream` command's parser, each subcommand with its `func` (see _build)."""
    return _build(sys.argv[1:] if argv is None else list(argv))[0]


def parse_args(argv: list[str] | None = None):
    """The command line parsed; serve's with vLLM's own options beside its own (serve.split_options) in
    `vllm_options`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, built = _build(argv)
    if not argv or argv[0] != "serve":
        return parser.parse_args(argv)
    from .run.serve import split_options

    ours, theirs = split_options(argv[1:], built["serve"].takes)
    args = parser.parse_args(["serve", *ours])
    args.vllm_options = theirs
    return args


class _Stopped(SystemExit):
    """SIGINT (Ctrl-C) or SIGTERM: unwinds like Ctrl-C does (temporary folders and files go, an old output
    stays: atomic.new_folder, new_file), then `main` says so in one line; its code is 128 + the signal."""


def _stop(signum, frame):
    raise _Stopped(128 + signum)


def main(argv=None):
    # both signals alike, everywhere (`serve` forwards them to its server meanwhile, run/serve.py); put back
    # on return, for a caller in the same process
    handlers = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(argv)
    except _Stopped as e:
        name = signal.Signals(int(e.code or 0) - 128).name
        print(f"error: interrupted ({name}): what was being written is removed, an old output kept", file=sys.stderr)
        return e.code
    except OSError as e:  # a last resort: the outputs' own steps say more (atomic.output_error)
        from .atomic import os_error

        print(f"error: {os_error(e)}", file=sys.stderr)
        return 2
    finally:
        for s, handler in handlers.items():
            if handler is not None:
                signal.signal(s, handler)


def _run(argv) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except MiniStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def console() -> None:
    """The `ministream` command: main's exit status. Once vLLM is imported the exit skips the interpreter's C++
    teardown, where vLLM's engine has aborted after its work was done ("terminate called without an active
    exception", exit -6: docs/faults.md rows 127 and 130), which made a passed verify fail. Every output is written,
    atomically, before main returns. What Python's own exit guarantees runs first (exit_now), but for an engine
    whose core ran in this process (tune's in_process choice): it has no processes to stop, and row 130's fix,
    measured, skipped its atexit handlers too."""
    import os

    from .run.engine import IN_PROCESS

    rc = main()
    code = rc if isinstance(rc, int) else (0 if rc is None else 1)
    if "vllm" in sys.modules:
        exit_now(code, handlers=os.environ.get(IN_PROCESS) != "0")
    sys.exit(code)


def exit_now(code: int, handlers: bool = True) -> None:
    """Exit with `code` (a negative one: killed by that signal, as the interpreter dies of an uncaught Ctrl-C)
    after what the interpreter's exit guarantees (non-daemon threads joined, atexit handlers run: vLLM's shutdown
    of its engine processes, multiprocessing's joins, temporary folders; output flushed), without the teardown
    after it: every module's objects freed one by one, C++ static destructors, C atexit handlers."""
    import atexit
    import contextlib
    import logging
    import os
    import threading

    if handlers:
        threading._shutdown()  # type: ignore[attr-defined]  # Py_Finalize's wait for non-daemon threads
        atexit._run_exitfuncs()
    else:
        logging.shutdown()  # one of those handlers
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    console()
