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
        from safetensors import SafetensorError, safe_open

        path = self.tensors[name].file
        try:
            with safe_open(path, "pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise FolderError(
                "weights", f"{path}: {name} cannot be read ({e})", "convert again (make convert)"
            ) from None

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
    check_weights(folder, config)
    return config


def check_weights(folder: Path, config: dict) -> dict[str, Tensor]:
    """Every tensor vLLM will load is in the safetensors files, whole, with the shape config.json gives it
    and a dtype the model takes; FolderError naming the first file and tensor that is not."""
    tensors = read_headers(folder)
    if not tensors:
        raise FolderError("weights", f"no *.safetensors in {folder}", "convert again (make convert)")
    missing, unexpected = name_differences(tensors, config_names(config))
    if missing or unexpected:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"holds {', '.join(unexpected[:3])}, not parameters"
        raise FolderError("tensors", f"the safetensors files in {folder} {what}", "convert again (make convert)")
    wrong = shape_differences(config, tensors)
    if wrong:
        raise FolderError("tensors", wrong[0], "convert again, or fix config.json to the training config")
    return tensors


def shape_differences(config: dict, tensors: dict[str, Tensor]) -> list[str]:
    """Each tensor whose shape or dtype is not what config.json makes of it, in words (file and tensor named);
    [] also when config.json is too broken to say (its own checks report that)."""
    try:
        want = spec.hf_shapes(spec.train_config_from_hf(config))
    except MiniStreamError:
        return []
    takes = set(spec.SAFETENSORS_CODES.values())
    found = []
    for name, t in sorted(tensors.items(), key=lambda kv: natural(kv[0])):
        if name in want and t.shape != want[name]:
            found.append(f"{t.file.name}: {name} is {list(t.shape)}, config.json makes it {list(want[name])}")
        elif t.dtype not in takes:
            found.append(f"{t.file.name}: {name} is {t.dtype}; the model loads {', '.join(sorted(takes))}")
    return found


def _config_words(message: str) -> str:
    """spec's checks name the train config's fields; whoever reads config.json knows its keys."""
    for f, key in spec.CONFIG_MAP.items():
        message = re.sub(rf"\b{f}\b", key, message)
    return message.replace("train config ", "")


# safetensors' dtype codes and their sizes in bytes (its format's list)
ITEM_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length


def read_header(path: Path) -> dict[str, Tensor]:
    """name -> shape, dtype and file of the tensors in one safetensors file, its header checked against the
    format and the file's size first (a file cut short, an edited header, a byte count that does not add up):
    FolderError naming the file, never safetensors' own exception."""
    path = Path(path)

    def broken(what: str) -> FolderError:
        return FolderError("weights", f"{path}: {what}", "the file is damaged: convert again (make convert)")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else None
            if n is None:
                raise broken(f"{size} bytes, shorter than a safetensors header's 8-byte length")
            if n > MAX_HEADER or 8 + n > size:
                raise broken(f"its header says {n} bytes, but the file has {size - 8} after the length")
            raw = f.read(n)
    except OSError as e:
        raise FolderError("weights", f"{path} cannot be read ({e.strerror})", "check the file's permissions") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise broken("its header is not JSON (edited, or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise broken(f"its header is a JSON {type(header).__name__}, not an object")
    body = size - 8 - n
    tensors: dict[str, Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise broken(f"tensor {name!r} in the header lacks dtype, shape or data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ITEM_SIZE:
            raise broken(f"tensor {name!r} has dtype {dtype!r}, which safetensors does not know")
        if not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise broken(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise broken(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
        count = 1
        for d in shape:
            count *= d
        if offsets[1] - offsets[0] != count * ITEM_SIZE[dtype]:
            raise broken(
                f"tensor {name!r} ({dtype} {shape}) needs {count * ITEM_SIZE[dtype]} bytes, but its data_offsets "
                f"span {offsets[1] - offsets[0]}"
            )
        tensors[name] = Tensor(tuple(shape), dtype, path)
        spans.append((offsets[0], offsets[1], name))
    # as safetensors checks on open: the tensors' bytes follow each other without gap or overlap, to the end
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise broken(f"tensor {name!r} starts at byte {begin} of the data, where the one before ends at {end}")
        end = stop
    if end != body:
        how = "cut short?" if end > body else "bytes after the last tensor"
        raise broken(f"the tensors' data is {end} bytes, but the file holds {body} after the header ({how})")
    return tensors


def read_headers(folder: Path) -> dict[str, Tensor]:
    """name -> shape, dtype and file of every tensor in the folder's *.safetensors files (read_header's checks)."""
    tensors: dict[str, Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        for name, t in read_header(path).items():
            if name in tensors:
                raise FolderError(
                    "weights",
                    f"{name} is in both {tensors[name].file.name} and {path.name}",
                    "remove the stale file, or convert again (make convert)",
                )
            tensors[name] = t
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
