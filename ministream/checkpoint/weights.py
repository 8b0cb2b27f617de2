"""A converted folder's weights, read and written: the safetensors files it holds, read one tensor at a time
(FolderTensors: by HF name or training row, plain reads) or read back into training names (read_folder: the
reference model's input, a quantized folder's linear weights dequantized as vLLM computes with them), and the
streaming writer convert, quantize and convert-lora share (write_safetensors).
"""

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

from .. import MiniStreamError
from ..spec import (
    DTYPES,
    EMBEDDING,
    SAFETENSORS_CODES,
    TrainConfig,
    check_state,
    hf_shapes,
    table,
    train_config_from_hf,
)
from .cast import check_cast
from .folder import checked
from .format import read_json
from .headers import ITEM_SIZE, read_header
from .scheme import CODE_DTYPES, decompress, is_quantized, read_scheme, stored

# safetensors' codes of the tensors a folder holds, as torch dtypes (FolderTensors.read): the float weights' and
# the quantized schemes' own
CODE_TORCH = {code: name for name, code in DTYPES.items()} | CODE_DTYPES


def read_folder(folder: str | Path, stream: bool = False) -> tuple[TrainConfig, dict]:
    """Read a converted folder back into the train config and training-named tensors; a quantized one's
    linear weights dequantized, as vLLM computes with them. One training tensor at a time (FolderTensors): the
    peak is the state it returns and one tensor's parts, where reading every file whole, dequantizing every
    weight and then concatenating held three copies (9.8 GB for a 1.2B w8a8 folder's fingerprint, issue 56).
    stream: the linear weights stay with the folder, each read when its layer runs (MiniStream.from_state): a
    quantized one as the folder stores it (Packed: the folder's bytes, not a float32 copy), a float one in its
    file (OnDisk: one weight at a time). The embedding and the norms are read."""
    folder = Path(folder)
    checked(folder)  # the one folder check: the reference model and the perplexities read what the server runs
    config = read_json(folder / "config.json")
    cfg = train_config_from_hf(config, f"{folder / 'config.json'}")
    tensors = FolderTensors(folder, cfg, config)
    state = {row.raw: _kept(tensors, row) if stream else tensors.raw(row) for row in table(cfg)}
    check_state(state, cfg, str(folder))
    return cfg, state


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: those its index names, or model.safetensors; each must exist."""
    index = folder / "model.safetensors.index.json"
    names = sorted(set(read_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for name in names:
        if not (folder / name).exists():
            raise MiniStreamError(f"{folder / name}: no such file; the folder is incomplete, convert it again")
    return [folder / name for name in names]


class FolderTensors:
    """A converted folder's float weights, read when asked from its safetensors files: by HF name, or by training
    row (the HF tensors concatenated); a quantized folder's linear weights dequantized as vLLM computes with them
    (scheme.decompress), one weight at a time. Read with plain file reads, not a memory map: a mapped file's
    pages, once read, stay in the process's resident memory until it is unmapped, which would make a streaming
    tool's peak the whole file (issue 56)."""

    def __init__(self, folder: Path, cfg, config: dict):
        self.shapes = {k: tuple(v) for k, v in hf_shapes(cfg).items()}
        quantized = "quantization_config" in config
        self.scheme, self.head = read_scheme(config, folder / "config.json") if quantized else ("", False)
        # the one header reader's checks (sizes, offsets, the file's length) before a byte is read
        self.where = {k: t for f in safetensors_files(folder) for k, t in read_header(f).items()}
        self.parts: dict[str, list[str]] = {}  # HF weight name -> the folder's tensors that stand for it
        for name, shape in self.shapes.items():
            stem = name.removesuffix(".weight")
            self.parts[name] = (
                [f"{stem}.{k}" for k in stored(shape, self.scheme)]
                if self.scheme and is_quantized(name, self.head)
                else [name]
            )
        expected = {t for names in self.parts.values() for t in names}
        if set(self.where) != expected:
            missing, extra = sorted(expected - set(self.where)), sorted(set(self.where) - expected)
            raise MiniStreamError(
                f"{folder}: tensors do not match config.json: missing {missing[:3]}, extra {extra[:3]}"
            )
        self.folder = folder

    def code(self, name: str) -> str:
        """The safetensors dtype code the folder stores tensor `name` in."""
        return self.where[name].dtype

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype the folder stores tensor `name` in."""
        return getattr(torch, CODE_TORCH[self.code(name)])

    def read(self, name: str) -> torch.Tensor:
        """The folder's tensor `name` as it is stored."""
        t = self.where[name]
        size = ITEM_SIZE[t.dtype] * math.prod(t.shape)
        buf = torch.empty(size, dtype=torch.uint8)
        with open(t.file, "rb") as f:
            f.seek(t.start)
            if f.readinto(buf.numpy().data) != size:
                raise MiniStreamError(f"{t.file}: cut short inside {name}: convert the folder again")
        return buf.view(self.dtype(name)).reshape(t.shape)

    def stored(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors that stand for HF weight `name`, as the folder stores them, by their local names."""
        stem = name.removesuffix(".weight") + "."
        return {k.removeprefix(stem): self.read(k) for k in self.parts[name]}

    def unpack(self, name: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """HF weight `name` as vLLM computes with it, from stored(name): dequantized where the folder quantized it."""
        t = decompress(stored, self.scheme) if self.parts[name] != [name] else stored["weight"]
        if tuple(t.shape) != self.shapes[name]:
            raise MiniStreamError(
                f"{self.folder}: {name} has shape {list(t.shape)}, config.json implies {list(self.shapes[name])}: "
                "convert the folder again"
            )
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.unpack(name, self.stored(name))

    def packs(self, row) -> bool:
        """Whether the training tensor of a spec.table row is stored quantized (all its HF weights are)."""
        return all(self.parts[h] != [h] for h in row.hf)

    def raw(self, row) -> torch.Tensor:
        """The training tensor of a spec.table row."""
        return joined(row, [self[h] for h in row.hf])


def _kept(tensors: "FolderTensors", row) -> "torch.Tensor | Packed | OnDisk":
    """A row's tensor as a streaming reference model keeps it (read_folder's stream)."""
    if tensors.packs(row):
        return Packed(tensors, row)
    return OnDisk(tensors, row) if len(row.shape) == 2 and row.raw != EMBEDDING else tensors.raw(row)


def joined(row, parts: list[torch.Tensor]) -> torch.Tensor:
    """A spec.table row's training tensor from its HF weights, in its order (fused rows: concatenated)."""
    return torch.cat(parts, dim=0) if row.split else parts[0]


