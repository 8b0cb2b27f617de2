"""Reading a MiniStream training checkpoint (format 1) safely: `model.pt` without executing code from it,
its zip proven to hold what its pickle says before a byte is mapped or inflated, dense tensors of the
format's dtypes, prefixes stripped, blocks renumbered, the train config resolved (no key of it dropped in
silence) and checked against the shapes.

A sharded checkpoint (format.md, "Sharded checkpoints": torch.distributed.checkpoint's folder `checkpoint/`,
with config.json beside it) is read by .sharded, one tensor at a time, into the same state dict, checks and notes.

Everything that reads a user's training checkpoint (the converter, the GGUF export, the reference model,
verify --raw) goes through `load_checkpoint` and `resolve_config`; what the tensors must be is ministream.spec's.
"""

import ctypes
import dataclasses
import io
import json
import mmap
import pickle
import re
import struct
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import MiniStreamError
from ..spec import (
    REQUIRED_FIELDS,
    TrainConfig,
    block_index,
    check_state,
    check_stored_dtype,
    drop_tied_head,
    infer_shapes,
    renumber_block,
)
from .sharded import METADATA, is_sharded, read_sharded


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, torch.Tensor]  # canonical keys: no prefixes, blocks numbered from 0
    config: dict | None  # the raw train config from the file, if it had one
    notes: list[str]  # what loading and resolving changed (prefixes stripped, blocks renumbered, ignored entries)
    mapped: bool = False  # the state's tensors are views of model.pt mapped into memory (read_pt)

    def release(self, t: torch.Tensor) -> None:
        """`t`, a tensor of the state (or a view of one), read for the last time by a command that streams: its
        pages leave this process's resident memory (page_out). Mapped pages, once read, stay resident until the
        file is unmapped, so convert's peak was the whole model's bytes (issue 56). Anything else (a copy made
        from a view, a sharded checkpoint's tensors, read into memory) is left alone."""
        if not self.mapped:
            return
        if not hasattr(self, "_ranges"):  # each storage of the state: a slice of the one mapping of the file
            storages = [v.untyped_storage() for v in self.state.values() if isinstance(v, torch.Tensor)]
            self._ranges = {(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages}
        start = t.data_ptr()
        if t.numel() and any(lo <= start < hi for lo, hi in self._ranges):
            last = sum((n - 1) * step for n, step in zip(t.shape, t.stride()))  # the view's last element
            page_out(start, start + (last + 1) * t.element_size())


_MADV_PAGEOUT = 21  # <linux/mman.h>, Linux 5.4 on


def page_out(start: int, end: int) -> None:
    """Ask the kernel to reclaim the pages of addresses [start, end) from this process (madvise MADV_PAGEOUT). It
    never changes what memory holds: a clean page of a mapped file is read again from the file when next touched,
    an anonymous one could only go to swap. Where the call is missing or refused, the pages just stay."""
    page = mmap.PAGESIZE
    first = start // page * page
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(-(-end // page) * page - first), _MADV_PAGEOUT)
    except (OSError, AttributeError):  # not Linux's libc
        pass


_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile
SHARDED_DIR = "checkpoint"  # a sharded checkpoint's DCP folder; config.json and tokenizer.json lie beside it
ADAPTER_FILE = "adapter.pt"  # a LoRA adapter's file (format.md, "LoRA adapters"), read by the same reader
RESAVE = {  # how the trainer saves each file with nothing but tensors, dicts and numbers
    "model.pt": "torch.save({'model': model.state_dict(), 'config': dict(config)}, 'model.pt')",
    ADAPTER_FILE: f"torch.save({{'lora': lora_state_dict, 'config': {{'r': r, 'alpha': alpha}}}}, '{ADAPTER_FILE}')",
}
CONFIG_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig))  # the format's "Train config" table
# A zip member that is not a tensor's storage (data.pkl, version, byteorder, ...) is bytes to kilobytes; one that
# would inflate beyond this is refused before inflating (a compressed storage must inflate to exactly its size).
MAX_INFLATED_RECORD = 64 * 2**20


def weights_path(path: str | Path) -> Path:
    """Where a training checkpoint given as `path` keeps its weights: its model.pt, or its sharded checkpoint/
    folder (`path` may be the folder holding either, either itself, or the sharded folder's .metadata)."""
    path = Path(path)
    if path.name == METADATA and path.is_file():
        return path.parent
    if not path.is_dir() or is_sharded(path):
        return path
    if not (path / "model.pt").is_file() and (path / SHARDED_DIR).is_dir():
        return path / SHARDED_DIR
    return path / "model.pt"


def is_training_checkpoint(path: str | Path) -> bool:
    """A training checkpoint (model.pt, or a sharded one), not a converted folder: both may hold config.json."""
    weights = weights_path(path)
    return weights.is_file() or weights.is_dir()


def checkpoint_inputs(path: str | Path) -> list[Path]:
    """The paths a training checkpoint given as `path` consists of: what an output must not be or lie in."""
    path, weights = Path(path), weights_path(path)
    beside = weights.parent
    return [path, weights, beside / "tokenizer.json"] + ([beside / "config.json"] if weights.is_dir() else [])


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a format-1 training checkpoint without executing code from it: `model.pt` (a file, or the folder
    holding it) or a sharded checkpoint (its folder, or the checkpoint/ folder in it)."""
    path = weights_path(path)
    if path.is_dir():
        return _load_sharded(path)
    if not path.is_file():
        raise MiniStreamError(
            f"{path}: no such file; a MiniStream training checkpoint folder holds model.pt and tokenizer.json, "
            f"or a sharded checkpoint: {SHARDED_DIR}/ (torch.distributed.checkpoint's), config.json and tokenizer.json"
        )
    notes: list[str] = []
    obj, mapped = read_pt_mapped(path, notes)

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
    return Checkpoint(path, named_tensors(path, state, notes), config, notes, mapped)


def _load_sharded(folder: Path) -> Checkpoint:
    """A sharded checkpoint: the train config from config.json beside `folder` (before the weights are read),
    the "model." tensors through torch's DCP reader."""
    config_file = folder.parent / "config.json"
    if not config_file.is_file():
        raise MiniStreamError(
            f"{config_file}: no such file; a sharded checkpoint keeps its train config beside {folder.name}/ as "
            "JSON: write it there (json.dump(dict(config), open('config.json', 'w')))"
        )
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise MiniStreamError(f"{config_file}: holds a {type(config).__name__}, expected a dict of train config values")
    notes: list[str] = []
    return Checkpoint(folder, named_tensors(folder, read_sharded(folder, notes), notes), config, notes)


def named_tensors(path: Path, state: dict, notes: list[str], what: str = "the state dict") -> dict[str, torch.Tensor]:
    """`state` (`what` in the file `path`) as format 1 holds tensors: named, dense, float32 or bfloat16, the
    DDP/compile prefixes stripped and blocks numbered from 0; what changed is added to `notes`."""
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise MiniStreamError(f"{path}: {what} entry {bad[0]!r} is not a named tensor")
    if not state:
        raise MiniStreamError(f"{path}: {what} is empty")

    state = _strip_prefixes(state, notes)
    state = _renumber_blocks(state, notes)
    for k, v in state.items():
        # a sparse, quantized or meta tensor has no plain row-major values to convert: refused by name
        if v.layout != torch.strided or v.is_quantized or v.device.type != "cpu":
            kind = v.layout if v.layout != torch.strided else "quantized" if v.is_quantized else f"on {v.device}"
            raise MiniStreamError(
                f"{path}: {k} is a {kind} tensor; format 1 holds dense tensors with their values: "
                "save t.to_dense() (or the model's own state_dict()) instead"
            )
        check_stored_dtype(path, k, v.dtype)
    return state


def read_pt(path: Path, notes: list[str]):
    """The object a format-1 `.pt` file holds (model.pt, adapter.pt), read with torch's weights-only loader
    after its zip is proven to hold what its pickle names (`_check_zip`); never unpickled in full."""
    return read_pt_mapped(path, notes)[0]


def read_pt_mapped(path: Path, notes: list[str]) -> tuple[object, bool]:
    """read_pt's object, and whether its tensors are views of the file mapped into memory."""
    if path.stat().st_size == 0:
        raise MiniStreamError(f"{path}: the file is empty")
    # mmap keeps the tensors on disk until they are read: converting streams instead of copying. It maps a
    # member's bytes as they lie in the file, so only a zip whose every member is stored may be mapped.
    mmap = zipfile.is_zipfile(path) and _check_zip(path, notes)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap), mmap
    except pickle.UnpicklingError as e:
        raise _refused_pickle(path, e) from None
    except Exception as e:  # torch raises many kinds (RuntimeError, EOFError, IndexError, ...) for a bad file
        raise _unreadable(path, e) from None


