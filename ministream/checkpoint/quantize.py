"""Quantize a converted folder's linear weights into compressed-tensors' format, the one vLLM reads on CPU and
GPU (`quantization_config` in config.json, quant_method compressed-tensors): round to nearest, no calibration.

    w8a8    int8 weights, one scale per output row; vLLM quantizes the activations to int8 per token at run time
    w4a16   int4 weights, one scale per group of 128 inputs (symmetric); activations stay in the model's dtype
    fp8     float8 (e4m3) weights, one scale per output row; activations to fp8 per token at run time (the
            preset FP8_DYNAMIC, llm-compressor's usual recipe for GPUs). vLLM 0.32's CPU build runs it too,
            through torch's scaled matmul (ChannelWiseTorchFP8ScaledMMLinearKernel), in float32 or bfloat16

The scheme, the packing and the config are the compressed-tensors library's own (its presets W8A8 and W4A16 and
its compressors), so what vLLM unpacks is what the library packed. Each projection keeps its own scales, under
its own name (q_proj, k_proj, v_proj, gate_proj, up_proj): vLLM fuses them by the model's
packed_modules_mapping. The embedding and the norms stay as they are; so does the head (`ignore`: lm_head)
unless `--head quantized`: then the head is quantized by the same scheme as a weight of its own, `lm_head.*`
(untied: the embedding stays float for the lookup, which reads one row a token, while the head is read whole
every step: 24.6 MB instead of 49 in bfloat16 for the reference shape's 32000 x 768), and the config's group
targets it. vLLM reads that from the release with PR #37291 (compressed-tensors gives a ParallelLMHead its
linear scheme; 0.32.0 has it); an older vLLM would load the int8 values as float weights, so the folder check
refuses it there.
`dequantize_state` gives back the weights vLLM computes with, for the reference model to be held to.
"""

import json
import re
import shutil
from pathlib import Path

import torch

from .. import MiniStreamError, spec
from ..atomic import check_space, disk_full, new_folder
from ..spec import EMBEDDING, TrainConfig, hf_names, hf_shapes, train_config_from_hf
from . import fingerprint, gptq, hf_files
from .cast import check_cast
from .convert import LazyFolder, llama_twin, safetensors_files
from .folder import checked
from .format import read_json

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


# stored()'s safetensors codes as torch names: what GPTQ's tensors are checked against before they are written
CODE_DTYPES = {"I8": "int8", "I32": "int32", "I64": "int64", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}
METHODS = ("rtn", "gptq")  # round to nearest (no data), or GPTQ on a calibration text (gptq.py)
RECORD = "ministream-quantize.json"  # beside config.json: the scheme, the source, what the rounding cost


