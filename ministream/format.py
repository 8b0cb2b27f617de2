"""MiniStream training checkpoint, format 1: the train config, loading `model.pt`, and shape checks.

The contract is shared/ministream-format.md. Everything that reads a user's training
checkpoint (the reference model, the converter) goes through `load_checkpoint`.
"""

import dataclasses
import json
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import MiniStreamError


@dataclass
class TrainConfig:
    vocab_size: int  # rows of embedding.weight; may exceed the tokenizer's size (padding)
    d_model: int  # hidden size H
    n_layers: int  # number of blocks L
    n_heads: int  # query heads Nq
    d_ff: int  # MLP inner size F
    max_seq_len: int  # trained context length
    norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    bos_id: int
    eos_id: int
    n_kv_heads: int | None = None  # key/value heads Nkv; divides n_heads; default n_heads
    head_dim: int | None = None  # per-head size D; default d_model // n_heads (need not be equal)
    tie_embeddings: bool = True  # output head shares embedding.weight

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise MiniStreamError(
                    f"head_dim is not set and d_model={self.d_model} is not a multiple of "
                    f"n_heads={self.n_heads}: give head_dim explicitly")
            self.head_dim = self.d_model // self.n_heads
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "d_ff", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise MiniStreamError(f"train config {name}={getattr(self, name)!r}: must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise MiniStreamError(
                f"train config n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "each key/value head must serve a whole group of query heads")
        if self.head_dim % 2:
            raise MiniStreamError(f"train config head_dim={self.head_dim} is odd: rotate-half RoPE needs an even head_dim")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise MiniStreamError(
                f"train config norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must both be positive")
        for name in ("bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise MiniStreamError(
                    f"train config {name}={getattr(self, name)} is outside the vocabulary [0, {self.vocab_size})")

    @classmethod
    def from_dict(cls, d: dict, source: str = "train config") -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - {k for k, v in d.items() if v is not None})
        if missing:
            raise MiniStreamError(
                f"{source} lacks {', '.join(missing)}: pass them as flags (e.g. --{missing[0].replace('_', '-')} N)")
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "max_seq_len", "bos_id", "eos_id"):
            if k in kwargs:
                if isinstance(kwargs[k], bool) or int(kwargs[k]) != kwargs[k]:
                    raise MiniStreamError(f"{source} {k}={kwargs[k]!r}: must be an integer")
                kwargs[k] = int(kwargs[k])
        for k in ("norm_eps", "rope_theta"):
            if k in kwargs:
                kwargs[k] = float(kwargs[k])
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def qkv_sizes(self) -> list[int]:
        """Row split of Wqkv: all query heads, then all key heads, then all value heads."""
        return [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]

    @property
    def w12_sizes(self) -> list[int]:
        """Row split of w12: gate, then up."""
        return [self.d_ff, self.d_ff]


# Per-layer and global tensors of format 1, with their shapes as functions of the config.
LAYER_SHAPES = {
    "norm1.weight": lambda c: (c.d_model,),
    "attn.Wqkv.weight": lambda c: (sum(c.qkv_sizes), c.d_model),
    "attn.out_proj.weight": lambda c: (c.d_model, c.n_heads * c.head_dim),
    "norm2.weight": lambda c: (c.d_model,),
    "mlp.w12.weight": lambda c: (2 * c.d_ff, c.d_model),
    "mlp.w3.weight": lambda c: (c.d_model, c.d_ff),
}
GLOBAL_SHAPES = {
    "embedding.weight": lambda c: (c.vocab_size, c.d_model),
    "norm_f.weight": lambda c: (c.d_model,),
    "lm_head.weight": lambda c: (c.vocab_size, c.d_model),  # only when tie_embeddings is false
}


def expected_shapes(cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    shapes = {k: f(cfg) for k, f in GLOBAL_SHAPES.items() if k != "lm_head.weight" or not cfg.tie_embeddings}
    for i in range(cfg.n_layers):
        shapes.update({f"blocks.{i}.{k}": f(cfg) for k, f in LAYER_SHAPES.items()})
    return shapes


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, torch.Tensor]  # canonical keys: no prefixes, blocks numbered from 0
    config: dict | None  # the raw train config from the file, if it had one
    notes: list[str]  # what loading changed (prefixes stripped, blocks renumbered, ignored entries)