def _check_zip(path: Path, notes: list[str]) -> bool:
    """Prove, from the zip's directory and the pickle alone (no storage read or inflated), that every
    storage the pickle names is there whole; True when every member is stored as torch.save writes it,
    so mapping the file reads the tensors' own bytes.

    A compressed member (left by a repacking or archiving tool) is read without mmap rather than refused:
    torch inflates it correctly, and the checkpoint is the user's real model. But torch inflates a member
    to the size it declares, so a compressed storage must declare exactly what its tensors need (a
    deflate bomb declares gigabytes for a few kilobytes of weights), and any other member a small size."""
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
            infos = zf.infolist()
            for i in infos:
                _check_member(path, raw, i)
            compressed = [i for i in infos if i.compress_type != zipfile.ZIP_STORED]
            archive = infos[0].filename.split("/")[0] if infos else ""  # torch names records "<archive>/<record>"
            records = {i.filename[len(archive) + 1 :]: i for i in infos if i.filename.startswith(archive + "/")}
            pkl = records.get("data.pkl")
            if pkl is None:
                return not compressed  # not a torch.save zip: torch.load says what is wrong
            for i in compressed:
                if not i.filename.startswith(f"{archive}/data/"):  # data.pkl, version, byteorder, ...
                    _refuse_inflating(path, i, i.file_size > MAX_INFLATED_RECORD, f"at most {MAX_INFLATED_RECORD}")
            needs = _storage_sizes(zf.read(pkl))
    except MiniStreamError:
        raise
    except pickle.UnpicklingError as e:
        raise _refused_pickle(path, e) from None
    except Exception as e:  # zipfile, zlib and the unpickler raise many kinds for a damaged file
        raise _unreadable(path, e) from None
    for key, need in needs.items():
        member = records.get(f"data/{key}")
        if member is None:
            raise MiniStreamError(
                f"{path}: the pickle names a tensor storage data/{key} that the zip does not hold; "
                "the file is damaged: copy it again from the training run"
            )
        if member.compress_type != zipfile.ZIP_STORED:
            _refuse_inflating(path, member, member.file_size != need, f"exactly the {need} its tensors need")
        elif member.file_size < need:  # mapped, the tensors would read past it into the next member
            raise MiniStreamError(
                f"{path}: zip member {member.filename} holds {member.file_size} bytes but its tensors need "
                f"{need}; the file is damaged: copy it again from the training run"
            )
    if compressed:
        names = [i.filename for i in compressed]
        notes.append(
            f"{len(names)} zip member(s) of {path.name} are compressed ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}), not stored as torch.save writes them: read into memory, not mapped"
        )
    return not compressed


