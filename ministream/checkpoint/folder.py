"""A converted folder, read once for the one check that every command reading a folder runs (quantize, gguf,
convert-lora's base, bench, the perplexity readers, and doctor, serve, generate and verify): config.json, the
tokenizer's size, and each tensor's name, shape and dtype from the safetensors headers (no weights are read but
an untied head's, to see it is not all zeros).

Which tensors a folder should hold is spec's answer (its tensor table); this module only compares. It lives on the
checkpoint floor so that the writers there (quantize, gguf, lora) run the same check as the engine's commands
(run/folder.py adds what only an engine needs: the installed vLLM's kernels on this machine).
"""

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import MiniStreamError, spec
from .tokenizer import check_chat_template as check_chat_template_text

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


@dataclass
class Finding:
    """One thing a check found: ok, warn or error, with what to do."""

    level: str  # ok | warn | error
    topic: str
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.level:<5} {self.topic}: {self.text}" + (f"; fix: {self.fix}" if self.fix else "")


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
    """config.json's object; FolderError naming the file when there is none, it is not JSON, or not an object."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FolderError(
            "config.json", f"{path}: no such file", "give the converted folder (make convert RAW=... OUT=...)"
        ) from None
    except (OSError, ValueError) as e:
        raise FolderError(
            "config.json", f"{path} cannot be read ({e})", "point MODEL at the converted folder (make convert)"
        ) from None
    if not isinstance(config, dict):
        what = "null" if config is None else f"a JSON {type(config).__name__}"
        raise FolderError("config.json", f"{path} holds {what}, not an object", "convert again (make convert)")
    return config


# --- config.json's keys: what a value may be -----------------------------------------------------
# A rule says what is wrong with a value (the config at hand beside it), or None when it is allowed.
# Types are JSON's as transformers 5 checks them (its config classes are strict dataclasses): an int field
# refuses 128.0, rms_norm_eps and initializer_range refuse an int, tie_word_embeddings refuses null.
Rule = Callable[[Any, dict], "str | None"]


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def integer(null: bool = False) -> Rule:
    def rule(v, _c):
        if (v is None and null) or (type(v) is int):
            return None
        if type(v) is float:
            return "must be an integer, written without a decimal point (transformers refuses a float here)"
        return f"must be a number, not {_kind(v)}"

    return rule


def real(v, _c):
    if type(v) is float:
        return None if math.isfinite(v) else "must be finite"
    if type(v) is int:
        return "must be written with a decimal point, e.g. 1.0 (transformers refuses an integer here)"
    return f"must be a number, not {_kind(v)}"


def number(v, _c):
    if type(v) in (int, float):
        return None if math.isfinite(v) else "must be finite"
    return f"must be a number, not {_kind(v)}"


def flag(v, _c):
    return None if type(v) is bool else "must be true or false"


def text(null: bool = False) -> Rule:
    return lambda v, _c: None if type(v) is str or (v is None and null) else f"must be a string, not {_kind(v)}"


def id_labels(v, _c):  # a classification head's labels, as transformers reads them: {"0": "LABEL_0"}
    ok = isinstance(v, dict) and all(k.isdigit() and type(x) is str for k, x in v.items())
    return None if ok else 'must be an object of labels such as {"0": "LABEL_0"}'


def label_ids(v, _c):  # and back: {"LABEL_0": 0}
    ok = isinstance(v, dict) and all(type(x) is int for x in v.values())
    return None if ok else 'must be an object of label ids such as {"LABEL_0": 0}'


def exactly(*allowed, why: str = "format 1's math; vLLM would apply any other value") -> Rule:
    words = " or ".join(json.dumps(a) for a in allowed)
    return lambda v, _c: None if any(same(v, a) for a in allowed) else f"must be {words}: {why}"


def plain_rope(v, c):
    want = spec.hf_rope_parameters(c.get("rope_theta"))
    return (
        None
        if same(v, want)
        else f"must be {json.dumps(want)}: plain RoPE at rope_theta, format 1's math; vLLM would apply any other"
    )


def same(a, b) -> bool:
    """Equal as JSON values, types included: false is not 0, 1.0 is 1 (a number), NaN is not NaN."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


