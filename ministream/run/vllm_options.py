"""vLLM's options as the installed vLLM will read them, checked by what they resolve to before it starts.

serve passes options it has no name for to vLLM's server (`--vllm-args`, and vLLM's options given beside its
own). vLLM's parser (FlexibleArgumentParser) takes more than their whole names: any unambiguous prefix
(`--load-form dummy`), `--opt=value` and `--opt value`, underscores for dashes, dotted keys of a dict option
(`--hf-overrides.rope_theta 5`, appended after everything else), and `--config FILE.yaml`, whose keys it puts
before the command line (so serve's own options win over the file's). A check of the strings misses all of
that; this one builds the installed vLLM's own parser for the command serve will run, parses it with and
without the user's options, and holds the RESOLVED settings to the tables below:

- OWN: settings serve makes itself, from its own options (the port it checked, the context doctor judged, the
  dtype the folder check vouched for, the LoRA slots it fitted): set by the user's options at all (by the YAML
  file too, even where serve's own value would win over it), refused naming serve's own option.
- FOLDER: settings that would serve other math than the folder's (its config overridden or read from
  elsewhere, another tokenizer, weights not read from its safetensors, another quantization, another class or
  KV-cache width): any value other than vLLM's default or those listed is refused.

Sampling-side options (logits processors, generation config, watermarking, seeds) change what is sampled from
the model, not the model: the user's to choose, passed on. vLLM 0.32 takes no option's default from the
environment (its arg_utils reads envs only when it builds the engine); one variable changes the math where serve
runs adapters (LORA_ENV). A refusal is one line naming the resolved option, the spelling given, and where it
came from (the command line, --vllm-args, or the YAML file and its key). The parse runs in a forked child
(check_resolved), so that serve's own process never holds vLLM's modules; building the parser is vLLM's import,
7-16 s on 2 cores, a parse a few milliseconds. Where vLLM cannot be imported the strings are checked against the
same tables (check_spelled, which also runs first, without vLLM): serve refuses to start without vLLM anyway.
"""

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from .. import MiniStreamError

# vLLM's settings (by their name in its parsed options) that serve makes itself, and serve's own option for each
OWN = {
    "model": "the folder argument",
    "model_tag": "the folder argument",
    "host": "--host",
    "port": "--port",
    "uds": "--host and --port",
    "served_model_name": "--name",
    "max_model_len": "--max-model-len",
    "dtype": "--dtype",  # the folder check judged the folder in serve's dtype
    "tensor_parallel_size": "--tp",
    "pipeline_parallel_size": "--pp",
    "api_key": "--api-key (or VLLM_API_KEY)",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "headless": "--nnodes N --node-rank R (a node of rank 1 or above runs headless)",
    # every adapter checked before the start, and a spare LoRA slot (engine.lora_settings)
    "lora_modules": "--lora NAME=DIR",
    "enable_lora": "--lora NAME=DIR",
    "max_lora_rank": "--lora NAME=DIR (its rank fitted to the adapters)",
    "max_loras": "--lora NAME=DIR (one slot per adapter, and a spare)",
}
SHORT = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size"}  # vLLM's short names of OWN settings

CONVERT = "change the folder instead (ministream convert again), so that every command reads it"
# vLLM's settings that would serve other math than the folder's config.json, tokenizer and weights: the values
# besides vLLM's default that keep the folder's math, and what to do instead
FOLDER: dict[str, tuple[tuple[str, ...], str]] = {
    "hf_overrides": ((), CONVERT),
    "hf_config_path": ((), CONVERT),
    "config_format": (("auto", "hf"), CONVERT),
    "rope_scaling": ((), CONVERT),  # options of older releases; 0.32 takes them as --hf-overrides
    "rope_theta": ((), CONVERT),
    "tokenizer": ((), CONVERT),
    "tokenizer_mode": (("auto", "hf"), "serve tokenizes with the folder's tokenizer.json: leave it out"),
    "revision": ((), CONVERT),
    "code_revision": ((), CONVERT),
    "tokenizer_revision": ((), CONVERT),
    "model_class_overrides": ((), "serve runs the folder's architecture as registered: leave it out"),
    "load_format": (("auto", "safetensors"), "serve runs the folder's own safetensors: give auto or safetensors"),
    "quantization": ((), "quantize the folder instead (ministream quantize), so that every command reads it"),
    "quantization_config": ((), "quantize the folder instead (ministream quantize), so that every command reads it"),
    "kv_cache_dtype": (("auto",), "serve keeps the KV cache in the model's dtype: leave it out"),
    "runner": (("auto", "generate"), "serve runs the folder as the text generator it is: leave it out"),
    "convert": (("auto", "none"), "serve runs the folder as the text generator it is: leave it out"),
}


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# the whole names the string check knows: vLLM's long name of each setting, and its short ones
SPELLED = {**{_option(d): d for d in (*OWN, *FOLDER) if d != "model_tag"}, **SHORT}