def _check_member(path: Path, raw, info: zipfile.ZipInfo) -> None:
    """A member torch can read, whose local header agrees with the directory (mmap trusts the local header)."""
    if info.flag_bits & 0x1:
        raise MiniStreamError(f"{path}: zip member {info.filename} is encrypted; torch cannot read it")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise MiniStreamError(
            f"{path}: zip member {info.filename} is compressed with zip method {info.compress_type}, which torch "
            "cannot read; re-save it: torch.save(torch.load(path, weights_only=True), path)"
        )
    raw.seek(info.header_offset)
    header = raw.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04" or struct.unpack("<H", header[8:10])[0] != info.compress_type:
        raise MiniStreamError(
            f"{path}: zip member {info.filename}: its local header disagrees with the zip directory; "
            "the file is damaged: copy it again from the training run"
        )


def _refuse_inflating(path: Path, info: zipfile.ZipInfo, refuse: bool, want: str) -> None:
    if refuse:
        raise MiniStreamError(
            f"{path}: zip member {info.filename} is compressed and declares {info.file_size} bytes inflated, "
            f"not {want}: refused before inflating it (a damaged file, or a zip bomb). "
            "Re-save the checkpoint with torch.save, which stores every member uncompressed"
        )


def _storage_sizes(pickle_bytes: bytes) -> dict[str, int]:
    """{storage key: bytes its tensors need}, read from torch.save's pickle with torch's own weights-only
    unpickler; every tensor is rebuilt on the meta device, so no storage is read."""
    from torch import _weights_only_unpickler as weights_only

    needs: dict[str, int] = {}

    def persistent_load(saved_id):
        _, storage_type, key, _location, numel = saved_id  # ("storage", type, key, location, numel)
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        needs[str(key)] = numel * dtype.itemsize
        meta = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=meta, dtype=dtype, _internal=True)

    unpickler = weights_only.Unpickler(io.BytesIO(pickle_bytes))
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        unpickler.load()
    finally:
        # sparse tensors rebuilt here queue themselves for torch.load's validation: not these meta ones
        getattr(torch._utils, "_sparse_tensors_to_validate", []).clear()
    return needs


def _refused_pickle(path: Path, e: pickle.UnpicklingError) -> MiniStreamError:
    # torch.load's wording, or its weights-only unpickler's own (the reader's scan of the pickle)
    if any(w in str(e) for w in ("weights_only", "Weights only", "GLOBAL", "Unsupported")):
        # torch names the callable it refused: "GLOBAL posix.system" or "Unsupported global: ..."
        what = re.search(r"GLOBAL\s+([\w.]+)", str(e)) or re.search(r"Unsupported global:\s+([\w.]+)", str(e))
        return MiniStreamError(
            f"{path}: the pickle needs code to be executed to load "
            f"({what.group(1) if what else 'an object that is not a tensor, dict or number'}); it is refused. "
            f"Re-save it with plain tensors and dicts: {RESAVE.get(path.name, RESAVE['model.pt'])}"
        )
    return MiniStreamError(f"{path}: not a readable torch checkpoint ({e}); is it truncated?")


