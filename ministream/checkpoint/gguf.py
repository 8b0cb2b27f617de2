"""Export a converted folder, or a training checkpoint, as one GGUF file for llama.cpp and the runtimes built
on it: llama.cpp's LLaMA architecture, the tensor names of spec.GGUF_NAMES, the training tokenizer.

The math needs no new code in llama.cpp: its LLaMA is the format's (RMSNorm, SwiGLU, GQA, the attention
scale of head_dim, a tied head read from the embedding when the file has no head tensor) once q and k rows are
reordered for its RoPE (spec.gguf_tensors). The tokenizer is stated, not guessed: llama.cpp splits text
with one of its own pre-tokenizers, named in tokenizer.ggml.pre, so the export names the one whose
rules are tokenizer.json's and refuses a tokenizer that none matches (PRE_TOKENIZERS). The weights stream
from the safetensors files (or the loaded checkpoint) to the file one tensor at a time.
"""

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import MiniStreamError, __version__
from ..atomic import check_apart, check_space, disk_full, new_file
from ..spec import TrainConfig, gguf_tensors, hf_shapes, raw_to_hf, train_config_from_hf
from .cast import check_cast
from .folder import checked
from .format import is_training_checkpoint, load_checkpoint, read_json, resolve_config
from .weights import FolderTensors