def check_spelled(args: Sequence[str], where: str = "--vllm-args") -> list[str]:
    """vLLM options, refused in one line where one, spelled out whole, sets an OWN or a FOLDER setting. The
    first check (a second, without vLLM), and the only one where vLLM cannot be imported here."""
    for i, arg in enumerate(args):
        option, eq, value = arg.partition("=")
        option = "--" + option[2:].replace("_", "-") if option.startswith("--") else option  # vLLM takes both
        option = option.split(".", 1)[0]  # vLLM's --hf-overrides.rope_theta VALUE sets one key of a dict option
        dest = SPELLED.get(option)
        if dest is None or dest == "quantization":  # the folder's own method may be repeated: check_resolved's
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else ""
        refuse(where, dest, value or "(none)", option, None)
    return list(args)


def refuse(where: str, dest: str, value: object, spelled: str | None, folder_quant: str | None) -> None:
    """Raise the one-line refusal for `dest` resolved to `value`, unless FOLDER lets that value be."""
    option = _option(dest) if dest != "model_tag" else "a model (a positional argument)"
    given = f" (given as {spelled})" if spelled and spelled != option else ""
    if dest in OWN:
        raise MiniStreamError(f"{where} sets {option}{given}, which serve sets itself: give {OWN[dest]} instead")
    allowed, todo = FOLDER[dest]
    if isinstance(value, str) and (value in allowed or (dest == "quantization" and value == folder_quant)):
        return
    shown = value if isinstance(value, str) else json.dumps(value, default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    if dest == "load_format":  # the message of issue 43, kept
        raise MiniStreamError(
            f"{where} sets --load-format {shown}{given}: serve runs the folder's own safetensors "
            "(give auto or safetensors, or leave it out)"
        )
    raise MiniStreamError(
        f"{where} sets {option}{given}, which would serve other math than the folder's config.json, tokenizer "
        f"and weights (it gives {shown}): {todo}"
    )


# vLLM's environment settings (envs.py, read as it reads them: "1" or "true") that would serve other math than
# the folder's where serve runs LoRA adapters: one loaded while serving fills the spare slot that keeps a base
# request the base model's (engine.lora_settings)
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "an adapter loaded while serving would fill the spare LoRA slot"}


def check_environment(env: Mapping[str, str], loras: bool) -> None:
    """The server's environment, refused in one line where vLLM would read from it other math than serve's."""
    for name, why in LORA_ENV.items() if loras else ():
        if env.get(name, "0").strip().lower() in ("1", "true"):
            raise MiniStreamError(
                f"{name}={env[name]}: {why} that keeps base requests the base model's: unset it, and give "
                "every adapter as --lora NAME=DIR"
            )


# --- the installed vLLM's own parser ----------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """This process's stdout and stderr (the file descriptors: C code and vLLM's logger too) to /dev/null:
    vLLM's import and parser say things ("Triton is installed...", "Found duplicate keys") that are not
    serve's, and a refusal is one line."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


_PARSER: list = []  # the parser, once built: a parse takes milliseconds, building it seconds (vLLM's import)


# where the server's make_arg_parser lives: 0.32 moved it to the launchers; the releases before kept it beside
# the OpenAI server. Named here, not imported by name, so that the check of what the tools reach in each release
# (checks/internals_check.py) is not asked for both in every release.
PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")