def _unreadable(path: Path, e: Exception) -> MiniStreamError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return MiniStreamError(
        f"{path}: not a readable torch checkpoint ({first}); "
        "is it truncated or another kind of file? Copy it again from the training run"
    )


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


def resolve_config(ckpt: Checkpoint, overrides: dict | None = None, ignore_keys: Iterable[str] = ()) -> TrainConfig:
    """The train config: the checkpoint's own, else the caller's values; checked against the shapes.

    A key the format does not define is refused by name unless the caller ignores it (`ignore_keys`,
    --ignore-config-key): dropped in silence, a model trained with e.g. scaled RoPE would be served with
    plain RoPE. What resolving changed (keys ignored, a tied head dropped) is added to `ckpt.notes`."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    config = _known_config(ckpt, set(ignore_keys))
    if config is not None:
        conflicts = {k: (config[k], v) for k, v in overrides.items() if k in config and config[k] != v}
        if conflicts:
            k, (a, b) = next(iter(conflicts.items()))
            raise MiniStreamError(
                f"{ckpt.path}: the checkpoint's config says {k}={a!r} but a flag says {b!r}; "
                "drop the flag (the checkpoint's own config wins) or fix the checkpoint"
            )
        values, source = {**overrides, **config}, f"{ckpt.path} config"
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
    ckpt.state, note = drop_tied_head(ckpt.state, cfg)
    if note:
        ckpt.notes.append(note)
    check_state(ckpt.state, cfg, str(ckpt.path))
    return cfg


def stored_dtype(ckpt: Checkpoint) -> str:
    """The dtype the checkpoint's weights are stored in (a name of spec.DTYPES): what convert writes unless told,
    so a bfloat16 checkpoint is not doubled to float32. Of mixed dtypes, float32, which holds each of them
    exactly (bfloat16 and float16 hold only part of each other's values); a note says so."""
    counts: dict[torch.dtype, int] = {}
    for t in ckpt.state.values():
        counts[t.dtype] = counts.get(t.dtype, 0) + 1
    names = {d: str(d).removeprefix("torch.") for d in counts}
    if len(counts) == 1:
        return names.popitem()[1]
    stored = ", ".join(f"{names[d]} ({n} tensors)" for d, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    ckpt.notes.append(
        f"the weights are stored in mixed dtypes, {stored}: writing float32, which holds each of them exactly "
        "(--dtype bfloat16 writes half the bytes)"
    )
    return "float32"


def _known_config(ckpt: Checkpoint, ignore: set[str]) -> dict | None:
    """The checkpoint's config without the keys the caller ignores; any other key the format does not
    define is refused by name."""
    kept = sorted(ignore & CONFIG_KEYS)
    if kept:
        raise MiniStreamError(
            f"--ignore-config-key {kept[0]}: {kept[0]} is a key of format 1's train config, which the conversion "
            "needs; only a key the format does not define can be ignored"
        )
    config = ckpt.config
    absent = sorted(k for k in ignore if config is None or k not in config)
    if absent:
        where = "the checkpoint has no config entry" if config is None else "the checkpoint's config has no such key"
        ckpt.notes.append(f"--ignore-config-key {', '.join(absent)}: {where}, nothing ignored")
    if config is None:
        return None
    unknown = [k for k in config if k not in CONFIG_KEYS]
    refused = [k for k in unknown if k not in ignore]
    if refused:
        k = refused[0]
        more = f" (and {len(refused) - 1} more: {', '.join(map(repr, refused[1:4]))})" if len(refused) > 1 else ""
        raise MiniStreamError(
            f"{ckpt.path}: the train config has {k!r} = {_short(config[k])}{more}, which format 1 does not "
            "define: converting without it could make another model (scaled RoPE served as plain RoPE, say). "
            "If it does not change the math, say so: " + " ".join(f"--ignore-config-key {r}" for r in refused)
        )
    if unknown:
        ckpt.notes.append(
            "ignored train config keys that format 1 does not define (--ignore-config-key): "
            + ", ".join(f"{k}={_short(config[k])}" for k in unknown)
        )
    return {k: v for k, v in config.items() if k in CONFIG_KEYS}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load(
    path: str | Path, overrides: dict | None = None, ignore_keys: Iterable[str] = ()
) -> tuple[TrainConfig, Checkpoint]:
    ckpt = load_checkpoint(path)
    return resolve_config(ckpt, overrides, ignore_keys), ckpt


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