def scheme_of(name: str):
    """The compressed-tensors QuantizationScheme of `--scheme name`, and its compressor class."""
    if name not in SCHEMES:
        raise MiniStreamError(f"--scheme {name}: choose one of {', '.join(SCHEMES)}")
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
    group = scheme_of(name)[0].weights.group_size
    if not group:
        return {"weight": ((rows, inputs), WEIGHT_CODES[SCHEMES[name][1]]), "weight_scale": ((rows, 1), "F32")}
    return {
        "weight_packed": ((rows, inputs // 8), "I32"),  # eight 4-bit values per int32, along the inputs
        "weight_scale": ((rows, inputs // group), "F32"),
        "weight_shape": ((2,), "I64"),
    }


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
    scheme, _ = scheme_of(name)
    group = scheme.weights.group_size
    if not group:
        return
    for tensor, shape in hf_shapes(cfg).items():  # the head's inputs are q_proj's: d_model
        if LINEAR.match(tensor) and shape[1] % group:
            raise MiniStreamError(
                f"{source}: {tensor} has {shape[1]} inputs, not a multiple of {name}'s group of {group}: "
                f"this model cannot be quantized {name}; use --scheme w8a8 (one scale per row)"
            )


def compress(weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """One linear weight [out, in] quantized: the tensors that replace `weight` (local names: weight or
    weight_packed, weight_scale, weight_shape), in float32 scales."""
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme, compressor = scheme_of(name)
    args, w = scheme.weights, weight.float()
    if args.group_size:
        view = w.view(w.shape[0], -1, args.group_size)
        low, high = view.amin(-1), view.amax(-1)
    else:
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale, zero = calculate_qparams(low, high, args)
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    return {k: v.contiguous() for k, v in out.items() if v is not None}


NONFINITE_FIX = "convert an earlier checkpoint, then quantize its folder"  # a NaN or Inf weight: the source's


def held(stem: str, weight: torch.Tensor, parts: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """The folder's tensors that stand for the weight `stem`.weight (local name -> tensor; "": `stem` itself, kept as
    it is), by their full names, each float one's values checked finite (cast.check_cast): a NaN or Inf weight
    makes NaN scales."""
    named = {f"{stem}.{k}" if k else stem: v for k, v in parts.items()}
    source = stem if "" in parts else f"{stem}.weight"
    for name, v in named.items():
        if v.is_floating_point():
            check_cast(name, weight, v.float(), scheme, "keep the folder unquantized", NONFINITE_FIX, source)
    return named


def decompress(local: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The float weight that `compress`'s tensors stand for: what vLLM multiplies by (before activations)."""
    scheme, compressor = scheme_of(name)
    return compressor.decompress(dict(local), scheme)["weight"]


def dequantize_state(
    raw: dict[str, torch.Tensor], cfg: TrainConfig, name: str, head: bool = False
) -> dict[str, torch.Tensor]:
    """The HF-named float weights vLLM computes with, from the tensors of a folder `quantize` wrote
    (convert.read_folder: the reference model of a quantized folder; `head`: its head is quantized too)."""
    state = {k: v for k, v in raw.items() if not is_quantized(k.rsplit(".", 1)[0] + ".weight", head)}
    for tensor in hf_shapes(cfg):
        if is_quantized(tensor, head):
            stem = tensor.removesuffix(".weight")
            local = {k.removeprefix(stem + "."): v for k, v in raw.items() if k.startswith(stem + ".")}
            if not local:
                raise MiniStreamError(f"the quantized folder has no tensors of {stem}: quantize it again")
            state[tensor] = decompress(local, name)
    return state


def scheme_name(config: dict, source: Path | str) -> str:
    """The --scheme a quantized config.json was written with, refused by name where it is not one of ours."""
    return read_scheme(config, source)[0]


def read_scheme(config: dict, source: Path | str) -> tuple[str, bool]:
    """The --scheme a quantized config.json was written with and whether its head is quantized (--head), refused
    by name where it is not one of ours."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        raise MiniStreamError(f"{source}: no quantization_config: the folder is not quantized")
    for name in SCHEMES:
        for head in (False, True):
            if q.get("quant_method") == "compressed-tensors" and _same_groups(q, quantization_config(name, head)):
                return name, head
    raise MiniStreamError(
        f"{source}: quantization_config ({q.get('quant_method')}, format {q.get('format')}) is none of "
        f"`ministream quantize`'s schemes ({', '.join(SCHEMES)}): quantize the converted folder again"
    )


def quantizes_head(config: dict) -> bool:
    """Whether config.json is one of ours with its head quantized (--head quantized): False for anything else."""
    try:
        return "quantization_config" in config and read_scheme(config, "config.json")[1]
    except MiniStreamError:
        return False


def _same_groups(have: dict, want: dict) -> bool:
    strip = lambda q: json.dumps({k: q.get(k) for k in ("format", "config_groups", "ignore")}, sort_keys=True)  # noqa: E731
    return strip(have) == strip(want)


def loss_record(src: Path, out: Path, scheme: str, max_len: int, text: Path | None = None) -> dict:
    """What the rounding cost, measured on the reference model: its perplexity on held-out text with the
    source's weights and with the quantized folder's, dequantized (checkpoint/perplexity.py). verify holds
    vLLM's perplexity on the folder to the source's by the scheme's rule."""
    from .perplexity import chunks, folder_perplexity

    c = chunks(src, text, max_len=max_len)
    source, quantized = folder_perplexity(src, c), folder_perplexity(out, c)
    return {
        "scheme": scheme,
        "source": str(src.resolve()),
        "perplexity": c.record() | {"source": source, "quantized": quantized},
    }


def calibrate(src: Path, tmp: Path, cfg: TrainConfig, scheme: str, python, text, samples, log) -> tuple[dict, dict]:
    """GPTQ's tensors for each linear weight, by stem, as stored() names and shapes them, and what the
    calibration was. The library's scratch folders (inside the output's temporary folder) are removed."""
    from safetensors.torch import load_file

    twin, made = llama_twin(src, tmp / ".gptq-in"), tmp / ".gptq-out"
    seq_len = min(gptq.SEQ_LEN, cfg.max_seq_len)
    try:
        how = gptq.run(python, twin, made, scheme, text, samples or gptq.SAMPLES, seq_len, log)
        produced = load_file(made / "model.safetensors")
    finally:
        for scratch in (twin, made, made.with_suffix(".json"), made.with_suffix(".log")):
            shutil.rmtree(scratch, ignore_errors=True) if scratch.is_dir() else scratch.unlink(missing_ok=True)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in hf_shapes(cfg).items():
        if LINEAR.match(name):
            stem = name.removesuffix(".weight")
            parts[stem] = {}
            for local, (want, code) in stored(tuple(shape), scheme).items():
                got = produced.get(f"{stem}.{local}")
                if got is None or tuple(got.shape) != want or got.dtype != getattr(torch, CODE_DTYPES[code]):
                    found = "nothing" if got is None else f"{list(got.shape)} {got.dtype}"
                    raise MiniStreamError(
                        f"GPTQ's output has {found} for {stem}.{local}, not {list(want)} {code}: llm-compressor "
                        f"{gptq.LLMCOMPRESSOR} wrote another layout; nothing was written"
                    )
                parts[stem][local] = got.contiguous()
    return how, parts


def read_record(folder: Path) -> dict | None:
    """A quantized folder's loss record (None: quantized elsewhere, or before the record existed)."""
    path = Path(folder) / RECORD
    return read_json(path) if path.is_file() else None


def quantize(
    src: str | Path,
    out: str | Path,
    scheme: str,
    force: bool = False,
    log=print,
    text: Path | None = None,
    method: str = "rtn",
    calibration: Path | None = None,
    samples: int | None = None,
    head: str = "float",
) -> Path:
    """Write `out`: the converted folder `src` with its linear weights quantized by `scheme`, round to nearest
    or (method "gptq") calibrated by GPTQ on `calibration` (gptq.py), and with `head` "quantized" its head too
    (round to nearest, untied); every other file copied as it is. `src` is never written; `out` appears whole
    or not at all (atomic.new_folder)."""
    src, out = Path(src), Path(out)
    scheme_of(scheme)  # the name first: the cheapest refusal
    if method not in METHODS:
        raise MiniStreamError(f"--method {method}: choose one of {', '.join(METHODS)}")
    if head not in HEADS:
        raise MiniStreamError(f"--head {head}: choose one of {', '.join(HEADS)}")
    quantize_head = head == "quantized"
    if quantize_head and scheme not in HEAD_SCHEMES:
        raise MiniStreamError(
            f"--head quantized --scheme {scheme}: a quantized head was run here for {', '.join(HEAD_SCHEMES)} "
            f"only (vLLM's {scheme} kernels on a GPU read attributes a ParallelLMHead lacks, vLLM PR #52543); "
            "leave the head float (--head float)"
        )
    if method == "gptq":
        gptq.check(scheme)
        if calibration is not None and not Path(calibration).is_file():
            raise MiniStreamError(f"--calibration-text {calibration}: no such file")
    if not (src / "config.json").is_file():
        raise MiniStreamError(
            f"{src}: no config.json; quantize takes a converted folder: `ministream convert CHECKPOINT DIR` first"
        )
    config = read_json(src / "config.json")
    if "quantization_config" in config:
        method = (
            config["quantization_config"].get("quant_method", "?")
            if isinstance(config["quantization_config"], dict)
            else "?"
        )
        raise MiniStreamError(
            f"{src}/config.json: the folder is quantized already ({method}); quantize the converted folder it came "
            "from (rounding twice loses more)"
        )
    checked(src)  # the one folder check: a folder the server would refuse is not quantized either
    cfg = train_config_from_hf(config, str(src / "config.json"))
    check_shapes(cfg, scheme, str(src / "config.json"))
    files = safetensors_files(src)
    tensors = LazyFolder(files, hf_shapes(cfg))
    what = f"quantizing {src} to {out}"
    check_space(out.parent if out.parent.exists() else Path("."), sum(f.stat().st_size for f in files), what)
    from safetensors.torch import save_file

    python = gptq.environment(log) if method == "gptq" else None  # made once, before anything is written
    try:
        with new_folder(out, force, inputs=[src]) as tmp:
            calibrated = calibrate(src, tmp, cfg, scheme, python, calibration, samples, log) if python else None
            state: dict[str, torch.Tensor] = {}
            for name in hf_shapes(cfg):  # a tied head has no tensor of its own: not in hf_shapes either
                t = tensors[name]
                if LINEAR.match(name):
                    stem = name.removesuffix(".weight")
                    parts = calibrated[1][stem] if calibrated else compress(t, scheme)
                    state.update(held(stem, t, parts, scheme))
                elif not (quantize_head and name == HEAD):
                    state.update(held(name, t, {"": t.contiguous()}, scheme))
            if quantize_head:  # the head's own weight, or the embedding it is tied to: rounded to nearest
                weight = tensors[EMBED if cfg.tie_embeddings else HEAD]
                state.update(held("lm_head", weight, compress(weight, scheme), scheme))
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for f in sorted(src.iterdir()):
                # not the weights, config.json, nor the tools' own dotfiles (the made-by record, locks)
                if f.is_file() and f.name != "config.json" and not WEIGHT_FILES.match(f.name) and f.name[0] != ".":
                    shutil.copy2(f, tmp / f.name)
            hf_files.write(tmp)  # this version's transformers files, whatever version wrote the source's
            written = {**config, "auto_map": dict(spec.HF_AUTO_MAP)}  # in place when the source has one
            written["quantization_config"] = quantization_config(scheme, quantize_head)
            if quantize_head:
                written["tie_word_embeddings"] = False  # the head is a tensor of its own now
            if needs_16_bits(scheme) and config.get("dtype", config.get("torch_dtype")) == "float32":
                # what vLLM's "auto" runs the folder in: a dtype its int4 kernels take
                written.update({k: "bfloat16" for k in ("dtype", "torch_dtype") if k in config})
            (tmp / "config.json").write_text(json.dumps(written, indent=2) + "\n")
            record = loss_record(src, tmp, scheme, cfg.max_seq_len, text)
            record["method"] = {"method": method, **({"calibration": calibrated[0]} if calibrated else {})}
            record["head"] = head
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            fingerprint.record(tmp, log)  # on the dequantized weights; replaces the source's, copied above
    except OSError as e:
        raise disk_full(e, out, f"while {what}") or e from None
    size = (out / "model.safetensors").stat().st_size
    log(
        f"quantize: wrote {out} ({scheme}: {sum(1 for n in hf_shapes(cfg) if LINEAR.match(n))} linear weights"
        f"{' and the head' if quantize_head else ''}, "
        f"{size / 2**20:.1f} MiB from {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB)"
    )
    ppl = record["perplexity"]
    log(
        f"quantize: the reference model's perplexity on {ppl['scored']} tokens of {Path(ppl['text']).name}: "
        f"{ppl['source']:.4f} -> {ppl['quantized']:.4f} ({ppl['quantized'] / ppl['source'] - 1:+.2%}); "
        f"`ministream verify {out}` holds vLLM to the {scheme} rule (docs/quantize.md)"
    )
    return out