class Packed:
    """A quantized training tensor as its folder stores it (a row's HF weights' int8, int4 or fp8 values and their
    scales), dequantized as vLLM computes with it only when asked: the reference model's weight while one product
    runs (reference.linear), so a quantized folder's model holds about the folder's bytes (issue 56)."""

    def __init__(self, tensors: FolderTensors, row):
        self.tensors, self.row = tensors, row
        self.stored = {h: tensors.stored(h) for h in row.hf}
        self.shape = row.shape
        # what tensor() returns: compressed-tensors dequantizes in the scales' dtype (float32, scheme.stored)
        self.dtype = self.stored[row.hf[0]]["weight_scale"].dtype

    def tensor(self) -> torch.Tensor:
        """The weight as vLLM computes with it: dequantized."""
        return joined(self.row, [self.tensors.unpack(h, stored) for h, stored in self.stored.items()])


class OnDisk:
    """A float linear weight left in its folder's file, read (FolderTensors' plain reads, no map that would stay
    resident) each time its layer runs: a streaming reference model on a folder holds one such weight at a time
    beside the embedding and the norms, where holding the state was the folder's bytes again (convert's and
    fingerprint's peak at 1.2B, issue 56). A step reads the folder from the page cache once."""

    def __init__(self, tensors: FolderTensors, row):
        self.tensors, self.row = tensors, row
        self.shape = row.shape
        self.dtype = tensors.dtype(row.hf[0])

    def tensor(self) -> torch.Tensor:
        return self.tensors.raw(self.row)


def write_safetensors(
    path: Path,
    tensors: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    progress,
    allow_nonfinite: bool = False,
    release=None,
) -> None:
    """Stream tensors into one safetensors file: the header is planned from shapes, then each tensor is
    converted and written on its own, so memory holds one tensor at a time, not the model. (safetensors'
    own save_file takes the whole state dict at once: a second copy of the model in memory.) release(t): called
    with each source tensor once written (Checkpoint.release: a mapped model.pt's pages leave memory)."""
    header: dict[str, dict[str, Any]] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        size = t.numel() * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_CODES[dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, t in tensors:
            out = t.to(dtype).contiguous()
            check_cast(
                name,
                t,
                out,
                str(dtype).removeprefix("torch."),
                "convert with --dtype bfloat16 or float32",
                None if allow_nonfinite else "convert an earlier checkpoint (or pass --allow-nonfinite to keep them)",
            )
            if out.numel():
                f.write(out.reshape(-1).view(torch.uint8).numpy().data)  # the buffer itself, no bytes copy
            progress.update(out.numel() * dtype.itemsize)
            del out
            if release:
                release(t)