_TRAIN_RULES = {"int": integer(), "int?": integer(null=True), "float": real, "number": number, "bool": flag}
# the train config's keys (spec.CONFIG_MAP), by the JSON type each has; their values then TrainConfig's checks
_TRAIN_KINDS = {
    "vocab_size": "int", "hidden_size": "int", "num_hidden_layers": "int", "num_attention_heads": "int",
    "num_key_value_heads": "int?", "head_dim": "int?",  # null: transformers' default, the format's too
    "intermediate_size": "int", "max_position_embeddings": "int", "rms_norm_eps": "float",
    "rope_theta": "number",  # transformers 5 moves it into rope_parameters, and takes an int there
    "tie_word_embeddings": "bool", "bos_token_id": "int", "eos_token_id": "int",
}  # fmt: skip


def quantized(v, _c):
    from . import scheme

    try:
        scheme.scheme_name({"quantization_config": v}, "config.json")
    except MiniStreamError:
        return (
            f"vLLM would apply it, and it is not one of `ministream quantize`'s schemes "
            f"({', '.join(scheme.SCHEMES)}), whose tensors this check knows"
        )
    return None


# Every key config.json may hold, with the values it may have. Any other key is refused: vLLM applies
# what it knows (rope_scaling, sliding_window, quantization_config, ...), and a table of what it ignores
# would be wrong by the next release.
CONFIG_KEYS: dict[str, Rule] = {
    # format 1, as spec.hf_config writes it
    "architectures": exactly([spec.ARCH], why="the class vLLM loads; names are matched in exact case"),
    # llama: MiniStreamConfig is LlamaConfig renamed (checkpoint/hf.py)
    "model_type": exactly(spec.MODEL_TYPE, "llama", why="the config class vLLM reads the file with"),
    **{key: _TRAIN_RULES[_TRAIN_KINDS[key]] for key in spec.CONFIG_MAP.values()},
    "rope_parameters": plain_rope,
    **{key: exactly(value) for key, value in spec.HF_FIXED.items()},
    "initializer_range": real,  # the training's initial weights
    "dtype": exactly(*spec.DTYPES, None),  # what vLLM serves in by default: the precision, not the math
    "torch_dtype": exactly(*spec.DTYPES, None),  # transformers 4's name for dtype
    "ministream_converter": text(),
    # the folder's own files, for transformers with trust_remote_code (hf_files.py); vLLM never reads it. An old
    # folder lacks it (doctor warns: hf_files.finding); any other value would run another program's code
    "auto_map": exactly(spec.HF_AUTO_MAP, why=f"the files `ministream hf-files` writes; {spec.MODEL_TYPE}'s classes"),
    # the metadata transformers' PretrainedConfig writes into every config.json (PretrainedConfig().to_dict()):
    # who wrote it and what transformers' own classes return, never what a causal LM computes
    "transformers_version": text(),
    "_name_or_path": text(),
    "output_attentions": flag,
    "output_hidden_states": flag,
    "return_dict": flag,
    "chunk_size_feed_forward": integer(),  # transformers' MLP in chunks: the same sums
    "id2label": id_labels,  # a classification head's labels and loss: a causal LM has none
    "label2id": label_ids,
    "problem_type": text(null=True),
    "is_encoder_decoder": exactly(False),  # true: vLLM would build an encoder-decoder
    # and what transformers' LlamaConfig writes beside it (LlamaConfig().to_dict()), at format 1's values
    "use_cache": flag,  # keeps keys and values between steps: the same values
    "pad_token_id": integer(null=True),  # batches padded in transformers; vLLM does not pad
    "attention_dropout": number,  # dropout is off at inference, in vLLM always
    "pretraining_tp": exactly(1),  # transformers splits its matmuls in that many slices
    "rope_scaling": exactly(None),  # transformers 4 wrote null: plain RoPE
    "quantization_config": quantized,  # `ministream quantize`'s; its tensors: quantized_view
}
# absent, these leave vLLM a default that is not the format's, or no model at all
REQUIRED_KEYS = ["architectures", "model_type"] + [
    key for f, key in spec.CONFIG_MAP.items() if f in spec.REQUIRED_FIELDS
]


