"""The quantization vocabulary of a folder `ministream quantize` wrote: its schemes, the tensors that stand for one
linear weight (stored), config.json's quantization_config and how to read the scheme back from it (read_scheme),
and the float weight vLLM computes with (decompress, which weights.FolderTensors calls one weight at a time). The
folder check, the reader and the quantizer share it; torch and compressed-tensors are imported where a function
needs them, so the folder check (doctor) stays light.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .. import MiniStreamError, spec
from ..paths import shipped
from ..spec import EMBEDDING, TrainConfig, hf_names, hf_shapes

if TYPE_CHECKING:
    import torch

# --scheme -> (the compressed-tensors preset, its compression format)
SCHEMES = {
    "w8a8": ("W8A8", "int-quantized"),
    "w4a16": ("W4A16", "pack-quantized"),
    "fp8": ("FP8_DYNAMIC", "float-quantized"),
}
# a scheme's stored weight: its safetensors code (pack-quantized stores int32 words: stored())
WEIGHT_CODES = {"int-quantized": "I8", "float-quantized": "F8_E4M3"}
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
EMBED, HEAD = hf_names(EMBEDDING)[0], hf_names(spec.HEAD)[0]
HEADS = ("float", "quantized")  # --head: as it is (tied to the embedding where the model ties it), or quantized
# schemes whose quantized head was run here through vLLM (fp8's on a GPU was not: a head is no LinearBase,
# and the fp8 kernels there read LinearBase's attributes, vLLM PR #52543)
HEAD_SCHEMES = ("w8a8", "w4a16")
WEIGHT_FILES = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")
# the quantization_config each scheme's folder carries, by compressed-tensors version (written_config)
WRITTEN = shipped("data", "quantization_configs.json")


# what read_scheme reads of a config.json: (--scheme, whether the head is quantized: --head quantized)
Quantization = tuple[str, bool]

# stored()'s safetensors codes as torch names: what GPTQ's tensors are checked against before they are written
CODE_DTYPES = {"I8": "int8", "I32": "int32", "I64": "int64", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


def check_scheme(name: str) -> None:
    """Refuse a `--scheme` that is none of ours, before compressed-tensors (~7 s of imports) is loaded."""
    if name not in SCHEMES:
        raise MiniStreamError(f"--scheme {name}: choose one of {', '.join(SCHEMES)}")


def scheme_of(name: str):
    """The compressed-tensors QuantizationScheme of `--scheme name`, and its compressor class."""
    check_scheme(name)
    from compressed_tensors.compressors import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import preset_name_to_scheme

    preset, fmt = SCHEMES[name]
    compressor = {
        "pack-quantized": PackedQuantizationCompressor,
        "int-quantized": IntQuantizationCompressor,
        "float-quantized": FloatQuantizationCompressor,
    }[fmt]
    return preset_name_to_scheme(preset, ["Linear"]), compressor


def stored(shape: tuple[int, ...], name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """What stands for one linear weight of `shape` [out, in] in a `--scheme name` folder: local name -> (shape,
    safetensors code). The scales are float32 whatever the folder's dtype: quantize computes them so."""
    rows, inputs = shape
    group = group_size(name)
    if not group:
        return {"weight": ((rows, inputs), WEIGHT_CODES[SCHEMES[name][1]]), "weight_scale": ((rows, 1), "F32")}
    return {
        "weight_packed": ((rows, inputs // 8), "I32"),  # eight 4-bit values per int32, along the inputs
        "weight_scale": ((rows, inputs // group), "F32"),
        "weight_shape": ((2,), "I64"),
    }


def stored_weights(shapes: dict[str, tuple[int, ...]], name: str, head: bool) -> dict[str, dict]:
    """stored() of each weight of `shapes` (spec.hf_shapes) that a `--scheme name` folder stores quantized
    (is_quantized; `head`: --head quantized), by its stem, the weight's name without `.weight`."""
    return {t.removesuffix(".weight"): stored(shape, name) for t, shape in shapes.items() if is_quantized(t, head)}


def needs_16_bits(name: str) -> bool:
    """Weight-only int4: vLLM's kernels (CPU and GPU) multiply in bfloat16 or float16, never float32."""
    return SCHEMES[name][1] == "pack-quantized"


def quantization_config(name: str, head: bool = False) -> dict:
    """config.json's quantization_config for `--scheme name`, written by the library; with `head`, its group
    targets lm_head too (by name: vLLM matches "Linear" against a layer's class, and the head's is
    ParallelLMHead)."""
    from compressed_tensors.quantization import QuantizationConfig

    scheme, _ = scheme_of(name)
    if head:
        scheme = scheme.model_copy(update={"targets": [*scheme.targets, "lm_head"]})
    fmt = SCHEMES[name][1]
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=[] if head else ["lm_head"],
    )
    return config.model_dump(mode="json", exclude_none=True)


def is_quantized(name: str, head: bool) -> bool:
    """Whether the folder's tensor `name` (an HF weight name) is stored quantized: every linear weight, and the
    head where `--head quantized` wrote it."""
    return bool(LINEAR.match(name)) or (head and name == HEAD)


def check_shapes(cfg: TrainConfig, name: str, source: str) -> None:
    """Refuse, by tensor and size, a shape the scheme cannot group: every input size a multiple of the group."""
    group = group_size(name)
    if not group:
        return
    for tensor, shape in hf_shapes(cfg).items():  # the head's inputs are q_proj's: d_model
        if LINEAR.match(tensor) and shape[1] % group:
            raise MiniStreamError(
                f"{source}: {tensor} has {shape[1]} inputs, not a multiple of {name}'s group of {group}: "
                f"this model cannot be quantized {name}; use --scheme w8a8 (one scale per row)"
            )


def decompress(local: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The float weight that `compress`'s tensors stand for: what vLLM multiplies by (before activations)."""
    scheme, compressor = scheme_of(name)
    return compressor.decompress(dict(local), scheme)["weight"]


def scheme_name(config: dict, source: Path | str) -> str:
    """The --scheme a quantized config.json was written with, refused by name where it is not one of ours."""
    return read_scheme(config, source)[0]


def read_scheme(config: dict, source: Path | str) -> Quantization:
    """The --scheme a quantized config.json was written with and whether its head is quantized (--head), refused
    by name where it is not one of ours."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        raise MiniStreamError(f"{source}: no quantization_config: the folder is not quantized")
    if q.get("quant_method") == "compressed-tensors":
        for name in SCHEMES:
            for head in (False, True):
                if _groups(q) == _our_groups(name, head):
                    return name, head
    raise MiniStreamError(
        f"{source}: quantization_config ({q.get('quant_method')}, format {q.get('format')}) is none of "
        f"`ministream quantize`'s schemes ({', '.join(SCHEMES)}): quantize the converted folder again"
    )


def quantization(config: dict) -> Quantization | None:
    """read_scheme's answer for config.json; None where it names no scheme of ours (none at all: float weights)."""
    if "quantization_config" not in config:
        return None
    try:
        return read_scheme(config, "config.json")
    except MiniStreamError:
        return None


def quantizes_head(config: dict) -> bool:
    """Whether config.json is one of ours with its head quantized (--head quantized): False for anything else."""
    q = quantization(config)
    return q is not None and q[1]


def _groups(q: dict) -> str:
    """What of a quantization_config says which scheme it is."""
    return json.dumps({k: q.get(k) for k in ("format", "config_groups", "ignore")}, sort_keys=True)


def _our_groups(name: str, head: bool) -> str:
    """_groups of the config `quantize --scheme name` writes."""
    return _groups(written_config(name, head))


def group_size(name: str) -> int | None:
    """How many inputs share one scale in `--scheme name` (None: one scale per row)."""
    return written_config(name, False)["config_groups"]["group_0"]["weights"].get("group_size")


@functools.cache
def written_config(name: str, head: bool) -> dict:
    """quantization_config(name, head) as the installed compressed-tensors writes it: from WRITTEN where it holds
    that version's (building it imports the library, ~7 s of every doctor and serve of a quantized folder),
    else built by the library. tests/test_quantize.py holds WRITTEN to the library's own output."""
    check_scheme(name)
    return _shipped().get(f"{name}+head" if head else name) or quantization_config(name, head)


@functools.cache
def _shipped() -> dict:
    """WRITTEN's entry for the installed compressed-tensors ({} where it has none), read once per process."""
    from importlib import metadata

    return json.loads(WRITTEN.read_text()).get(metadata.version("compressed-tensors"), {})


def written_table() -> dict:
    """WRITTEN's entry for the installed compressed-tensors, built by the library: `python -m
    ministream.checkpoint.scheme` adds it to WRITTEN (after a vLLM release pins another compressed-tensors)."""
    return {f"{n}+head" if h else n: quantization_config(n, h) for n in SCHEMES for h in (False, True)}


if __name__ == "__main__":
    from importlib import metadata

    known = json.loads(WRITTEN.read_text())
    known[metadata.version("compressed-tensors")] = written_table()
    WRITTEN.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
