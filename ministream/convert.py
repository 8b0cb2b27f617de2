"""Convert a MiniStream training checkpoint (format 1) into an HF-style folder that the patched vLLM loads.

The folder uses Hugging Face LLaMA's tensor names and config keys under model_type "ministream":
the math is LLaMA's, so every tool that reads LLaMA folders understands the tensors, while the
architecture name keeps the model ours. One mapping table below, read forwards to convert and
backwards to restore, so raw -> HF -> raw is provably lossless.
"""

import argparse
import dataclasses
import json
import shutil
import struct
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from . import MiniStreamError, __version__
from .atomic import check_output, new_folder
from .format import Checkpoint, TrainConfig, check_state, load_checkpoint, read_json, resolve_config

# training name                    HF names                                             row split
LAYER_MAP = [
    ("blocks.{i}.norm1.weight",       ["model.layers.{i}.input_layernorm.weight"],          None),
    # Wqkv rows: all query heads, then all key heads, then all value heads
    ("blocks.{i}.attn.Wqkv.weight",   ["model.layers.{i}.self_attn.q_proj.weight",
                                       "model.layers.{i}.self_attn.k_proj.weight",
                                       "model.layers.{i}.self_attn.v_proj.weight"],         "qkv_sizes"),
    ("blocks.{i}.attn.out_proj.weight", ["model.layers.{i}.self_attn.o_proj.weight"],       None),
    ("blocks.{i}.norm2.weight",       ["model.layers.{i}.post_attention_layernorm.weight"], None),
    # w12 rows: gate, then up (silu applies to the gate)
    ("blocks.{i}.mlp.w12.weight",     ["model.layers.{i}.mlp.gate_proj.weight",
                                       "model.layers.{i}.mlp.up_proj.weight"],              "w12_sizes"),
    ("blocks.{i}.mlp.w3.weight",      ["model.layers.{i}.mlp.down_proj.weight"],            None),
]
GLOBAL_MAP = [
    ("embedding.weight",              ["model.embed_tokens.weight"],                        None),
    ("norm_f.weight",                 ["model.norm.weight"],                                None),
    ("lm_head.weight",                ["lm_head.weight"],                                   None),  # untied only
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_SHARD_SIZE = 2 * 1024**3


def mapping(cfg: TrainConfig) -> list[tuple[str, list[str], list[int] | None]]:
    """The table instantiated for a config: (training key, HF keys, row sizes or None)."""
    rows = []
    for i in range(cfg.n_layers):
        for raw, hf, split in LAYER_MAP:
            rows.append((raw.format(i=i), [h.format(i=i) for h in hf], getattr(cfg, split) if split else None))
    for raw, hf, split in GLOBAL_MAP:
        if raw != "lm_head.weight" or not cfg.tie_embeddings:
            rows.append((raw, hf, None))
    return rows


def raw_to_hf(cfg: TrainConfig, state: dict):
    """Yield (HF name, tensor) in file order; splits are views, so nothing is copied here."""
    for raw, hf, split in mapping(cfg):
        parts = state[raw].split(split, dim=0) if split else [state[raw]]
        yield from zip(hf, parts)


def hf_to_raw(cfg: TrainConfig, hf_state: dict) -> dict:
    """The inverse of raw_to_hf: concatenating the split rows restores each training tensor."""
    return {raw: torch.cat([hf_state[h] for h in hf], dim=0) if split else hf_state[hf[0]]
            for raw, hf, split in mapping(cfg)}


# TrainConfig field -> config.json key (LLaMA's names); the inverse restores the train config.
CONFIG_MAP = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
}


def hf_config(cfg: TrainConfig, dtype: str) -> dict:
    config = {"architectures": ["MiniStreamForCausalLM"], "model_type": "ministream"}
    config.update({hf: getattr(cfg, f) for f, hf in CONFIG_MAP.items()})
    config.update({
        # transformers >= 5 reads rope_parameters, older releases rope_theta: write both
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "dtype": dtype,
        "torch_dtype": dtype,
        "ministream_converter": __version__,
    })
    return config


def train_config_from_hf(config: dict) -> TrainConfig:
    return TrainConfig.from_dict({f: config.get(hf) for f, hf in CONFIG_MAP.items()}, "config.json")