def vllm_parser():
    """The installed vLLM's OpenAI server parser (what `python -m vllm.entrypoints.openai.api_server`, serve's
    server, parses its command line with), or None where vLLM cannot be imported here (asked again next time)."""
    if _PARSER:
        return _PARSER[0]
    try:
        with _quiet():
            from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

            for name in PARSER_MODULES:
                try:
                    make_arg_parser = importlib.import_module(name).make_arg_parser
                    break
                except (ImportError, AttributeError):
                    continue
            else:
                return None
            _PARSER.append(
                make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
            )
            return _PARSER[0]
    except ImportError:  # below 0.11 (no argparse_utils): the whole-name check alone (check_spelled)
        return None


class _Refused(Exception):
    """vLLM's parser refused the command line (its error(), which would print usage and exit)."""


def _parse(parser, args: list[str], namespace: argparse.Namespace | None = None) -> dict:
    """vLLM's parsed options for `args` (its parser's own handling: prefixes, underscores, dotted keys, the
    --config file), as a dict."""

    def error(message: str):
        raise _Refused(message)

    parser.error = error  # argparse calls self.error(message); an instance's own attribute wins
    try:
        with _quiet():
            return vars(parser.parse_args(args, namespace))
    except SystemExit:  # --help, --version: vLLM would print and exit without serving
        raise _Refused("it asks vLLM for help, not to serve") from None
    except (ValueError, TypeError, AssertionError, OSError) as e:  # its own checks of the --config file
        raise _Refused(str(e) or type(e).__name__) from None


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def read_yaml(path: str, where: str) -> dict:
    """--config's YAML file as vLLM reads it (a mapping of option names to values), refused in one line where
    vLLM would fail on it with a traceback: another extension, missing, unreadable, not YAML, not a mapping."""
    import yaml  # vLLM's dependency: there wherever its parser is

    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        raise MiniStreamError(f"{where}: --config {path}: vLLM reads a config file ending .yaml or .yml: rename it")
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise MiniStreamError(f"{where}: --config {path}: no such file: give the YAML file's path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MiniStreamError(f"{where}: --config {path} cannot be read ({e}): give a readable YAML file") from None
    except yaml.YAMLError as e:
        raise MiniStreamError(f"{where}: --config {path} is not valid YAML ({_one_line(e)}): fix it") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise MiniStreamError(
            f"{where}: --config {path} holds {type(data).__name__}, not `option: value` lines: give vLLM's "
            "options as a mapping, e.g. max-num-seqs: 64"
        )
    return data


def _configs(given: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, dict]]:
    """where -> (the --config file given there, its mapping). vLLM reads a file only as the two words
    `--config FILE`, one in the whole command line."""
    found: dict[str, tuple[str, dict]] = {}
    for where, args in given.items():
        args = list(args)
        if "--config" not in args:
            continue
        at = args.index("--config")
        if args.count("--config") > 1 or found:
            raise MiniStreamError(f"{where}: --config is given twice; vLLM reads one config file: merge them")
        if at + 1 >= len(args):
            raise MiniStreamError(f"{where}: --config needs a YAML file: give --config FILE.yaml")
        found[where] = (args[at + 1], read_yaml(args[at + 1], where))
    return found


def _spelling(dest: str, parser, tokens: Sequence[str]) -> str | None:
    """The last of `tokens` (options as given, or "--KEY" of a YAML file) that vLLM's parser takes for `dest`'s
    option: its whole name, a prefix of it, or with underscores."""
    strings = {s for a in parser._actions if a.dest == dest for s in a.option_strings}
    for token in reversed(tokens):
        name = token.split("=", 1)[0]
        norm = "--" + name[2:].split(".", 1)[0].replace("_", "-") if name.startswith("--") else name
        if norm in strings or (len(norm) > 2 and norm.startswith("--") and any(s.startswith(norm) for s in strings)):
            return name
    return None