# --dtype -> (torch dtype of the matrices, gguf file type); 1-D tensors (the norms) stay f32, as llama.cpp's
# converter keeps them: its CPU kernels want f32 norm weights.
DTYPES = {"f32": (torch.float32, 0), "f16": (torch.float16, 1), "bf16": (torch.bfloat16, 32)}
# the block-quantized types llama.cpp users run, made by the gguf package's own quantizers (gguf.quants, the code
# llama.cpp's convert_hf_to_gguf.py --outtype q8_0 runs): every matrix, embedding and head included; the
# norms f32. --dtype -> (GGMLQuantizationType name, gguf file type)
QUANTS = {"q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2)}

# what to do where a width cannot hold a tensor's values (cast.check_cast): a wider width of the export
OVERFLOW_FIX = {
    "f32": "export with --dtype f32",  # only a source that holds NaN or Inf: refused as such first
    "f16": "export with --dtype bf16 or f32 (float16 holds |values| up to 65504)",
    "bf16": "export with --dtype f32",
    "q8_0": "its blocks' float16 scales cannot hold them: export with --dtype bf16 or f32",
    "q4_0": "its blocks' float16 scales cannot hold them: export with --dtype bf16 or f32",
}
NONFINITE_FIX = "export an earlier checkpoint (or its converted folder)"

# GPT-2's split (tokenizers' ByteLevel with use_regex) and LLaMA 3's (a Split with this regex, then
# ByteLevel without): llama.cpp's pre-tokenizers of the same rules, llama-vocab.cpp. Other tokenizers are
# refused by name rather than exported with a split llama.cpp does not apply.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"gpt2-bytelevel": "gpt-2", LLAMA3_SPLIT: "llama-bpe"}
# llama.cpp's token types (llama.h LLAMA_TOKEN_TYPE_*)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def export(
    src: str | Path,
    out: str | Path,
    dtype: str = "f32",
    force: bool = False,
    log=print,
    ignore_config_keys: Iterable[str] = (),
) -> TrainConfig:
    """Write `out` (a .gguf file) from `src`: a converted folder (config.json) or a training checkpoint folder
    (`ignore_config_keys`: as convert's, for a training checkpoint's train config)."""
    src, out = Path(src), Path(out)
    if dtype not in DTYPES and dtype not in QUANTS:
        raise MiniStreamError(f"--dtype {dtype}: choose one of {', '.join([*DTYPES, *QUANTS])}")
    if out.exists() and (out.is_dir() or not force):
        raise MiniStreamError(
            f"{out} exists: give another name, or --force to replace the file"
            if not out.is_dir()
            else f"{out} is a folder: give the path of the .gguf file to write"
        )
    check_apart(out, [src])  # --force never replaces a file the export reads
    cfg, tensors, tok_file, chat_template = _read(src, ignore_config_keys, log)
    vocab = tokenizer_metadata(json.loads(tok_file.read_text()), cfg, tok_file)
    import gguf

    matrices, file_type = DTYPES[dtype] if dtype in DTYPES else (torch.float32, QUANTS[dtype][1])
    quant = getattr(gguf.GGMLQuantizationType, QUANTS[dtype][0]) if dtype in QUANTS else None
    # the header from the shapes alone (meta tensors), so the weights are read once, while they are written
    shapes = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(cfg).items()}
    header = [(name, _file_dtype(t, matrices), t.shape) for name, t in gguf_tensors(cfg, shapes)]
    if quant is not None:
        block = gguf.GGML_QUANT_SIZES[quant][0]
        for name, _, shape in header:
            if len(shape) == 2 and shape[-1] % block:
                raise MiniStreamError(
                    f"{src}: {name} has rows of {shape[-1]} values, not a multiple of {dtype}'s block of {block}: "
                    "llama.cpp cannot hold it in that type; export f32, bf16 or f16"
                )

    def stored(dt: torch.dtype, shape) -> tuple[tuple[int, ...] | None, int]:
        """A tensor's bytes in the file: its blocks where it is quantized (their shape too), else its dtype's."""
        if quant is not None and len(shape) == 2:
            byte_shape = tuple(gguf.quant_shape_to_byte_shape(tuple(shape), quant))
            return byte_shape, math.prod(byte_shape)
        return None, dt.itemsize * shape.numel()

    what = f"exporting {src} to {out}"
    check_space(out.parent, sum(stored(d, s)[1] for _, d, s in header), what)

    try:
        with new_file(out) as partial:
            w = gguf.GGUFWriter(str(partial), "llama")
            _metadata(w, cfg, src, file_type, vocab, chat_template)
            for name, dt, shape in header:
                byte_shape, size = stored(dt, shape)
                if byte_shape is not None:
                    w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), size, quant)
                    continue
                bf16 = dt == torch.bfloat16  # travels as its bits in uint16
                w.add_tensor_info(
                    name,
                    list(shape),
                    np.dtype(np.uint16) if bf16 else NUMPY[dt],
                    size,
                    gguf.GGMLQuantizationType.BF16 if bf16 else None,
                )
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for name, t in gguf_tensors(cfg, tensors):
                if quant is not None and t.dim() == 2:
                    # the blocks' float16 scales are what overflows first: held as llama.cpp will read them
                    # (numpy's own overflow warnings silenced: check_cast says what overflowed, in one line)
                    with np.errstate(over="ignore", invalid="ignore"):
                        blocks = gguf.quants.quantize(t.float().contiguous().numpy(), quant)
                        held = torch.from_numpy(gguf.quants.dequantize(blocks, quant))
                    check_cast(name, t, held, dtype, OVERFLOW_FIX[dtype], NONFINITE_FIX)
                    w.write_tensor_data(blocks)
                    continue
                narrow = t.to(_file_dtype(t, matrices)).contiguous()
                width = str(narrow.dtype).removeprefix("torch.")
                check_cast(name, t, narrow, width, OVERFLOW_FIX[dtype], NONFINITE_FIX)
                bf16 = narrow.dtype == torch.bfloat16
                w.write_tensor_data(narrow.view(torch.uint16).numpy() if bf16 else narrow.numpy())
            w.close()
    except OSError as e:
        raise disk_full(e, out, f"while {what}") or e from None
    log(
        f"gguf: wrote {out} ({cfg.n_layers} layers, heads {cfg.n_heads}/{cfg.n_kv_heads}, head_dim {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, {dtype}, tokenizer pre {vocab['pre']!r}, {out.stat().st_size / 2**20:.1f} MiB)"
    )
    return cfg


