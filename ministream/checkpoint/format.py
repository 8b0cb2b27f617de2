"""Reading a MiniStream training checkpoint (format 1) safely: `model.pt` without executing code from it,
prefixes stripped, blocks renumbered, the train config resolved and checked against the shapes.

Everything that reads a user's training checkpoint (the reference model, the converter) goes through
`load_checkpoint`; what the tensors must be is ministream.spec's.
"""

import json
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import MiniStreamError
from ..spec import REQUIRED_FIELDS, TrainConfig, block_index, check_state, infer_shapes, renumber_block


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, torch.Tensor]  # canonical keys: no prefixes, blocks numbered from 0
    config: dict | None  # the raw train config from the file, if it had one
    notes: list[str]  # what loading changed (prefixes stripped, blocks renumbered, ignored entries)


_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a format-1 `model.pt` (a file, or the folder holding it) without executing code from it."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise MiniStreamError(
            f"{path}: no such file; a MiniStream training checkpoint folder holds model.pt and tokenizer.json"
        )
    obj = _torch_load(path)

    notes = []
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        state, config = obj["model"], obj.get("config")
        ignored = sorted(k for k in obj if k not in ("model", "config"))
        if ignored:
            notes.append(f"ignored entries: {', '.join(ignored)}")
        if config is not None and not isinstance(config, dict):
            raise MiniStreamError(
                f"{path}: 'config' is a {type(config).__name__}, expected a dict of train config values"
            )
    elif isinstance(obj, dict):
        state, config = obj, None
    else:
        raise MiniStreamError(
            f"{path}: holds a {type(obj).__name__}, not a MiniStream checkpoint "
            "(expected a state dict or {'model': state dict, 'config': ...})"
        )
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
                "torch.save({'model': model.state_dict(), 'config': dict(config)}, 'model.pt')"
            ) from None
        raise MiniStreamError(f"{path}: not a readable torch checkpoint ({e}); is it truncated?") from None
    except Exception as e:  # torch raises many kinds (RuntimeError, EOFError, IndexError, ...) for a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MiniStreamError(
            f"{path}: not a readable torch checkpoint ({first}); "
            "is it truncated or another kind of file? Copy it again from the training run"
        ) from None


def _strip_prefixes(state: dict, notes: list[str]) -> dict:
    out, stripped = {}, set()
    for key, value in state.items():
        k = key
        while k.startswith(_PREFIXES):
            p = next(p for p in _PREFIXES if k.startswith(p))
            stripped.add(p)
            k = k[len(p) :]
        if k in out:
            raise MiniStreamError(
                f"key {k!r} appears twice once the {'/'.join(sorted(stripped))} prefixes are stripped"
            )
        out[k] = value
    if stripped:
        notes.append(f"stripped key prefixes: {', '.join(sorted(stripped))}")
    return out


def _renumber_blocks(state: dict, notes: list[str]) -> dict:
    ids = sorted({i for k in state if (i := block_index(k)) is not None})
    if not ids or ids[0] != 1 or ids != list(range(1, len(ids) + 1)):
        return state
    notes.append(f"blocks are numbered 1..{ids[-1]} in the file; renumbered to 0..{ids[-1] - 1}")
    return {renumber_block(k, -1): v for k, v in state.items()}


def resolve_config(ckpt: Checkpoint, overrides: dict | None = None) -> TrainConfig:
    """The train config: the checkpoint's own, else the caller's values; checked against the shapes."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if ckpt.config is not None:
        conflicts = {k: (ckpt.config[k], v) for k, v in overrides.items() if k in ckpt.config and ckpt.config[k] != v}
        if conflicts:
            k, (a, b) = next(iter(conflicts.items()))
            raise MiniStreamError(
                f"{ckpt.path}: the checkpoint's config says {k}={a!r} but a flag says {b!r}; "
                "drop the flag (the checkpoint's own config wins) or fix the checkpoint"
            )
        values, source = {**overrides, **ckpt.config}, f"{ckpt.path} config"
    else:
        values, source = overrides, f"{ckpt.path} has no config entry, so the flags"
        inferred = infer_shapes(ckpt.state)
        missing = sorted(REQUIRED_FIELDS - set(values))
        if missing:
            seen = ", ".join(f"{k}={v}" for k, v in inferred.items() if k in missing)
            raise MiniStreamError(
                f"{ckpt.path} has no config entry and these values are not given: {', '.join(missing)}; "
                f"pass them as flags: {' '.join('--' + m.replace('_', '-') + ' N' for m in missing)}"
                + (f". The tensor shapes suggest {seen}" if seen else "")
            )
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
