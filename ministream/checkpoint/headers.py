"""The safetensors files of a converted folder, read by their headers only: each tensor's name, shape, dtype and
file, the header checked against the format and the file's size first, so that a damaged file is refused by name
(FolderError) before safetensors or vLLM opens it. No weights are read here."""

import json
from dataclasses import dataclass
from pathlib import Path

from .findings import FolderError


@dataclass(frozen=True)
class Tensor:
    shape: tuple[int, ...]
    dtype: str  # safetensors' code: F32, BF16, F16
    file: Path
    start: int = 0  # where its bytes begin in the file (a reader that seeks, not maps: perplexity.FolderTensors)


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
        tensors[name] = Tensor(tuple(shape), dtype, path, 8 + n + offsets[0])
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