def _read(src: Path, ignore_config_keys: Iterable[str] = (), log=print):
    """(config, HF-named tensors read one at a time, tokenizer.json, chat template or None) of `src`."""
    if (src / "config.json").is_file() and not is_training_checkpoint(src):  # a sharded checkpoint has one too
        if ignore_config_keys:
            raise MiniStreamError(
                f"--ignore-config-key is for a training checkpoint's train config; {src} is a converted folder "
                "(config.json): drop the flag"
            )
        config = read_json(src / "config.json")
        if "quantization_config" in config:  # its stored integers read as weights would be another model
            raise MiniStreamError(
                f"{src}/config.json: the folder is quantized (`ministream quantize`); export the converted folder it "
                "came from (--dtype q8_0 or q4_0 make llama.cpp's own quantized types)"
            )
        checked(src)  # the one folder check: what the server would run is what is exported, or nothing
        cfg = train_config_from_hf(config, str(src / "config.json"))
        tensors: Any = FolderTensors(src, cfg, config)  # read one at a time, never mapped
        settings = src / "tokenizer_config.json"
        template = read_json(settings).get("chat_template") if settings.is_file() else None
        tok = src / "tokenizer.json"
    elif src.is_file() and src.suffix == ".safetensors":
        raise MiniStreamError(
            f"{src}: one safetensors file holds no config; gguf exports a converted folder (config.json beside the "
            f"weights) or a training checkpoint (model.pt): give the folder, {src.parent}"
            + ("" if (src.parent / "config.json").is_file() else ", once `ministream convert` has written it")
        )
    elif is_training_checkpoint(src):
        ckpt = load_checkpoint(src)
        if ckpt.config is None:  # resolve_config would ask for convert's flags, which gguf has not
            raise MiniStreamError(
                f"{ckpt.path} is a bare state dict, with no train config for the GGUF's settings; convert it with "
                f"the settings as flags (`ministream convert {src} DIR --d-model N ...`), then export DIR"
            )
        cfg = resolve_config(ckpt, ignore_keys=ignore_config_keys)
        for note in ckpt.notes:  # what loading and resolving changed
            log(f"note: {note}")
        tensors = ReadOnce(raw_to_hf(cfg, ckpt.state), ckpt.release)  # views of the one loaded copy
        template, tok = None, ckpt.path.parent / "tokenizer.json"
    else:
        raise MiniStreamError(
            f"{src}: neither a converted folder (config.json) nor a training checkpoint (model.pt, "
            "or a sharded checkpoint/ folder); give one of them"
        )
    if not tok.is_file():
        raise MiniStreamError(f"{tok}: no such file; the GGUF file carries the tokenizer, so the folder must hold it")
    return cfg, tensors, tok, template


class ReadOnce(dict):
    """HF name -> a view of a training checkpoint's tensor, each read once, in order (spec.gguf_tensors): reading
    one releases the one read before (Checkpoint.release: a mapped model.pt's pages leave memory)."""

    def __init__(self, items, release):
        super().__init__(items)
        self.release, self.last = release, None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.last is not None:
            self.release(self.last)
        self.last = super().__getitem__(name)
        return self.last


def _file_dtype(t: torch.Tensor, matrices: torch.dtype) -> torch.dtype:
    return torch.float32 if t.dim() == 1 else matrices


NUMPY: dict[torch.dtype, np.dtype] = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16)}


def _metadata(w, cfg: TrainConfig, src: Path, file_type: int, vocab: dict, chat_template: str | None) -> None:
    w.add_name(src.resolve().name)
    w.add_string("general.source.ministream", f"ministream {__version__}")
    w.add_file_type(file_type)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)  # head_dim need not be d_model / n_heads
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(cfg.bos_id)
    w.add_eos_token_id(cfg.eos_id)
    w.add_add_bos_token(vocab["add_bos"])
    w.add_add_eos_token(vocab["add_eos"])
    if chat_template:
        w.add_chat_template(chat_template)


