"""The files every converted folder carries for Hugging Face transformers, and config.json's auto_map to them.

MiniStream in transformers is written the way transformers writes a model that differs little from another: a
configuration and a model file, each a small commented diff against transformers' own LLaMA
(transformers_files/, templates whose open names spec fills in: model_type, the class and module names). They
import transformers only, so a folder opens where ministream is not installed:
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`.

One definition, three readers: `files()` is what convert and quantize write into a folder, what doctor compares a
folder's files with (`finding`), and what `ministream.checkpoint.hf` executes to register the classes for users who
refuse remote code; so the two routes cannot drift. `refresh` (`ministream hf-files FOLDER`) writes this version's
into a folder in place, the weights untouched. Nothing here imports transformers or torch: doctor reads it.
"""

import functools
import json
import os
import re
import tempfile
from pathlib import Path

from .. import MiniStreamError, __version__, spec
from ..atomic import lock, maker, mark_remade, signals_held, umask
from .config_json import read_config
from .findings import Finding, FolderError
from .folder import examine

TEMPLATES = "transformers_files"  # beside this module, shipped as package data
# template -> the file a folder carries, in the order they are executed (the model file imports the config's)
FILES = {"configuration.py": f"{spec.HF_CONFIG_MODULE}.py", "modeling.py": f"{spec.HF_MODEL_MODULE}.py"}
# the names the templates leave open, each spec's
NAMES = {
    "__CONFIG_MODULE__": spec.HF_CONFIG_MODULE,
    "__CONFIG_CLASS__": spec.CONFIG_CLASS,
    "__MODEL_CLASS__": spec.MODEL_CLASS,
    "__ARCH__": spec.ARCH,
    "__MODEL_TYPE__": spec.MODEL_TYPE,
}
_OPEN_NAME = re.compile(r"__[A-Z][A-Z_]*__")
TOPIC = "transformers"  # doctor's topic


@functools.cache
def files() -> dict[str, str]:
    """{file name: text} of the transformers files this version writes into a folder."""
    from importlib import resources

    written = {}
    for template, name in FILES.items():
        text = resources.files(__package__).joinpath(TEMPLATES).joinpath(template).read_text()
        for token, value in NAMES.items():
            text = text.replace(token, value)
        left = _OPEN_NAME.search(text)
        if left:  # a template names something spec does not: the package itself is broken
            raise MiniStreamError(f"{TEMPLATES}/{template}: {left[0]} is not one of {', '.join(NAMES)}: reinstall")
        written[name] = text
    return written


def write(folder: Path) -> None:
    """The files into a writer's temporary folder (atomic.new_folder: the folder appears whole or not at all)."""
    for name, text in files().items():
        (Path(folder) / name).write_text(text)


def differences(folder: Path, config: dict | None = None) -> list[str]:
    """How the folder's transformers files and auto_map differ from what this version writes, in words ([]: none).
    `config`: config.json's object where the caller has read it (doctor: the folder check's), else read here."""
    folder = Path(folder)
    found = []
    for name, text in files().items():
        try:
            have = (folder / name).read_text()
        except FileNotFoundError:
            found.append(f"{name} is missing")
            continue
        except (OSError, UnicodeDecodeError) as e:
            found.append(f"{name} cannot be read ({e})")
            continue
        if have != text:
            found.append(f"{name} is not the one ministream {__version__} writes")
    try:
        auto_map = (read_config(folder) if config is None else config).get("auto_map")
    except FolderError:
        auto_map = None  # the folder check names what is wrong with config.json
    if auto_map != spec.HF_AUTO_MAP:
        found.append("config.json has no auto_map" if auto_map is None else "config.json's auto_map is another one")
    return found


def finding(folder: Path, config: dict | None = None) -> Finding:
    """doctor's line: a folder whose files are not this version's opens in vLLM all the same, so a warning.
    `config`: as differences takes it."""
    folder = Path(folder)
    diffs = differences(folder, config)
    if not diffs:
        return Finding(
            "ok",
            TOPIC,
            f"{', '.join(files())} and auto_map are ministream {__version__}'s: transformers opens the folder "
            "(trust_remote_code=True, or after `import ministream.checkpoint.hf`)",
        )
    return Finding(
        "warn",
        TOPIC,
        f"{'; '.join(diffs)}: transformers with trust_remote_code does not run this version's MiniStream from the "
        "folder (vLLM serves it all the same)",
        f"ministream hf-files {folder}",
    )


def refresh(folder: Path, log=print) -> int:
    """`ministream hf-files FOLDER`: this version's transformers files and config.json's auto_map, written into a
    converted folder in place, whole or not at all: every new file is written beside its target first, then all
    are renamed into place together with interrupts held; the weights and the fingerprint are not touched."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MiniStreamError(f"{folder}: no such folder; give a converted folder (make convert)")
    with lock(folder, f"writing {folder}'s transformers files"):  # the lock convert and quantize take
        others = [f for f in examine(folder).errors if f.topic != "auto_map"]  # auto_map: what this fixes
        if others:
            raise FolderError(others[0].topic, others[0].text, others[0].fix)
        config = read_config(folder)
        new = {name: text for name, text in files().items() if _text(folder / name) != text}
        if config.get("auto_map") != spec.HF_AUTO_MAP:
            # config.json's other keys as they are, in their order; auto_map after model_type, as convert writes it
            rebuilt = {}
            for key, value in config.items():
                if key != "auto_map":
                    rebuilt[key] = value
                if key == "model_type":
                    rebuilt["auto_map"] = dict(spec.HF_AUTO_MAP)
            new["config.json"] = json.dumps(rebuilt, indent=2) + "\n"  # model_type is a required key
        if not new:
            log(f"hf-files: {folder} already carries ministream {__version__}'s transformers files; nothing written")
            return 0
        _replace_together(folder, new)
        mark_remade(folder, list(new))
    log(f"hf-files: wrote {', '.join(new)} into {folder} (ministream {__version__}'s); the weights are untouched")
    return 0


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _replace_together(folder: Path, new: dict[str, str]) -> None:
    """Write each text beside its file (`.<name>.part-<pid>@<host>-<random>`, atomic's leftover names), then
    rename them all into place with interrupts held: a failure before the renames leaves the folder as it was."""
    staged: dict[str, str] = {}
    try:
        for name, text in new.items():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.part-{maker()}-")
            staged[name] = tmp
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~umask())
        with signals_held():
            for name, tmp in staged.items():
                os.replace(tmp, folder / name)
    except OSError as e:
        raise MiniStreamError(
            f"cannot write {folder}'s transformers files ({e.filename or folder}: {e.strerror}); nothing was "
            "replaced: check that you may write the folder, and run again"
        ) from None
    finally:
        for tmp in staged.values():
            Path(tmp).unlink(missing_ok=True)
