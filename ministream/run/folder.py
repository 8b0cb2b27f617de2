"""A converted folder, read once for the checks doctor and verify share: config.json, the tokenizer's
size, and each tensor's name, shape and dtype from the safetensors headers (no weights are read).

Which tensors a folder should hold is spec's answer (its tensor table); this module only compares.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import MiniStreamError, spec

# the HF names the checks speak of, asked of spec's table
EMBED = spec.hf_names(spec.EMBEDDING)[0]
HEAD = spec.hf_names(spec.HEAD)[0]
FINAL_NORM = next(
    n for row in spec.GLOBAL_TABLE if row[0] not in (spec.EMBEDDING, spec.HEAD) for n in spec.hf_names(row[0])
)


class FolderError(MiniStreamError):
    """A folder that cannot be read at all: what is wrong (text) and what to do (fix)."""

    def __init__(self, topic: str, text: str, fix: str):
        super().__init__(f"{text}; {fix}")
        self.topic, self.text, self.fix = topic, text, fix


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: str  # safetensors' code: F32, BF16, F16
    file: Path


@dataclass
class Folder:
    path: Path
    config: dict
    tensors: dict[str, Tensor]
    tokenizer_size: int | None  # tokens in tokenizer.json, added ones included; None without the file
    _loaded: dict = field(default_factory=dict, repr=False)

    @property
    def parameters(self) -> int:
        total = 0
        for t in self.tensors.values():
            n = 1
            for s in t.shape:
                n *= s
            total += n
        return total

    def load(self, name: str):
        """One tensor's values (the only place this module reads weights)."""
        from safetensors import safe_open

        with safe_open(self.tensors[name].file, "pt") as f:
            return f.get_tensor(name)

    def all_zero(self, name: str) -> bool:
        return not self.load(name).any()


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FolderError(
            "config.json", f"{path}: no such file", "give the converted folder (make convert RAW=... OUT=...)"
        ) from None
    except (OSError, ValueError) as e:
        raise FolderError(
            "config.json", f"{path} cannot be read ({e})", "point MODEL at the converted folder (make convert)"
        ) from None


def check_servable(folder: Path) -> dict:
    """What `serve`, `generate` and `verify` need of a folder before vLLM spends a minute starting: a
    config.json holding a JSON object whose model settings have the right types and agree (spec's
    checks), and a tokenizer.json that parses. The config; FolderError naming the file and key otherwise."""
    folder = Path(folder)
    path = folder / "config.json"
    config = read_config(folder)
    if not isinstance(config, dict):
        raise FolderError(
            "config.json", f"{path} holds a JSON {type(config).__name__}, not an object", "convert again (make convert)"
        )
    missing = [key for f, key in spec.CONFIG_MAP.items() if f in spec.REQUIRED_FIELDS and config.get(key) is None]
    if missing:
        raise FolderError("config.json", f"{path} lacks {', '.join(missing)}", "convert again (make convert)")
    try:
        spec.train_config_from_hf(config, str(path))
    except MiniStreamError as e:
        raise FolderError(
            "config.json", _config_words(str(e)), "fix that value, or convert again (make convert)"
        ) from None
    try:
        size = tokenizer_size(folder)
    except Exception as e:  # tokenizers raises its own errors for a file that is not a tokenizer
        raise FolderError(
            "tokenizer",
            f"{folder / 'tokenizer.json'} cannot be read ({str(e).strip()[:200]})",
            "copy the training checkpoint's tokenizer.json there, or convert again",
        ) from None
    if size is None:
        raise FolderError(
            "tokenizer",
            f"{folder / 'tokenizer.json'}: no such file; the model has no tokenizer",
            "copy the training checkpoint's tokenizer.json there, or convert again (make convert)",
        )
    return config


def _config_words(message: str) -> str:
    """spec's checks name the train config's fields; whoever reads config.json knows its keys."""
    for f, key in spec.CONFIG_MAP.items():
        message = re.sub(rf"\b{f}\b", key, message)
    return message.replace("train config ", "")


def read_headers(folder: Path) -> dict[str, Tensor]:
    """name -> shape, dtype and file of every tensor in the folder's *.safetensors files."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                tensors[name] = Tensor(tuple(s.get_shape()), s.get_dtype(), path)
    return tensors


def tokenizer_size(folder: Path) -> int | None:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def open_folder(folder: Path) -> Folder:
    """The folder's config, tensor headers and tokenizer size; FolderError if it has no config or weights."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = read_headers(folder)
    if not tensors:
        raise FolderError("weights", f"no *.safetensors in {folder}", "convert again (make convert)")
    return Folder(folder, config, tensors, tokenizer_size(folder))


# --- the checks doctor and verify share -------------------------------------------------------


def expected_names(n_layers: int, tied: bool) -> list[str]:
    """The tensors MiniStreamForCausalLM loads (LLaMA's names), in file order; the head only untied.
    Needs only these two settings, so a folder whose other settings are broken still gets its names checked."""
    names = [n for i in range(n_layers) for row in spec.LAYER_TABLE for n in spec.hf_names(row[0], i)]
    return names + [n for row in spec.GLOBAL_TABLE if row[0] != spec.HEAD or not tied for n in spec.hf_names(row[0])]


def config_names(config: dict) -> list[str]:
    """expected_names as config.json states them (an unset tie_word_embeddings is LLaMA's false)."""
    return expected_names(int(config.get("num_hidden_layers", 0)), bool(config.get("tie_word_embeddings", False)))


def name_differences(have, want) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the expected names the folder lacks, and its names nothing expects; in layer order."""
    have, want = set(have), set(want)
    return sorted(want - have, key=natural), sorted(have - want, key=natural)


def natural(name: str):
    """Sort key: layer 10 after layer 9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
