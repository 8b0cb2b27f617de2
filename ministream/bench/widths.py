"""widths: what each engine runs for a weight width, said once for bench, bench-serve and bench-accuracy.

A width is what the weights are stored in. Full precision runs the converted folder itself; a quantized width
runs vLLM on a `ministream quantize` folder and llama.cpp on a GGUF of llama.cpp's own quantizer, both made
from the same float32 folder. The dtype is what the engine computes in: vLLM 0.32's CPU int8 kernels take
float32 (the folder's own, w8a8) or bfloat16 (w8a8-bf16) activations, its int4 kernels bfloat16 only
(docs/quantize.md), its fp8 one either (bfloat16, as GPUs serve fp8); llama.cpp dequantizes as it goes.
"""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Width:
    dtype: str  # the engines compute in it (vLLM's --dtype; llama.cpp's KV cache)
    scheme: str | None  # vLLM runs `ministream quantize --scheme` of the folder; None: the folder itself
    gguf: str  # llama.cpp runs `ministream gguf --dtype`
    bytes_per_parameter: int | None  # full precision: every parameter's size; quantized: read_bytes reads the files
    method: str = "rtn"  # `ministream quantize --method`: round to nearest, or calibrated (gptq)
    head: str = "float"  # `ministream quantize --head`: the head as it is, or quantized by the scheme too

    @property
    def rule(self) -> str:
        """The width whose rule (verify.RULES) it is held to: its scheme's, or its dtype's at full precision."""
        return self.scheme or self.dtype


WIDTHS = {
    "float32": Width("float32", None, "f32", 4),
    "bfloat16": Width("bfloat16", None, "bf16", 2),
    "float16": Width("float16", None, "f16", 2),
    "w8a8": Width("float32", "w8a8", "q8_0", None),
    # the same int8 folder computing in bfloat16: its float head and activations at half float32's bytes (docs/bench.md)
    "w8a8-bf16": Width("bfloat16", "w8a8", "q8_0", None),
    # and its head in int8 too, as llama.cpp's q8_0 file has it (quantize --head quantized)
    "w8a8-bf16-head": Width("bfloat16", "w8a8", "q8_0", None, head="quantized"),
    "w4a16": Width("bfloat16", "w4a16", "q4_0", None),
    # and its head in 4 bits too, as llama.cpp's q4_0 file (`ministream gguf`) has it
    "w4a16-head": Width("bfloat16", "w4a16", "q4_0", None, head="quantized"),
    # GPUs' 8 bits; llama.cpp has no float8 type, so its 8-bit file is q8_0, as for int8
    "fp8": Width("bfloat16", "fp8", "q8_0", None),
    # 4-bit calibrated by GPTQ (llm-compressor) in the same layout; llama.cpp's counterpart stays q4_0
    "w4a16-gptq": Width("bfloat16", "w4a16", "q4_0", None, "gptq"),
}


def width(name: str) -> Width:
    from .. import MiniStreamError

    if name not in WIDTHS:
        raise MiniStreamError(f"unknown width {name!r}: choose one of {', '.join(WIDTHS)}")
    return WIDTHS[name]


def refusal(name: str) -> str | None:
    """Why this machine's vLLM cannot run the width (run/folder.check_dtype: its kernels and the dtype), naming
    the widths of the same weights it can run instead; None where it can."""
    e = _kernels_refuse(name)
    if e is None:
        return None
    others = _runnable_twins(name)
    return f"{e.text}; use {' or '.join(others)} here" if others else f"{e.text}; {e.fix}"


def runnable(name: str) -> str:
    """The width itself where this machine's vLLM runs it, else the first width of the same weights it runs (w8a8
    on a CPU with AMX: w8a8-bf16, its int8 kernel taking 16-bit activations only); the width itself where none runs
    (its row then says why)."""
    if _kernels_refuse(name) is None:
        return name
    return next(iter(_runnable_twins(name)), name)


def _runnable_twins(name: str) -> list[str]:
    """The other widths of the same weights (scheme, method, head) that this machine's vLLM runs."""
    w = width(name)
    same = [n for n, o in WIDTHS.items() if (o.scheme, o.method, o.head) == (w.scheme, w.method, w.head)]
    return [n for n in same if n != name and _kernels_refuse(n) is None]


def _kernels_refuse(name: str):
    """check_dtype's FolderError for the width on this machine, None where it runs."""
    from ..run.folder import FolderError, check_dtype

    w = width(name)
    try:
        check_dtype(w.scheme, w.dtype, f"the width {name}")
    except FolderError as e:
        return e
    return None


def vllm_width(name: str) -> Width:
    """The width, refused (MiniStreamError) before anything runs where this machine's vLLM cannot run it."""
    from .. import MiniStreamError

    if why := refusal(name):
        raise MiniStreamError(why)
    return width(name)


def vllm_folder(folder: str | Path, name: str, out: Path | None = None, text: Path | None = None, log=print) -> Path:
    """The folder vLLM runs for the width: the converted folder itself, or `out` (default FOLDER-WIDTH beside it)
    quantized anew as the width says, scheme, method and head (of the folder as it is now, as gguf_file exports
    anew); `text`: the held-out text quantize's record measures perplexity on."""
    from ..checkpoint.quantize import quantize

    folder, w = Path(folder), width(name)
    if w.scheme is None:
        return folder
    out = out or folder.parent / f"{folder.name}-{name}"
    return quantize(folder, out, w.scheme, force=True, log=log, text=text, method=w.method, head=w.head)


def gguf_file(folder: str | Path, name: str) -> Path:
    """llama.cpp's file of the width, beside the folder, exported anew (of the folder as it is now)."""
    from ..checkpoint.gguf import export

    folder, w = Path(folder), width(name)
    gguf = folder.parent / f"{folder.name}-{w.gguf}.gguf"
    export(folder, gguf, w.gguf, force=True)
    return gguf


def read_bytes(parameters: int, name: str, file_bytes: int | None) -> int | None:
    """The bytes a decode step reads, for the decode ceiling: every parameter at the width's size, or, at a
    quantized width, the size of the file the engine ran (its quantized linears, their scales, and what each
    engine keeps in float: vLLM's folder its embedding, llama.cpp's q8_0/q4_0 file nothing), which a count of
    parameters cannot say. None where that file's size is not known."""
    w = width(name)
    return parameters * w.bytes_per_parameter if w.bytes_per_parameter else file_bytes


def folder_bytes(folder: str | Path) -> int:
    """The bytes of a converted (or quantized) folder's weight files that a decode step reads: all of them, but
    where the head is quantized (--head quantized) the float embedding is read a row a token, not whole."""
    import json

    from safetensors import safe_open

    from ..checkpoint.scheme import EMBED, quantizes_head
    from ..checkpoint.weights import safetensors_files

    files = safetensors_files(Path(folder))
    size = sum(f.stat().st_size for f in files)
    if not quantizes_head(json.loads((Path(folder) / "config.json").read_text())):
        return size
    for f in files:
        with safe_open(str(f), "pt") as t:
            if EMBED in t.keys():
                embed = t.get_slice(EMBED)
                shape, itemsize = embed.get_shape(), 2 if embed.get_dtype() in ("BF16", "F16") else 4
                return size - shape[0] * shape[1] * itemsize
    return size