def load_hf(folder: str | Path) -> tuple[TrainConfig, dict]:
    """Read a converted folder back into the train config and training-named tensors."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = train_config_from_hf(read_json(folder / "config.json"))
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
    hf_state = {}
    for name in files:
        if not (folder / name).exists():
            raise MiniStreamError(f"{folder / name}: no such file; the folder is incomplete, convert it again")
        hf_state.update(load_file(folder / name))
    expected = {h for _, hf, _ in mapping(cfg) for h in hf}
    if set(hf_state) != expected:
        missing, extra = sorted(expected - set(hf_state)), sorted(set(hf_state) - expected)
        raise MiniStreamError(f"{folder}: tensors do not match config.json: missing {missing[:3]}, extra {extra[:3]}")
    state = hf_to_raw(cfg, hf_state)
    check_state(state, cfg, str(folder))
    return cfg, state


def write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype, progress) -> None:
    """Stream tensors into one safetensors file: the header is planned from shapes, then each tensor is
    converted and written on its own, so memory holds one tensor at a time, not the model."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors:
        size = t.numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, t in tensors:
            out = t.to(dtype).contiguous()
            if out.numel():
                f.write(out.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no bytes copy
            progress.update(out.numel() * dtype.itemsize)


def shard(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype, max_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for name, t in tensors:
        n = t.numel() * dtype.itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def tokenizer_files(raw_dir: Path, cfg: TrainConfig, chat_template: str | None) -> dict:
    """tokenizer_config.json for the training tokenizer.json, after checking it fits the model."""
    from tokenizers import Tokenizer

    path = raw_dir / "tokenizer.json"
    if not path.is_file():
        raise MiniStreamError(f"{path}: no such file; the training checkpoint folder must hold the tokenizer it was trained with")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise MiniStreamError(f"{path}: not a Hugging Face tokenizers file ({e})") from None
    if tok.get_vocab_size() > cfg.vocab_size:
        raise MiniStreamError(
            f"{path}: the tokenizer has {tok.get_vocab_size()} tokens but the model's embedding has only "
            f"vocab_size={cfg.vocab_size} rows: wrong tokenizer for this checkpoint?")
    special = {}
    for role, i in (("bos_token", cfg.bos_id), ("eos_token", cfg.eos_id)):
        token = tok.id_to_token(i)
        if token is None:
            raise MiniStreamError(f"{path}: has no token with id {i} ({role.split('_')[0]}_id in the train config)")
        special[role] = token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def write_folder(tmp: Path, raw_dir: Path, cfg: TrainConfig, state: dict, dtype: str,
                 chat_template: str | None, max_shard_bytes: int) -> None:
    tok_config = tokenizer_files(raw_dir, cfg, chat_template)  # check the tokenizer before the heavy part
    torch_dtype = DTYPES[dtype]
    tensors = list(raw_to_hf(cfg, state))
    total = sum(t.numel() for _, t in tensors) * torch_dtype.itemsize
    shards = shard(tensors, torch_dtype, max_shard_bytes)
    with tqdm(total=total, unit="B", unit_scale=True, desc="convert", file=sys.stderr,
              disable=None, mininterval=0.5) as progress:
        if len(shards) == 1:
            write_safetensors(tmp / "model.safetensors", shards[0], torch_dtype, progress)
        else:
            weight_map = {}
            for n, part in enumerate(shards, 1):
                name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(tmp / name, part, torch_dtype, progress)
                weight_map.update({k: name for k, _ in part})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_json(tmp / "config.json", hf_config(cfg, dtype))
    _write_json(tmp / "generation_config.json", {"bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id})
    _write_json(tmp / "tokenizer_config.json", tok_config)
    shutil.copyfile(raw_dir / "tokenizer.json", tmp / "tokenizer.json")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def dry_run(ckpt: Checkpoint, overrides: dict, log=print) -> int:
    """Print the mapping table and both key-set differences; write nothing. Exit 0 when all match."""
    for note in ckpt.notes:
        log(f"note: {note}")
    try:
        cfg = resolve_config(ckpt, overrides)
        problem = None
    except MiniStreamError as e:
        problem = str(e)
        values = {**{k: v for k, v in overrides.items() if v is not None}, **(ckpt.config or {})}
        try:
            cfg = TrainConfig.from_dict(values)
        except MiniStreamError:
            log(f"error: {problem}")
            return 1
    rows = mapping(cfg)
    width = max(len(r) for r, _, _ in rows)
    log(f"{'training checkpoint':<{width}}  {'shape':<14}  HF folder")
    for raw, hf, split in rows:
        shape = list(ckpt.state[raw].shape) if raw in ckpt.state else "MISSING"
        log(f"{raw:<{width}}  {str(shape):<14}  {', '.join(hf)}" + (f"  (rows {split})" if split else ""))
    have, want = set(ckpt.state), {r for r, _, _ in rows}
    written = {h for _, hf, _ in rows for h in hf}
    model_keys = _model_param_names(cfg)
    diffs = [("in the checkpoint, not in the mapping", have - want),
             ("in the mapping, not in the checkpoint", want - have),
             ("written, not a MiniStreamForCausalLM parameter", written - model_keys),
             ("MiniStreamForCausalLM parameters not written", model_keys - written)]
    for title, keys in diffs:
        log(f"{title}: {', '.join(sorted(keys)) if keys else 'none'}")
    if problem:
        log(f"error: {problem}")
    return 1 if problem or any(keys for _, keys in diffs) else 0


def _model_param_names(cfg: TrainConfig) -> set[str]:
    """The transformers-side model's own parameter names (tied lm_head excluded), built on the meta device."""
    from .hf import MiniStreamForCausalLM, to_hf_config

    with torch.device("meta"):
        model = MiniStreamForCausalLM(to_hf_config(cfg))
    names = set(model.state_dict())
    if cfg.tie_embeddings:
        names.discard("lm_head.weight")
    return names


def convert(raw_dir: str | Path, out: str | Path, dtype: str = "float32", force: bool = False,
            chat_template: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_SIZE,
            overrides: dict | None = None, log=print) -> TrainConfig:
    raw_dir, out = Path(raw_dir), Path(out)
    if out.resolve() == raw_dir.resolve():
        raise MiniStreamError(f"{out}: the output folder is the training checkpoint folder; choose another")
    check_output(out, force)  # before the (possibly long) load
    ckpt = load_checkpoint(raw_dir)
    for note in ckpt.notes:
        log(f"note: {note}")
    cfg = resolve_config(ckpt, overrides)
    with new_folder(out, force) as tmp:
        write_folder(tmp, ckpt.path.parent, cfg, ckpt.state, dtype, chat_template, max_shard_bytes)
    log(f"convert: wrote {out} ({cfg.n_layers} layers, d_model {cfg.d_model}, heads {cfg.n_heads}/{cfg.n_kv_heads}, "
        f"head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'untied'}, {dtype})")
    return cfg


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="training checkpoint folder -> HF-style folder", description=__doc__)
    p.add_argument("raw", type=Path, help="training checkpoint folder (model.pt, tokenizer.json) or model.pt")
    p.add_argument("out", type=Path, nargs="?", help="output folder (written whole, or not at all)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--dry-run", action="store_true", help="print the mapping and key differences; write nothing")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file for tokenizer_config.json")
    p.add_argument("--max-shard-size", default="2GB", help="split model.safetensors above this size (e.g. 500MB)")
    g = p.add_argument_group("train config", "values for a checkpoint without a config entry "
                             "(checked against the tensor shapes)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "tie_embeddings":
            g.add_argument("--tied", dest="tie_embeddings", action="store_true", default=None)
            g.add_argument("--untied", dest="tie_embeddings", action="store_false")
        else:
            kind = float if f.name in ("norm_eps", "rope_theta") else int
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind)
    p.set_defaults(func=_main)


def _main(a) -> int:
    overrides = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)}
    raw_dir = a.raw.parent if a.raw.is_file() else a.raw
    if a.dry_run:
        return dry_run(load_checkpoint(a.raw), overrides)
    if a.out is None:
        raise MiniStreamError("give an output folder: ministream convert RAW OUT (or --dry-run)")
    template = a.chat_template.read_text() if a.chat_template else None
    convert(raw_dir, a.out, a.dtype, a.force, template, _size(a.max_shard_size), overrides)
    return 0