_PREFIXES = ("module.", "_orig_mod.")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a format-1 `model.pt` (a file, or the folder holding it) without executing code from it."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise MiniStreamError(f"{path}: no such file; a MiniStream training checkpoint folder holds model.pt and tokenizer.json")
    obj = _torch_load(path)

    notes = []
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        state, config = obj["model"], obj.get("config")
        ignored = sorted(k for k in obj if k not in ("model", "config"))
        if ignored:
            notes.append(f"ignored entries: {', '.join(ignored)}")
        if config is not None and not isinstance(config, dict):
            raise MiniStreamError(f"{path}: 'config' is a {type(config).__name__}, expected a dict of train config values")
    elif isinstance(obj, dict):
        state, config = obj, None
    else:
        raise MiniStreamError(
            f"{path}: holds a {type(obj).__name__}, not a MiniStream checkpoint "
            "(expected a state dict or {'model': state dict, 'config': ...})")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise MiniStreamError(f"{path}: state dict entry {bad[0]!r} is not a named tensor")
    if not state:
        raise MiniStreamError(f"{path}: the state dict is empty")

    state = _strip_prefixes(state, notes)
    state = _renumber_blocks(state, notes)
    for k, v in state.items():
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise MiniStreamError(f"{path}: {k} has dtype {v.dtype}; format 1 holds float32 or bfloat16 tensors")
    return Checkpoint(path, state, config, notes)


def _torch_load(path: Path):
    if path.stat().st_size == 0:
        raise MiniStreamError(f"{path}: the file is empty")
    # mmap keeps the tensors on disk until they are read: converting streams instead of copying
    mmap = zipfile.is_zipfile(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only" in str(e):
            # torch names the callable it refused: "GLOBAL posix.system" or "Unsupported global: ..."
            what = re.search(r"(?:GLOBAL|Unsupported global:)\s+([\w.]+)", str(e))
            raise MiniStreamError(
                f"{path}: the pickle needs code to be executed to load "
                f"({what.group(1) if what else 'an object that is not a tensor, dict or number'}); it is refused. "
                "Re-save it with plain tensors and dicts: "
                "torch.save({'model': model.state_dict(), 'config': dict(config)}, 'model.pt')") from None
        raise MiniStreamError(f"{path}: not a readable torch checkpoint ({e}); is it truncated?") from None
    except Exception as e:  # torch raises many kinds (RuntimeError, EOFError, IndexError, ...) for a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MiniStreamError(
            f"{path}: not a readable torch checkpoint ({first}); "
            "is it truncated or another kind of file? Copy it again from the training run") from None


def _strip_prefixes(state: dict, notes: list[str]) -> dict:
    out, stripped = {}, set()
    for key, value in state.items():
        k = key
        while k.startswith(_PREFIXES):
            p = next(p for p in _PREFIXES if k.startswith(p))
            stripped.add(p)
            k = k[len(p):]
        if k in out:
            raise MiniStreamError(f"key {k!r} appears twice once the {'/'.join(sorted(stripped))} prefixes are stripped")
        out[k] = value
    if stripped:
        notes.append(f"stripped key prefixes: {', '.join(sorted(stripped))}")
    return out


def _renumber_blocks(state: dict, notes: list[str]) -> dict:
    ids = sorted({int(m.group(1)) for k in state if (m := _BLOCK.match(k))})
    if not ids or ids[0] != 1 or ids != list(range(1, len(ids) + 1)):
        return state
    notes.append(f"blocks are numbered 1..{ids[-1]} in the file; renumbered to 0..{ids[-1] - 1}")
    return {_BLOCK.sub(lambda m: f"blocks.{int(m.group(1)) - 1}.", k): v for k, v in state.items()}


def infer_shapes(state: dict) -> dict:
    """What the tensor shapes say about the config (to help a user whose checkpoint has none)."""
    got = {}
    if "embedding.weight" in state:
        got["vocab_size"], got["d_model"] = state["embedding.weight"].shape
    ids = {int(m.group(1)) for k in state if (m := _BLOCK.match(k))}
    if ids:
        got["n_layers"] = max(ids) + 1
    if "blocks.0.mlp.w3.weight" in state:
        got["d_ff"] = state["blocks.0.mlp.w3.weight"].shape[1]
    got["tie_embeddings"] = "lm_head.weight" not in state
    return got