def settings(config: dict) -> dict:
    """config.json with rope_theta read from rope_parameters where only that holds it: transformers 5's
    save_pretrained writes the RoPE base there alone."""
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        return {**config, "rope_theta": rope["rope_theta"]}
    return config


def config_findings(config: dict, path: Path) -> tuple[spec.TrainConfig | None, list[Finding]]:
    """config.json key by key against CONFIG_KEYS, then the train config it holds (spec's checks): the
    settings when every key is allowed, and what was found."""
    fix = "convert again (make convert)"
    found = [
        Finding(
            "error",
            key,
            f"{path}: {key}={_shown(value)}: format 1 does not define it; vLLM would apply it",
            f"remove {key} from config.json, or {fix}",
        )  # fmt: skip
        for key, value in config.items()
        if key not in CONFIG_KEYS
    ]
    for key, value in config.items():
        if key in CONFIG_KEYS and (wrong := CONFIG_KEYS[key](value, config)):
            found.append(
                Finding("error", key, f"{path} {key}={_shown(value)}: {wrong}", f"set {key} as it says, or {fix}")
            )
    missing = [key for key in REQUIRED_KEYS if key not in config]
    if missing:
        found.append(Finding("error", "config.json", f"{path} lacks {', '.join(missing)}", fix))
    if found:
        return None, found
    try:
        cfg = spec.train_config_from_hf(config, str(path))
    except MiniStreamError as e:
        return None, [Finding("error", "config.json", _config_words(str(e)), f"fix that value, or {fix}")]
    return cfg, [
        Finding(
            "ok",
            "config.json",
            f"every key is format 1's or inert metadata (rms_norm_eps {cfg.norm_eps}, rope_theta {cfg.rope_theta}, "
            f"plain RoPE, silu, no biases)",
        )
    ]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- the one check -------------------------------------------------------------------------------


@dataclass
class Examined:
    folder: Folder
    train: spec.TrainConfig | None  # config.json's settings, when every key passed
    found: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.found if f.level == "error"]


def examine(folder: Path) -> Examined:
    """The one check of a converted folder: every command that reads one refuses it on its first error (checked:
    quantize, gguf, convert-lora's base, bench, the perplexity readers; check_servable: serve, generate, verify)
    and doctor prints all it found, so none of them can disagree. config.json's keys and values, the tensors'
    names, shapes and dtypes, the head, the tokenizer and its chat template. FolderError where the folder cannot
    be read at all."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = read_headers(folder)
    if not tensors:
        raise FolderError("weights", f"no *.safetensors in {folder}", "convert again (make convert)")
    config = settings(config)
    cfg, found = config_findings(config, folder / "config.json")
    if "quantization_config" in config:
        tensors, quantized = quantized_view(config, tensors)
        found += quantized
    size, tok = tokenizer_findings(folder)
    f = Folder(folder, config, tensors, size)
    if cfg is not None:  # the tensors are compared with settings only when config.json holds them
        found.append(check_head_dim(cfg, tensors))
        found.append(check_head(f))
        found += check_names(config, tensors)
        found += check_shapes(config, tensors)
        if size is not None:
            found.append(check_vocab(config, tensors, size))
    found += tok + check_chat_template(folder)
    return Examined(f, cfg, found)


def checked(folder: Path) -> Examined:
    """examine's check, refused on its first error: FolderError naming the file and key, and what to do."""
    seen = examine(folder)
    if seen.errors:
        first = seen.errors[0]
        raise FolderError(first.topic, first.text, first.fix)
    return seen


