"""A converted folder's weights, read and written: the safetensors files it holds, memory-mapped one tensor at a
time (LazyFolder) or read back into training names (read_folder: the reference model's input, a quantized
folder's linear weights dequantized as vLLM computes with them), and the streaming writer convert, quantize and
convert-lora share (write_safetensors).
"""

import json
import struct
from pathlib import Path
from typing import Any

import torch

from .. import MiniStreamError
from ..spec import SAFETENSORS_CODES, TrainConfig, check_state, hf_to_raw, table, train_config_from_hf
from .cast import check_cast
from .folder import checked
from .format import read_json
from .scheme import dequantize_state, read_scheme


def read_folder(folder: str | Path) -> tuple[TrainConfig, dict]:
    """Read a converted folder back into the train config and training-named tensors; a quantized one's
    linear weights dequantized, as vLLM computes with them."""
    from safetensors.torch import load_file

    folder = Path(folder)
    checked(folder)  # the one folder check: the reference model and the perplexities read what the server runs
    config = read_json(folder / "config.json")
    cfg = train_config_from_hf(config, f"{folder / 'config.json'}")
    hf_state = {}
    for file in safetensors_files(folder):
        hf_state.update(load_file(file))
    if "quantization_config" in config:  # `ministream quantize`'s: the weights vLLM computes with
        hf_state = dequantize_state(hf_state, cfg, *read_scheme(config, folder / "config.json"))
    expected = {h for row in table(cfg) for h in row.hf}
    if set(hf_state) != expected:
        missing, extra = sorted(expected - set(hf_state)), sorted(set(hf_state) - expected)
        raise MiniStreamError(f"{folder}: tensors do not match config.json: missing {missing[:3]}, extra {extra[:3]}")
    state = hf_to_raw(cfg, hf_state)
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


class LazyFolder:
    """HF name -> tensor, read from the folder's safetensors files when asked (memory-mapped, one at a time)."""

    def __init__(self, files: list[Path], shapes: dict):
        from safetensors import safe_open

        self.shapes, self.where = shapes, {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self.where.update({k: (f, handle) for k in handle.keys()})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise MiniStreamError(f"the folder's safetensors files have no tensor {name!r}: convert it again")
        file, handle = self.where[name]
        t = handle.get_tensor(name)
        if tuple(t.shape) != self.shapes[name]:
            raise MiniStreamError(
                f"{file}: {name} has shape {list(t.shape)}, config.json implies {list(self.shapes[name])}: "
                "convert the folder again"
            )
        return t


def write_safetensors(
    path: Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype, progress, allow_nonfinite: bool = False
) -> None:
    """Stream tensors into one safetensors file: the header is planned from shapes, then each tensor is
    converted and written on its own, so memory holds one tensor at a time, not the model. (safetensors'
    own save_file takes the whole state dict at once: a second copy of the model in memory.)"""
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