def _touched(parser, args: list[str]) -> dict:
    """The settings `args` alone set (whatever the value, vLLM's default too), by vLLM's own parse: every setting
    starts as a marker that argparse leaves where nothing sets it."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    got = _parse(parser, args, namespace)
    return {d: v for d, v in got.items() if v is not unset and not (d == "model_tag" and v is None)}


def check_resolved(
    command: Callable[[Sequence[str]], list[str]], given: Mapping[str, Sequence[str]], folder_quant: str | None
) -> bool:
    """resolve() in a child process (fork), which alone imports vLLM: its parser holds ~360 MiB of vLLM, torch
    and transformers (measured: 224 -> 581 MiB RSS), which serve's own process, alive as long as the server,
    would otherwise keep. Its refusal raised here; where this process already built the parser, the child
    inherits it."""
    _configs(given)  # the file's faults in this process: a second, without vLLM
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its answer down the pipe, then out without this process's exit handlers
        os.close(read)
        try:
            answer: dict = {"checked": resolve(command, given, folder_quant)}
        except MiniStreamError as e:
            answer = {"refused": str(e)}
        except BaseException as e:  # every end of the child is reported, never raised past os._exit
            answer = {"failed": f"{type(e).__name__}: {_one_line(e)}"}
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(answer))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    answer = json.loads(text) if text else {"failed": "it ended without an answer"}
    if "refused" in answer:
        raise MiniStreamError(answer["refused"])
    if "failed" in answer:
        raise MiniStreamError(
            f"checking vLLM's options with the installed vLLM's parser failed ({answer['failed']}): is vLLM "
            "installed whole? run `make install` again"
        )
    return answer["checked"]


def resolve(
    command: Callable[[Sequence[str]], list[str]], given: Mapping[str, Sequence[str]], folder_quant: str | None
) -> bool:
    """The user's vLLM options (`given`: where they were given -> the options) resolved by the installed vLLM's
    own parser in the command serve will run (`command(options)`: the server's command line with them), and
    refused in one line where they set an OWN setting at all, or a FOLDER setting resolves to another value than
    serve's own command line gives it.
    folder_quant: the folder's quant_method, which --quantization may repeat. False where vLLM cannot be
    imported here (check_spelled was all there was)."""
    configs = _configs(given)  # the file's faults first: a second, where building vLLM's parser takes ten
    parser = vllm_parser()
    if parser is None:
        return False

    def parsed(options: Sequence[str], where: str, alone: bool = False) -> dict:
        cmd = command(options)
        args = cmd[cmd.index("-m") + 2 :]  # after `python -m vllm.entrypoints.openai.api_server`
        try:
            return _touched(parser, list(options)) if alone else _parse(parser, args)
        except _Refused as e:
            raise MiniStreamError(
                f"{where}: vLLM's parser refuses them ({_one_line(e)}): fix the option (vLLM's own names: "
                f"{sys.executable} -m vllm.entrypoints.openai.api_server --help)"
            ) from None

    base = parsed([], "serve's own options")
    for where, args in given.items():
        # serve's own settings, set at all (even to what serve would pass, even where serve's own value wins over
        # the file's); the folder's math, as the whole command line resolves it
        touched, mine = parsed(args, where, alone=True), parsed(args, where)
        for dest in (*OWN, *FOLDER):
            if dest in OWN and dest in touched:
                value = touched[dest]
            elif dest in FOLDER and dest in mine and mine[dest] != base.get(dest):
                value = mine[dest]
            else:
                continue
            spelled, source = _spelling(dest, parser, [a for a in args if a.startswith("-")]), where
            if spelled is None and where in configs:  # not on the command line: from the YAML file
                path, data = configs[where]
                spelled = _spelling(dest, parser, ["--" + k for k in data])
                source = f"{path} ({spelled[2:] if spelled else 'a key'}, --config in {where})"
            refuse(source, dest, value, spelled, folder_quant)
        if mine.get("config") is not None and where not in configs:  # --config=FILE, --conf FILE: set, not read
            spelled = _spelling("config", parser, [a for a in args if a.startswith("-")])
            raise MiniStreamError(
                f"{where}: {spelled}{'=FILE' if spelled == '--config' else ' FILE'} is not read by vLLM, which "
                "reads a config file only as the two words --config FILE: give it so"
            )
    together = parsed([a for args in given.values() for a in args], "the options together")
    for dest in FOLDER:  # each alone passed, so only together (none seen: a guard)
        if dest in together and together[dest] != base.get(dest):
            refuse(" and ".join(given), dest, together[dest], None, folder_quant)
    return True
