"""config.json of a converted folder: read and parsed once for a check (ConfigJson: its values, and the quantization
scheme they name), then key by key against what format 1 allows (CONFIG_KEYS) and the train config it holds
(spec's checks). Any key the table does not name is refused: vLLM applies what it knows.
"""

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import MiniStreamError, spec
from . import scheme
from .findings import Finding, FolderError


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


@dataclass(frozen=True)
class ConfigJson:
    """config.json, read and parsed once for a check: every rule and check of the folder takes this."""

    path: Path
    values: dict  # as settings() gives them: rope_theta read from rope_parameters where only that holds it
    # scheme.read_scheme's (--scheme, head quantized); None for float weights, and for a quantization_config that
    # is not ours (its rule below names that)
    quantization: scheme.Quantization | None


def read_config_json(folder: Path) -> ConfigJson:
    """The folder's config.json, read once: FolderError as read_config; the scheme read once too."""
    return parsed(read_config(folder), Path(folder) / "config.json")


def parsed(config: dict, path: Path) -> ConfigJson:
    """config.json's object, already read from `path`, as every check takes it: its settings and its scheme."""
    values = settings(config)
    quantized = "quantization_config" in values  # else float weights: no scheme to read
    return ConfigJson(Path(path), values, scheme.quantization(values) if quantized else None)


# --- config.json's keys: what a value may be -----------------------------------------------------
# A rule says what is wrong with a value (the config at hand beside it), or None when it is allowed.
# Types are JSON's as transformers 5 checks them (its config classes are strict dataclasses): an int field
# refuses 128.0, rms_norm_eps and initializer_range refuse an int, tie_word_embeddings refuses null.
Rule = Callable[[Any, ConfigJson], "str | None"]


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


def plain_rope(v, c: ConfigJson):
    theta: Any = c.values.get("rope_theta")  # whatever it is: its own rule judges it
    want = spec.hf_rope_parameters(theta)
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


def quantized(_v, c: ConfigJson):
    if c.quantization is None:  # read once, by read_config_json
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


def config_findings(c: ConfigJson) -> tuple[spec.TrainConfig | None, list[Finding]]:
    """config.json key by key against CONFIG_KEYS, then the train config it holds (spec's checks): the
    settings when every key is allowed, and what was found."""
    fix, config, path = "convert again (make convert)", c.values, c.path
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
        if key in CONFIG_KEYS and (wrong := CONFIG_KEYS[key](value, c)):
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


def _config_words(message: str) -> str:
    """spec's checks name the train config's fields; whoever reads config.json knows its keys."""
    for f, key in spec.CONFIG_MAP.items():
        message = re.sub(rf"\b{f}\b", key, message)
    return message.replace("train config ", "")