def quantized_view(config: dict, tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[Finding]]:
    """A quantized folder's tensors as the other checks read them: the tensors that stand for each linear weight
    (scheme.stored: names, shapes, dtypes for the folder's scheme) checked, then replaced by one tensor of
    the weight's own shape. A scheme `ministream quantize` does not write is an error: nothing here could say
    whether vLLM would read its weights right."""
    from .scheme import is_quantized, read_scheme, stored

    fix = "quantize the converted folder with `ministream quantize` (make quantize)"
    try:
        scheme, head = read_scheme(config, "config.json")
        want = spec.hf_shapes(spec.train_config_from_hf(config))
    except MiniStreamError:
        return tensors, []  # config_findings names what is wrong with config.json
    what = f"{scheme} (compressed-tensors){', the head too' if head else ''}"
    view, found = dict(tensors), [Finding("ok", "quantization", what)]
    for name, shape in want.items():
        if not is_quantized(name, head):
            continue
        stem, parts = name.removesuffix(".weight"), stored(shape, scheme)
        have = {local: view.pop(f"{stem}.{local}", None) for local in parts}
        for local, t in have.items():
            if t is None:
                found.append(Finding("error", "quantization", f"{stem}.{local} is missing ({scheme})", fix))
            elif (t.shape, t.dtype) != parts[local]:
                s, code = parts[local]
                found.append(
                    Finding(
                        "error",
                        "quantization",
                        f"{t.file.name}: {stem}.{local} is {list(t.shape)} {t.dtype}, {scheme} makes it {list(s)} "
                        f"{code}",
                        fix,
                    )
                )
        present = [t for t in have.values() if t is not None]
        if present:
            view[name] = Tensor(tuple(shape), "F32", present[0].file)
    return view, found


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


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def tokenizer_findings(folder: Path) -> tuple[int | None, list[Finding]]:
    """The tokenizer's size, and an error unless tokenizer.json is there and parses (vLLM needs it)."""
    path = Path(folder) / "tokenizer.json"
    fix = "copy the training checkpoint's tokenizer.json there, or convert again (make convert)"
    try:
        size = tokenizer_size(folder)
    except Exception as e:  # tokenizers raises its own errors for a file that is not a tokenizer
        return None, [Finding("error", "tokenizer", f"{path} cannot be read ({str(e).strip()[:200]})", fix)]
    if size is None:
        return None, [Finding("error", "tokenizer", f"{path}: no such file; the model has no tokenizer", fix)]
    return size, []


def check_head_dim(cfg: spec.TrainConfig, tensors: dict[str, Tensor]) -> Finding:
    """The head size config.json gives (head_dim, else hidden_size / heads) against layer 0's q and k rows."""
    q, k = (tensors.get(name) for name in spec.hf_names(spec.QKV, 0)[:2])
    if not (q and k):
        return Finding("error", "head_dim", "cannot check: layer 0's q_proj/k_proj is missing", "convert again")
    d_q, d_k = q.shape[0] / cfg.n_heads, k.shape[0] / cfg.n_kv_heads
    if d_q != d_k:
        return Finding(
            "error",
            "head_dim",
            f"q_proj gives {d_q:g} per head, k_proj {d_k:g}: num_attention_heads "
            f"({cfg.n_heads}) or num_key_value_heads ({cfg.n_kv_heads}) is wrong",
            "set them from the training config",
        )
    if cfg.head_dim != d_q:
        return Finding(
            "error",
            "head_dim",
            f"config.json head_dim={cfg.head_dim}, but the weights have {d_q:g} per head "
            f"(q_proj {q.shape[0]} rows / {cfg.n_heads} heads)",
            f'set "head_dim": {d_q:g} in config.json',
        )
    return Finding("ok", "head_dim", f"{cfg.head_dim} per head, as the weights say")


