"""The one check of a converted folder, which every command that reads one runs (quantize, gguf, convert-lora's
base, bench, the perplexity readers, and doctor, serve, generate and verify): config.json (config_json.py's rules),
the tensors' names, shapes and dtypes from the safetensors headers (headers.py), the head, the tokenizer and its
chat template. No weights are read but an untied head's, to see it is not all zeros.

Which tensors a folder should hold is spec's answer (its tensor table); this module only compares. It lives on the
checkpoint floor so that the writers there (quantize, gguf, lora) run the same check as the engine's commands
(run/folder.py adds what only an engine needs: the installed vLLM's kernels on this machine).
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import MiniStreamError, spec
from .config_json import ConfigJson, config_findings, read_config, read_config_json
from .findings import Finding, FolderError
from .headers import ITEM_SIZE, Tensor, read_headers
from .scheme import Quantization, stored_weights
from .tokenizer import check_chat_template as check_chat_template_text

# the HF names the checks speak of, asked of spec's table
EMBED = spec.hf_names(spec.EMBEDDING)[0]
HEAD = spec.hf_names(spec.HEAD)[0]
FINAL_NORM = spec.hf_names(spec.FINAL_NORM)[0]
Q0, K0 = spec.hf_names(spec.QKV, 0)[:2]  # layer 0's q_proj and k_proj: the head size they give


@dataclass
class Folder:
    path: Path
    config: dict
    tensors: dict[str, Tensor]
    tokenizer_size: int | None  # tokens in tokenizer.json, added ones included; None without the file
    _loaded: dict = field(default_factory=dict, repr=False)
    # the tensors as the files store them: a quantized folder's packed weights and scales, which `tensors` shows
    # as one tensor of each weight's own shape (quantized_view); None: the same as `tensors`
    stored: dict[str, Tensor] | None = field(default=None, repr=False)

    @property
    def parameters(self) -> int:
        total = 0
        for t in self.tensors.values():
            n = 1
            for s in t.shape:
                n *= s
            total += n
        return total

    def held_bytes(self, dtype: str) -> int:
        """The bytes an engine computing in `dtype` holds of the folder's weights: each float tensor at the dtype's
        size, each integer one (packed quantized weights) as stored."""
        size = ITEM_SIZE[spec.DTYPES[dtype]]
        floats = set(spec.DTYPES.values())
        return sum(
            math.prod(t.shape) * (size if t.dtype in floats else ITEM_SIZE[t.dtype])
            for t in (self.stored or self.tensors).values()
        )

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


# --- the one check -------------------------------------------------------------------------------


@dataclass
class Examined:
    folder: Folder
    train: spec.TrainConfig | None  # config.json's settings, when every key passed
    found: list[Finding]
    config: ConfigJson  # config.json as the check read it: its values (folder.config) and its scheme

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.found if f.level == "error"]


def examine(folder: Path) -> Examined:
    """The one check of a converted folder: every command that reads one refuses it on its first error (checked:
    quantize, gguf, convert-lora's base, bench, the perplexity readers; check_servable: serve, generate, verify)
    and doctor prints all it found, so none of them can disagree. config.json's keys and values, the tensors'
    names, shapes and dtypes, the head, the tokenizer and its chat template. FolderError where the folder cannot
    be read at all. config.json is read and parsed once, its scheme too; each check below takes what they gave."""
    folder = Path(folder)
    config = read_config_json(folder)
    cfg, found = config_findings(config)  # findings, never a FolderError: the headers' come first all the same
    tensors = stored = read_headers(folder)
    if not tensors:
        raise FolderError("weights", f"no *.safetensors in {folder}", "convert again (make convert)")
    want = _shapes(cfg, config.values)
    if "quantization_config" in config.values:
        tensors, quantized = quantized_view(config.quantization, want, tensors)
        found += quantized
    size, tok = tokenizer_findings(folder)
    f = Folder(folder, config.values, tensors, size, stored=stored)
    if cfg is not None and want is not None:  # the tensors are compared with settings only when config.json holds them
        found.append(check_head_dim(cfg, tensors))
        found.append(check_head(f, config.quantization))
        found += check_names(config.values, tensors)
        found += check_shapes(want, tensors)
        if size is not None:
            found.append(check_vocab(config.values, tensors, size))
    found += tok + check_chat_template(folder)
    return Examined(f, cfg, found, config)


def _shapes(cfg: spec.TrainConfig | None, config: dict) -> dict[str, tuple[int, ...]] | None:
    """Every tensor config.json implies, with its shape: from its settings, or where a key alone was refused, from
    the train config it holds all the same (quantized_view still checks the tensors then); None where it holds
    none."""
    try:
        return spec.hf_shapes(cfg or spec.train_config_from_hf(config))
    except MiniStreamError:
        return None


def checked(folder: Path) -> Examined:
    """examine's check, refused on its first error: FolderError naming the file and key, and what to do."""
    seen = examine(folder)
    if seen.errors:
        first = seen.errors[0]
        raise FolderError(first.topic, first.text, first.fix)
    return seen


def quantized_view(
    quantization: Quantization | None, want: dict[str, tuple[int, ...]] | None, tensors: dict[str, Tensor]
) -> tuple[dict[str, Tensor], list[Finding]]:
    """A quantized folder's tensors as the other checks read them: the tensors that stand for each linear weight
    (scheme.stored_weights: names, shapes, dtypes for the folder's scheme) checked, then replaced by one tensor of
    the weight's own shape. A scheme `ministream quantize` does not write is an error: nothing here could say
    whether vLLM would read its weights right. `quantization`: config.json's scheme, `want`: the shapes it
    implies (either None: config_findings names what is wrong with config.json)."""
    if quantization is None or want is None:
        return tensors, []
    fix = "quantize the converted folder with `ministream quantize` (make quantize)"
    scheme, head = quantization
    what = f"{scheme} (compressed-tensors){', the head too' if head else ''}"
    view, found = dict(tensors), [Finding("ok", "quantization", what)]
    for stem, parts in stored_weights(want, scheme, head).items():
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
            view[f"{stem}.weight"] = Tensor(want[f"{stem}.weight"], "F32", present[0].file)
    return view, found


def shape_differences(want: dict[str, tuple[int, ...]], tensors: dict[str, Tensor]) -> list[str]:
    """Each tensor whose shape or dtype is not what config.json makes of it (`want`: spec.hf_shapes of its
    settings), in words (file and tensor named)."""
    takes = set(spec.DTYPES.values())  # the safetensors codes of the dtypes a folder is converted to
    found = []
    for name, t in sorted(tensors.items(), key=lambda kv: natural(kv[0])):
        if name in want and t.shape != want[name]:
            found.append(f"{t.file.name}: {name} is {list(t.shape)}, config.json makes it {list(want[name])}")
        elif t.dtype not in takes:
            found.append(f"{t.file.name}: {name} is {t.dtype}; the model loads {', '.join(sorted(takes))}")
    return found


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
    rows: list[tuple[str, int | None]] = [(row[0], i) for i in range(n_layers) for row in spec.LAYER_TABLE]
    rows += [(row[0], None) for row in spec.GLOBAL_TABLE if row[0] != spec.HEAD or not tied]
    return [n for raw, i in rows for n in spec.hf_names(raw, i)]


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
    q, k = tensors.get(Q0), tensors.get(K0)
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


def check_head(folder: Folder, quantization: Quantization | None) -> Finding:
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
    quantized_head = quantization is not None and quantization[1]
    if not tied and not quantized_head and folder.all_zero(HEAD):  # stored as int there
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


def check_shapes(want: dict[str, tuple[int, ...]], tensors: dict[str, Tensor]) -> list[Finding]:
    wrong = shape_differences(want, tensors)
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