def tokenizer_metadata(tok: dict, cfg: TrainConfig, source: Path) -> dict:
    """The GGUF tokenizer of a tokenizers file: llama.cpp's pre-tokenizer of the same rules, the tokens
    padded to the embedding's rows, their types, the merges, and whether BOS/EOS are added."""
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or (tok.get("decoder") or {}).get("type") != "ByteLevel":
        raise MiniStreamError(
            f"{source}: a {model.get('type')} tokenizer with a {(tok.get('decoder') or {}).get('type')} decoder; the "
            "GGUF export writes byte-level BPE tokenizers (GPT-2's kind), which this is not"
        )
    for key, fine in (("dropout", None), ("continuing_subword_prefix", None), ("end_of_word_suffix", None)):
        if model.get(key) not in (fine, ""):
            raise MiniStreamError(f"{source}: model.{key}={model[key]!r}: llama.cpp's BPE has no such rule")
    if model.get("byte_fallback"):
        raise MiniStreamError(f"{source}: model.byte_fallback is set: llama.cpp's byte-level BPE has no such rule")
    if tok.get("normalizer") is not None:
        raise MiniStreamError(
            f"{source}: has a normalizer ({tok['normalizer'].get('type')}); llama.cpp's byte-level BPE applies none, "
            "so its ids would differ: not exported"
        )
    pre = _pre_tokenizer(tok.get("pre_tokenizer"), source)
    if bool(model.get("ignore_merges")) != (pre == "llama-bpe"):  # llama.cpp ignores merges for llama-bpe only
        raise MiniStreamError(
            f"{source}: model.ignore_merges={model.get('ignore_merges')!r} with the {pre!r} split: llama.cpp "
            "applies ignore_merges with LLaMA 3's split only, so its ids would differ: not exported"
        )
    vocab = model.get("vocab") or {}
    added = {a["id"]: a for a in tok.get("added_tokens") or []}
    size = max([*vocab.values(), *added, -1]) + 1
    if size > cfg.vocab_size:
        raise MiniStreamError(
            f"{source}: ids reach {size - 1} but the model has vocab_size={cfg.vocab_size} rows: wrong tokenizer?"
        )
    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]  # padding rows: never produced by the tokenizer
    types = [UNUSED] * cfg.vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for i, a in added.items():
        tokens[i], types[i] = a["content"], CONTROL if a.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    add_bos, add_eos = _added_specials(tok, cfg, source)
    return {"pre": pre, "tokens": tokens, "types": types, "merges": merges, "add_bos": add_bos, "add_eos": add_eos}


def _pre_tokenizer(pre: dict | None, source: Path) -> str:
    def bytelevel(p: dict, regex: bool) -> bool:
        return p.get("type") == "ByteLevel" and not p.get("add_prefix_space") and p.get("use_regex", True) == regex

    if pre and bytelevel(pre, True):
        return PRE_TOKENIZERS["gpt2-bytelevel"]
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else None
    if steps and len(steps) == 2 and steps[0].get("type") == "Split" and bytelevel(steps[1], False):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex in PRE_TOKENIZERS and split.get("behavior") == "Isolated" and not split.get("invert"):
            return PRE_TOKENIZERS[regex]
    raise MiniStreamError(
        f"{source}: its pre-tokenizer ({json.dumps(pre)[:200]}) is none that llama.cpp applies as written (GPT-2's "
        "byte-level split, or LLaMA 3's regex then byte-level); a GGUF file with another split would tokenize "
        "differently, so none is written"
    )


def _added_specials(tok: dict, cfg: TrainConfig, source: Path) -> tuple[bool, bool]:
    """Whether encoding adds BOS first and EOS last: what the post-processor does, asked of tokenizers itself."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(json.dumps(tok))
    plain, rest = t.encode("a b", add_special_tokens=False).ids, t.encode("a b").ids
    add_bos = len(rest) > len(plain) and rest[0] == cfg.bos_id
    rest = rest[1:] if add_bos else rest
    add_eos = len(rest) > len(plain) and rest[-1] == cfg.eos_id
    rest = rest[:-1] if add_eos else rest
    if rest != plain:
        raise MiniStreamError(
            f"{source}: its post-processor adds tokens other than BOS first and EOS last ({rest} for {plain}); "
            "llama.cpp can add only those two"
        )
    return add_bos, add_eos