def check_head(folder: Folder) -> Finding:
    from . import scheme

    tied, has_head = folder.config.get("tie_word_embeddings"), HEAD in folder.tensors
    if tied is None:
        return Finding(
            "warn",
            "lm_head",
            f"tie_word_embeddings is not set: LLaMA's default is false, so vLLM expects "
            f"{HEAD}" + ("" if has_head else ", which is missing"),
            "set tie_word_embeddings explicitly (true when the head shares embed_tokens)",
        )
    if tied and has_head:
        return Finding(
            "warn",
            "lm_head",
            f"tie_word_embeddings is true and {HEAD} is present: vLLM ignores the tensor and uses embed_tokens",
            f"drop {HEAD}, or set tie_word_embeddings false if the head was trained separately",
        )
    if not tied and not has_head:
        return Finding(
            "error",
            "lm_head",
            f"tie_word_embeddings is false but there is no {HEAD}: vLLM's head stays uninitialized",
            "set tie_word_embeddings true if the head shares embed_tokens, else convert again",
        )
    if not tied and not scheme.quantizes_head(folder.config) and folder.all_zero(HEAD):  # stored as int there
        return Finding(
            "error",
            "lm_head",
            f"{HEAD} is all zeros (an untied head that was never copied): every token gets the same logit",
            "set tie_word_embeddings true if the training checkpoint ties it, else convert again",
        )
    return Finding("ok", "lm_head", "tied to embed_tokens" if tied else f"untied, {HEAD} present")


def check_vocab(config: dict, tensors: dict[str, Tensor], tok: int) -> Finding:
    vocab: int = config["vocab_size"]  # examined before: an int
    embed = tensors.get(EMBED)
    if embed and vocab != embed.shape[0]:
        return Finding(
            "error",
            "vocab",
            f"vocab_size={vocab}, but embed_tokens has {embed.shape[0]} rows",
            f'set "vocab_size": {embed.shape[0]} in config.json',
        )
    if tok > vocab:
        return Finding(
            "error",
            "vocab",
            f"the tokenizer has {tok} tokens but the model only {vocab} rows: ids >= {vocab} index past the embeddings",
            "use the tokenizer the model was trained with",
        )
    pad = f" ({vocab - tok} padding rows, fine)" if vocab > tok else ""
    return Finding("ok", "vocab", f"vocab_size {vocab} covers the tokenizer's {tok} tokens{pad}")


def check_names(config: dict, tensors: dict[str, Tensor]) -> list[Finding]:
    missing, unexpected = name_differences(tensors, config_names(config))
    found = []
    if missing:
        found.append(
            Finding(
                "error",
                "tensors",
                f"missing from the safetensors files: {_names(missing)}",
                "convert again (or check num_hidden_layers / tie_word_embeddings)",
            )
        )
    if unexpected:
        found.append(
            Finding(
                "error",
                "tensors",
                f"not parameters of {spec.ARCH}: {_names(unexpected)}; vLLM stops at names it does not know",
                "convert again; the converter writes LLaMA's names",
            )
        )
    return found or [Finding("ok", "tensors", f"the {len(tensors)} tensors are exactly {spec.ARCH}'s parameters")]


def check_shapes(config: dict, tensors: dict[str, Tensor]) -> list[Finding]:
    wrong = shape_differences(config, tensors)
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        return [Finding("error", "shapes", "; ".join(wrong[:3]) + more, "convert again, or fix config.json")]
    return [Finding("ok", "shapes", "every tensor has the shape and dtype config.json gives it")]


def check_chat_template(folder: Path) -> list[Finding]:
    """tokenizer_config.json's chat template, when it has one, compiles (vLLM compiles it per chat request)."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        template = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
    except (OSError, ValueError, AttributeError) as e:
        return [Finding("error", "chat_template", f"{path} cannot be read ({e})", "convert again (make convert)")]
    if template is None:
        return []
    if not isinstance(template, str):
        return [Finding("warn", "chat_template", f"{path}: a chat template that is not one string", "check it")]
    try:
        check_chat_template_text(template, f"{path} chat_template")
    except MiniStreamError as e:
        return [Finding("error", "chat_template", str(e), "convert again with a fixed --chat-template")]
    return [Finding("ok", "chat_template", "tokenizer_config.json's chat template compiles")]