def check_state(state: dict, cfg: TrainConfig, source: str) -> None:
    """Every tensor the config implies is there with its shape, and nothing else is."""
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    if "lm_head.weight" in extra and cfg.tie_embeddings:
        raise MiniStreamError(
            f"{source}: has lm_head.weight but the config says tie_embeddings=true; "
            "set tie_embeddings false (--untied) if the head was trained separately")
    if missing:
        hint = ""
        if missing == ["lm_head.weight"]:
            hint = "; the config says tie_embeddings=false: set it true (--tied) if the head shares the embedding"
        raise MiniStreamError(
            f"{source}: missing {len(missing)} tensor(s) the config implies, first {missing[0]!r}{hint} "
            f"(n_layers={cfg.n_layers}; keys present: {_summarize(state)})")
    if extra:
        raise MiniStreamError(
            f"{source}: {len(extra)} unexpected tensor(s), first {extra[0]!r}: "
            "not part of MiniStream format 1 (biases? another architecture? wrong n_layers?)")
    for k, shape in want.items():
        got = tuple(state[k].shape)
        if got != shape:
            raise MiniStreamError(
                f"{source}: {k} has shape {list(got)} but the config implies {list(shape)} "
                f"({_explain(k, cfg)}); fix the config values or the checkpoint")


def _explain(key: str, c: TrainConfig) -> str:
    if key.endswith("Wqkv.weight"):
        return (f"(n_heads + 2*n_kv_heads)*head_dim = ({c.n_heads} + 2*{c.n_kv_heads})*{c.head_dim} "
                f"rows, d_model={c.d_model} columns")
    if key.endswith("out_proj.weight"):
        return f"d_model={c.d_model} rows, n_heads*head_dim = {c.n_heads}*{c.head_dim} columns"
    if key.endswith("w12.weight"):
        return f"2*d_ff = 2*{c.d_ff} rows, d_model={c.d_model} columns"
    if key.endswith("w3.weight"):
        return f"d_model={c.d_model} rows, d_ff={c.d_ff} columns"
    if key in ("embedding.weight", "lm_head.weight"):
        return f"vocab_size={c.vocab_size} rows, d_model={c.d_model} columns"
    return f"d_model={c.d_model}"


def _summarize(state: dict) -> str:
    keys = sorted(state)
    return ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")


def resolve_config(ckpt: Checkpoint, overrides: dict | None = None) -> TrainConfig:
    """The train config: the checkpoint's own, else the caller's values; checked against the shapes."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if ckpt.config is not None:
        conflicts = {k: (ckpt.config[k], v) for k, v in overrides.items()
                     if k in ckpt.config and ckpt.config[k] != v}
        if conflicts:
            k, (a, b) = next(iter(conflicts.items()))
            raise MiniStreamError(
                f"{ckpt.path}: the checkpoint's config says {k}={a!r} but a flag says {b!r}; "
                "drop the flag (the checkpoint's own config wins) or fix the checkpoint")
        values, source = {**overrides, **ckpt.config}, f"{ckpt.path} config"
    else:
        values, source = overrides, f"{ckpt.path} has no config entry, so the flags"
        inferred = infer_shapes(ckpt.state)
        required = {f.name for f in dataclasses.fields(TrainConfig) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(values))
        if missing:
            seen = ", ".join(f"{k}={v}" for k, v in inferred.items() if k in missing)
            raise MiniStreamError(
                f"{ckpt.path} has no config entry and these values are not given: {', '.join(missing)}; "
                f"pass them as flags: {' '.join('--' + m.replace('_', '-') + ' N' for m in missing)}"
                + (f". The tensor shapes suggest {seen}" if seen else ""))
    cfg = TrainConfig.from_dict(values, source)
    check_state(ckpt.state, cfg, str(ckpt.path))
    return cfg


def load(path: str | Path, overrides: dict | None = None) -> tuple[TrainConfig, Checkpoint]:
    ckpt = load_checkpoint(path)
    return resolve_config(ckpt, overrides), ckpt


def save_checkpoint(path: Path, state: dict, cfg: TrainConfig | None, extra: dict | None = None) -> None:
    """Write model.pt as MiniStream's trainer does: {'model', 'config', ...extra}, or a bare state dict."""
    obj = state if cfg is None else {"model": state, "config": cfg.to_dict(), **(extra or {})}
    torch.save(obj, path)


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MiniStreamError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise MiniStreamError(f"{path}: not valid JSON ({e})") from None
